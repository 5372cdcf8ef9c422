"""Seconds and memory per optimizer step on one GPU at Qwen2.5 sizes: TRL's GRPOTrainer vs ours.

Models: Qwen2.5-0.5B and Qwen2.5-1.5B shapes (``SHAPES``: hidden size, layers, attention and
key/value heads, MLP size, the 151,936-token vocabulary, tied embeddings) built locally from a
``Qwen2Config`` and randomly initialised on the device in bf16: nothing is downloaded. The
prompts, rewards (one success per group, feedback on the rest), BPE tokenizer (trained on the
task's own text) and oracle traces are benchmarks/trainer_overhead.py's.

Arms, one after the other (each a fresh model and trainer, the previous one freed first, so each
arm's peak memory is its own):

* ``plain``        ``trl.GRPOTrainer``
* ``channels_off`` ours with ``alpha_sdpo = beta_replay = 0``
* ``all_on``       ours with all three channels: the policy as channel 2's teacher and SimPO
                   trace replay, the GPU example's settings (``--dpo``: DPO, with its frozen
                   reference copy)

Every arm trains with TRL's GPU defaults as a run would (bf16 weights and autocast, gradient
checkpointing; ``--no-gradient-checkpointing`` turns it off) and the same rollouts per step;
every completion has exactly ``--completion-len`` tokens (``min_new_tokens``; a random model of
this vocabulary almost never samples EOS anyway). Per step, wall seconds with the device's queue
drained at every reading (``torch.cuda.synchronize``): the whole optimizer step; generation
(rollouts, rewards and, for ours, the channel inputs: ``_generate_and_score_completions``); the
channel-2 teacher (its forward over the hinted contexts and the JSD: the trainer's
``time/teacher_s``); and loss + backward (the rest: policy forward, losses, backward, optimizer
step). The first ``--warmup`` steps are dropped (CUDA context, kernel selection, allocator
growth); medians of the rest. Peak memory: ``torch.cuda.max_memory_allocated`` over the measured
steps (on CPU the process's peak resident memory, reset the same way).

Generation: TRL's rollout engines (``[train] generation``: ``generate``, ``static`` (a static
key/value cache, the decoding forward compiled on a GPU), ``paged``, ``paged_eager``, and where
vLLM is installed ``vllm`` / ``vllm_server``; assembly.build.GENERATION_ARGS) are timed on the
plain arm at the first shape, right after its arms (``--generation-options``; ``--gen-steps``
steps each, the first dropped when there are several: the process is warm by then, but the
static engine compiles in its first step, so give it 3 or more).
Every step counts: TRL sets continuous batching up afresh at each generation (its CUDA-graph
warm-up included). ``--out`` keeps the JSON so far on disk after every arm, so a run cut short
by a time limit (scripts/gpu-check.sh) keeps its first shape.

    python benchmarks/gpu_step.py                        # one GPU: qwen05b and qwen15b
    python benchmarks/gpu_step.py --device cpu --tiny    # the same code on a tiny model (tests)

Timing (issue 39): by default 18 steps per arm, the first 2 dropped, so every median is over 16
steps (fewer on a GPU prints a warning: generation varies up to 1.5x from step to step, and 2-8
steps let that spread decide the ratios). Every part is reported with its spread (min, quartiles,
max), and generation apart from the rest of the step: ``train`` = step - generation, what the
trainer's own code costs (forwards, losses, backward, optimizer step; the teacher included).

Last line: JSON with ``gpu_train_part_ratio`` (median train part, all three channels / TRL's;
goal <= 1.15) and ``gpu_train_part_ratio_channels_off`` (goal <= 1.02), each with its
``_range`` (``[q1(ours) / q3(TRL), q3(ours) / q1(TRL)]``); ``gpu_channels_off_ratio`` and
``gpu_all_on_ratio`` (the whole step, median / TRL's, generation included; with ``_range``),
``gpu_peak_memory_ratio`` (all on / TRL; goal <= 1.05) at the first shape, the same with a
``_<shape>`` suffix for the others; every arm's parts
(``<shape>_<arm>_{step,generation,train,teacher,loss_backward}_s``, medians, and
``..._spread_s``), ``<shape>_<arm>_peak_gb``, ``measured_steps``, ``generation_<engine>_s``
and ``gpu_generation_<engine>_ratio`` (vs ``generate``), and the setup.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_overhead as overhead  # noqa: E402  (benchmarks/ is not a package)

from composer_replication.assembly.build import (  # noqa: E402
    GENERATION_ARGS,
    VLLM_ENGINES,
    configure_generation,
    generation_args,
)
from composer_replication.trainer import ComposerConfig  # noqa: E402

# Qwen2.5's published configurations (hidden, layers, heads, KV heads, MLP, vocabulary; tied
# input/output embeddings at these two sizes); "tiny" is the CPU smoke shape (vocabulary: the
# tokenizer's).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen05b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    "qwen15b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=None,
    ),
}
ARMS = ("plain", "channels_off", "all_on")
# Per step: the whole step, generation (rollouts, rewards, channel inputs), the step minus
# generation ("train": what the trainer's own code decides: forwards, losses, backward, optimizer
# step), the channel-2 teacher and the rest of "train" (loss+backward).
PARTS = ("step", "generation", "train", "teacher", "loss_backward")
# The figure needs at least this many timed steps per arm on a GPU (issue 39).
MIN_MEASURED = 16


def build_model(shape: str, tok: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A randomly initialised Qwen2.5-shaped model, created directly on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    spec = dict(SHAPES[shape])
    spec["vocab_size"] = spec["vocab_size"] or len(tok)
    config = Qwen2Config(
        **spec,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


class PeakMemory:
    """Peak memory since `reset`: CUDA's allocator statistics, or on CPU the process's peak
    resident set (Linux: /proc/self/clear_refs resets VmHWM); None where neither exists."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass

    def read(self) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None


