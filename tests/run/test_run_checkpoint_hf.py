"""A run's checkpoint is an ordinary Hugging Face folder: `AutoModelForCausalLM` and
`AutoTokenizer` give back the model and the exact tokenizer it was trained with, and
`train model.name=<checkpoint>` continues from it with the same held-out evaluation at step 0.

The reference for "the same" is the in-memory model and tokenizer that wrote the checkpoint:
token ids, greedy completions of the held-out prompts and their accuracy/reward must be equal.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from _run_small import TINY_RUN
from docblocks import run_doc_block

from composer_replication.assembly.build import build_model, build_task, load_tokenizer
from composer_replication.config import dump_toml, load_config
from composer_replication.exchange.store import ObjectStore
from composer_replication.models.tokenizers import DEFAULT_CHARSET, SPECIAL_TOKENS
from composer_replication.run.checkpoint import mirror_checkpoints, save_checkpoint
from composer_replication.run.reporter import evaluate, greedy_completions

OVERRIDES = [*TINY_RUN, "task.n_eval=16"]
NEW_TOKENS = 6


def _checkpoint(tmp_path: Path, model: object, tok: object, run: str = "run") -> Path:
    """Written to the store as replica 0 writes it, mirrored into the run folder as the driver
    mirrors it."""
    store = ObjectStore((tmp_path / "store").as_uri() + "/")
    save_checkpoint(store, name="final", model=model, tokenizer=tok, round=1, step=2)
    (folder,) = mirror_checkpoints(store, tmp_path / run / "checkpoints")
    return folder


def test_checkpoint_loads_back_as_the_model_and_tokenizer_that_wrote_it(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_config(overrides=OVERRIDES)
    model, tok = build_model(config)
    task = build_task(config)
    examples = task.eval_examples()
    folder = _checkpoint(tmp_path, model, tok)

    loaded_model = AutoModelForCausalLM.from_pretrained(folder)
    loaded_tok = AutoTokenizer.from_pretrained(folder)
    assert type(loaded_tok) is type(tok)
    for (name, a), b in zip(model.state_dict().items(), loaded_model.state_dict().values()):
        assert torch.equal(a, b), name
    prompts = [ex.prompt for ex in examples]
    for prompt in prompts:
        chat = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        assert loaded_tok(chat).input_ids == tok(chat).input_ids
    expected = greedy_completions(model, tok, prompts, max_new_tokens=NEW_TOKENS)
    assert (
        greedy_completions(loaded_model, loaded_tok, prompts, max_new_tokens=NEW_TOKENS) == expected
    )
    reference = evaluate(model, tok, task, examples, max_new_tokens=NEW_TOKENS)
    assert (
        evaluate(loaded_model, loaded_tok, task, examples, max_new_tokens=NEW_TOKENS) == reference
    )

    # The project loads the folder the same way (`train model.name=<checkpoint>`).
    again_model, again_tok = build_model(
        load_config(overrides=[*OVERRIDES, f"model.name={folder}"])
    )
    assert type(again_tok) is type(tok) and again_tok.get_vocab() == tok.get_vocab()
    assert (
        greedy_completions(again_model, again_tok, prompts, max_new_tokens=NEW_TOKENS) == expected
    )


def test_the_quickstart_snippet_reproduces_the_runs_evaluation(tmp_path: Path) -> None:
    """docs/quickstart.md's snippet, as written, in a folder laid out as a run's: it loads the
    checkpoint with the Auto classes, applies the chat template and prints the completions and
    the accuracy the run's own evaluation (run/reporter.py's `evaluate`) gives, beside the run's
    last recorded evaluation."""
    config = load_config(overrides=OVERRIDES)
    model, tok = build_model(config)
    task = build_task(config)
    n_eval = min(config.train.eval_max_examples, config.task.n_eval)
    examples = task.eval_examples()[:n_eval]
    new_tokens = config.train.max_completion_length
    reference = evaluate(model, tok, task, examples, max_new_tokens=new_tokens)
    expected = greedy_completions(
        model, tok, [ex.prompt for ex in examples], max_new_tokens=new_tokens
    )
    run = tmp_path / "runs" / "first-run"
    _checkpoint(tmp_path, model, tok, run="runs/first-run")
    (run / "config.toml").write_text(dump_toml(config))
    records = [  # an earlier evaluation, then the last one (the snippet must pick the last)
        {"kind": "eval", "step": 0, "replica": 0, "eval/accuracy": 0.5},
        {"kind": "train", "step": 2, "replica": 0, "reward": 0.0},
        {"kind": "eval", "step": 2, "replica": 0, **reference},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    out = run_doc_block("docs/quickstart.md", "apply_chat_template", cwd=tmp_path).splitlines()
    for line, ex, completion in zip(out[:3], examples, expected, strict=False):
        assert line.startswith(f"{ex.prompt!r} -> {completion!r} ("), (line, completion)
    accuracy = reference["eval/accuracy"]
    assert out[-1] == (
        f"accuracy {accuracy:.3f} on {n_eval} held-out prompts; "
        f"the run's last evaluation: {accuracy:.3f}"
    )


def _old_char_tokenizer() -> object:
    """The character-level tokenizer as this project built it before its tokenizers became
    `Qwen2Tokenizer`s: a generic fast tokenizer over a WordLevel vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS.values(), "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *DEFAULT_CHARSET])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        padding_side="left",
        extra_special_tokens=["<|im_end|>"],
        **SPECIAL_TOKENS,
    )


