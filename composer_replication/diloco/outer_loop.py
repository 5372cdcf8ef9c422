"""make_diloco_outer_loop: the DiLoCo outer loop around any inner optimizer.

Every replica runs its own inner optimizer (AdamW, ...) for H steps; then each replica's
pseudo-gradient ``global - local`` (torchft's and the paper's sign, fixed in torchft PR #233 and
pinned by the ``diloco`` extra to torchft 0.2.0) is averaged across replicas once and an outer
optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9 by default, as in DiLoCo) steps the
global weights, which every replica then continues from::

    global_{t+1} = OuterSGD(global_t, grad = mean_r(global_t - local_r))

With outer lr 1 and no momentum this is exactly the average of the local weights (local SGD).

The mechanics are `torchft.local_sgd.DiLoCo` (hooks on the inner optimizer's ``step``, backup of
the global weights, rollback when a round fails, Streaming DiLoCo fragments). This module adds
what our users need around it:

- the seed call ``make_diloco_outer_loop(inner_optimizer=..., manager=..., sync_every_h=...)``
  with no model (the parameters come from the optimizer) and an optimizer that may not exist yet
  (``trainer.optimizer`` is None until a Hugging Face trainer starts); the object binds to the
  model/optimizer when it first can: at construction, at ``with``, or in the callback's
  ``on_train_begin``;
- a plain context manager (``with outer: ...``) and ``outer.callback()`` (a `TrainerCallback`);
- one seam to whoever averages across replicas, the `Manager` protocol (diloco/manager.py):
  `ObjectStoreManager` (the object store) or `TorchFTManager` (torchft's Manager; a raw
  ``torchft.Manager`` is wrapped). Through it the initial weights come from the run (every
  replica starts identical; a restart resumes from the latest committed round), the outer state
  is published after committed rounds, and a replica that fell behind heals;
- Streaming DiLoCo via ``num_fragments`` (strided layer assignment) or explicit
  ``model_fragments``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from composer_replication.diloco.fragments import strided_fragments, whole_model_fragment
from composer_replication.diloco.outer_optimizer import (
    OUTER_OPTIMIZERS,
    OuterOptimizerConfig,
    OuterOptimizerFactory,
)
from composer_replication.diloco.torchft.torchft_path import as_manager

if TYPE_CHECKING:
    from composer_replication.diloco.callback import DiLoCoCallback
    from composer_replication.diloco.manager import Manager, RoundRecord

__all__ = [
    "OUTER_OPTIMIZERS",
    "DiLoCoOuterLoop",
    "OuterOptimizerConfig",
    "StreamingOptions",
    "make_diloco_outer_loop",
    "unwrap_optimizer",
]


def _require_torchft() -> Any:
    try:
        from torchft import local_sgd
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "the DiLoCo outer loop needs torchft: pip install composer-replication[diloco]"
        ) from exc
    return local_sgd


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step`` actually runs (unwraps accelerate / HF wrappers).

    DiLoCo hooks ``register_step_pre/post_hook`` on the optimizer; accelerate's
    AcceleratedOptimizer delegates ``step`` to ``.optimizer``, so hooks must sit on that one.
    """
    seen = 0
    while not type(optimizer).__module__.startswith("torch.") and hasattr(optimizer, "optimizer"):
        inner = optimizer.optimizer
        if not isinstance(inner, torch.optim.Optimizer) or seen > 4:
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"inner_optimizer must be a torch.optim.Optimizer (got {type(optimizer).__name__})"
        )
    return optimizer


@dataclass(frozen=True, kw_only=True)
class StreamingOptions:
    """torchft `DiLoCo`'s own options: ``fragment_sync_delay`` (tau, inner steps between sending
    a fragment and applying it), ``fragment_update_alpha`` (after a sync, model = lerp(global,
    local, alpha); 0 = take the global), where the global weights' backup lives
    (``backup_device``) and bucketized allreduce (``use_bucketization``, ``bucket_cap_mb``)."""

    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    backup_device: torch.device | None = None
    use_bucketization: bool = False
    bucket_cap_mb: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}"
            )


