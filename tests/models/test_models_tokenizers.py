"""The tiny model's tokenizers: char and BPE share conventions; BPE is deterministic and cached."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from composer_replication.models import (
    BPE_VOCAB_SIZE,
    DEFAULT_CHARSET,
    TOKENIZER_KINDS,
    build_bpe_tokenizer,
    build_tiny_model,
    build_tokenizer,
    default_cache_dir,
)
from composer_replication.models.model_config import ModelConfig
from composer_replication.models.tokenizers import CACHE_ENV, SPECIAL_TOKENS
from composer_replication.tasks import get_task

ROOT = Path(__file__).resolve().parents[2]


def _corpus() -> list[str]:
    return get_task("arithmetic", n_train=300, n_eval=50, max_operand=31).text_corpus("train")


def _chat(tok: object, text: str) -> str:
    return tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_both_tokenizers_share_specials_padding_and_chat_template(tmp_path: Path) -> None:
    char = build_tokenizer()
    bpe = build_bpe_tokenizer(_corpus(), cache_dir=tmp_path)
    for tok in (char, bpe):
        assert tok.padding_side == "left"
        for i, name in enumerate(SPECIAL_TOKENS):
            assert getattr(tok, f"{name}_id") == i, name
        assert tok.convert_tokens_to_ids("<|im_end|>") == 4
        # Every charset character round-trips, and so does the chat-formatted prompt.
        assert tok.decode(tok(DEFAULT_CHARSET).input_ids) == DEFAULT_CHARSET
        text = _chat(tok, "12+31=")
        assert text == "<|im_start|>user\n12+31=<|im_end|>\n<|im_start|>assistant\n"
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
        batch = tok(["1+2=", "12+31="], padding=True, return_tensors="pt")
        assert batch["attention_mask"][0, 0] == 0 and batch["input_ids"][0, 0] == tok.pad_token_id
    # The vocabulary is far smaller than a hub tokenizer's, and larger than the char one.
    assert len(char) == 5 + len(DEFAULT_CHARSET) < len(bpe) <= BPE_VOCAB_SIZE


def test_bpe_reads_digits_one_by_one_and_words_whole(tmp_path: Path) -> None:
    bpe = build_bpe_tokenizer(_corpus(), cache_dir=tmp_path)
    tokens = bpe.convert_ids_to_tokens(bpe("12+31=", add_special_tokens=False).input_ids)
    assert tokens == ["1", "2", "+", "3", "1", "="]  # numbers read as with the char tokenizer
    hinted = _chat(bpe, "12+31=\nCorrect solution:\n\n43\n\nCorrectly solve the original question.")
    n_bpe = len(bpe(hinted, add_special_tokens=False).input_ids)
    n_char = len(build_tokenizer()(hinted, add_special_tokens=False).input_ids)
    # 26 vs 87 tokens: the hint template's words are single tokens.
    assert (n_bpe, n_char) == (26, 87)
    # Byte-level symbols, as in Qwen2's vocabulary: a leading space is 'Ġ'.
    assert "assistant" in bpe.get_vocab() and "Ġsolution" in bpe.get_vocab()


def test_bpe_is_deterministic_across_processes(tmp_path: Path) -> None:
    """Same text -> identical vocabulary and merges, in a fresh process with another hash seed
    (replicas average weights, so their token ids must agree)."""
    here = build_bpe_tokenizer(_corpus(), use_cache=False).backend_tokenizer.to_str()
    script = (
        "import sys\n"
        "from composer_replication.models import build_bpe_tokenizer\n"
        "from composer_replication.tasks import get_task\n"
        "c = get_task('arithmetic', n_train=300, n_eval=50, max_operand=31).text_corpus('train')\n"
        "sys.stdout.write(build_bpe_tokenizer(c, use_cache=False).backend_tokenizer.to_str())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    there = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(there)["model"] == json.loads(here)["model"]  # vocab and merges
    assert there == here
    other = build_bpe_tokenizer([*_corpus(), "a brand new sentence"] * 2, use_cache=False)
    assert other.backend_tokenizer.to_str() != here


def test_bpe_cache_is_keyed_by_inputs_and_validated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = _corpus()
    first = build_bpe_tokenizer(corpus, cache_dir=tmp_path)
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "tokenizer.json"]
    # Another vocabulary size or another text is another entry.
    build_bpe_tokenizer(corpus, cache_dir=tmp_path, vocab_size=200)
    build_bpe_tokenizer(corpus[:-1], cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
    original = (folder / "tokenizer.json").read_text()
    # A hit reads the cached file: an edit made there with a matching checksum comes back.
    data = json.loads(original)
    data["model"]["vocab"]["zzz"] = len(data["model"]["vocab"])
    edited = json.dumps(data)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(
        json.dumps({**meta, "sha256": hashlib.sha256(edited.encode()).hexdigest()})
    )
    (folder / "tokenizer.json").write_text(edited)
    assert "zzz" in build_bpe_tokenizer(corpus, cache_dir=tmp_path).get_vocab()
    # An edit that breaks the recorded checksum is rebuilt, with a warning, and rewritten.
    (folder / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        rebuilt = build_bpe_tokenizer(corpus, cache_dir=tmp_path)
    assert "checksum" in caplog.text
    assert "zzz" not in rebuilt.get_vocab() and rebuilt.get_vocab() == first.get_vocab()
    assert (folder / "tokenizer.json").read_text() == original
    # Garbage in the cache is rebuilt too (never trusted, never unpickled).
    (folder / "tokenizer.json").write_text("not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = build_bpe_tokenizer(corpus, cache_dir=tmp_path)
    assert "rebuilding" in caplog.text
    assert again.get_vocab() == first.get_vocab()
    assert (folder / "tokenizer.json").read_text() == original


def test_bpe_cache_location_and_bad_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c" / "tokenizers"
    build_bpe_tokenizer(["1+2=", "3"] * 3)
    assert len(list((tmp_path / "c" / "tokenizers").iterdir())) == 1
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "composer-replication" / "tokenizers"
    with pytest.raises(ValueError, match="empty corpus"):
        build_bpe_tokenizer([])
    with pytest.raises(ValueError, match="vocab_size must be an int >= 101"):
        build_bpe_tokenizer(["x"], vocab_size=50)
    with pytest.raises(ValueError, match="min_frequency"):
        build_bpe_tokenizer(["x"], min_frequency=0)


def test_tiny_model_sizes_itself_to_either_tokenizer(tmp_path: Path) -> None:
    bpe = build_bpe_tokenizer(_corpus(), cache_dir=tmp_path)
    model = build_tiny_model(bpe, hidden_size=32, num_layers=1, seed=0)
    assert model.config.vocab_size == len(bpe)
    # EOS and the chat template's end of turn, as Qwen2.5-Instruct's generation_config
    assert bpe.eos_token_id == 1 and model.generation_config.eos_token_id == [1, 4]
    ids = bpe(_chat(bpe, "3+4="), return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 3


def test_run_schema_names_the_same_tokenizers_and_default_vocabulary() -> None:
    """config/ may not import models/, so the schema repeats these; this keeps them equal."""
    hints = typing.get_type_hints(ModelConfig)
    assert typing.get_args(hints["tokenizer"]) == TOKENIZER_KINDS
    assert ModelConfig().vocab_size == BPE_VOCAB_SIZE


@pytest.mark.parametrize("kind", TOKENIZER_KINDS)
def test_a_saved_tokenizer_loads_back_exactly_through_autotokenizer(
    kind: str, tmp_path: Path
) -> None:
    """A folder with the tiny model's config.json and the tokenizer (what a checkpoint holds):
    `AutoTokenizer.from_pretrained` gives back the same tokenizer, no trust_remote_code. With a
    generic fast tokenizer saved there, transformers would pick Qwen2's own tokenizer class for
    the Qwen2 model and drop every space and newline."""
    import random

    from transformers import AutoTokenizer

    tok = (
        build_tokenizer() if kind == "char" else build_bpe_tokenizer(_corpus(), cache_dir=tmp_path)
    )
    folder = tmp_path / "checkpoint"
    build_tiny_model(tok, hidden_size=32, num_layers=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    assert type(loaded) is type(tok)
    assert loaded.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert loaded.get_vocab() == tok.get_vocab() and len(loaded) == len(tok)
    assert loaded.padding_side == "left" and loaded.chat_template == tok.chat_template
    for i, name in enumerate(SPECIAL_TOKENS):
        assert getattr(loaded, f"{name}_id") == i, name
    # The example, against ids counted by hand: 5 + the character's charset index.
    if kind == "char":
        expected = [5 + DEFAULT_CHARSET.index(c) for c in "a\nb c"]
        assert loaded("a\nb c").input_ids == tok("a\nb c").input_ids == expected
    rng = random.Random(0)
    texts = ["a\nb c", _chat(tok, "7 + 8 =\n"), DEFAULT_CHARSET] + [
        "".join(rng.choice(DEFAULT_CHARSET) for _ in range(rng.randint(0, 60))) for _ in range(300)
    ]
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        assert loaded(text, add_special_tokens=False).input_ids == ids, repr(text)
        assert loaded.decode(ids) == tok.decode(ids) == text
    batch = ["1+2=", "12+31=\nCorrect solution:"]
    assert loaded(batch, padding=True).input_ids == tok(batch, padding=True).input_ids
