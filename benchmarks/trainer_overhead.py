"""Seconds per optimizer step: plain TRL GRPOTrainer vs ComposerReplicationTrainer.

Variants (same ~10M-parameter Qwen2-architecture model built from a config, same batch, same
completion length, same seed):

* ``plain``        trl.GRPOTrainer
* ``channels_off`` ComposerReplicationTrainer with alpha_sdpo=0, beta_replay=0
* ``all_on``       ComposerReplicationTrainer with all three channels (JSD hint distillation with
                   the policy as teacher, DPO trace replay against oracle traces)
* ``all_on_simpo`` the same with SimPO as channel 3 (reference-free: no reference forward; the
                   variant the embedded default run uses)

Every completion has exactly the given number of tokens (``min_new_tokens``) so all variants do
the same generation work; ``--completion-lens 32,64,128`` measures each length in turn (fresh
trainers per length). Variants run round-robin (``--rounds`` times ``--steps`` steps each, 5 x 4
by default: with 3 rounds the 32-token ratio spread over 1.30-1.39 between runs) so
machine-load drift hits them equally; the first step of each run is dropped (warm-up) and the
median step time is reported. Ratios use process CPU seconds (``time.process_time``) with one
torch thread: on a shared, loaded machine wall time mostly measures the neighbours; CPU time
measures the work. Wall-time ratios are printed too. For ``all_on`` the time inside the added
pieces (hint/pair building, teacher forward, chosen forward, reference log-probs) is measured as
well.

``--tokenizer bpe`` (the default) trains the tiny model's BPE vocabulary on the benchmark task's
own text (prompts, answers, feedback and hinted prompts, as a run's ``[model] tokenizer = "bpe"``
trains on its task's text; deterministic, cached): every real model has a subword tokenizer, so
this gives the hinted teacher context its realistic length relative to the completion.
``--tokenizer char`` (one token per character, the tiny model's other tokenizer) makes the hint
template alone ~140 tokens and is kept to compare with earlier figures.

    python benchmarks/trainer_overhead.py [--quick] [--tokenizer bpe|char] [--completion-lens 32,64,128]

Last line: JSON with ``channels_off_ratio``, ``all_on_ratio`` and ``all_on_simpo_ratio`` (median
CPU s/step / plain) at the first completion length (32 by default) and ``all_on_ratio_<n>`` /
``all_on_simpo_ratio_<n>`` / ``channels_off_ratio_<n>`` for every other length ``n``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOTrainer

import composer_replication.trainer.trainer as trainer_module
from composer_replication.data import TraceRecord, TraceStore, prompt_key
from composer_replication.data.hints import HintTemplate
from composer_replication.models import build_bpe_tokenizer, build_tiny_model, build_tokenizer
from composer_replication.trainer import ComposerConfig, ComposerReplicationTrainer

PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


def answer_of(prompt: str) -> str:
    a, b = prompt[:-1].split("+")
    return str(int(a) + int(b))


def feedback_text(answer: str, text: str) -> str:
    """What the reward says about a wrong completion (channel 2's feedback)."""
    return f"expected {answer}, got {text[:6]!r}"


def task_corpus() -> list[str]:
    """The benchmark task's own text, to train the BPE tokenizer on (as `Task.text_corpus`):
    each prompt, its answer, the feedback on a few wrong answers and the hinted prompt the
    channel-2 teacher reads, rendered with the default hint template."""
    template = HintTemplate()
    texts: list[str] = []
    for p in PROMPTS:
        a = answer_of(p)
        texts += [p, a]
        for wrong in (str(int(a) + 1), a[::-1] + "0", "x"):
            fb = feedback_text(a, wrong)
            texts += [fb, template.render_text(p, a, fb)]
    return texts


def reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[tuple[float, Any]]:
    """1.0 if the completion starts with the answer, else 0.0 plus feedback (channel 2 input)."""
    out = []
    for i, (c, a) in enumerate(zip(completions, answer)):
        text = c[0]["content"] if isinstance(c, list) else c
        ok = text.strip().startswith(a) or i % 4 == 0  # one 'success' per group: siblings exist
        out.append((1.0, None) if ok else (0.0, feedback_text(a, text)))
    return out


def plain_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    return [score for score, _ in reward(completions, answer)]


class StepTimer(TrainerCallback):
    """Wall and process-CPU seconds of each optimizer step (generation included)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._t0 = self._c0 = 0.0

    def on_step_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.process_time() - self._c0)


class Sections:
    """Accumulates CPU time spent inside the composer's added functions while ``active``
    (the module-level loss terms are shared by both all-on variants; only ``all_on`` counts)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # process CPU seconds
        self.active = False

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                if self.active:
                    self.seconds[label] += time.process_time() - t0

        setattr(owner, name, timed)


def build(
    variant: str,
    args: ComposerConfig,
    tok: Any,
    hidden: int,
    layers: int,
    share_prefix: bool,
    model: Any = None,
) -> Any:
    """One variant's trainer (``plain``, ``channels_off``, ``all_on`` or ``all_on_simpo``) on
    ``model`` (default: a fresh tiny Qwen2 of ``hidden`` x ``layers``; benchmarks/gpu_step.py
    passes Qwen2.5-shaped ones)."""
    if model is None:
        model = build_tiny_model(
            tok, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2, seed=0
        )
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p in PROMPTS],
            "answer": [answer_of(p) for p in PROMPTS],
        }
    )
    if variant == "plain":
        return GRPOTrainer(
            model=model,
            reward_funcs=[plain_reward],
            args=args,
            train_dataset=data,
            processing_class=tok,
        )
    if variant == "channels_off":
        return ComposerReplicationTrainer(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=data,
            processing_class=tok,
            alpha_sdpo=0.0,
            beta_replay=0.0,
        )
    store = TraceStore(
        TraceRecord(prompt_key([{"role": "user", "content": p}]), "oracle", a, 1.0)
        for p, a in zip(data["prompt"] and PROMPTS, data["answer"])
    )
    return ComposerReplicationTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=data,
        processing_class=tok,
        trace_store=store,
        alpha_sdpo=0.1,
        beta_replay=0.05,
        # the cost of channel 2 when it distils: this random model's hinted teacher is no
        # better than its student, so the teacher gate would keep the channel off
        sdpo_gate=False,
        sdpo_share_prefix=share_prefix,
        dpo_variant="simpo" if variant == "all_on_simpo" else "dpo",
    )


