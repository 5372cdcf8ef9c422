"""Ablation of the composer loss channels on a built-in task (issue 7's benchmark).

    python benchmarks/composer_ablation.py [--quick] [--steps N] [--seeds K] [--task NAME]

Variants, all from the same initial model (per seed) and the same budget of inner steps:

    grpo         channel 1 only                 (alpha_sdpo = 0, beta_replay = 0)
    grpo_sdpo    + channel 2, hint distillation (beta_replay = 0)
    grpo_replay  + channel 3, oracle replay     (alpha_sdpo = 0)
    all          all three channels             (the embedded default's weights)

Everything else is the embedded default configuration (`composer-replication config show`):
the tiny Qwen2 model, the arithmetic task, the oracle teacher. Each run trains ONE replica
in-process (the channels are what is compared; DiLoCo would only add the same averaging to
every variant). Measured per run:

- steps_to_threshold: first inner step at which the 10-step moving average of the mean
  training reward reaches the demo threshold (default 0.4, i.e. mostly well-formed answers that
  are close to the right value); runs that never reach it are reported as not reached and
  counted as the step budget in the mean (a censored value, so the mean is a lower bound);
- final_eval_accuracy: exact-match accuracy of greedy answers on the held-out prompts.

Prints a table, writes a plot (reward curves and final accuracy), and as the LAST line one JSON
object: {"steps_to_threshold": {variant: {"mean", "spread", "reached"}}, "final_eval_accuracy":
{variant: {"mean", "spread"}}, ...}; spread is the standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, float | None]] = {
    "grpo": {"alpha_sdpo": 0.0, "beta_replay": 0.0},
    "grpo_sdpo": {"alpha_sdpo": None, "beta_replay": 0.0},  # None: the default weight
    "grpo_replay": {"alpha_sdpo": 0.0, "beta_replay": None},
    "all": {"alpha_sdpo": None, "beta_replay": None},
}
WINDOW = 10


def moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def steps_to(values: list[float], threshold: float, window: int = WINDOW) -> int | None:
    """1-based step at which the moving average first reaches threshold (after a full window)."""
    for i, avg in enumerate(moving_average(values, window)):
        if i + 1 >= window and avg >= threshold:
            return i + 1
    return None


def run_one(
    variant: str, seed: int, steps: int, task_name: str, extra: list[str], threads: int = 0
) -> dict:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    from _inprocess import RewardLog, build_parts, held_out, run_config

    from composer_replication.assembly.build import build_trainer

    overrides = [f"task.name={task_name}", *extra]
    for key, value in VARIANTS[variant].items():
        if value is not None:
            overrides.append(f"loss.{key}={value}")
    config = run_config(seed, steps, overrides)
    task, model, tok = build_parts(config)  # the initial model depends on the seed only
    log = RewardLog()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="composer-ablation-") as scratch:
        trainer = build_trainer(
            config,
            model=model,
            tokenizer=tok,
            task=task,
            max_steps=steps,
            seed=seed,
            output_dir=scratch,
            callbacks=[log],
        )
        trainer.train()
    seconds = time.monotonic() - t0
    metrics = held_out(model, tok, task, config)
    rewards = log.rewards
    return {
        "variant": variant,
        "seed": seed,
        "rewards": rewards,
        "eval_accuracy": metrics["accuracy"],
        "eval_reward": metrics["reward"],
        "seconds": seconds,
    }


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "spread": None}
    spread = statistics.pstdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "spread": spread}


def summarize(results: list[dict], steps: int, threshold: float) -> dict[str, Any]:
    out: dict[str, Any] = {"steps_to_threshold": {}, "final_eval_accuracy": {}}
    for variant in VARIANTS:
        runs = [r for r in results if r["variant"] == variant]
        hits = [steps_to(r["rewards"], threshold) for r in runs]
        censored = [float(h if h is not None else steps) for h in hits]
        entry = _stats(censored)
        entry["reached"] = f"{sum(h is not None for h in hits)}/{len(hits)}"
        out["steps_to_threshold"][variant] = entry
        out["final_eval_accuracy"][variant] = _stats([r["eval_accuracy"] for r in runs])
    return out


def plot(results: list[dict], threshold: float, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax_r, ax_a = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    for i, variant in enumerate(VARIANTS):
        runs = [r for r in results if r["variant"] == variant]
        curves = [moving_average(r["rewards"], WINDOW) for r in runs]
        n = min(len(c) for c in curves)
        mean = [statistics.fmean(c[j] for c in curves) for j in range(n)]
        ax_r.plot(range(1, n + 1), mean, label=variant, color=f"C{i}")
        accs = [r["eval_accuracy"] for r in runs]
        ax_a.bar(i, statistics.fmean(accs), color=f"C{i}")
        ax_a.errorbar(
            i, statistics.fmean(accs), yerr=statistics.pstdev(accs), color="black", capsize=4
        )
    ax_r.axhline(threshold, color="gray", linestyle="--", linewidth=1, label="threshold")
    ax_r.set_xlabel("inner step")
    ax_r.set_ylabel(f"mean reward ({WINDOW}-step moving average)")
    ax_r.set_title("training reward (mean over seeds)")
    ax_r.legend(fontsize=8)
    ax_r.grid(alpha=0.3)
    ax_a.set_xticks(range(len(VARIANTS)), list(VARIANTS), rotation=20)
    ax_a.set_ylabel("eval accuracy")
    ax_a.set_title("final held-out accuracy")
    ax_a.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and seeds (a smoke run)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="inner steps per run (default: the embedded default's train.max_steps, 900; "
        "--quick: 80)",
    )
    p.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 3)")
    p.add_argument("--task", default="arithmetic", help="built-in task (default arithmetic)")
    p.add_argument("--threshold", type=float, default=0.4, help="demo reward threshold")
    p.add_argument("--plot", default="docs/composer_ablation.png", help="output PNG")
    p.add_argument(
        "--jobs", type=int, default=1, help="runs in parallel processes (each with 1 torch thread)"
    )
    p.add_argument("overrides", nargs="*", help="extra section.key=value config overrides")
    args = p.parse_args()
    if args.steps is None and not args.quick:
        from composer_replication.config import load_config

        args.steps = load_config().train.max_steps  # the default run's budget per replica
    steps = args.steps or 80
    seeds = args.seeds or (2 if args.quick else 3)
    t0 = time.monotonic()
    jobs = [(variant, seed) for seed in range(seeds) for variant in VARIANTS]
    threads = 1 if args.jobs > 1 else 0
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = [
                pool.submit(run_one, v, s, steps, args.task, args.overrides, threads)
                for v, s in jobs
            ]
            outputs = [f.result() for f in futures]
    else:
        outputs = [run_one(v, s, steps, args.task, args.overrides) for v, s in jobs]
    results = []
    for r in outputs:
        hit = steps_to(r["rewards"], args.threshold)
        print(
            f"{r['variant']:12s} seed {r['seed']}: steps to {args.threshold} = "
            f"{hit if hit is not None else 'not reached'}, final eval accuracy "
            f"{r['eval_accuracy']:.3f}, last-10 reward "
            f"{statistics.fmean(r['rewards'][-10:]):.3f} ({r['seconds']:.0f} s)",
            flush=True,
        )
        results.append(r)
    summary = summarize(results, steps, args.threshold)
    print(
        f"\n{args.task}, {steps} inner steps, {seeds} seeds, threshold {args.threshold} "
        f"(10-step moving average of the mean reward)"
    )
    print(f"{'variant':12s} | steps to threshold (mean ± sd, reached) | final eval acc (mean ± sd)")
    for variant in VARIANTS:
        s, a = summary["steps_to_threshold"][variant], summary["final_eval_accuracy"][variant]
        print(
            f"{variant:12s} | {s['mean']:7.1f} ± {s['spread']:5.1f}  ({s['reached']})"
            f"            | {a['mean']:.3f} ± {a['spread']:.3f}"
        )
    plot(results, args.threshold, Path(args.plot))
    print(f"plot: {args.plot}")
    summary.update(
        task=args.task,
        steps=steps,
        seeds=seeds,
        threshold=args.threshold,
        seconds=round(time.monotonic() - t0, 1),
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
