"""The training reward judges the text evaluation judges, cut at the same tokens.

Two paths to one verdict: the reward a policy trains on (TRL's rollout cut at its stop ids, then
the task's reward function with the completion's token ids) and the held-out evaluation (greedy
generation, `run.reporter.greedy_completions`' decode, `Task.verify`). The first test feeds raw
completions through both; the second runs real GRPO steps of `ComposerReplicationTrainer` on
scripted rollouts and checks each logged training reward against the evaluation verdict of the
same tokens. Before the fix, TRL's decode without special tokens deleted the `<|im_end|>` the
verifier cuts at: `<|im_end|>25` scored 1.0 as a reward and 0.0 in evaluation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _trainer_helpers import G, config

from composer_replication.assembly.build import task_reward
from composer_replication.data.turns import end_of_turn_id, stop_token_ids
from composer_replication.models import build_tiny_model, build_tokenizer
from composer_replication.tasks import get_task
from composer_replication.tasks.task import decode_completion

IM_END, EOS = "<|im_end|>", "<|endoftext|>"


def _task() -> Any:
    return get_task("arithmetic", seed=0, n_train=8, n_eval=2, num_operands=3)


def _cases(answer: str) -> list[str]:
    wrong = str(int(answer) + 1)
    return [
        answer + IM_END,  # a clean answer
        answer,  # truncated, no end marker
        answer + IM_END + "\n9" + IM_END + "\n1",  # junk after the end of turn
        IM_END + answer,  # an end marker first: an empty answer
        wrong + IM_END + answer,  # the right answer only after the end of turn
        answer + EOS + "junk",  # EOS instead of the end of turn
        "<|im_start|>" + answer + IM_END,  # a stray special token before the answer
        " " + answer + " " + IM_END,
        wrong[:1] + IM_END + answer[1:],
        "",
    ]


def _trl_cut(ids: list[int], eos_ids: list[int]) -> list[int]:
    """TRL 1.16's rollout cut (`_generate_single_turn`): everything after the first stop id."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


def test_reward_path_and_evaluation_path_give_identical_verdicts() -> None:
    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1)
    task = _task()
    stops = stop_token_ids(tok, model.generation_config.eos_token_id)
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids(IM_END)
    assert set(stops) == {tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)}
    reward = task_reward(task, tok, model)
    old_reward = task.reward_func()  # the text as TRL decodes it, no ids
    disagreed_before = 0
    for ex in task.train_examples()[:3]:
        for raw in _cases(ex.answer):
            ids = tok(raw, add_special_tokens=False)["input_ids"]
            generated = ids + [tok.pad_token_id] * 3  # generate pads a finished row
            # evaluation: the decode greedy_completions uses, then the verifier
            verdict = task.verify(ex, decode_completion(tok, generated, stops))
            # training: TRL's cut and its text (special tokens skipped), the ids beside it
            cut = _trl_cut(generated, stops)
            text = tok.decode(cut, skip_special_tokens=True)
            columns = {"example_id": [ex.id], "answer": [ex.answer]}
            got = reward(completions=[text], completion_ids=[cut], **columns)[0]
            assert got == (verdict.reward, verdict.feedback), (raw, got, verdict)
            # before: rollouts stopped at EOS only, and the reward read TRL's text
            old_cut = _trl_cut(generated, [tok.eos_token_id])
            old_text = tok.decode(old_cut, skip_special_tokens=True)
            before = old_reward(completions=[old_text], **columns)[0]
            disagreed_before += before[0] != verdict.reward
    assert disagreed_before >= 3  # the defect this guards against is real on these cases


def test_greedy_evaluation_decodes_like_the_reward(tmp_path: Any) -> None:
    """`greedy_completions` returns decode_completion's text of the generated row."""
    from composer_replication.run.reporter import greedy_completions

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, seed=3)
    texts = greedy_completions(model, tok, ["1+2=", "3+4+5="], max_new_tokens=6)
    stops = stop_token_ids(tok, model.generation_config.eos_token_id)
    for prompt, text in zip(["1+2=", "3+4+5="], texts, strict=True):
        chat = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        enc = tok([chat], return_tensors="pt", add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
        row = out[0, enc["input_ids"].shape[1] :].tolist()
        assert text == decode_completion(tok, row, stops)


class _ScriptedGeneration:
    """Rollouts from a script: `generate` returns the prompt followed by the next scripted
    completion ids (padded as generate pads a finished row); the rest of the model is real."""

    def __init__(self, model: Any, scripts: list[list[int]], pad_id: int) -> None:
        self.model = model
        self.scripts = scripts
        self.pad_id = pad_id
        self.rows: list[tuple[list[int], list[int]]] = []  # (prompt ids, completion ids)
        self._next = 0

    def generate(self, input_ids: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
        width = max(len(s) for s in self.scripts) + 2
        out = []
        for row in input_ids.tolist():
            ids = self.scripts[self._next % len(self.scripts)]
            self._next += 1
            padded = ids + [self.pad_id] * (width - len(ids))
            self.rows.append((row, padded))
            out.append(row + padded)
        return torch.tensor(out, dtype=input_ids.dtype, device=input_ids.device)


@pytest.mark.parametrize("channels", ["off", "all"])
def test_logged_training_reward_equals_evaluation_verdict(tmp_path: Any, channels: str) -> None:
    from composer_replication.trainer import ComposerReplicationTrainer

    tok = build_tokenizer()
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, seed=0)
    task = _task()
    answer = task.train_examples()[0].answer
    scripts = [tok(raw, add_special_tokens=False)["input_ids"] for raw in _cases(answer)]
    scripted = _ScriptedGeneration(model, scripts, tok.pad_token_id)
    model.generate = scripted.generate  # this model's rollouts come from the script
    g = G  # the trainer tests' group size (tests/trainer/_trainer_helpers.py)
    args = config(tmp_path, max_completion_length=16, max_steps=3, learning_rate=1e-3)
    on = channels == "all"
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=[task_reward(task, tok, model)],
        args=args,
        train_dataset=task.to_dataset("train"),
        processing_class=tok,
        trace_store=None,
        alpha_sdpo=0.1 if on else 0.0,
        beta_replay=0.0,
        sdpo_teacher_probe=0,  # the script serves rollouts only
    )
    trainer.train()
    logged = list(
        zip(trainer._logs["prompt"], trainer._logs["rewards"]["arithmetic_reward"], strict=True)
    )
    assert len(scripted.rows) == 3 * 2 * g and len(logged) == 2 * g  # the last batch is kept
    stops = stop_token_ids(tok, model.generation_config.eos_token_id)
    by_prompt = {ex.prompt: ex for ex in task.train_examples()}
    last = scripted.rows[-len(logged) :]
    for (prompt, got), (_, completion) in zip(logged, last, strict=True):
        text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        ex = by_prompt[text]
        verdict = task.verify(ex, decode_completion(tok, completion, stops))
        expected = torch.tensor(verdict.reward, dtype=torch.float32).item()  # TRL's dtype
        assert got == expected, (text, completion, got, verdict)
