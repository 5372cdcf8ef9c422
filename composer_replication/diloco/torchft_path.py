"""The real torchft path: a lighthouse + `torchft.Manager` over gloo, for clusters.

Where replicas can reach each other (a Ray cluster, Kubernetes, Modal clusters) the outer loop
runs unchanged over torchft's own fault-tolerant Manager instead of the object store::

    lighthouse = start_lighthouse(min_replicas=2)              # once, somewhere reachable
    manager, close = build_torchft_manager(
        replica_id="replica_0", lighthouse_addr=lighthouse_address(lighthouse),
        min_replicas=2, timeouts=TorchFTTimeouts())
    outer = make_diloco_outer_loop(opt, manager, sync_every_h=500, model=model)

What each replica needs (torchft 0.2.0): a `ProcessGroupGloo` (reconfigured at every quorum), a
TCPStore for its replica group (one process per group here, so it hosts its own), and the
lighthouse's address. The Manager opens inbound connections (gRPC manager server, HTTP checkpoint
transport, gloo, TCPStore), which is why serverless replicas use `ObjectStoreManager` instead.

Timeouts (torchft leaves their relation undocumented; torchtitan #2899) must be ordered

    process_group_s  <=  operation_s  <  join_s  <  quorum_s,     heartbeat_s < join_s

- ``process_group_s``: gloo's own collective timeout; detects a peer that died mid-allreduce.
  Not longer than ``operation_s``, or the Manager gives up on a collective gloo still waits on.
- ``operation_s`` (``Manager(timeout=)``): allreduce waits, the should_commit RPC, and healing
  (checkpoint transfer to a recovering replica).
- ``join_s`` (lighthouse ``join_timeout_ms``): how long the lighthouse waits for heartbeating
  replicas that have not asked for the quorum yet (still in their inner steps, or recovering).
  It must exceed the recovery time (``operation_s``), or a recovering replica never gets back in
  (torchft PR #75).
- ``quorum_s`` (``Manager(quorum_timeout=)``): how long ``start_quorum`` waits for the lighthouse.
  It must exceed ``join_s`` (the lighthouse may legitimately wait that long for stragglers), and
  for DiLoCo a whole round of H inner steps, since a replica that arrives after a quorum formed
  waits for the next one.
- ``heartbeat_s`` (lighthouse ``heartbeat_timeout_ms``): silence after which a replica counts as
  dead, so the others stop waiting for it; shorter than ``join_s``.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

__all__ = [
    "TorchFTTimeouts",
    "build_torchft_manager",
    "lighthouse_address",
    "start_lighthouse",
]


def _require_torchft() -> Any:
    try:
        import torchft
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the torchft path needs torchft: pip install composer-replication[diloco]"
        ) from exc
    return torchft


@dataclass(frozen=True)
class TorchFTTimeouts:
    """Seconds for each torchft timeout; validated to the order in the module docstring."""

    process_group_s: float = 60.0
    operation_s: float = 120.0
    join_s: float = 300.0
    quorum_s: float = 3600.0
    heartbeat_s: float = 10.0
    connect_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("process_group_s", "operation_s", "join_s", "quorum_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TorchFTTimeouts.{name} must be > 0, got {getattr(self, name)}")
        if not self.connect_s > 0:
            raise ValueError(f"TorchFTTimeouts.connect_s must be > 0, got {self.connect_s}")
        if not self.process_group_s <= self.operation_s < self.join_s < self.quorum_s:
            raise ValueError(
                "torchft timeouts must be ordered process_group_s <= operation_s < join_s < "
                f"quorum_s; got {self.process_group_s} / {self.operation_s} / {self.join_s} / "
                f"{self.quorum_s}. A quorum timeout shorter than the lighthouse's join wait "
                "aborts quorums that are still forming; a join wait shorter than recovery "
                "(operation_s) locks healing replicas out."
            )
        if not self.heartbeat_s < self.join_s:
            raise ValueError(
                f"heartbeat_s={self.heartbeat_s} must be < join_s={self.join_s} so a dead "
                "replica is noticed before the lighthouse stops waiting for stragglers"
            )


def start_lighthouse(
    min_replicas: int,
    *,
    bind: str = "127.0.0.1:0",
    timeouts: TorchFTTimeouts | None = None,
    quorum_tick_ms: int = 100,
) -> Any:
    """Start an in-process `torchft.coordination.LighthouseServer`; call ``.shutdown()`` to stop.

    The CLI equivalent (for a separate host):
    ``torchft_lighthouse --bind 0.0.0.0:29510 --min_replicas N --join_timeout_ms J
    --heartbeat_timeout_ms B``. Use `lighthouse_address` for the address replicas dial.
    """
    if min_replicas < 1:
        raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
    _require_torchft()
    from torchft.coordination import LighthouseServer

    t = timeouts or TorchFTTimeouts()
    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=int(t.join_s * 1000),
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=int(t.heartbeat_s * 1000),
    )


def lighthouse_address(lighthouse: Any, host: str = "127.0.0.1") -> str:
    """``http://host:port`` of a lighthouse (its own ``address()`` names the machine's hostname,
    which may not resolve inside containers; pass the host replicas should dial)."""
    port = urlparse(lighthouse.address()).port
    return f"http://{host}:{port}"


def build_torchft_manager(
    *,
    replica_id: str,
    lighthouse_addr: str | None = None,
    min_replicas: int,
    timeouts: TorchFTTimeouts | None = None,
    hostname: str = "127.0.0.1",
    store_port: int = 0,
    manager_port: int = 0,
    load_state_dict: Callable[[Any], None] | None = None,
    state_dict: Callable[[], Any] | None = None,
    init_sync: bool = True,
) -> tuple[Any, Callable[[], None]]:
    """A `torchft.Manager` for one single-process replica group, ready for DiLoCo.

    Hosts the replica group's TCPStore on ``hostname:store_port`` (0 = a free port), builds a
    `ProcessGroupGloo` with ``timeouts.process_group_s`` and a Manager with a synchronous quorum
    (DiLoCo requires ``use_async_quorum=False``). ``load_state_dict`` / ``state_dict`` register
    extra user state for healing (DiLoCo registers its global weights and outer optimizer
    itself). Replicas should start from identical weights (same seed); torchft heals replicas
    that are behind from a peer at the next quorum.

    ``lighthouse_addr`` points at a running lighthouse (``http://host:port``); None reads
    ``$TORCHFT_LIGHTHOUSE`` (torchft's own variable). Returns (manager, close); ``close()`` shuts
    the manager and its store down.
    """
    import os

    lighthouse_addr = lighthouse_addr or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse_addr:
        raise ValueError(
            "no lighthouse: pass lighthouse_addr='http://host:port' (start one with "
            "start_lighthouse() or the torchft_lighthouse CLI) or set $TORCHFT_LIGHTHOUSE"
        )
    if min_replicas < 1:
        raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
    if not replica_id:
        raise ValueError("replica_id must be a non-empty string, unique per replica group")
    _require_torchft()
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    t = timeouts or TorchFTTimeouts()
    store = TCPStore(
        host_name=hostname,
        port=store_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=t.connect_s),
    )
    pg = ProcessGroupGloo(timeout=timedelta(seconds=t.process_group_s))
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timedelta(seconds=t.operation_s),
        quorum_timeout=timedelta(seconds=t.quorum_s),
        connect_timeout=timedelta(seconds=t.connect_s),
        rank=0,
        world_size=1,
        store_addr=hostname,
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=replica_id,
        port=manager_port,
        hostname=hostname,
        init_sync=init_sync,
    )

    def close() -> None:
        manager.shutdown(wait=False)
        del store_ref[:]

    store_ref = [store]  # keep the TCPStore alive as long as the manager
    return manager, close


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on `host` (for manager/store ports chosen up front)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