class StepClock(TrainerCallback):
    """Per optimizer step: wall seconds (device queue drained), generation seconds (from the
    wrapped ``_generate_and_score_completions``), teacher seconds (our trainer's own
    ``time/teacher_s``, synchronised the same way), and the peak memory after warm-up."""

    def __init__(self, trainer: Any, device: torch.device, warmup: int, label: str) -> None:
        self.trainer, self.device, self.warmup, self.label = trainer, device, warmup, label
        self.rows: list[dict[str, float]] = []
        self.memory = PeakMemory(device)
        self.peak: int | None = None
        self._t0 = 0.0
        self._generation = 0.0
        original = trainer._generate_and_score_completions

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self._now()
            try:
                return original(*args, **kwargs)
            finally:
                self._generation += self._now() - t0

        trainer._generate_and_score_completions = timed

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.warmup:
            self.memory.reset()
        self._generation = 0.0
        self._t0 = self._now()

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        step = self._now() - self._t0
        teacher_log = self.trainer._metrics["train"].get("time/teacher_s") or [0.0]
        teacher = float(teacher_log[-1])
        row = {
            "step": step,
            "generation": self._generation,
            "train": max(0.0, step - self._generation),
            "teacher": teacher,
            "loss_backward": max(0.0, step - self._generation - teacher),
        }
        self.rows.append(row)
        tag = "warm-up" if state.global_step <= self.warmup else "measured"
        print(
            f"    {self.label} step {state.global_step} ({tag}): {step:.3f} s = generation "
            f"{row['generation']:.3f} + teacher {teacher:.3f} + loss/backward "
            f"{row['loss_backward']:.3f}",
            flush=True,
        )

    def on_train_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self.peak = self.memory.read()


def trainer_args(opts: argparse.Namespace, out: str, steps: int, generation: str) -> Any:
    cuda = opts.device.type == "cuda"
    extra: dict[str, Any] = {}
    if opts.no_gradient_checkpointing:
        extra["gradient_checkpointing"] = False
    return ComposerConfig(
        output_dir=out,
        per_device_train_batch_size=opts.batch,
        num_generations=opts.generations,
        max_completion_length=opts.completion_len,
        generation_kwargs={"min_new_tokens": opts.completion_len},
        max_steps=steps,
        learning_rate=1e-6,
        beta=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        use_cpu=not cuda,
        bf16=opts.dtype == torch.bfloat16 and cuda,  # autocast matches the weights
        **extra,
        **generation_args(generation),
    )