def test_a_checkpoint_saved_before_the_fix_loads_with_its_own_tokenizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Such a folder records a generic tokenizer class, which AutoTokenizer replaces for a Qwen2
    model (dropping spaces and newlines); the project loads the class the folder records, and
    says why."""
    from transformers import AutoTokenizer

    from composer_replication.models import build_tiny_model

    old = _old_char_tokenizer()
    folder = tmp_path / "old-checkpoint"
    build_tiny_model(old, hidden_size=32, num_layers=1).save_pretrained(folder)
    old.save_pretrained(folder)
    text = "a\nb c"
    expected = [5 + DEFAULT_CHARSET.index(c) for c in text]
    assert old(text).input_ids == expected
    # What transformers itself does with the folder (the reason for the exception).
    assert AutoTokenizer.from_pretrained(folder)(text).input_ids != expected
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(str(folder))
    assert tok(text).input_ids == expected and tok.decode(expected) == text
    assert "builds a Qwen2Tokenizer" in caplog.text
    assert f"PreTrainedTokenizerFast.from_pretrained({str(folder)!r})" in caplog.text


@pytest.mark.long
@pytest.mark.slow
def test_train_from_a_checkpoint_starts_with_the_evaluation_of_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train model.name=runs/<run>/checkpoints/final`: the run's step-0 evaluation of the
    held-out prompts equals that of the model and tokenizer that wrote the checkpoint
    (accuracy, and the mean shaped reward, which moves with any change of a completion)."""
    from composer_replication.cli import main
    from composer_replication.run.metrics import read_metrics

    small = [*OVERRIDES, "diloco.sync_every_h=2", "train.max_steps=2"]
    config = load_config(overrides=small)
    model, tok = build_model(config)
    task = build_task(config)
    n_eval = min(config.train.eval_max_examples, config.task.n_eval)
    reference = evaluate(
        model,
        tok,
        task,
        task.eval_examples()[:n_eval],
        max_new_tokens=config.train.max_completion_length,
    )
    folder = _checkpoint(tmp_path, model, tok)

    monkeypatch.chdir(tmp_path)
    assert main(["train", *small, f"model.name={folder}", "--name", "continued"]) == 0
    records = read_metrics(tmp_path / "runs" / "continued" / "metrics.jsonl")
    started = next(r for r in records if r["kind"] == "eval")
    assert started["step"] == 0
    for key, value in reference.items():
        assert started[key] == value, key
