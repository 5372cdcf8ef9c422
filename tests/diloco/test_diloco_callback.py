"""outer.callback() inside ComposerReplicationTrainer.train(): 2 replicas sync every H steps.

The seed wiring, verbatim in spirit: build the trainer, ``make_diloco_outer_loop(inner_optimizer=
trainer.optimizer, manager=MockManager(allreduce=rendezvous), sync_every_h=H)`` while the
optimizer does not exist yet, ``trainer.add_callback(outer.callback())``, ``trainer.train()``.
The two replicas are threads of this process (each with its own trainer, model and store
handle) to keep the test within budget; the exchange is the real file:// protocol.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))

from _trainer_helpers import config, make_trainer, plain_reward  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from composer_replication.diloco import make_diloco_outer_loop  # noqa: E402
from composer_replication.exchange import AllReduceConfig, MockManager, ObjectStoreAllReduce  # noqa: E402

H = 2
STEPS = 4


class _RoundLog(TrainerCallback):
    def __init__(self, outer: Any) -> None:
        self.outer = outer
        self.seen: list[tuple[int, int]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen.append((state.global_step, self.outer.round))


@pytest.mark.slow
def test_composer_trainer_with_outer_callback_syncs_every_h_steps(tmp_path: Path) -> None:
    uri = "file://" + str(tmp_path / "run")
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    # accelerate keeps process-wide singleton state (GradientState, AcceleratorState) that two
    # trainers built at the same moment in two threads can race on: build them one at a time,
    # then train concurrently
    build = threading.Lock()

    def replica(rank: int) -> None:
        try:
            work = tmp_path / f"replica{rank}"
            args = config(work, max_steps=STEPS, seed=rank, learning_rate=5e-2)
            with build:
                trainer = make_trainer(work, reward=plain_reward, args=args)
            rendezvous = ObjectStoreAllReduce(
                uri, world_size=2, rank=rank, config=AllReduceConfig(timeout_s=120)
            )
            manager = MockManager(allreduce=rendezvous)
            outer = make_diloco_outer_loop(
                inner_optimizer=trainer.optimizer, manager=manager, sync_every_h=H
            )
            log = _RoundLog(outer)
            trainer.add_callback(outer.callback())
            trainer.add_callback(log)
            trainer.train()
            results[rank] = (trainer, outer, log)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    if errors:
        raise errors[0]
    for rank in range(2):
        _, outer, log = results[rank]
        assert log.seen == [(1, 0), (2, 1), (3, 1), (4, 2)], log.seen
        assert [h["included_ranks"] for h in outer.history] == [[0, 1], [0, 1]]
    p0 = dict(results[0][0].model.named_parameters())
    p1 = dict(results[1][0].model.named_parameters())
    assert all(torch.equal(p0[n], p1[n]) for n in p0), "replicas differ after the last sync"
    start = make_trainer(tmp_path / "fresh", reward=plain_reward).model
    moved = [n for n, p in start.named_parameters() if not torch.equal(p, p0[n])]
    assert moved, "training changed nothing"