def run_arm(
    opts: argparse.Namespace, tok: Any, shape: str, arm: str, generation: str, steps: int
) -> dict[str, Any]:
    """One arm's trainer for `steps` steps: the per-step rows, medians after warm-up, peak."""
    _release(opts.device)
    resident = _resident(opts.device)
    model = build_model(shape, tok, opts.device, opts.dtype)
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="gpu-step-") as out:
        args = trainer_args(opts, out, steps, generation)
        variant = {"plain": "plain", "channels_off": "channels_off"}.get(arm, "all_on")
        if arm == "all_on" and not opts.dpo:
            variant = "all_on_simpo"
        trainer = overhead.build(
            variant, args, tok, 0, 0, share_prefix=opts.share_prefix, model=model
        )
        configure_generation(trainer, generation)
        clock = StepClock(trainer, opts.device, min(opts.warmup, steps - 1), f"{shape} {arm}")
        trainer.add_callback(clock)
        trainer.remove_callback(_printer())
        trainer.train()
        gradient_checkpointing = bool(trainer.args.gradient_checkpointing)
        del trainer
    del model
    measured = clock.rows[clock.warmup :]
    return {
        "params": n_params,
        "rows": clock.rows,
        "measured": len(measured),
        "median": {p: statistics.median(r[p] for r in measured) for p in PARTS},
        "spread": {p: spread([r[p] for r in measured]) for p in PARTS},
        "peak": clock.peak,
        "resident_before": resident,
        "gradient_checkpointing": gradient_checkpointing,
    }


def spread(values: list[float]) -> dict[str, float]:
    """``min``, quartiles ``q1`` / ``q3`` (inclusive method, so they stay between ``min`` and
    ``max`` however few steps were measured; the median when one value) and ``max``."""
    ordered = sorted(values)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"min": ordered[0], "q1": q1, "q3": q3, "max": ordered[-1]}


def ratio_range(ours: dict[str, float], theirs: dict[str, float]) -> list[float]:
    """The interquartile range of ours / theirs: ``[q1(ours) / q3(theirs), q3(ours) /
    q1(theirs)]`` (the spread of the ratio of medians; None-safe for a zero quartile)."""
    low = ours["q1"] / theirs["q3"] if theirs["q3"] > 0 else float("inf")
    high = ours["q3"] / theirs["q1"] if theirs["q1"] > 0 else float("inf")
    return [round(low, 4), round(high, 4)]


