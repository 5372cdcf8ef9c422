"""The outer loop's one seam: the registry picks one `OuterLoopMode` per `[diloco] mode` /
`manager`, each mode checks its own rules, builds its learner side with the settings in use,
and answers what the run does around it (what run/ asks instead of testing the mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from composer_replication.config import ConfigError, from_dict, load_config
from composer_replication.diloco.decoupled import DecoupledLearner
from composer_replication.diloco.decoupled.decoupled_mode import DecoupledDiLoCo
from composer_replication.diloco.mode_protocol import ReplicaContext
from composer_replication.diloco.mode_registry import outer_loop_mode, outer_loop_modes
from composer_replication.diloco.outer_loop import DiLoCoOuterLoop
from composer_replication.diloco.outer_optimizer import OuterOptimizerConfig
from composer_replication.diloco.section import DilocoConfig
from composer_replication.diloco.sparseloco import ErrorFeedbackManager
from composer_replication.diloco.sync.sync_mode import SyncDiLoCo
from composer_replication.diloco.synchronizer_config import SynchronizerConfig
from composer_replication.diloco.torchft.torchft_mode import TorchftDiLoCo
from composer_replication.exchange.store import ObjectStore


def _ctx(tmp_path: Path, n: int = 2) -> ReplicaContext:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return ReplicaContext(
        store=ObjectStore(str(tmp_path / "store")), rank=0, n_replicas=n, keep_rounds=4, model=model
    )


def test_the_registry_has_one_class_per_mode_and_names_what_cannot_run() -> None:
    assert outer_loop_modes() == {
        ("sync", "object_store"): SyncDiLoCo,
        ("sync", "torchft"): TorchftDiLoCo,
        ("decoupled", "object_store"): DecoupledDiLoCo,
    }
    with pytest.raises(ConfigError, match="diloco.mode.*did you mean 'decoupled'"):
        load_config(overrides=["diloco.mode=decoupld"])
    with pytest.raises(ValueError, match="diloco.manager: 'torchft' does not run diloco.mode"):
        outer_loop_mode(from_dict(DilocoConfig, dict(mode="decoupled", manager="torchft")))
    with pytest.raises(ConfigError, match="set diloco.manager = 'object_store'"):
        load_config(overrides=["diloco.mode=decoupled", "diloco.manager=torchft"])


def test_what_the_run_does_around_each_mode() -> None:
    sync = outer_loop_mode(from_dict(DilocoConfig, dict(min_replicas=2)))
    torchft = outer_loop_mode(from_dict(DilocoConfig, dict(manager="torchft")))
    decoupled = outer_loop_mode(
        from_dict(DilocoConfig, dict(mode="decoupled", synchronizer="external"))
    )
    assert isinstance(sync, SyncDiLoCo) and isinstance(torchft, TorchftDiLoCo)
    assert (sync.worker_role, torchft.worker_role, decoupled.worker_role) == (
        "replica",
        "replica",
        "learner",
    )
    assert (sync.n_rounds(60), torchft.n_rounds(60), decoupled.n_rounds(60)) == (3, 3, None)
    assert (sync.departure_roles, torchft.departure_roles) == (("replica",), ())
    # its synchronizer leaves a departed learner out
    assert decoupled.departure_roles == ("learner",)
    assert decoupled.service_roles == ("synchronizer",) and decoupled.driver_service() is None
    service = outer_loop_mode(from_dict(DilocoConfig, dict(mode="decoupled"))).driver_service()
    assert service is not None and (service.name, service.identity) == (
        "synchronizer",
        "synchronizer",
    )
    assert sync.service_roles == () and torchft.driver_service() is None
    # a sync run of 3 with min_replicas 2 may lose one replica for good, not two
    assert sync.quorum(3) == 2 and sync.after_loss(3) == "go_on"
    assert sync.may_finish_without(2, 3) and not sync.may_finish_without(1, 3)
    assert torchft.quorum(3) == 3 and torchft.after_loss(3) == "stop"
    # the default quorum tolerates one lost or refused replica: max(1, n - 1)
    default = outer_loop_mode(DilocoConfig())
    assert [default.quorum(n) for n in (1, 2, 3, 8)] == [1, 1, 2, 7]
    assert default.after_loss(2) == "go_on" and default.after_loss(1) == "stop"
    # decoupled: all learners but one by default, never finished without one
    assert decoupled.quorum(4) == 3 and decoupled.after_loss(4) == "go_on"
    assert not decoupled.may_finish_without(3, 4)


def test_the_outer_lr_reported_is_the_one_in_use(tmp_path: Path) -> None:
    """`outer.outer_lr` once reported DiLoCo's default 0.7 whatever the run config said (the
    replica handed the outer loop a factory, and the attribute kept the argument's default)."""
    loop = SyncDiLoCo(
        from_dict(DilocoConfig, dict(outer_lr=0.3, outer_momentum=0.5))
    ).build_learner(_ctx(tmp_path))
    outer = loop.outer
    assert isinstance(outer, DiLoCoOuterLoop)
    assert (outer.outer_lr, outer.outer_momentum, outer.nesterov) == (0.3, 0.5, True)
    loop.close()
    sgd = SyncDiLoCo(
        from_dict(DilocoConfig, dict(outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0))
    )
    outer = sgd.build_learner(_ctx(tmp_path / "sgd")).outer
    assert isinstance(outer, DiLoCoOuterLoop)
    assert (outer.outer_lr, outer.outer_momentum, outer.nesterov) == (1.0, 0.0, False)
    # SparseLoCo: the error feedback replaces the momentum, the outer step is its own lr
    sparse = SyncDiLoCo(
        from_dict(DilocoConfig, dict(codec="sparseloco", sparseloco_outer_lr=0.8, outer_lr=0.3))
    )
    outer = sparse.build_learner(_ctx(tmp_path / "sparse")).outer
    assert isinstance(outer, DiLoCoOuterLoop)
    assert isinstance(outer.manager, ErrorFeedbackManager)
    assert (outer.outer_lr, outer.outer_momentum, outer.nesterov) == (0.8, 0.0, False)
    # after binding: the outer optimizers actually built
    ctx = _ctx(tmp_path / "bound")
    outer = SyncDiLoCo(from_dict(DilocoConfig, dict(outer_lr=0.3))).build_learner(ctx).outer
    assert isinstance(outer, DiLoCoOuterLoop)
    outer.bind(model=ctx.model, optimizer=torch.optim.SGD(ctx.model.parameters(), lr=0.1))
    assert [g["lr"] for o in outer.outer_optimizers for g in o.param_groups] == [0.3]
    assert outer.outer_lr == 0.3


