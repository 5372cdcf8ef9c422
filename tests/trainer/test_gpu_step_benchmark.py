"""benchmarks/gpu_step.py: the Qwen2.5 shapes are the published ones, bad flags and a missing GPU
fail clearly, and the same code runs end to end on a CPU with the tiny shape, printing every key
docs/trainer.md quotes (the figures themselves come from a GPU: scripts/gpu-check.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_step  # noqa: E402


def test_shapes_are_qwen25s_and_the_model_is_built_on_the_device_in_the_dtype():
    q05, q15 = gpu_step.SHAPES["qwen05b"], gpu_step.SHAPES["qwen15b"]
    assert (q05["hidden_size"], q05["num_hidden_layers"], q05["intermediate_size"]) == (
        896,
        24,
        4864,
    )
    assert (q15["hidden_size"], q15["num_hidden_layers"], q15["intermediate_size"]) == (
        1536,
        28,
        8960,
    )
    assert q05["vocab_size"] == q15["vocab_size"] == 151936
    from composer_replication.models import build_tokenizer

    tok = build_tokenizer()
    model = gpu_step.build_model("tiny", tok, torch.device("cpu"), torch.bfloat16)
    assert model.config.vocab_size == len(tok) and model.config.tie_word_embeddings
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bad_flags_and_a_missing_gpu_fail_clearly(capsys):
    cases = [
        (["--device", "cpu", "--shapes", "qwen7b"], "--shapes: unknown"),
        (["--device", "cpu", "--generation-options", "sglang"], "--generation-options: unknown"),
        (["--device", "cpu", "--steps", "1"], "--steps >= 2"),
        (["--device", "cpu", "--steps", "2"], "1 <= --warmup < --steps"),
        (["--device", "cpu", "--batch", "6", "--generations", "4"], "multiple of --generations"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "sees no CUDA device"))
    for argv, message in cases:
        with pytest.raises(SystemExit):
            gpu_step.parse(argv)
        assert message in capsys.readouterr().err, argv
    opts = gpu_step.parse(["--device", "cpu", "--tiny"])
    assert opts.shape_list == ["tiny"] and opts.dtype == torch.float32
    vllm = ["vllm", "vllm_server"] if importlib.util.find_spec("vllm") else []
    assert opts.engines == ["generate", "static", "paged", "paged_eager", *vllm]
    # the figure: at least 16 timed steps per arm after the warm-up, by default
    assert opts.steps - opts.warmup >= gpu_step.MIN_MEASURED == 16


def test_spread_and_the_ratio_range():
    assert gpu_step.spread([3.0]) == {"min": 3.0, "q1": 3.0, "q3": 3.0, "max": 3.0}
    s = gpu_step.spread([5.0, 1.0, 2.0, 4.0, 3.0])
    assert (s["min"], s["max"]) == (1.0, 5.0) and (s["q1"], s["q3"]) == (2.0, 4.0)
    # two steps (the CPU smoke run): the quartiles stay inside the measured values (the exclusive
    # method put q1 below the minimum, a negative time when the two steps differ a lot)
    two = gpu_step.spread([0.1, 2.0])
    assert 0.1 <= two["q1"] <= two["q3"] <= 2.0
    ours = {"min": 1.0, "q1": 2.0, "q3": 3.0, "max": 9.0}
    theirs = {"min": 1.0, "q1": 1.0, "q3": 4.0, "max": 5.0}
    assert gpu_step.ratio_range(ours, theirs) == [0.5, 3.0]  # [q1 / q3', q3 / q1']


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1500)  # six arms of a tiny model; ~6 min on a loaded 2-core machine
def test_tiny_cpu_run_prints_every_key():
    pytest.importorskip("trl")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_step.py"),
        "--device",
        "cpu",
        "--tiny",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--batch",
        "4",
        "--generations",
        "2",
        "--completion-len",
        "4",
        "--generation-options",
        "generate,paged",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["shapes"] == ["tiny"]
    for key in (
        "gpu_channels_off_ratio",
        "gpu_all_on_ratio",
        "gpu_peak_memory_ratio",
        "generation_generate_s",
        "generation_paged_s",
        "gpu_generation_paged_ratio",
        "gpu_train_part_ratio",
        "gpu_train_part_ratio_channels_off",
    ):
        assert result[key] > 0, key
    for key in ("gpu_train_part_ratio", "gpu_all_on_ratio", "gpu_channels_off_ratio"):
        low, high = result[f"{key}_range"]
        assert 0 < low <= high, key
    assert result["measured_steps"] == 2
    for arm in gpu_step.ARMS:
        for part in ("step", "generation", "train", "loss_backward"):
            assert result[f"tiny_{arm}_{part}_s"] > 0, (arm, part)
            spread = result[f"tiny_{arm}_{part}_spread_s"]
            assert spread["min"] <= result[f"tiny_{arm}_{part}_s"] <= spread["max"], (arm, part)
        # generation and the rest of the step add up to the step, per step and so in medians
        train, generation = result[f"tiny_{arm}_train_s"], result[f"tiny_{arm}_generation_s"]
        assert train < result[f"tiny_{arm}_step_s"] and generation < result[f"tiny_{arm}_step_s"]
        assert result[f"tiny_{arm}_peak_gb"] > 0
    # only all_on runs a teacher; every step was printed with its split
    assert result["tiny_all_on_teacher_s"] > 0 and result["tiny_plain_teacher_s"] == 0
    assert done.stdout.count("(measured)") == 3 * 2 + 1  # three arms x 2 + the paged engine
    assert result["generation_fastest"] in ("generate", "paged")