def _printer() -> Any:
    from transformers.trainer_callback import PrinterCallback

    return PrinterCallback


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _resident(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _gb(n: int | None) -> float | None:
    return None if n is None else round(n / 1e9, 3)


def time_engines(
    opts: argparse.Namespace, tok: Any, shape: str, plain_generation: float, result: dict
) -> None:
    """TRL's rollout engines on the plain arm at `shape` (the arms' own engine is reused)."""
    print(f"  {shape} generation engines (plain arm, {opts.gen_steps} steps each):")
    times: dict[str, float] = {}
    for engine in opts.engines:
        if engine == opts.generation:  # the plain arm measured it already
            times[engine] = plain_generation
        else:
            run = run_arm(opts, tok, shape, "plain", engine, opts.gen_steps)
            times[engine] = run["median"]["generation"]
        result[f"generation_{engine}_s"] = round(times[engine], 4)
        print(f"    {engine}: {times[engine]:.3f} s per generation", flush=True)
        if "generate" in times and engine != "generate":
            result[f"gpu_generation_{engine}_ratio"] = round(times[engine] / times["generate"], 4)
    result["generation_fastest"] = min(times, key=lambda e: times[e])


def default_engines() -> list[str]:
    """The rollout engines timed by default: all of `GENERATION_ARGS`, the vLLM ones only where
    vLLM is installed."""
    import importlib.util

    vllm = importlib.util.find_spec("vllm") is not None
    return [e for e in GENERATION_ARGS if vllm or e not in VLLM_ENGINES]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape only (CPU smoke run)")
    ap.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated, of {', '.join(SHAPES)} (default qwen05b,qwen15b)",
    )
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help="weights (default bfloat16 on CUDA, float32 on CPU)",
    )
    ap.add_argument("--batch", type=int, default=8, help="rollouts per step")
    ap.add_argument("--generations", type=int, default=4, help="rollouts per prompt (G)")
    ap.add_argument("--completion-len", type=int, default=128, help="tokens per completion")
    ap.add_argument(
        "--steps",
        type=int,
        default=MIN_MEASURED + 2,
        help=f"optimizer steps per arm, warm-up included (default {MIN_MEASURED + 2}: "
        f"{MIN_MEASURED} timed after 2 warm-up steps)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="leading steps dropped")
    ap.add_argument(
        "--generation",
        choices=tuple(GENERATION_ARGS),
        default="generate",
        help="rollout engine of the three arms",
    )
    ap.add_argument(
        "--generation-options",
        default=",".join(default_engines()),
        help="engines timed on the plain arm at the first shape ('' or 'none' = none; default: every "
        "engine but the vLLM ones, which need vLLM installed)",
    )
    ap.add_argument(
        "--gen-steps",
        type=int,
        default=2,
        help="steps per engine, the first dropped when there are several",
    )
    ap.add_argument("--dpo", action="store_true", help="all_on with DPO (a frozen reference copy)")
    ap.add_argument(
        "--share-prefix",
        action="store_true",
        help="channel 2's shared-prefix teacher forward (opt-in, as in a run)",
    )
    ap.add_argument("--no-gradient-checkpointing", action="store_true")
    ap.add_argument(
        "--out",
        default=None,
        help="also write the JSON so far here after every arm (a run cut short by a "
        "time limit keeps what it measured)",
    )
    opts = ap.parse_args(argv)
    try:
        opts.device = torch.device(opts.device)
    except RuntimeError:
        ap.error(f"--device: {opts.device!r} is not a torch device (cuda or cpu)")
    if opts.device.type == "cuda" and not torch.cuda.is_available():
        ap.error(
            f"--device cuda: torch {torch.__version__} sees no CUDA device; run on a GPU "
            "machine, or use --device cpu --tiny"
        )
    if opts.device.type not in ("cuda", "cpu"):
        ap.error(f"--device: {opts.device} (cuda or cpu)")
    raw = "tiny" if opts.tiny else opts.shapes or "qwen05b,qwen15b"
    opts.shape_list = [s.strip() for s in raw.split(",") if s.strip()]
    unknown = [s for s in opts.shape_list if s not in SHAPES]
    if unknown or not opts.shape_list:
        ap.error(f"--shapes: unknown {unknown or raw!r}; choose from {', '.join(SHAPES)}")
    raw_engines = "" if opts.generation_options.strip() == "none" else opts.generation_options
    engines = [g.strip() for g in raw_engines.split(",") if g.strip()]
    bad = [g for g in engines if g not in GENERATION_ARGS]
    if bad:
        ap.error(f"--generation-options: unknown {bad}; choose from {', '.join(GENERATION_ARGS)}")
    opts.engines = engines
    if opts.steps < 2 or not 1 <= opts.warmup < opts.steps or opts.gen_steps < 1:
        ap.error("need --steps >= 2, 1 <= --warmup < --steps and --gen-steps >= 1")
    if opts.batch % opts.generations:
        ap.error(f"--batch {opts.batch} must be a multiple of --generations {opts.generations}")
    if opts.device.type == "cuda" and opts.steps - opts.warmup < MIN_MEASURED:
        print(
            f"gpu_step: {opts.steps - opts.warmup} timed steps per arm (< {MIN_MEASURED}): the "
            "ratios are a smoke figure, not the issue's (generation varies up to 1.5x per step)",
            file=sys.stderr,
        )
    default_dtype = "bfloat16" if opts.device.type == "cuda" else "float32"
    opts.dtype = getattr(torch, opts.dtype or default_dtype)
    return opts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    opts = parse(argv)
    logging.getLogger("composer_replication").setLevel(logging.WARNING)
    import transformers
    import trl

    tok = overhead.build_bpe_tokenizer(overhead.task_corpus())
    cuda = opts.device.type == "cuda"
    name = torch.cuda.get_device_name(opts.device) if cuda else "cpu"
    print(
        f"device {opts.device} ({name}), weights {str(opts.dtype).removeprefix('torch.')}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl "
        f"{trl.__version__}; {opts.batch} rollouts/step (G={opts.generations}) x "
        f"{opts.completion_len} tokens; {opts.steps} steps per arm, {opts.warmup} dropped",
        flush=True,
    )
    result: dict[str, Any] = {
        "device": str(opts.device),
        "device_name": name,
        "dtype": str(opts.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "batch": opts.batch,
        "generations": opts.generations,
        "completion_len": opts.completion_len,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "generation": opts.generation,
        "channel3": "dpo" if opts.dpo else "simpo",
        "shapes": opts.shape_list,
    }
    t_start = time.perf_counter()

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - t_start, 1)
        if opts.out:
            tmp = Path(opts.out + ".tmp")
            tmp.write_text(json.dumps(result) + "\n")
            tmp.replace(opts.out)

    for k, shape in enumerate(opts.shape_list):
        runs = {}
        for arm in ARMS:
            t0 = time.perf_counter()
            runs[arm] = run_arm(opts, tok, shape, arm, opts.generation, opts.steps)
            r = runs[arm]
            med = r["median"]
            sp = r["spread"]
            print(
                f"  {shape} {arm}: {r['params'] / 1e6:.0f}M params, medians of "
                f"{r['measured']} steps: step {med['step']:.3f} s [{sp['step']['min']:.3f}-"
                f"{sp['step']['max']:.3f}] = generation {med['generation']:.3f} "
                f"[{sp['generation']['min']:.3f}-{sp['generation']['max']:.3f}] + train "
                f"{med['train']:.3f} [{sp['train']['min']:.3f}-{sp['train']['max']:.3f}] "
                f"(teacher {med['teacher']:.3f}, loss/backward {med['loss_backward']:.3f}), peak "
                f"{_gb(r['peak'])} GB, {time.perf_counter() - t0:.0f} s for the arm",
                flush=True,
            )
            for part in PARTS:
                result[f"{shape}_{arm}_{part}_s"] = round(med[part], 4)
                result[f"{shape}_{arm}_{part}_spread_s"] = {
                    k: round(v, 4) for k, v in sp[part].items()
                }
            result[f"{shape}_{arm}_peak_gb"] = _gb(r["peak"])
            result[f"{shape}_{arm}_resident_before_gb"] = _gb(r["resident_before"])
            save()
        result["gradient_checkpointing"] = runs["plain"]["gradient_checkpointing"]
        result[f"{shape}_params_m"] = round(runs["plain"]["params"] / 1e6, 1)
        plain = runs["plain"]["median"]["step"]
        suffix = "" if k == 0 else f"_{shape}"
        result[f"gpu_channels_off_ratio{suffix}"] = round(
            runs["channels_off"]["median"]["step"] / plain, 4
        )
        result[f"gpu_all_on_ratio{suffix}"] = round(runs["all_on"]["median"]["step"] / plain, 4)
        # the step minus generation: what the trainer's own code costs, ours over TRL's
        train = runs["plain"]["median"]["train"]
        for arm, name in (
            ("all_on", "gpu_train_part_ratio"),
            ("channels_off", "gpu_train_part_ratio_channels_off"),
        ):
            ours = runs[arm]
            result[f"{name}{suffix}"] = round(ours["median"]["train"] / train, 4) if train else None
            result[f"{name}_range{suffix}"] = ratio_range(
                ours["spread"]["train"], runs["plain"]["spread"]["train"]
            )
        for arm, name in (
            ("channels_off", "gpu_channels_off_ratio"),
            ("all_on", "gpu_all_on_ratio"),
        ):
            result[f"{name}_range{suffix}"] = ratio_range(
                runs[arm]["spread"]["step"], runs["plain"]["spread"]["step"]
            )
        result["measured_steps"] = runs["plain"]["measured"]
        peaks = runs["plain"]["peak"], runs["all_on"]["peak"]
        result[f"gpu_peak_memory_ratio{suffix}"] = (
            round(peaks[1] / peaks[0], 4) if peaks[0] and peaks[1] else None
        )
        save()
        if k == 0 and opts.engines:  # before the next shape: a time limit cuts the largest last
            time_engines(opts, tok, shape, runs["plain"]["median"]["generation"], result)
            save()
    save()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
