"""benchmarks/trainer_overhead.py: its BPE tokenizer gives the hinted context a realistic length,
and a tiny two-length run prints the keys docs/benchmarks-notebook.md quotes (the figures are not judged
here, only their form: every variant ran at every length)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bpe_on_the_task_text_shortens_the_hinted_context():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import trainer_overhead as bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from composer_replication.data.hints import HintTemplate
    from composer_replication.models import build_bpe_tokenizer, build_tokenizer

    corpus = bench.task_corpus()
    assert bench.answer_of("7+8=") == "15" and "7+8=" in corpus
    hinted = HintTemplate().render_text("7+8=", "15", bench.feedback_text("15", "x14"))
    char = build_tokenizer()(hinted)["input_ids"]
    bpe = build_bpe_tokenizer(corpus)
    ids = bpe(hinted)["input_ids"]
    assert bpe.decode(ids) == hinted  # lossless on the task's text
    assert len(ids) * 3 < len(char)  # the template's words are single tokens


@pytest.mark.slow
def test_quick_run_prints_the_keys_for_every_length():
    pytest.importorskip("trl")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "trainer_overhead.py"),
        "--quick",
        "--hidden",
        "32",
        "--layers",
        "2",
        "--steps",
        "2",
        "--completion-lens",
        "4,8",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokenizer"] == "bpe" and result["share_prefix"] is True
    assert result["completion_len"] == 4
    for key in (
        "channels_off_ratio",
        "all_on_ratio",
        "all_on_simpo_ratio",
        "channels_off_ratio_8",
        "all_on_ratio_8",
        "all_on_simpo_ratio_8",
    ):
        assert result[key] > 0, key
    assert result["context_tokens"] > 0  # channel 2 had hinted rows