def test_a_decoupled_learner_and_its_synchronizer_take_the_keys_as_named(tmp_path: Path) -> None:
    config = from_dict(
        DilocoConfig,
        dict(
            mode="decoupled",
            sync_every_h=4,
            fragments=2,
            alpha=0.25,
            grace_gamma=0.5,
            grace_tau=3.0,
            aggregate_outlier_ratio=5.0,
            late="drop",
            outer_lr=0.4,
            outer_optimizer="sgd",
            outer_momentum=0.5,
            quorum=2,
            lease_ttl_s=7.0,
        ),
    )
    mode = outer_loop_mode(config)
    assert isinstance(mode, DecoupledDiLoCo)
    loop = mode.build_learner(_ctx(tmp_path, n=3))
    learner = loop.outer
    assert isinstance(learner, DecoupledLearner)
    assert (learner.num_fragments, learner.alpha, learner.sync_every_h) == (2, 0.25, 4)
    assert (loop.start_round, loop.start_step) == (0, 0)
    assert loop.heartbeat() == {"round": 0, "step": 0, "versions": []}
    sync = mode.synchronizer_config(keep_rounds=6, max_steps=40, local=True)
    assert sync == SynchronizerConfig(
        quorum=2,
        grace_gamma=0.5,
        grace_tau=3.0,
        merge="mean",
        late="drop",
        lease_ttl_s=7.0,
        weighting="equal",
        aggregate="mean",
        aggregate_outlier_ratio=5.0,
        keep_rounds=6,
        max_steps=40,
        poll_interval_s=0.05,
        outer=OuterOptimizerConfig(outer_optimizer="sgd", outer_lr=0.4, outer_momentum=0.5),
    )
    assert (sync.outer.nesterov, sync.resolved_quorum(5)) == (False, 2)
    assert SynchronizerConfig().resolved_quorum(5) == 4  # unset: all learners but one


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["diloco.manager=torchft", "diloco.codec=int8"], "diloco.codec: 'int8' applies to"),
        (["diloco.manager=torchft", "backend.kind=ray"], "diloco.lighthouse: backend 'ray'"),
        (["diloco.manager=torchft", "security.sign=true"], "security.sign: signs the object"),
        (["diloco.lighthouse=http://10.0.0.5:29510"], "diloco.lighthouse: is only used with"),
        (["diloco.mode=decoupled", "diloco.codec=sparseloco"], "diloco.codec: 'sparseloco' runs"),
        (
            ["diloco.codec=sparseloco", "diloco.outer_optimizer=adam"],
            "diloco.outer_optimizer: 'adam' contradicts codec = 'sparseloco'",
        ),
    ],
)
def test_each_mode_checks_its_own_rules(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert needle in str(info.value)


def test_loading_a_config_of_any_mode_imports_no_training_framework() -> None:
    """Loading a run config picks its outer-loop mode (the schema checks the mode's rules), and
    must not import transformers or torchft on the way: the Monarch recipe's actors load the
    config on several threads of one process while another builds the model, and a second
    thread importing transformers at the same moment fails ("cannot import name
    'TrainerControl'")."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from composer_replication.config import load_config\n"
        "for o in ([], ['diloco.mode=decoupled'], ['diloco.manager=torchft']):\n"
        "    load_config(overrides=o)\n"
        "heavy = sorted(m for m in ('transformers', 'trl', 'torchft') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
