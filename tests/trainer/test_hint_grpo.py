"""`hint_grpo`: the rows a dataset marks as hinted examples (`data.HINTED_EXAMPLE_COLUMN`) earn
no channel-1 advantage with `hint_grpo=False`, and no other row's advantage moves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from _trainer_helpers import ANSWERS, PROMPTS, G, make_trainer, oracle_store  # noqa: E402

from composer_replication.data import HINTED_EXAMPLE_COLUMN  # noqa: E402


def _batch(trainer: Any, hinted: tuple[bool, bool] | None) -> dict[str, Any]:
    """One training generation batch whose prompt groups are (or are not) hinted examples;
    `None`: rows without the column."""
    torch.manual_seed(0)
    trainer.model.train()
    rows: list[dict[str, Any]] = [
        {"prompt": p, "answer": a} for p, a in zip(PROMPTS, ANSWERS, strict=True) for _ in range(G)
    ]
    if hinted is not None:
        for i, row in enumerate(rows):
            row[HINTED_EXAMPLE_COLUMN] = hinted[i // G]
    return trainer._generate_and_score_completions(rows)


def test_hinted_examples_earn_no_grpo_advantage_when_asked(tmp_path) -> None:
    kw = {"store": oracle_store(), "beta_replay": 1.0}
    ask = make_trainer(tmp_path / "ask", hint_grpo=False, **kw)
    default = make_trainer(tmp_path / "default", **kw)
    assert default.composer.hint_grpo is True  # the default: TRL's, every row earns advantage
    with_grpo = _batch(default, (True, False))["advantages"]
    without = _batch(ask, (True, False))
    # positional_reward: the first rollout of a group succeeds, so every group has advantage.
    assert with_grpo[:G].abs().min() > 0 and with_grpo[G:].abs().min() > 0
    assert torch.equal(without["advantages"][:G], torch.zeros(G))
    assert torch.equal(without["advantages"][G:], with_grpo[G:])
    # Channel 3 still replays the hinted group's failures against the oracle's trace.
    assert without["replay_pair_mask"][:G].any()
    assert ask._metrics["train"]["grpo/frac_hinted_examples"][-1] == 0.5


def test_a_dataset_without_the_column_is_untouched(tmp_path) -> None:
    a = make_trainer(tmp_path / "a", hint_grpo=False)
    b = make_trainer(tmp_path / "b")
    plain = _batch(b, None)["advantages"]
    assert torch.equal(plain, _batch(a, None)["advantages"])
    assert torch.equal(plain, _batch(make_trainer(tmp_path / "c"), (False, False))["advantages"])
    assert plain.abs().min() > 0