def measure(
    opts: argparse.Namespace, tok: Any, comp_len: int, steps: int, rounds: int
) -> dict[str, Any]:
    """One completion length: fresh trainers, round-robin runs, the medians and the sections."""
    out = tempfile.mkdtemp(prefix="trainer-overhead-")
    variants = ["plain", "channels_off", "all_on", "all_on_simpo"]
    trainers = {}
    timers = {}
    sections = Sections()
    for v in variants:
        args = ComposerConfig(
            output_dir=f"{out}/{v}",
            per_device_train_batch_size=opts.batch,
            num_generations=opts.generations,
            max_completion_length=comp_len,
            generation_kwargs={"min_new_tokens": comp_len},
            max_steps=steps,
            learning_rate=1e-5,
            beta=0.0,
            logging_steps=10_000,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainers[v] = build(v, args, tok, opts.hidden, opts.layers, not opts.no_share_prefix)
        timers[v] = StepTimer()
        trainers[v].add_callback(timers[v])
    n_params = sum(p.numel() for p in trainers["plain"].model.parameters())
    all_on = trainers["all_on"]
    for name, label in (
        ("_hint_inputs", "build hints (tokenise contexts)"),
        ("_pair_inputs", "build pairs + reference log-probs"),
    ):
        sections.wrap(all_on, name, label)
    # The loss library's public terms, as the trainer module calls them.
    originals = {name: getattr(trainer_module, name) for name in ("sdpo_term", "replay_term")}
    sections.wrap(trainer_module, "sdpo_term", "channel 2 loss (teacher forward + JSD)")
    sections.wrap(trainer_module, "replay_term", "channel 3 loss (chosen forward + DPO)")
    contexts: list[int] = []
    original_hint_inputs = all_on._hint_inputs

    def hint_inputs(*a: Any, **kw: Any) -> Any:  # hinted context lengths (tokens, hinted rows)
        tensors = original_hint_inputs(*a, **kw)
        rows = tensors["sdpo_sample_mask"]
        ctx = tensors["sdpo_teacher_attention_mask"][:, :-comp_len].sum(-1)
        contexts.extend(ctx[rows].tolist())
        return tensors

    all_on._hint_inputs = hint_inputs  # type: ignore[method-assign]
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    wall: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for _ in range(rounds):
            for v in variants:
                sections.active = v == "all_on"
                timers[v].wall.clear()
                timers[v].cpu.clear()
                trainers[v].train()
                cpu[v].extend(timers[v].cpu[1:])  # drop the warm-up step
                wall[v].extend(timers[v].wall[1:])
    finally:
        for name, fn in originals.items():
            setattr(trainer_module, name, fn)
    return {
        "n_params": n_params,
        "cpu": cpu,
        "median": {v: statistics.median(cpu[v]) for v in variants},
        "median_wall": {v: statistics.median(wall[v]) for v in variants},
        "sections": dict(sections.seconds),
        "steps_all_on": len(cpu["all_on"]) + rounds,
        "context_tokens": statistics.median(contexts) if contexts else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter steps")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="rollouts per step")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument(
        "--completion-lens",
        default=None,
        help="comma-separated completion lengths; the first one gives the headline keys "
        "(default 32,64,128; --quick 16)",
    )
    parser.add_argument(
        "--tokenizer",
        choices=("bpe", "char"),
        default="bpe",
        help="bpe: trained on the task's text (realistic context lengths); char: one per character",
    )
    parser.add_argument(
        "--no-share-prefix",
        action="store_true",
        help="A/B: channel 2's teacher forward over whole contexts (no shared-prefix cache)",
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per run (first dropped)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="round-robin rounds (5; --quick 1)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 = least noisy)"
    )
    opts = parser.parse_args()
    steps = opts.steps or (3 if opts.quick else 4)
    rounds = opts.rounds or (1 if opts.quick else 5)
    raw = opts.completion_lens or ("16" if opts.quick else "32,64,128")
    try:
        lens = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--completion-lens must be comma-separated integers, got {raw!r}")
    if not lens or any(n < 1 for n in lens):
        parser.error(f"--completion-lens needs positive lengths, got {raw!r}")
    logging.getLogger("composer_replication").setLevel(logging.WARNING)
    torch.set_num_threads(opts.threads)

    tok = build_bpe_tokenizer(task_corpus()) if opts.tokenizer == "bpe" else build_tokenizer()
    summary: dict[str, Any] = {
        "tokenizer": opts.tokenizer,
        "vocab": len(tok),
        "share_prefix": not opts.no_share_prefix,
    }
    for k, comp_len in enumerate(lens):
        r = measure(opts, tok, comp_len, steps, rounds)
        median, median_wall, cpu = r["median"], r["median_wall"], r["cpu"]
        print(
            f"model: Qwen2 hidden={opts.hidden} layers={opts.layers} "
            f"params={r['n_params'] / 1e6:.1f}M, {opts.tokenizer} tokenizer ({len(tok)} tokens); "
            f"batch={opts.batch} rollouts (G={opts.generations}), completion={comp_len} tokens, "
            f"hinted context median {r['context_tokens']:.0f} tokens, "
            f"{rounds} round(s) x {steps} steps"
        )
        print("process CPU seconds per optimizer step (ratios use these; wall is load-dependent)")
        for v in median:
            print(
                f"{v:>13}: cpu median {median[v]:.3f} s/step (min {min(cpu[v]):.3f}, "
                f"max {max(cpu[v]):.3f}, n={len(cpu[v])})  ratio "
                f"{median[v] / median['plain']:.3f}   wall median {median_wall[v]:.3f} s"
            )
        print("all_on: CPU time inside the added pieces, per step (all steps incl. warm-up):")
        for label, seconds in sorted(r["sections"].items(), key=lambda kv: -kv[1]):
            print(f"  {label:<42} {seconds / r['steps_all_on']:.3f} s")
        off = round(median["channels_off"] / median["plain"], 4)
        on = round(median["all_on"] / median["plain"], 4)
        simpo = round(median["all_on_simpo"] / median["plain"], 4)
        if k == 0:
            summary.update(
                {
                    "params_m": round(r["n_params"] / 1e6, 2),
                    "completion_len": comp_len,
                    "threads": opts.threads,
                    "context_tokens": r["context_tokens"],
                    "plain_s_per_step": round(median["plain"], 4),
                    "channels_off_s_per_step": round(median["channels_off"], 4),
                    "all_on_s_per_step": round(median["all_on"], 4),
                    "wall_channels_off_ratio": round(
                        median_wall["channels_off"] / median_wall["plain"], 4
                    ),
                    "wall_all_on_ratio": round(median_wall["all_on"] / median_wall["plain"], 4),
                    "channels_off_ratio": off,
                    "all_on_ratio": on,
                    "all_on_simpo_ratio": simpo,
                }
            )
        else:
            summary[f"channels_off_ratio_{comp_len}"] = off
            summary[f"all_on_ratio_{comp_len}"] = on
            summary[f"all_on_simpo_ratio_{comp_len}"] = simpo
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
