"""`composer-replication report RUN`: PNG plots and a markdown summary of a run folder.

Plots (in `<run>/plots/`, one line per replica): reward.png, loss_<channel>.png for each loss
channel that was logged (total, grpo, sdpo, replay), eval_accuracy.png, outer_rounds.png
(seconds and megabytes per outer round), time_breakdown.png (where each round's wall time went,
stacked: training split into generation / channel-2 teacher / loss + backward by the logged step
shares, then the exchange's upload / wait for peers / merge; replica 0, or the first replica),
throughput.png (inner steps and tokens per second per round), health.png (the run state the driver recorded:
starting / healthy / degraded / critical over time, and the decoupled synchronizer's merges). `summarize` computes the headline numbers (first-10%
vs last-10% mean reward, eval accuracy before/after) that `train` prints at the end.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from composer_replication.json_types import (
    JSONDict,
    JSONValue,
    as_dict,
    as_float,
    as_int,
    as_list,
    as_number,
)
from composer_replication.run.folder import RunFolder
from composer_replication.run.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "device_lines",
    "draw_plots",
    "headline_lines",
    "health_summary",
    "rejections",
    "summarize",
    "summary_markdown",
    "write_report",
]

# logged key -> plot name; TRL logs the total optimised loss as "loss".
LOSS_KEYS = {
    "loss": "total",
    "loss/total": "total",
    "loss/grpo": "grpo",
    "loss/sdpo": "sdpo",
    "loss/replay": "replay",
}


def _mean(values: Iterable[JSONValue]) -> float | None:
    """Mean of the finite numbers among `values` (metrics are read from JSON: anything else,
    missing or malformed, is skipped); None when there are none."""
    numbers = [
        float(v)
        for v in values
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]
    return sum(numbers) / len(numbers) if numbers else None


def _series(records: list[JSONDict], kind: str, key: str) -> dict[int, list[tuple[int, float]]]:
    """replica -> [(step, value)] sorted by step, for records of `kind` that have `key`."""
    out: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        value = r.get(key)
        if r.get("kind") == kind and isinstance(value, int | float) and not isinstance(value, bool):
            out[as_int(r.get("replica", 0))].append((as_int(r.get("step", 0)), float(value)))
    return {k: sorted(v) for k, v in sorted(out.items())}


def reward_key(records: list[JSONDict]) -> str | None:
    """The logged mean-reward key: TRL logs 'reward'; fall back to any 'reward*' mean."""
    keys = {k for r in records if r.get("kind") == "train" for k in r}
    if "reward" in keys:
        return "reward"
    candidates = sorted(k for k in keys if k.startswith("reward") and not k.endswith("std"))
    return candidates[0] if candidates else None


# (summary name, logged metric) of each loss channel, in channel order
class LossChannel(NamedTuple):
    """One loss channel as the summary and the printout name it."""

    number: int  # 1, 2, 3: the channel's number in `total = grpo + alpha sdpo + beta replay`
    label: str  # short name in the printout and summary.md ("grpo")
    key: str  # summary key prefix ("loss_grpo" -> loss_grpo_first10 / loss_grpo_last10)
    metric: str  # the trainer's logged metric ("loss/grpo")


LOSS_CHANNELS: tuple[LossChannel, ...] = tuple(
    LossChannel(i, label, f"loss_{label}", f"loss/{label}")
    for i, label in enumerate(("grpo", "sdpo", "replay"), start=1)
)


def wilson_interval(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion `p` measured on `n` trials."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _run_mean(records: list[JSONDict], key: str) -> float | None:
    """Mean of a train metric over every step it was logged at, pooled over replicas."""
    return _mean([v for series in _series(records, "train", key).values() for _, v in series])


def _first_last10(records: list[JSONDict], key: str) -> tuple[float, float, int] | None:
    """(mean over the first 10 % of steps, over the last 10 %, last step) of a train metric,
    pooled over replicas; None when it was never logged."""
    points = [p for series in _series(records, "train", key).values() for p in series]
    steps = sorted({s for s, _ in points})
    if not steps:
        return None
    k = max(1, math.ceil(len(steps) / 10))
    first, last = set(steps[:k]), set(steps[-k:])
    first_mean = _mean([v for s, v in points if s in first])
    last_mean = _mean([v for s, v in points if s in last])
    if first_mean is None or last_mean is None:
        return None
    return first_mean, last_mean, steps[-1]


# Why the distillation channels' losses can go up on a run that learns (the printout says it in
# one line, summary.md in full).
LOSS_RISE_NOTE = (
    "Channels 2 and 3 can rise while reward and accuracy improve, and usually do when a model "
    "learns from scratch: channel 2 (hint self-distillation) measures how much the model's "
    "predictions change when it is shown a correct sibling's answer and the feedback, which "
    "grows as it learns to use that hint (at first it predicts as little with the hint as "
    "without); channel 3 (trace replay) prefers the teacher's trace to the model's own rollout, "
    "and as the rollouts become right they resemble the trace, so the preference margin shrinks "
    "and the loss rises. Judge a run by its reward and held-out accuracy."
)
LOSS_RISE_LINE = (
    "(ch2/ch3 rising is expected while accuracy improves: ch2 grows as the model learns to use "
    "the hint, ch3 as its own answers come to match the teacher's; see summary.md)"
)


def _num(value: JSONValue, digits: int = 3) -> str:
    number = as_number(value)
    return "n/a" if number is None else f"{number:.{digits}f}"


def losses_rose(summary: Mapping[str, JSONValue]) -> bool:
    """Whether channel 2 or 3 ended above where it started (last vs first 10% of steps)."""
    for ch in LOSS_CHANNELS[1:]:
        first, last = summary.get(f"{ch.key}_first10"), summary.get(f"{ch.key}_last10")
        if isinstance(first, int | float) and isinstance(last, int | float) and last > first:
            return True
    return False


REJECTIONS_SHOWN = 10  # refusals listed in the headline (all are in the summary and metrics)


def headline_lines(summary: JSONDict, *, eval_n: int | None = None) -> list[str]:
    """The headline numbers as `train` prints them at the end and `report` prints them: mean
    reward first/last 10%, held-out accuracy first/last with its 95% interval, each loss
    channel first/last 10% (and why channels 2/3 rising is no alarm, when they rose)."""
    n = summary.get("eval_n", eval_n)
    lines = [
        f"  mean reward      first 10%: {_num(summary.get('reward_first10'))}   "
        f"last 10%: {_num(summary.get('reward_last10'))}",
        f"  eval accuracy    first: {_num(summary.get('eval_accuracy_first'))}   "
        f"last: {_num(summary.get('eval_accuracy_last'))}"
        + (f"   ({n} held-out prompts)" if n is not None else ""),
    ]
    ci = summary.get("eval_accuracy_last_ci95")
    if isinstance(ci, list | tuple) and len(ci) == 2:
        lines.append(f"  95% interval     last: {ci[0]:.3f} - {ci[1]:.3f}   (Wilson)")
    if summary.get("eval_ood_accuracy_last") is not None:
        lines.append(
            f"  out-of-distrib.  first: {_num(summary.get('eval_ood_accuracy_first'))}   "
            f"last: {_num(summary.get('eval_ood_accuracy_last'))}   "
            f"({summary.get('eval_ood_n', '?')} prompts outside the training distribution)"
        )
    for ch in LOSS_CHANNELS:
        if summary.get(f"{ch.key}_first10") is not None:
            label = f"loss ch{ch.number} {ch.label}"
            lines.append(
                f"  {label:<16} first 10%: {_num(summary.get(ch.key + '_first10'), 4)}   "
                f"last 10%: {_num(summary.get(ch.key + '_last10'), 4)}"
            )
    if losses_rose(summary):
        lines.append(f"  {LOSS_RISE_LINE}")
    if summary.get("teacher_advantage_first10") is not None:
        gate = summary.get("gate_open_last10")
        lines.append(
            f"  ch2 teacher adv. first 10%: {_num(summary.get('teacher_advantage_first10'))}   "
            f"last 10%: {_num(summary.get('teacher_advantage_last10'))}   "
            f"whole run: {_num(summary.get('teacher_advantage_run'))}"
            + (f"   (gate open in {gate:.0%} of the last 10%)" if gate is not None else "")
        )
    refused = [as_dict(r) for r in as_list(summary.get("rejections"))]
    for r in refused[:REJECTIONS_SHOWN]:  # every refusal is in metrics.jsonl (event "rejected")
        lines.append(f"  refused          round {r['round']} rank {r['rank']}: {r['reason']}")
    if len(refused) > REJECTIONS_SHOWN:
        lines.append(
            f"  refused          ... {len(refused) - REJECTIONS_SHOWN} more (metrics.jsonl)"
        )
    return lines


def closed_attempts(driver: JSONDict) -> list[JSONDict]:
    """Every launch of the run with its wall time, oldest first: driver.json's `attempts`, plus
    the current attempt once it has an end (`ended`; for a driver that was killed, its last
    `updated`). Each: ``{"attempt", "started", "ended", "seconds", "status"}``."""
    attempts = [
        a
        for a in as_list(driver.get("attempts"))
        if isinstance(a, dict) and as_number(a.get("seconds")) is not None
    ]
    current = driver.get("attempt")
    started = as_number(driver.get("started"))
    ended = as_number(driver.get("ended"))
    ended = ended if ended is not None else as_number(driver.get("updated"))
    recorded = {a.get("attempt") for a in attempts}
    if started is not None and ended is not None and ended >= started and current not in recorded:
        attempts.append(
            {
                "attempt": current,
                "started": started,
                "ended": ended,
                "seconds": ended - started,
                "status": driver.get("status"),
            }
        )
    return attempts


def run_wall_seconds(driver: JSONDict) -> float | None:
    """The run's one wall time: from the driver's start to the end of training (driver.json's
    `started` / `ended`), summed over the run's attempts (a resumed run's earlier launches
    count: `closed_attempts`); what the printout and summary.md both show."""
    seconds = [as_float(a["seconds"]) for a in closed_attempts(driver)]
    return sum(seconds) if seconds else None


def wall_text(driver: JSONDict) -> str:
    """ "651.0 s over 2 attempts (616.2 + 34.8 s)", "616.2 s", or "" when unknown."""
    seconds = [as_float(a["seconds"]) for a in closed_attempts(driver)]
    if not seconds:
        return ""
    if len(seconds) == 1:
        return f"{seconds[0]:.1f} s"
    return (
        f"{sum(seconds):.1f} s over {len(seconds)} attempts "
        f"({' + '.join(f'{s:.1f}' for s in seconds)} s)"
    )


# What the learning signal looked like (train metrics; summary.md shows first / last 10 % of
# steps): (summary key, metric, label).
LEARNING_SIGNALS: tuple[tuple[str, str, str], ...] = (
    ("entropy", "entropy", "policy entropy (nats per completion token)"),
    (
        "zero_std_share",
        "frac_reward_zero_std",
        "share of prompt groups with one reward for all rollouts (zero advantage)",
    ),
    (
        "teacher_advantage",
        "sdpo/teacher_advantage",
        "channel 2: hinted teacher's reward minus the student's, same prompts",
    ),
    ("gate_open", "sdpo/gate_open", "channel 2: share of batches its teacher gate let through"),
)


def summarize(records: list[JSONDict]) -> JSONDict:
    """Headline numbers of a run.

    Rewards are pooled over replicas and ordered by inner step; "first 10%" is the records
    whose step is in the first tenth of the steps seen (at least one step), likewise the last.
    """
    out: JSONDict = {"replicas": [*sorted({as_int(r.get("replica", 0)) for r in records})]}
    key = reward_key(records)
    if key is not None:
        first_last = _first_last10(records, key)
        if first_last is not None:
            out["reward_first10"], out["reward_last10"], out["steps"] = first_last
    for channel in LOSS_CHANNELS:
        first_last = _first_last10(records, channel.metric)
        if first_last is not None:
            out[f"{channel.key}_first10"], out[f"{channel.key}_last10"], _ = first_last
    for key, metric, _ in LEARNING_SIGNALS:
        first_last = _first_last10(records, metric)
        if first_last is not None:
            out[f"{key}_first10"], out[f"{key}_last10"], _ = first_last
            out[f"{key}_run"] = _run_mean(records, metric)
    evals = sorted(
        (
            (as_int(r.get("step", 0)), as_float(r["eval/accuracy"]), r.get("eval/n"))
            for r in records
            if r.get("kind") == "eval" and isinstance(r.get("eval/accuracy"), int | float)
        ),
    )
    if evals:
        out["eval_accuracy_first"] = evals[0][1]
        out["eval_accuracy_last"] = evals[-1][1]
        out["eval_accuracy_best"] = max(v for _, v, _ in evals)
        n = evals[-1][2]
        if isinstance(n, int | float) and n >= 1:
            out["eval_n"] = int(n)
            out["eval_accuracy_last_ci95"] = [*wilson_interval(evals[-1][1], int(n))]
    ood = sorted(
        (
            (as_int(r.get("step", 0)), as_float(r["eval/ood_accuracy"]), r.get("eval/ood_n"))
            for r in records
            if r.get("kind") == "eval" and isinstance(r.get("eval/ood_accuracy"), int | float)
        ),
    )
    if ood:  # the task's out-of-distribution row (a figure, not a target)
        out["eval_ood_accuracy_first"] = ood[0][1]
        out["eval_ood_accuracy_last"] = ood[-1][1]
        if isinstance(ood[-1][2], int | float) and ood[-1][2] >= 1:
            out["eval_ood_n"] = as_int(ood[-1][2])
    rounds = [r for r in records if r.get("kind") == "round"]
    if rounds:
        out["rounds"] = max(as_int(r.get("round", 0)) for r in rounds)
        out["round_seconds_mean"] = _mean([r.get("round/seconds") for r in rounds])
        out["round_bytes_total"] = sum(
            as_int(r.get("round/bytes_up") or 0) + as_int(r.get("round/bytes_down") or 0)
            for r in rounds
        )
    times = [as_float(r["time"]) for r in records if isinstance(r.get("time"), int | float)]
    if times:
        out["wall_seconds"] = max(times) - min(times)
    devices = device_lines(records)
    if devices:
        out["devices"] = [*devices]
    out.update(health_summary(records))
    refused = rejections(records)
    if refused:
        out["rejections"] = [*refused]
    return out


def rejections(records: list[JSONDict]) -> list[JSONDict]:
    """Every contribution the exchange refused or left out ("rejected" events: round, rank,
    reason), once each however many replicas reported it, in round order."""
    seen: dict[tuple[int, int, str], None] = {}
    for r in records:
        if r.get("kind") == "event" and r.get("event") == "rejected":
            seen[
                (as_int(r.get("round") or 0), as_int(r.get("rank") or 0), str(r.get("reason")))
            ] = None
    return [{"round": rnd, "rank": rank, "reason": why} for rnd, rank, why in sorted(seen)]


def _device_text(r: JSONDict) -> str:
    device = str(r.get("device") or "?")
    if r.get("device_name"):
        device += f" ({r['device_name']})"
    checkpointing = "on" if r.get("gradient_checkpointing") else "off"
    return (
        f"{device}, weights {r.get('param_dtype') or '?'}, autocast {r.get('autocast') or '?'}, "
        f"gradient checkpointing {checkpointing}, generation {r.get('generation') or '?'}"
    )


def device_lines(records: list[JSONDict]) -> list[str]:
    """One line per distinct device setup the replicas reported (their ``device`` event: device,
    GPU name, parameter and autocast dtypes, gradient checkpointing, rollout engine), each with
    the replicas that used it when they differ; the latest report of each replica counts."""
    latest: dict[int, JSONDict] = {}
    for r in records:
        if r.get("kind") == "event" and r.get("event") == "device":
            replica = as_int(r.get("replica", 0))
            if replica not in latest or as_float(r.get("time") or 0) >= as_float(
                latest[replica].get("time") or 0
            ):
                latest[replica] = r
    by_text: dict[str, list[int]] = defaultdict(list)
    for replica, r in sorted(latest.items()):
        by_text[_device_text(r)].append(replica)
    if len(by_text) == 1:
        return list(by_text)
    return [
        f"{text} (replica{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
        for text, rs in by_text.items()
    ]


def _health_points(records: list[JSONDict]) -> list[tuple[float, int, JSONDict]]:
    return sorted(
        (as_float(r["time"]), as_int(r["health/level"]), r)
        for r in records
        if r.get("kind") == "health"
        and isinstance(r.get("time"), int | float)
        and isinstance(r.get("health/level"), int)
        and not isinstance(r.get("health/level"), bool)
    )


HEALTH_STATES = ("starting", "healthy", "degraded", "critical")  # health/level -1, 0, 1, 2


def health_summary(records: list[JSONDict]) -> JSONDict:
    """Seconds spent starting / healthy / degraded / critical (each health record holds until
    the next)."""
    points = _health_points(records)
    if len(points) < 2:
        return {}
    spent = [0.0] * len(HEALTH_STATES)
    for (t, level, _), (t_next, _, _) in zip(points, points[1:]):
        spent[min(max(level + 1, 0), len(HEALTH_STATES) - 1)] += t_next - t
    return {
        "health_seconds": dict(zip(HEALTH_STATES, spent)),
        "health_last": points[-1][2].get("health/state"),
    }


def _figure(title: str, ylabel: str, nrows: int = 1) -> tuple[Figure, list[Axes]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.2 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    axes: list[Axes] = list(fig.subplots(nrows, 1, squeeze=False)[:, 0])
    axes[0].set_title(title)
    for ax in axes:
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("inner step")
    return fig, axes


def _plot_series(
    ax: Axes, series: dict[int, list[tuple[int, float]]], legend: str = "replica {replica}"
) -> None:
    """One line per replica; replicas whose points are all equal share one line, labelled so
    (drawn separately, the last would hide the others exactly)."""
    groups: dict[tuple[tuple[int, float], ...], list[int]] = {}
    for replica, points in series.items():
        groups.setdefault(tuple(points), []).append(replica)
    for shared, replicas in groups.items():
        xs, ys = zip(*shared)
        if len(replicas) == 1:
            label = legend.format(replica=replicas[0])
        else:
            label = f"replicas {', '.join(map(str, replicas))} (identical)"
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label)
    if series:
        ax.legend(fontsize=8)


def _from_zero(ax: Axes) -> None:
    """A y axis from 0 with 10 % headroom: a constant series (the same bytes every round) is
    then a flat line at its value, not a line in the middle of a 1.00-1.10 axis."""
    import numpy as np

    values = [float(np.max(np.asarray(line.get_ydata(), dtype=float))) for line in ax.get_lines()]
    top = max(values, default=0.0)
    ax.set_ylim(0.0, top * 1.1 if top > 0 else 1.0)


# The evaluator replica evaluates the global weights (identical on every replica after a
# committed round): the line is the global model's, not that replica's own.
EVAL_LEGEND = "global model (evaluated by replica {replica})"


def draw_plots(records: list[JSONDict], out_dir: Path) -> list[Path]:
    """Draw every plot the records support; return the PNG paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path)
        written.append(path)

    key = reward_key(records)
    if key is not None:
        fig, (ax,) = _figure("mean reward per inner step", "reward")
        _plot_series(ax, _series(records, "train", key))
        save(fig, "reward.png")
    drawn: set[str] = set()
    for loss_key, channel in LOSS_KEYS.items():
        series = _series(records, "train", loss_key)
        if series and channel not in drawn:
            drawn.add(channel)
            title = (
                "total loss (all channels, weighted)"
                if channel == "total"
                else f"{loss_key} (channel loss, before weighting)"
            )
            fig, (ax,) = _figure(title, "loss")
            _plot_series(ax, series)
            save(fig, f"loss_{channel}.png")
    series = _series(records, "eval", "eval/accuracy")
    if series:
        fig, (ax,) = _figure("eval accuracy of the global model", "accuracy")
        _plot_series(ax, series, EVAL_LEGEND)
        ax.set_ylim(-0.02, 1.02)
        save(fig, "eval_accuracy.png")
    for plot in (_plot_rounds, _plot_time_breakdown, _plot_throughput, _plot_health):
        plot(records, save)
    return written


