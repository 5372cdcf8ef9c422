"""The torchft path: `TorchftDiLoCo`, the ``mode = "sync"``, ``manager = "torchft"``
`OuterLoopMode`.

The same lockstep outer loop as `SyncDiLoCo`, averaged by a torchft Manager over gloo
(diloco/torchft/torchft_path.py) that dials a lighthouse: ``[diloco] lighthouse``, else the one the
driver runs on 127.0.0.1 for a local run (`build_lighthouse`, handed to the replicas as
$TORCHFT_LIGHTHOUSE). The replicas publish their outer state to the run's store, so a resumed
run continues from it. torchft averages fp32 equally over gloo: the object-store exchange's
codecs, token weighting, robust aggregation, screening and signatures do not apply.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlparse

from composer_replication.diloco.manager import Manager
from composer_replication.diloco.mode_protocol import GlobalWeights, ReplicaContext, RunShape
from composer_replication.diloco.section import ManagerName, ModeName
from composer_replication.diloco.sync.sync_mode import SyncDiLoCo
from composer_replication.diloco.torchft.torchft_path import (
    TorchFTEndpoint,
    build_torchft_manager,
    lighthouse_address,
    start_lighthouse,
)
from composer_replication.exchange import codec_fp32
from composer_replication.exchange.run_documents import RunDocuments
from composer_replication.exchange.store import ObjectStore
from composer_replication.fields import require

__all__ = ["LIGHTHOUSE_ENV", "LocalLighthouse", "TorchftDiLoCo"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse address


class LocalLighthouse:
    """A torchft lighthouse on 127.0.0.1 that the driver runs for the run's lifetime."""

    def __init__(self, min_replicas: int) -> None:
        if "torchft" not in sys.modules and "RUST_LOG" not in os.environ:
            # torchft's Rust logger reads RUST_LOG once, at import: keep the lighthouse's
            # per-quorum INFO lines out of the progress display (replicas keep theirs).
            os.environ["RUST_LOG"] = "warn"
            try:
                import torchft  # noqa: F401
            finally:
                del os.environ["RUST_LOG"]
        self._server: Any = start_lighthouse(min_replicas, bind="127.0.0.1:0")

    @property
    def env(self) -> Mapping[str, str]:
        return {LIGHTHOUSE_ENV: lighthouse_address(self._server)}

    def shutdown(self) -> None:
        self._server.shutdown()


def _hostname() -> str:
    """This machine's address as its peers should dial it ($TORCHFT_HOSTNAME overrides)."""
    return os.environ.get("TORCHFT_HOSTNAME") or socket.getfqdn()


class TorchftDiLoCo(SyncDiLoCo):
    """Sync DiLoCo over torchft's Manager and lighthouse (see the module docstring)."""

    mode: ClassVar[ModeName] = "sync"
    manager: ClassVar[ManagerName] = "torchft"
    departure_roles: tuple[str, ...] = ()  # torchft's lighthouse tracks who is alive

    def quorum(self, n_replicas: int) -> int:
        """The lighthouse's ``min_replicas``: ``diloco.min_replicas``, else every replica
        (torchft forms a quorum of whoever joins in time; the object-store exchange's default
        of one fewer, `exchange.settings.default_quorum`, is about refused contributions,
        which torchft's gloo allreduce does not have)."""
        return self.config.exchange.min_replicas or n_replicas

    def end_of_run_problem(self, store: ObjectStore, n_replicas: int, max_steps: int) -> str | None:
        return None  # torchft keeps no rounds in the store

    def check_section(self) -> None:
        d = self.config
        require(
            d.decoupled.fragments == 1,
            "diloco.fragments",
            "is used with diloco.mode = 'decoupled' only",
        )
        require(
            d.exchange.aggregate == "mean" and d.exchange.screen == "none",
            "diloco.aggregate",
            "robust aggregation and screening run in the object-store exchange; torchft "
            "averages over gloo (use manager = 'object_store')",
        )
        require(
            d.exchange.codec == codec_fp32.NAME,  # torchft's own allreduce: lossless float32
            "diloco.codec",
            f"{d.exchange.codec!r} applies to the object-store exchange; torchft averages fp32 "
            "over gloo (use codec = 'fp32' or manager = 'object_store')",
        )
        require(
            d.exchange.weighting == "equal",
            "diloco.weighting",
            "torchft averages replicas equally; 'tokens' needs manager = 'object_store'",
        )

    def check_run(self, run: RunShape) -> None:
        if not self.config.torchft.lighthouse:
            require(
                run.local_backend,
                "diloco.lighthouse",
                f"backend {run.backend!r} runs replicas the driver's own lighthouse "
                "(127.0.0.1) cannot serve; start `torchft_lighthouse` where they can reach it "
                "and set diloco.lighthouse = 'http://HOST:PORT'",
            )
        require(
            not run.signed,
            "security.sign",
            "signs the object-store exchange; torchft averages over gloo (use diloco.manager = "
            "'object_store')",
        )

    def build_manager(self, ctx: ReplicaContext, global_weights: GlobalWeights) -> Manager:
        """A torchft Manager dialling the lighthouse, publishing its outer state to the store."""
        d = self.config
        lighthouse = d.torchft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise ValueError(
                "diloco.manager = 'torchft' needs a lighthouse: set diloco.lighthouse = "
                "'http://HOST:PORT' (the driver starts one itself for local runs)"
            )
        # What this replica advertises to its peers: loopback when the run is on this machine.
        local = (urlparse(lighthouse).hostname or "") in ("127.0.0.1", "localhost", "::1")
        states = RunDocuments(
            ctx.store,
            world_size=ctx.n_replicas,
            codec=d.exchange.codec,
            keep_steps=ctx.keep_rounds,
            poll_interval_s=0.5,
        )
        # init_sync=False: every replica builds the same initial weights (same seed or
        # checkpoint), so the first quorum need not copy them; a replica that is behind (a
        # restart) is still healed from a peer.
        return build_torchft_manager(
            replica_id=f"replica_{ctx.rank}",
            lighthouse_addr=lighthouse,
            min_replicas=self.quorum(ctx.n_replicas),
            endpoint=TorchFTEndpoint("127.0.0.1" if local else _hostname()),
            init_sync=False,
            states=states,
        )

    def build_lighthouse(self, n_replicas: int) -> LocalLighthouse | None:
        if self.config.torchft.lighthouse:  # the user runs one where the replicas can reach it
            return None
        return LocalLighthouse(self.quorum(n_replicas))
