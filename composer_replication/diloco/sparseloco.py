"""SparseLoCo's replica side: the error-feedback accumulator around the exchange.

SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706) replaces DiLoCo's outer momentum by a local
error-feedback accumulator ``e`` per replica and sends only a compressed message::

    delta = global - local                        (the pseudo-gradient of the round)
    acc   = decay * e + delta
    sent  = Q(TopK_chunk(acc))                    (codec "sparseloco": exchange/sparse.py)
    e     = acc - sent                            (what was not sent waits for a later round)
    global <- global - outer_lr * mean_r(sent_r)  (plain SGD: no outer momentum)

`ErrorFeedbackManager` wraps the replica's `Manager` (an `ObjectStoreManager` whose exchange
uses codec ``"sparseloco"``): DiLoCo hands it each pseudo-gradient through ``allreduce``; it
replaces the tensor by ``acc``, which the exchange encodes into exactly ``sent`` (the encoder
is a deterministic function of its input, and this class runs the same encoder to know
``sent``), and the exchange overwrites the tensor in place with the mean of the replicas'
decoded messages, which the outer optimizer (`sparseloco_outer_optimizer`: SGD at
``outer_lr``, momentum 0) applies.

Accounting (what the tests pin): ``e`` only changes when a round commits, so over committed
rounds ``sum(sent) + e == sum(decay-weighted deltas)`` exactly up to float32 rounding; nothing
is dropped except by ``decay``. A round that fails (the exchange did not commit) leaves ``e``
as it was, like DiLoCo drops the round's local work; a round the inner manager adopted (it
committed, but this replica could not read a contribution it lists, and loaded the round's
published state instead: ``should_commit`` False, ``current_step`` advanced) counts as
committed, since its message went to that step. The store keeps the first upload of a
step, and a failed step is retried at the same step; the retry therefore accounts the message
of the first attempt (remembered here), which is what the store holds whenever that first
upload went through (a round sat out after a heal uploads nothing and is not remembered). With
streaming fragments, DiLoCo sends fragment ``round % P``; each
fragment's tensors have their own accumulators (keyed by fragment and position, checked by
shape). The accumulators are local state: a replica that restarts starts them at zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from composer_replication.exchange import codecs
from composer_replication.exchange.sparse import BITS, SparseSpec
from composer_replication.fields import require, setting

if TYPE_CHECKING:
    from composer_replication.diloco.manager import Manager
    from composer_replication.exchange.outer_state import LoadStateFn, SaveStateFn
    from composer_replication.exchange.store_manager import RoundRecord

__all__ = ["ErrorFeedbackManager", "SparseLoCoConfig", "compress", "sparseloco_outer_optimizer"]

_SPEC = SparseSpec()  # the exchange's encoder defaults: density, chunk and bits come from there


@dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig:
    """SparseLoCo's settings (codec ``"sparseloco"``, the `[diloco] sparseloco_*` keys): what the
    exchange's encoder keeps (`sparse_spec`) and the replica's error feedback and outer step."""

    sparseloco_density: float = setting(
        _SPEC.density, "codec = 'sparseloco': fraction of each chunk sent (top-k by magnitude)"
    )
    sparseloco_chunk: int = setting(_SPEC.chunk, "codec = 'sparseloco': elements per top-k chunk")
    sparseloco_bits: int = setting(
        _SPEC.bits, f"codec = 'sparseloco': bits per sent value, one of {list(BITS)}"
    )
    sparseloco_ef_decay: float = setting(
        0.95,
        "codec = 'sparseloco': error-feedback decay beta in e = beta * e + delta (in [0, 1])",
    )
    sparseloco_outer_lr: float = setting(
        1.0,
        "codec = 'sparseloco': lr of the outer SGD step on the mean of the replicas' messages "
        "(1 = apply it as is; docs/diloco.md has the benchmark's sweep)",
    )

    def __post_init__(self) -> None:
        try:
            self.sparse_spec()
        except ValueError as exc:  # "sparseloco <field> must be ...": name the key
            field_name = str(exc).split(" ")[1]
            raise ValueError(f"sparseloco_{field_name}: {exc}") from None
        require(0.0 <= self.sparseloco_ef_decay <= 1.0, "sparseloco_ef_decay", "must be in [0, 1]")
        require(self.sparseloco_outer_lr > 0, "sparseloco_outer_lr", "must be > 0")

    def sparse_spec(self) -> SparseSpec:
        """What the exchange's sparse encoder keeps (`exchange.sparse.SparseSpec`)."""
        return SparseSpec(
            density=self.sparseloco_density, chunk=self.sparseloco_chunk, bits=self.sparseloco_bits
        )

    def build_sparse_outer_optimizer(
        self,
    ) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
        """SparseLoCo's outer step at ``sparseloco_outer_lr`` (`sparseloco_outer_optimizer`)."""
        return sparseloco_outer_optimizer(self.sparseloco_outer_lr)

    def build_error_feedback(self, manager: Manager) -> ErrorFeedbackManager:
        """The replica's error feedback around ``manager`` (an exchange with this codec)."""
        return ErrorFeedbackManager(manager, self.sparse_spec(), decay=self.sparseloco_ef_decay)