def _plot_rounds(records: list[JSONDict], save: Callable[[Figure, str], None]) -> None:
    """Seconds and MB exchanged per outer round."""
    seconds = _series(records, "round", "round/seconds")
    if not seconds:
        return
    fig, axes = _figure("outer rounds", "seconds", nrows=2)
    _plot_series(axes[0], seconds)
    mb = defaultdict(list)
    for r in records:
        if r.get("kind") == "round":
            total = as_int(r.get("round/bytes_up") or 0) + as_int(r.get("round/bytes_down") or 0)
            mb[as_int(r.get("replica", 0))].append((as_int(r.get("step", 0)), total / 1e6))
    _plot_series(axes[1], {k: sorted(v) for k, v in sorted(mb.items())})
    axes[1].set_ylabel("MB up + down")
    for ax in axes:
        _from_zero(ax)
    save(fig, "outer_rounds.png")


def _plot_time_breakdown(records: list[JSONDict], save: Callable[[Figure, str], None]) -> None:
    """Where the time of each outer round goes (one replica)."""
    breakdown = _time_breakdown(records)
    if not breakdown:
        return
    replica, rows = breakdown
    fig, (ax,) = _figure(f"where the time goes (replica {replica}, per outer round)", "seconds")
    rounds = [rnd for rnd, _ in rows]
    bottom = [0.0] * len(rows)
    for name in TIME_PARTS:
        heights = [parts[name] for _, parts in rows]
        ax.bar(rounds, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("outer round")
    ax.set_xticks(rounds)
    # beside the axes, not over them: inside, it covered the bars of whichever rounds were tall
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    save(fig, "time_breakdown.png")


def _plot_throughput(records: list[JSONDict], save: Callable[[Figure, str], None]) -> None:
    """Inner steps (and tokens) per second, per outer round."""
    pace = _series(records, "round", "round/steps_per_s")
    if not pace:
        return
    tokens = _series(records, "round", "round/tokens_per_s")
    fig, axes = _figure("throughput per outer round", "inner steps / s", nrows=2 if tokens else 1)
    _plot_series(axes[0], pace)
    if tokens:
        _plot_series(axes[1], tokens)
        axes[1].set_ylabel("tokens / s")
    save(fig, "throughput.png")


def _plot_health(records: list[JSONDict], save: Callable[[Figure, str], None]) -> None:
    """The run state over time, and the synchronizer's merges."""
    points = _health_points(records)
    if not points:
        return
    t0 = points[0][0]
    merges = [
        (t - t0, r.get("health/merges"))
        for t, _, r in points
        if isinstance(r.get("health/merges"), int)
    ]
    fig, axes = _figure("run health", "state", nrows=2 if merges else 1)
    axes[0].step([t - t0 for t, _, _ in points], [lvl for _, lvl, _ in points], where="post")
    axes[0].set_yticks([-1, 0, 1, 2], list(HEALTH_STATES))
    axes[0].set_ylim(-1.3, 2.3)
    if merges:
        axes[1].plot(*zip(*merges), marker=".")
        axes[1].set_ylabel("merges (synchronizer)")
    axes[-1].set_xlabel("seconds since the first health record")
    save(fig, "health.png")


TIME_PARTS = (
    "generation",
    "teacher forward",
    "loss + backward",
    "upload",
    "wait for peers",
    "merge",
)


def _time_breakdown(
    records: list[JSONDict],
) -> tuple[int, list[tuple[int, dict[str, float]]]] | None:
    """(replica, [(round, seconds per part of TIME_PARTS)]) for the lowest replica with round
    timings: the exchange parts as measured; the training time (round/train_s) split by the
    shares of generation, teacher and the rest in the steps it logged during that round."""
    rounds = [r for r in records if r.get("kind") == "round" and r.get("round/wall_s")]
    if not rounds:
        return None
    replica = min(as_int(r.get("replica", 0)) for r in rounds)
    steps = [r for r in records if r.get("kind") == "train" and r.get("replica", 0) == replica]
    rows = []
    for r in sorted(
        (r for r in rounds if r.get("replica", 0) == replica), key=lambda r: as_int(r["round"])
    ):
        mine = [s for s in steps if as_int(s.get("round", -1)) == as_int(r["round"]) - 1]
        shares = [
            sum(as_float(s.get(k) or 0.0) for s in mine)
            for k in ("time/generate_s", "time/teacher_s", "time/loss_backward_s")
        ]
        total = sum(shares)
        train = as_float(r.get("round/train_s") or 0.0)
        split = [train * x / total for x in shares] if total > 0 else [0.0, 0.0, train]
        parts = dict(
            zip(
                TIME_PARTS,
                [
                    *split,
                    *(
                        as_float(r.get(k) or 0.0)
                        for k in ("round/upload_s", "round/wait_s", "round/merge_s")
                    ),
                ],
            )
        )
        rows.append((as_int(r["round"]), parts))
    return replica, rows


def _fmt(value: JSONValue, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def summary_markdown(
    folder: RunFolder, summary: JSONDict, plots: list[Path], config: JSONDict
) -> str:
    driver = folder.read_driver()
    lines = [f"# Run `{folder.name}`", ""]
    model = as_dict(config.get("model")).get("name", "?")
    task = as_dict(config.get("task")).get("name", "?")
    backend = as_dict(config.get("backend"))
    loss = as_dict(config.get("loss"))
    lines += [
        f"- model: `{model}`, task: `{task}`, backend: `{backend.get('kind', '?')}` x "
        f"{backend.get('n_replicas', '?')} replicas",
        f"- loss: alpha_sdpo={loss.get('alpha_sdpo')}, beta_replay={loss.get('beta_replay')}, "
        f"dpo_variant={loss.get('dpo_variant')}",
        *(f"- device: {line}" for line in as_list(summary.get("devices"))),
        f"- status: {driver.get('status', 'unknown')}",
        *(
            [f"- stopped: {as_dict(driver['no_quorum']).get('reason')}"]
            if isinstance(driver.get("no_quorum"), dict)
            else []
        ),
        *(
            f"- refused: round {r['round']} rank {r['rank']}: {r['reason']}"
            for r in map(as_dict, as_list(summary.get("rejections")))
        ),
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean reward, first 10% of steps | {_fmt(summary.get('reward_first10'))} |",
        f"| mean reward, last 10% of steps | {_fmt(summary.get('reward_last10'))} |",
        f"| eval accuracy, first evaluation | {_fmt(summary.get('eval_accuracy_first'))} |",
        f"| eval accuracy, last evaluation | {_fmt(summary.get('eval_accuracy_last'))} |",
        f"| eval accuracy, last: 95% interval (Wilson, {summary.get('eval_n', '?')} prompts) | "
        f"{_fmt_interval(summary.get('eval_accuracy_last_ci95'))} |",
        *(
            [
                f"| out-of-distribution accuracy, first / last ({summary.get('eval_ood_n', '?')} "
                f"prompts) | {_fmt(summary.get('eval_ood_accuracy_first'))} / "
                f"{_fmt(summary.get('eval_ood_accuracy_last'))} |"
            ]
            if summary.get("eval_ood_accuracy_last") is not None
            else []
        ),
        *(
            f"| loss {ch.label} (channel {ch.number}), first / last 10% of steps | "
            f"{_fmt(summary.get(ch.key + '_first10'))} / {_fmt(summary.get(ch.key + '_last10'))} |"
            for ch in LOSS_CHANNELS
            if summary.get(ch.key + "_first10") is not None
        ),
        *(
            f"| {label}, first / last 10% of steps | {_fmt(summary.get(key + '_first10'))} / "
            f"{_fmt(summary.get(key + '_last10'))} |"
            for key, _, label in LEARNING_SIGNALS
            if summary.get(key + "_first10") is not None
        ),
        f"| inner steps per replica | {_fmt(summary.get('steps'))} |",
        f"| outer rounds | {_fmt(summary.get('rounds'))} |",
        f"| mean outer-round time (s) | {_fmt(summary.get('round_seconds_mean'))} |",
        f"| store traffic, all replicas (MB) | "
        f"{_fmt((as_number(summary.get('round_bytes_total')) or 0) / 1e6, 2)} |",
        f"| wall time | {wall_text(driver) or _fmt(summary.get('wall_seconds'), 1) + ' s'} |",
    ]
    lines += _table_end(summary)
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}](plots/{p.name})" for p in plots]
        lines.append("")
    checkpoints = sorted(p.name for p in folder.checkpoints.glob("*") if p.is_dir())
    if checkpoints:
        lines += ["## Checkpoints", ""]
        lines += [f"- `checkpoints/{name}/`" for name in checkpoints]
        lines.append("")
    return "\n".join(lines)


