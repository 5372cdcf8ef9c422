"""The report's plots show what they plot: time_breakdown.png's legend sits beside the bars,
never over one, and outer_rounds.png shows replicas that exchanged the same bytes as one
labelled line on an axis from 0 (drawn one over the other on a 1.00-1.10 axis, replica 0's
line was hidden and the flat traffic looked like a curve)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("matplotlib")

from composer_replication.run.report import _plot_rounds, _plot_time_breakdown  # noqa: E402


def _records(bytes_by_replica: dict[int, int]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for replica, nbytes in bytes_by_replica.items():
        for rnd in range(1, 5):
            step = rnd * 10
            records.append(
                {
                    "kind": "round",
                    "replica": replica,
                    "round": rnd,
                    "step": step,
                    "round/seconds": 0.5 + 0.1 * replica,
                    "round/bytes_up": nbytes // 2,
                    "round/bytes_down": nbytes - nbytes // 2,
                    # every round as tall: no corner inside the axes is free for a legend
                    "round/wall_s": 8.0,
                    "round/train_s": 7.7,
                    "round/upload_s": 0.1,
                    "round/wait_s": 0.1,
                    "round/merge_s": 0.1,
                }
            )
            records.append(
                {
                    "kind": "train",
                    "replica": replica,
                    "round": rnd - 1,
                    "step": step,
                    "time/generate_s": 0.2,
                    "time/teacher_s": 0.5,
                    "time/loss_backward_s": 0.3,
                }
            )
    return records


def _draw(plot: Any, records: list[dict[str, Any]]) -> Any:
    figures: list[Any] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.canvas.draw()
        figures.append(fig)

    plot(records, save)
    (fig,) = figures
    return fig


def test_the_time_breakdown_legend_covers_no_bar() -> None:
    fig = _draw(_plot_time_breakdown, _records({0: 1_045_000}))
    (ax,) = fig.axes
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_height() > 0]
    assert len(bars) >= 4 * 3
    assert not [b for b in bars if b.overlaps(legend)]
    # and the legend is inside the figure, not cut off
    assert fig.bbox.contains(legend.x1 - 1, legend.y0 + 1)


def test_replicas_with_the_same_traffic_are_one_line_on_an_axis_from_zero() -> None:
    fig = _draw(_plot_rounds, _records({0: 1_045_000, 1: 1_045_000}))
    seconds_ax, mb_ax = fig.axes
    assert [line.get_label() for line in mb_ax.get_lines()] == ["replicas 0, 1 (identical)"]
    assert mb_ax.get_ylim()[0] == 0.0 and mb_ax.get_ylim()[1] == pytest.approx(1.045 * 1.1)
    # different series keep a line each
    assert [line.get_label() for line in seconds_ax.get_lines()] == ["replica 0", "replica 1"]
    assert seconds_ax.get_ylim()[0] == 0.0


def test_replicas_with_different_traffic_keep_their_own_lines() -> None:
    fig = _draw(_plot_rounds, _records({0: 1_000_000, 1: 2_000_000}))
    _, mb_ax = fig.axes
    assert [line.get_label() for line in mb_ax.get_lines()] == ["replica 0", "replica 1"]