def compress(acc: torch.Tensor, spec: SparseSpec) -> torch.Tensor:
    """What codec ``"sparseloco"`` puts on the wire for ``acc``, decoded (float32, same shape)."""
    parts = codecs.encode(acc, codecs.SPARSE, spec)
    out = torch.empty(acc.numel(), dtype=torch.float32)
    return codecs.decode_into(parts, codecs.SPARSE, out).view(acc.shape)


def sparseloco_outer_optimizer(
    lr: float,
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """SparseLoCo's outer step: plain SGD at ``lr`` on the averaged sparse messages (the error
    feedback takes the place of the outer momentum)."""
    if not lr > 0:
        raise ValueError(f"outer lr must be > 0, got {lr}")
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.0)


class ErrorFeedbackManager:
    """A `Manager` that adds SparseLoCo's error feedback around another one (module docstring).

    Args:
        manager: the replica's manager; its exchange must encode with codec ``"sparseloco"``
            and the same ``spec`` (an `ObjectStoreManager` built on such an exchange).
        spec: what the codec keeps (density, chunk, bits).
        decay: the accumulator's decay ``beta`` in ``acc = beta * e + delta``, in [0, 1].
        num_fragments: P of Streaming DiLoCo (fragment ``round % P`` syncs each round).
    """

    def __init__(
        self, manager: Manager, spec: SparseSpec, *, decay: float, num_fragments: int = 1
    ) -> None:
        if not isinstance(spec, SparseSpec):
            raise TypeError(f"spec must be a SparseSpec, got {type(spec).__name__}")
        if not (isinstance(decay, (int, float)) and 0.0 <= decay <= 1.0):
            raise ValueError(f"error-feedback decay must be in [0, 1], got {decay!r}")
        if not isinstance(num_fragments, int) or num_fragments < 1:
            raise ValueError(f"num_fragments must be an int >= 1, got {num_fragments!r}")
        exchange = getattr(manager, "exchange", None)
        codec = getattr(exchange, "codec", None)
        if codec is not None and codec != codecs.SPARSE:
            raise ValueError(
                f"error feedback needs the exchange to send codec 'sparseloco', not {codec!r} "
                "(the accumulator must know what was sent)"
            )
        if exchange is not None and getattr(exchange, "sparse", spec) != spec:
            raise ValueError(
                f"the exchange encodes with {exchange.sparse}, the error feedback assumes {spec}:"
                " give both the same SparseSpec"
            )
        self.inner = manager
        self.spec = spec
        self.decay = float(decay)
        self.num_fragments = num_fragments
        self._use_async_quorum = manager._use_async_quorum
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}  # (fragment, position) -> e
        self._fragment = 0
        self._calls = 0
        self._step = 0  # the store step this round's messages go to
        self._healed = False  # this round's quorum healed: the round is sat out
        self._pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # acc, sent
        self._failed_step: int | None = None
        self._failed_sent: dict[tuple[int, int], torch.Tensor] = {}

    # ------------------------------------------------------------------ what DiLoCo calls
    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        before = self.inner.current_step()
        self.inner.start_quorum(allow_heal=allow_heal, shrink_only=shrink_only, timeout=timeout)
        # A heal loaded a newer round: this replica sits the round out (nothing is uploaded,
        # should_commit says False), which is not a failed exchange to remember. DiLoCo picks
        # the fragment from current_step() after the quorum too.
        self._healed = self.inner.current_step() != before
        self._fragment = self.inner.current_step() % self.num_fragments
        self._step = self.inner.current_step() + 1
        self._calls = 0
        self._pending = {}

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> dist.Work:
        """``tensor`` (a pseudo-gradient) -> ``decay * e + tensor``, which is what the inner
        manager's exchange encodes; it comes back as the mean of the replicas' messages."""
        key = (self._fragment, self._calls)
        self._calls += 1
        with torch.no_grad():
            e = self.buffers.get(key)
            if e is not None and e.shape != tensor.shape:
                raise RuntimeError(
                    f"error feedback: tensor {key[1]} of fragment {key[0]} has shape "
                    f"{tuple(tensor.shape)}, its accumulator {tuple(e.shape)}: the outer loop "
                    "must send the same tensors in the same order every round"
                )
            acc = tensor.detach().to(torch.float32, copy=True)
            if e is not None:
                acc.add_(e, alpha=self.decay) if self.decay != 1.0 else acc.add_(e)
            if self._failed_step == self._step and key in self._failed_sent:
                sent = self._failed_sent[key]  # the store holds the first attempt's message
            else:
                sent = compress(acc, self.spec)
            self._pending[key] = (acc, sent)
            tensor.copy_(acc)
        return self.inner.allreduce(tensor, should_quantize=should_quantize)

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        committed = self.inner.should_commit(timeout=timeout)
        # False, yet at this round's step: the inner manager adopted the committed round's
        # published state (a contribution it lists was unreadable here); this replica's
        # message went to that committed step as in a committed round, so it leaves the buffer
        adopted = not committed and self.inner.current_step() == self._step
        if committed or adopted:
            for key, (acc, sent) in self._pending.items():
                self.buffers[key] = acc.sub_(sent)
            self._failed_step, self._failed_sent = None, {}
        elif self._pending and not self._healed:
            if self._failed_step != self._step:
                self._failed_sent = {k: sent for k, (_, sent) in self._pending.items()}
            self._failed_step = self._step
        self._pending = {}
        return committed

    def current_step(self) -> int:
        return self.inner.current_step()

    def register_state_dict_fn(
        self, key: str, load_state_dict: LoadStateFn, state_dict: SaveStateFn
    ) -> None:
        self.inner.register_state_dict_fn(key, load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        self.inner.allow_state_dict_read()

    def disallow_state_dict_read(self) -> None:
        self.inner.disallow_state_dict_read()

    # ------------------------------------------------------------------ the outer loop's hooks
    def add_heal_hook(self, fn: Callable[[], None]) -> None:
        self.inner.add_heal_hook(fn)

    def initial_sync(self, named_parameters: Mapping[str, torch.Tensor]) -> int:
        return self.inner.initial_sync(named_parameters)

    def record_inner_step(self) -> None:
        self.inner.record_inner_step()

    def record_tokens(self, n: int) -> None:
        self.inner.record_tokens(n)

    def publish_if_due(self) -> bool:
        return self.inner.publish_if_due()

    def drain(self) -> None:
        self.inner.drain()

    def close(self) -> None:
        self.inner.close()

    @property
    def history(self) -> Sequence[RoundRecord]:
        return self.inner.history

    def residual_norm(self) -> float:
        """L2 norm of everything not sent yet (all accumulators): a health signal."""
        return float(sum(float(e.double().pow(2).sum()) for e in self.buffers.values()) ** 0.5)