def _table_end(summary: JSONDict) -> list[str]:
    """The metrics table's last row (the health) and, after the whole table (a paragraph
    between two rows splits it), the note on rising channel 2/3 losses."""
    lines = []
    spent = summary.get("health_seconds")
    if isinstance(spent, dict) and spent:
        lines.append(
            f"| run health (s {' / '.join(HEALTH_STATES)}) | "
            + " / ".join(f"{spent.get(name, 0.0):.0f}" for name in HEALTH_STATES)
            + " |"
        )
    if losses_rose(summary):
        lines += ["", LOSS_RISE_NOTE]
    return [*lines, ""]


def _fmt_interval(ci: JSONValue) -> str:
    if not isinstance(ci, list | tuple) or len(ci) != 2:
        return "n/a"
    return f"{ci[0]:.3f} - {ci[1]:.3f}"


def write_report(folder: RunFolder) -> tuple[JSONDict, list[Path]]:
    """Draw the plots and write summary.md; return (summary numbers, plot paths)."""
    records = read_metrics(folder.metrics)
    plots = draw_plots(records, folder.plots)
    summary = summarize(records)
    try:
        config = json.loads(folder.config_json.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        config = {}
    folder.summary.write_text(summary_markdown(folder, summary, plots, config))
    return summary, plots