class DiLoCoOuterLoop:
    """The outer loop; build it with `make_diloco_outer_loop` (see the module docstring).

    Attributes once bound: ``diloco`` (the torchft object), ``fragments``, ``outer_optimizers``,
    ``model``. ``round`` is the number of committed outer rounds, ``history`` the manager's
    per-round records (`RoundRecord`).
    """

    def __init__(
        self,
        inner_optimizer: Any,
        manager: Manager,
        sync_every_h: int,
        *,
        model: nn.Module | None = None,
        model_fragments: Sequence[nn.Module] | None = None,
        num_fragments: int = 1,
        outer: OuterOptimizerConfig | OuterOptimizerFactory | None = None,
        streaming: StreamingOptions | None = None,
        sync_initial_state: bool = True,
    ) -> None:
        if manager is None:
            raise ValueError(
                "manager is required: an ObjectStoreManager, a TorchFTManager or a torchft.Manager"
            )
        if not isinstance(sync_every_h, int) or isinstance(sync_every_h, bool) or sync_every_h < 1:
            raise ValueError(f"sync_every_h must be a positive int, got {sync_every_h!r}")
        if model_fragments is not None and num_fragments != 1:
            raise ValueError("pass either model_fragments or num_fragments, not both")
        n_frag = len(model_fragments) if model_fragments is not None else num_fragments
        if n_frag < 1:
            raise ValueError(f"need at least one fragment, got {n_frag}")
        if sync_every_h % n_frag != 0:
            raise ValueError(
                f"sync_every_h={sync_every_h} must be a multiple of the number of fragments "
                f"({n_frag}): each fragment syncs every sync_every_h / n_fragments steps"
            )
        streaming = StreamingOptions() if streaming is None else streaming
        delay = streaming.fragment_sync_delay
        if not 0 <= delay < sync_every_h // n_frag:
            raise ValueError(
                f"fragment_sync_delay={delay} must be in [0, sync_every_h / "
                f"n_fragments = {sync_every_h // n_frag}) so a fragment finishes before its next sync"
            )
        if outer is None:  # DiLoCo's outer Nesterov SGD
            outer = OuterOptimizerConfig()
        factory = (
            outer.build_outer_optimizer() if isinstance(outer, OuterOptimizerConfig) else outer
        )
        self.manager: Manager = as_manager(manager)
        self.sync_every_h = sync_every_h
        self.num_fragments = n_frag
        self._outer_factory: OuterOptimizerFactory = factory
        # The outer step's settings in use, read off an outer optimizer the factory builds.
        probe = factory([nn.Parameter(torch.zeros(1))])
        self._outer_hparams = dict(probe.param_groups[0])
        self._model_fragments = list(model_fragments) if model_fragments is not None else None
        self._kw = {f.name: getattr(streaming, f.name) for f in fields(streaming)}
        self.sync_initial_state = sync_initial_state
        self.model = model
        self.inner_optimizer: torch.optim.Optimizer | None = None
        self.diloco: Any = None
        self.fragments: list[nn.Module] = []
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []
        self._entered = False
        if inner_optimizer is not None:
            self.bind(optimizer=inner_optimizer)

    # ------------------------------------------------------------------ binding
    @property
    def bound(self) -> bool:
        return self.diloco is not None

    def bind(self, *, model: nn.Module | None = None, optimizer: Any = None) -> DiLoCoOuterLoop:
        """Attach to the inner optimizer (and model); builds DiLoCo and syncs the initial state.

        Idempotent: a second call is ignored. With ``sync_initial_state`` this loads the run's
        global weights into the model (`Manager.initial_sync`: with the object store, ours are
        published first on a fresh run).
        """
        if self.bound:
            return self
        if optimizer is None:
            raise ValueError(
                "the outer loop has no inner optimizer yet: pass inner_optimizer= to "
                "make_diloco_outer_loop, or use outer.callback() with a Hugging Face trainer "
                "(it binds in on_train_begin)"
            )
        self.inner_optimizer = unwrap_optimizer(optimizer)
        if model is not None and self.model is None:
            self.model = model
        if self._model_fragments is not None:
            fragments = self._model_fragments
        elif self.num_fragments > 1:
            if self.model is None:
                raise ValueError(
                    "num_fragments > 1 needs model= (the layers are assigned to fragments by "
                    "index), or pass model_fragments="
                )
            fragments = strided_fragments(self.model, self.num_fragments)
        elif self.model is not None:
            fragments = [whole_model_fragment(self.model)]
        else:
            params = [p for g in self.inner_optimizer.param_groups for p in g["params"]]
            fragments = [whole_model_fragment(params)]
        self.fragments = fragments
        self.outer_optimizers = [self._make_outer(f.parameters()) for f in fragments]
        local_sgd = _require_torchft()
        self.diloco = local_sgd.DiLoCo(
            self.manager,
            fragments,
            self.inner_optimizer,
            self.outer_optimizers,
            sync_every=self.sync_every_h,
            pin_memory=False,
            **self._kw,
        )
        self.manager.add_heal_hook(self.load_global_weights)
        if self.sync_initial_state:
            self.manager.initial_sync(
                {f"f{i}.{n}": p for i, f in enumerate(fragments) for n, p in f.named_parameters()}
            )
            self.load_global_weights()
        return self

    def _make_outer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self._outer_factory(params)

    def _outer_group(self) -> dict[str, Any]:
        """The first outer parameter group in use (before binding: what the factory builds)."""
        if self.outer_optimizers:
            return dict(self.outer_optimizers[0].param_groups[0])
        return self._outer_hparams

    @property
    def outer_lr(self) -> float:
        """The outer learning rate in use (SparseLoCo's ``sparseloco_outer_lr`` with that codec)."""
        return float(self._outer_group()["lr"])

    @property
    def outer_momentum(self) -> float:
        """The outer momentum in use (0 for plain SGD; Adam's is its first beta)."""
        group = self._outer_group()
        if "betas" in group:
            return float(group["betas"][0])
        return float(group.get("momentum", 0.0))

    @property
    def nesterov(self) -> bool:
        """Nesterov momentum in the outer step in use."""
        return bool(self._outer_group().get("nesterov", False))

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> DiLoCoOuterLoop:
        if self._entered:
            return self
        self.bind(optimizer=self.inner_optimizer)
        assert self.inner_optimizer is not None
        self.diloco.__enter__()
        # Registered after DiLoCo's own hooks, so the pre-hook counts a step DiLoCo is about to
        # see and the post-hook runs after a sync DiLoCo just performed.
        self._hooks = [
            self.inner_optimizer.register_step_pre_hook(self._pre_step),
            self.inner_optimizer.register_step_post_hook(self._post_step),
        ]
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if not self._entered:
            return False
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.diloco.__exit__(exc_type, exc, tb)
        self._entered = False
        if exc_type is None:
            self.manager.drain()
        return False

    def _pre_step(self, *_: object) -> None:
        self.manager.record_inner_step()

    def _post_step(self, *_: object) -> None:
        self.manager.publish_if_due()

    # ------------------------------------------------------------------ user API
    def callback(self) -> DiLoCoCallback:
        """A Hugging Face `TrainerCallback` that runs this outer loop inside ``trainer.train()``."""
        from composer_replication.diloco.callback import DiLoCoCallback

        return DiLoCoCallback(self)

    def record_tokens(self, n: int) -> None:
        """Report `n` tokens trained this round (used when the store weights by tokens)."""
        self.manager.record_tokens(n)

    @property
    def round(self) -> int:
        """Committed outer rounds so far (the round the global weights are at)."""
        return int(self.manager.current_step())

    @property
    def local_step(self) -> int:
        """Inner steps since the last fragment sync."""
        return int(self.diloco._local_step) if self.bound else 0

    @property
    def history(self) -> list[RoundRecord]:
        return list(self.manager.history)

    def outer_optimizer_state(self) -> dict[str, dict[str, object]]:
        """Each fragment's outer optimizer state (momentum, lr, ...), keyed ``fragment_<i>``:
        what a checkpoint needs besides the global weights. Identical on every replica after
        a committed round."""
        self._require_bound()
        return {
            f"fragment_{i}": {"outer_optimizer": opt.state_dict()}
            for i, opt in enumerate(self.outer_optimizers)
        }

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The current global weights (copies), keyed ``f<fragment>.<name>``."""
        self._require_bound()
        return {
            f"f{i}.{name}": t.clone()
            for i, frag in enumerate(self.diloco._fragments)
            for name, t in frag.original_parameters.items()
        }

    def load_global_weights(self) -> None:
        """Copy the global weights into the model (e.g. before evaluating or saving)."""
        self._require_bound()
        self.diloco._restore_parameters()

    def _require_bound(self) -> None:
        if not self.bound:
            raise RuntimeError("the outer loop is not bound to an optimizer yet")


def make_diloco_outer_loop(
    inner_optimizer: Any,
    manager: Manager,
    sync_every_h: int,
    *,
    model: nn.Module | None = None,
    model_fragments: Sequence[nn.Module] | None = None,
    num_fragments: int = 1,
    outer: OuterOptimizerConfig | OuterOptimizerFactory | None = None,
    streaming: StreamingOptions | None = None,
    sync_initial_state: bool = True,
) -> DiLoCoOuterLoop:
    """Build the DiLoCo outer loop (see the module docstring).

    Args:
        inner_optimizer: the replica's optimizer (torch or accelerate-wrapped), or None to bind
            later through ``outer.callback()`` (Hugging Face trainers create it in ``train()``).
        manager: a `Manager`: `ObjectStoreManager` (serverless), `TorchFTManager` or a raw
            ``torchft.Manager`` (clusters; wrapped in `TorchFTManager`).
        sync_every_h: H, inner steps between syncs of the whole model.
        model: the module being trained; optional when the optimizer holds all its parameters.
        model_fragments / num_fragments: Streaming DiLoCo; explicit modules, or a strided split
            of ``model``'s blocks into ``num_fragments`` (each synced every H / P steps).
        outer: the outer optimizer: its settings (`OuterOptimizerConfig`, the ``[diloco]
            outer_*`` keys; None: DiLoCo's SGD with Nesterov momentum, lr 0.7, momentum 0.9) or a
            factory of a fragment's parameters (e.g. SparseLoCo's plain SGD).
        streaming: torchft DiLoCo's own options (`StreamingOptions`; None: its defaults).
        sync_initial_state: start from the run's global weights (`Manager.initial_sync`).
    """
    return DiLoCoOuterLoop(
        inner_optimizer,
        manager,
        sync_every_h,
        model=model,
        model_fragments=model_fragments,
        num_fragments=num_fragments,
        outer=outer,
        streaming=streaming,
        sync_initial_state=sync_initial_state,
    )
