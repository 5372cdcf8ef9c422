"""Departure records in decoupled mode (issue 22, item 3): as in sync mode the driver declares a
learner departed when its process fails (or it falls silent), with a message true to the mode,
and the synchronizer leaves a departed learner out of its quorum at once (not after its
heartbeat goes dead); it counts again once the record is cleared."""

from __future__ import annotations

import torch

from composer_replication.config import load_config
from composer_replication.exchange.push_store import DecoupledStore, fragment_manifest
from composer_replication.exchange.store import ObjectStore

LEARNERS = 2


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def test_a_departed_learner_leaves_the_synchronizers_quorum_at_once(tmp_path):
    from composer_replication.diloco.decoupled.decoupled_mode import DecoupledDiLoCo
    from composer_replication.diloco.decoupled.synchronizer import Synchronizer, SynchronizerConfig
    from composer_replication.exchange.liveness import (
        LEARNER_ROLE,
        clear_departure,
        write_departure,
        write_heartbeat,
    )

    config = load_config(
        overrides=["diloco.mode=decoupled", "diloco.sync_every_h=8", "train.max_steps=16"]
    )
    assert DecoupledDiLoCo(config.diloco).departure_roles == (
        LEARNER_ROLE,
    )  # the driver writes them
    store = ObjectStore(str(tmp_path / "store"))
    docs = DecoupledStore(store)
    docs.ensure_manifest(fragment_manifest([_tensors(0)], n_learners=LEARNERS, codec="fp32"))
    docs.publish_global(0, 0, _tensors(0))
    for r in range(LEARNERS):
        write_heartbeat(store, LEARNER_ROLE, r, state="running")
    sync = Synchronizer(store, SynchronizerConfig(quorum=2))
    assert sync.activate()
    try:
        sync._refresh_liveness()
        assert sync._active_learners() == {0, 1}
        write_departure(store, LEARNER_ROLE, 1, reason="exit code -9")
        sync._refresh_liveness()
        assert sync._active_learners() == {0}  # its heartbeat is still fresh
        clear_departure(store, LEARNER_ROLE, 1)
        sync._refresh_liveness()
        assert sync._active_learners() == {0, 1}
    finally:
        sync.lease.release()


def test_the_driver_declares_a_lost_learner_departed_with_a_message_true_to_the_mode(tmp_path):
    from composer_replication.assembly.outer import outer_loop_mode
    from composer_replication.exchange.liveness import LEARNER_ROLE, read_departure
    from composer_replication.executors.executor import ReplicaHandle, ReplicaStatus
    from composer_replication.run.supervision import Departures

    class NoRestarts:
        def will_restart(self, rank: int) -> bool:
            return False

    config = load_config(
        overrides=["diloco.mode=decoupled", "diloco.sync_every_h=8", "train.max_steps=16"]
    )
    store = ObjectStore(str(tmp_path / "store"))
    failed = ReplicaHandle(
        replica_id=1,
        backend="local",
        job_id="job-1",
        status=ReplicaStatus.FAILED,
        exit_code=-9,
        error="exit code -9",
    )
    (message,) = Departures(config, outer_loop_mode(config), store).note(
        [failed],
        NoRestarts(),  # type: ignore[arg-type]
    )
    assert read_departure(store, LEARNER_ROLE, 1) is not None
    assert message.startswith("replica 1 is lost (exit code -9); the other learners go on")
    assert "min_replicas" not in message
