"""The Decoupled DiLoCo learner: trains without ever waiting for peers, pushes fragments on its
own clock and takes each new global fragment as the synchronizer publishes it.

    learner = DecoupledLearner(store, learner=rank, n_learners=M,
                               config=LearnerConfig(sync_every_h=H, fragments=P),
                               model=model, inner_optimizer=opt)
    with learner:                       # binds: manifest, initial weights, newest globals
        for batch in data:
            loss = model(**batch).loss
            opt.zero_grad(); loss.backward(); opt.step()   # every step may push/apply a fragment
    learner.load_global_weights()       # the run's final global weights (all learners agree)

- **Fragments**: the model's repeated blocks split strided into P fragments
  (diloco/fragments.py, as Streaming DiLoCo), or ``model_fragments=``.
- **Pushes**: fragment p is pushed every H inner steps, at local steps ``(p + 1) * H / P`` (mod
  H), so one fragment leaves every H / P steps. A push is the pseudo-gradient ``base - local``
  of that fragment against the global version it was last loaded from, plus the work behind
  it (inner steps and tokens since that version) and the learner's seconds per step; it is
  written by a background thread (never blocking training; if the store is slower than the
  schedule, a newer push of a fragment replaces a queued one, which its work includes).
- **New globals**: a background thread polls ``heads.json`` (one small GET per poll) and
  downloads each fragment's new version; between two inner steps the learner overwrites its
  fragment with it (``alpha`` = 0, the paper's choice) or mixes ``lerp(global, local, alpha)``,
  and counts its work from that version on. The inner optimizer's state is kept.
- **Restart**: `resume_state` (taken right after a push) is everything of the learner's own a
  restarted one needs to continue exactly: its step, for each fragment the global version it
  was last loaded from and those weights (the base of its next push), the steps and tokens
  since that base and since its last push. `restore` (before binding) continues from it; the
  caller restores the model and inner optimizer (diloco/decoupled/learner_state.py saves both with the
  trainer's resume state). Without one, a learner resumes its step count from its progress
  document (written after each push) and starts from the newest global version of every
  fragment with fresh inner state. Either way binding downloads only the newest version of
  each fragment (none for a fragment still at the resume state's base), never the versions
  merged in between, and uploads nothing; `rejoin` records what it downloaded.
- **End**: leaving the context pushes every fragment once more (``final``), marks the learner
  done and waits (up to ``drain_timeout_s``) for the synchronizer's ``final.json``, then holds
  the run's final global fragments (`load_global_weights` copies them into the model).

It offers what the DiLoCo callback and the run's reporter use of `DiLoCoOuterLoop` (``bind``,
the context manager, ``record_tokens``, ``round``, ``history``, ``load_global_weights``,
``global_parameters``, ``outer_optimizer_state``, ``callback``). ``round`` is the lowest global
version over fragments: a full round has passed when every fragment has been merged once more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypedDict, get_args

import torch
from torch import nn

from composer_replication.diloco.fragments import strided_fragments, whole_model_fragment
from composer_replication.diloco.synchronizer_config import SynchronizerSettings
from composer_replication.exchange.codecs import CodecName
from composer_replication.exchange.liveness import LEARNER_ROLE, write_heartbeat
from composer_replication.exchange.protocol import CorruptContributionError, tensors_digest
from composer_replication.exchange.push_store import DecoupledStore, fragment_manifest
from composer_replication.exchange.settings import ExchangeConfig
from composer_replication.exchange.signing import RunKeys
from composer_replication.exchange.store import Store
from composer_replication.exchange.store_manager import RoundRecord, round_record
from composer_replication.fields import require, setting

__all__ = [
    "SYNCHRONIZER_PLACES",
    "DecoupledConfig",
    "DecoupledLearner",
    "LearnerConfig",
    "LearnerState",
    "RejoinRecord",
    "push_offsets",
]

log = logging.getLogger(__name__)

SynchronizerPlace = Literal["driver", "external"]
SYNCHRONIZER_PLACES: tuple[SynchronizerPlace, ...] = get_args(SynchronizerPlace)


@dataclass(frozen=True, kw_only=True)
class DecoupledConfig(SynchronizerSettings):
    """Decoupled DiLoCo's settings: the learners' (``fragments``, ``alpha``), the synchronizer's
    (`SynchronizerSettings`) and where the synchronizer runs."""

    fragments: int = setting(
        1, "decoupled: P strided fragments; one is pushed every sync_every_h / fragments steps"
    )
    alpha: float = setting(
        0.0, "decoupled: a learner takes a new global as lerp(global, local, alpha); 0 = overwrite"
    )
    synchronizer: SynchronizerPlace = setting(
        "driver",
        "decoupled: 'driver' runs the synchronizer beside the driver; 'external': you run "
        "`composer-replication synchronizer RUN` yourself",
    )

    def __post_init__(self) -> None:
        SynchronizerSettings.__post_init__(self)
        require(self.fragments >= 1, "fragments", "must be >= 1")
        require(0.0 <= self.alpha <= 1.0, "alpha", "must be in [0, 1]")
        require(
            self.synchronizer in SYNCHRONIZER_PLACES,
            "synchronizer",
            f"{self.synchronizer!r} is not one of {list(SYNCHRONIZER_PLACES)}",
        )


_DECOUPLED = DecoupledConfig()
_EXCHANGE = ExchangeConfig()


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """One learner's settings: the ``[diloco]`` keys it reads, under their names
    (``sync_every_h``: H, inner steps between two pushes of the same fragment; ``fragments``: P
    strided fragments of the model, 1 when the caller gives ``model_fragments``; ``alpha``; the
    ``codec`` of its pushes), and its timings: ``poll_interval_s`` (how often the background
    thread looks for new global versions), ``drain_timeout_s`` (how long leaving the context waits
    for the run's final versions; the run passes ``[diloco] timeout_s``) and
    ``heartbeat_every_s`` (write this learner's heartbeat, exchange/liveness.py, this often from a
    thread; None = the caller writes it, as the run's replica does)."""

    sync_every_h: int
    fragments: int = _DECOUPLED.fragments
    alpha: float = _DECOUPLED.alpha
    codec: CodecName = _EXCHANGE.codec
    poll_interval_s: float = 0.2
    drain_timeout_s: float = _EXCHANGE.timeout_s
    heartbeat_every_s: float | None = 1.0

    def __post_init__(self) -> None:
        h = self.sync_every_h
        if not isinstance(h, int) or isinstance(h, bool) or h < 1:
            raise ValueError(f"sync_every_h must be a positive int, got {h!r}")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {self.fragments!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        for key in ("poll_interval_s", "drain_timeout_s", "heartbeat_every_s"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key} must be > 0, got {value!r}")


class RejoinRecord(TypedDict):
    """What a learner downloaded when it bound (`DecoupledLearner.rejoin`): at its first start
    the newest global of every fragment; restarted, only the newest version of each fragment
    merged while it was down (none for a fragment still at its resume state's base)."""

    step: int  # the step it (re)started at
    from_versions: list[int] | None  # its resume state's base versions (None: no state)
    versions: list[int]  # the global versions it holds after binding
    merged_meanwhile: int | None  # versions merged past from_versions, over fragments
    objects: int  # global states it read (GETs) while binding
    bytes: int  # their tensor bytes (those it took)


class LearnerState(TypedDict):
    """A learner's own resume state (`DecoupledLearner.resume_state`)."""

    step: int
    versions: list[int]
    base: list[dict[str, torch.Tensor]]
    since_base: list[int]
    since_push: list[int]
    tokens_base: list[int | None]
    tokens_reported: bool
    step_seconds: float | None


def push_offsets(sync_every_h: int, num_fragments: int) -> list[int]:
    """The local step (mod H) at which each fragment is pushed: ``(p + 1) * H / P``, mod H."""
    return [((p + 1) * sync_every_h // num_fragments) % sync_every_h for p in range(num_fragments)]


class DecoupledLearner:
    """One Decoupled DiLoCo learner (see the module docstring).

    Args:
        store: the run's store (only this learner's pushes and progress are written).
        learner: this learner's index in ``[0, n_learners)``.
        config: its settings (`LearnerConfig`: H, the fragments, ``alpha``, the codec, timings).
        model_fragments: explicit modules instead of ``config.fragments`` strided fragments.
        start_step: the learner's inner steps so far (None: from its progress document).
        keys: this learner's signing keys (``[security] sign``): its pushes and progress are
            signed, and a global, heads or final document not signed by the synchronizer is
            refused (recorded under ``decoupled/refused/``) and never applied.
    """

    def __init__(
        self,
        store: Store,
        *,
        learner: int,
        n_learners: int,
        config: LearnerConfig,
        model: nn.Module | None = None,
        inner_optimizer: Any = None,
        model_fragments: Sequence[nn.Module] | None = None,
        start_step: int | None = None,
        keys: RunKeys | None = None,
    ) -> None:
        if not isinstance(n_learners, int) or n_learners < 1:
            raise ValueError(f"n_learners must be an int >= 1, got {n_learners!r}")
        if not isinstance(learner, int) or not 0 <= learner < n_learners:
            raise ValueError(f"learner must be in [0, n_learners={n_learners}), got {learner!r}")
        if model_fragments is not None and config.fragments != 1:
            raise ValueError("pass either model_fragments or config.fragments, not both")
        sync_every_h = config.sync_every_h
        n_frag = len(model_fragments) if model_fragments is not None else config.fragments
        if n_frag < 1 or sync_every_h % n_frag:
            raise ValueError(
                f"sync_every_h={sync_every_h} must be a multiple of the number of fragments "
                f"({n_frag}): one fragment is pushed every sync_every_h / fragments steps"
            )
        self.config = config
        self.store = store
        self.keys = keys
        self.docs = DecoupledStore(store, codec=config.codec, keys=keys)
        self.learner = learner
        self.n_learners = n_learners
        self.sync_every_h = sync_every_h
        self.num_fragments = n_frag
        self.alpha = float(config.alpha)
        self.poll_interval_s = float(config.poll_interval_s)
        self.drain_timeout_s = float(config.drain_timeout_s)
        self.heartbeat_every_s = config.heartbeat_every_s
        self.model = model
        self.inner_optimizer: torch.optim.Optimizer | None = None
        self._model_fragments = list(model_fragments) if model_fragments is not None else None
        self.offsets = push_offsets(sync_every_h, n_frag)
        if start_step is None:
            doc = self.docs.read_progress(learner)
            start_step = int(doc["step"]) if doc is not None else 0
        self.start_step = int(start_step)
        self.step = self.start_step
        self._init_state(n_frag)
        if inner_optimizer is not None:
            self.bind(optimizer=inner_optimizer)

    def _init_state(self, n_frag: int) -> None:
        """The learner's fragments, queues, threads and counters before it binds."""
        self.fragments: list[nn.Module] = []
        self._names: list[list[str]] = []
        self._params: list[list[torch.Tensor]] = []
        self._reference: list[dict[str, tuple[list[int], str]]] = []
        self.base: list[dict[str, torch.Tensor]] = []  # global weights each fragment came from
        self.versions: list[int] = []
        self._since_base = [0] * n_frag  # steps since the fragment's base was loaded
        self._tokens_base: list[int | None] = [None] * n_frag
        self._since_push = [0] * n_frag
        self._tokens_pending = 0
        self._tokens_reported = False
        self._step_s: float | None = None
        self._last_step_end: float | None = None
        self._ready: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self._bad_versions: dict[int, int] = {}
        self._queue: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self._queue_cv = threading.Condition()
        self._uploading = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._hooks: list[Any] = []
        self._entered = False
        self._bound = False
        self._state = "running"
        self.pushes = 0  # written
        self.written: list[str] = []  # the names of the pushes written, in order
        self.pushes_skipped = 0  # nothing trained since the base (a new global just arrived)
        self.pushes_replaced = 0  # a newer push of the fragment replaced it in the queue
        self.pushes_failed = 0  # store errors (retried)
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self.applied = 0
        self.history: list[RoundRecord] = []
        self._round_t0 = time.monotonic()
        self.final_versions: list[int] | None = None
        self.trained_until: float | None = None  # wall time its final pushes were written
        self.start_versions: list[int] = []  # the global versions this learner started from
        self.loaded: dict[str, str] = {}  # "<fragment>/<version>" -> sha256 of what it loaded
        self.last_push_step: int | None = None  # the step of the newest push queued
        self._restore: LearnerState | None = None  # a resume state to continue from at bind
        self.restored_from: int | None = None  # the step of the resume state it continued from
        self.rejoin: RejoinRecord | None = None  # what binding downloaded (set by bind)
        self._bind_objects = 0

    # ------------------------------------------------------------------ binding
    @property
    def bound(self) -> bool:
        return self._bound

    def bind(self, *, model: nn.Module | None = None, optimizer: Any = None) -> DecoupledLearner:
        """Attach to the optimizer (and model): fragments, the run manifest, version 0 of every
        fragment (put-if-absent: the first learner's weights), then the newest globals."""
        if self._bound:
            return self
        from composer_replication.diloco.outer_loop import unwrap_optimizer

        if optimizer is None:
            raise ValueError(
                "the learner needs the inner optimizer: pass inner_optimizer= or "
                "use learner.callback() with a Hugging Face trainer"
            )
        self.inner_optimizer = unwrap_optimizer(optimizer)
        if model is not None and self.model is None:
            self.model = model
        if self._model_fragments is not None:
            fragments = self._model_fragments
        elif self.num_fragments > 1:
            if self.model is None:
                raise ValueError("num_fragments > 1 needs model= (blocks are assigned by index)")
            fragments = strided_fragments(self.model, self.num_fragments)
        elif self.model is not None:
            fragments = [whole_model_fragment(self.model)]
        else:
            params = [p for g in self.inner_optimizer.param_groups for p in g["params"]]
            fragments = [whole_model_fragment(params)]
        self.fragments = list(fragments)
        embedding_ids = {
            id(m.weight)
            for m in (self.model.modules() if self.model is not None else [])
            if isinstance(m, nn.Embedding)
        }
        mean_only: list[list[str]] = []
        for frag in self.fragments:
            named = list(frag.named_parameters())
            self._names.append([n for n, _ in named])
            self._params.append([p for _, p in named])
            mean_only.append([n for n, p in named if id(p) in embedding_ids])
        snapshot = [self._local(i) for i in range(self.num_fragments)]
        manifest = fragment_manifest(
            snapshot, n_learners=self.n_learners, codec=self.docs.codec, mean_only=mean_only
        )
        manifest = self.docs.ensure_manifest(manifest)
        self._reference = [DecoupledStore.reference(manifest, i) for i in range(self.num_fragments)]
        # One LIST per fragment; version 0 (put-if-absent: the first learner's weights) is
        # written only when the fragment has no version yet, so a rejoining learner uploads
        # nothing here.
        stored = []
        for i, tensors in enumerate(snapshot):
            listed = self.docs.versions(i, "global")
            if not listed:
                self.docs.publish_global(i, 0, tensors)
                listed = [0]
            stored.append(listed)
        self.base = []
        self.versions = []
        self._bind_objects, nbytes = 0, self.bytes_downloaded
        from_versions: list[int] | None = None
        if self._restore is not None:
            self._apply_restore(self._restore)
            self._restore = None
            from_versions = list(self.versions)
            # Globals merged while this learner was down replace its fragments now, as they
            # would have between two steps had it kept running: a resumed learner never starts
            # behind the globals announced when it stopped. Only the newest version of each
            # fragment is downloaded, and nothing for a fragment still at its base.
            for i in range(self.num_fragments):
                newer = self._newest_global(i, stored[i], above=self.versions[i])
                if newer is not None:
                    self._take_global(i, *newer)
        else:
            for i in range(self.num_fragments):
                got = self._newest_global(i, stored[i], above=-1)
                if got is None:
                    raise CorruptContributionError(
                        f"fragment {i}: no readable global version in the store"
                    )
                v, tensors = got
                self.base.append(tensors)
                self.versions.append(v)
                self._load_fragment(i, tensors, alpha=0.0)
        self.start_versions = list(self.versions)
        self.rejoin = RejoinRecord(
            step=int(self.step),
            from_versions=from_versions,
            versions=list(self.versions),
            merged_meanwhile=None
            if from_versions is None
            else sum(max(0, v - b) for v, b in zip(self.versions, from_versions)),
            objects=self._bind_objects,
            bytes=self.bytes_downloaded - nbytes,
        )
        self._bound = True
        log.info(
            "learner %d: starts at step %d from global versions %s",
            self.learner,
            self.step,
            self.versions,
        )
        return self

    # ------------------------------------------------------------------ exact resume
    def resume_state(self) -> LearnerState:
        """The learner's own state (see the module docstring), between two inner steps; the
        base tensors are shared, not copied (they are replaced, never modified)."""
        self._require_bound()
        return {
            "step": int(self.step),
            "versions": [int(v) for v in self.versions],
            "base": [dict(b) for b in self.base],
            "since_base": [int(n) for n in self._since_base],
            "since_push": [int(n) for n in self._since_push],
            "tokens_base": [None if t is None else int(t) for t in self._tokens_base],
            "tokens_reported": bool(self._tokens_reported),
            "step_seconds": None if self._step_s is None else float(self._step_s),
        }

    def restore(self, state: object) -> None:
        """Continue from `resume_state`'s output (before binding): the step now, the rest when
        binding (the base tensors are checked against the run's manifest then). ValueError
        naming what does not fit this learner."""
        if self._bound:
            raise RuntimeError("restore() must come before the learner binds")
        if not isinstance(state, dict):
            raise ValueError("learner resume state: not a dict")
        n = self.num_fragments
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"learner resume state: step {step!r} is not an int >= 0")
        for key in ("versions", "base", "since_base", "since_push", "tokens_base"):
            value = state.get(key)
            if not isinstance(value, list) or len(value) != n:
                raise ValueError(f"learner resume state: {key} is not a list of {n} fragments")
        for key in ("versions", "since_base", "since_push"):
            if not all(isinstance(x, int) and x >= 0 for x in state[key]):
                raise ValueError(f"learner resume state: {key} must hold ints >= 0")
        if not all(x is None or (isinstance(x, int) and x >= 0) for x in state["tokens_base"]):
            raise ValueError("learner resume state: tokens_base must hold ints >= 0 or None")
        if not all(isinstance(b, dict) for b in state["base"]):
            raise ValueError("learner resume state: base must hold one dict per fragment")
        step_s = state.get("step_seconds")
        self._restore = LearnerState(
            step=step,
            versions=list(state["versions"]),
            base=list(state["base"]),
            since_base=list(state["since_base"]),
            since_push=list(state["since_push"]),
            tokens_base=list(state["tokens_base"]),
            tokens_reported=bool(state.get("tokens_reported")),
            step_seconds=float(step_s) if isinstance(step_s, int | float) else None,
        )
        self.start_step = self.step = step

    def _apply_restore(self, state: LearnerState) -> None:
        """Bind-time half of `restore`: the base tensors must match the run's fragments."""
        for i, base in enumerate(state["base"]):
            reference = self._reference[i]
            if set(base) != set(reference):
                raise ValueError(
                    f"learner resume state: fragment {i}'s base tensors are not the run's"
                )
            for name, (shape, _) in reference.items():
                t = base[name]
                if not isinstance(t, torch.Tensor) or list(t.shape) != list(shape):
                    raise ValueError(
                        f"learner resume state: fragment {i} tensor {name} has the wrong shape"
                    )
        self.base = [{n: t.to("cpu", torch.float32) for n, t in b.items()} for b in state["base"]]
        self.versions = list(state["versions"])
        for i, v in enumerate(self.versions):
            self.loaded.setdefault(f"{i}/{v}", tensors_digest(self.base[i]))
        self._since_base = list(state["since_base"])
        self._since_push = list(state["since_push"])
        self._tokens_base = list(state["tokens_base"])
        self._tokens_reported = state["tokens_reported"]
        self._step_s = state["step_seconds"]
        self.restored_from = self.step

    def _local(self, i: int) -> dict[str, torch.Tensor]:
        """Fragment i's current weights as float32 CPU copies."""
        return {
            n: p.detach().to("cpu", torch.float32).clone()
            for n, p in zip(self._names[i], self._params[i])
        }

    def _newest_global(
        self, i: int, stored: Sequence[int], *, above: int
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest readable global version of fragment i among ``stored`` (its listed
        versions) newer than ``above``, or None: only that one is downloaded (an older one
        only when a newer is corrupt or gone), counted in `bytes_downloaded`."""
        for v in sorted((v for v in stored if v > above), reverse=True):
            self._bind_objects += 1
            try:
                tensors = self.docs.fetch_global(i, v, self._reference[i])
            except CorruptContributionError as e:
                log.warning("learner %d: %s; trying an older version", self.learner, e)
                continue
            if tensors is not None:
                self.bytes_downloaded += sum(t.numel() * t.element_size() for t in tensors.values())
                self.loaded[f"{i}/{v}"] = tensors_digest(tensors)
                return v, tensors
        return None

    def _load_fragment(self, i: int, tensors: dict[str, torch.Tensor], *, alpha: float) -> None:
        with torch.no_grad():
            for name, p in zip(self._names[i], self._params[i]):
                g = tensors[name].to(device=p.device, dtype=p.dtype)
                if alpha == 0.0:
                    p.copy_(g)
                else:
                    p.copy_(torch.lerp(g, p.detach(), alpha))

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> DecoupledLearner:
        if self._entered:
            return self
        self.bind(optimizer=self.inner_optimizer)
        assert self.inner_optimizer is not None
        self._hooks = [self.inner_optimizer.register_step_post_hook(self._after_step)]
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._upload_loop, name="learner-upload", daemon=True),
            threading.Thread(target=self._fetch_loop, name="learner-fetch", daemon=True),
        ]
        if self.heartbeat_every_s is not None:
            self._threads.append(
                threading.Thread(target=self._heartbeat_loop, name="learner-heartbeat", daemon=True)
            )
        for t in self._threads:
            t.start()
        self._last_step_end = time.monotonic()
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
        self._entered = False
        try:
            if exc_type is None:
                self.finish()
            else:
                self._state = "failed"
        finally:
            self.close()
        return False

    def close(self) -> None:
        """Stop the background threads (queued pushes that were not written are lost)."""
        self._stop.set()
        with self._queue_cv:
            self._queue_cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []
        if self.heartbeat_every_s is not None:
            self._beat()

    # ------------------------------------------------------------------ per step
    def record_tokens(self, n: int) -> None:
        """Add ``n`` trained tokens to the step in progress (the token weighting's input)."""
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        self._tokens_pending += int(n)
        self._tokens_reported = True

    def _after_step(self, *_: object) -> None:
        now = time.monotonic()
        if self._last_step_end is not None:
            dt = now - self._last_step_end
            self._step_s = dt if self._step_s is None else 0.8 * self._step_s + 0.2 * dt
        self.step += 1
        tokens, self._tokens_pending = self._tokens_pending, 0
        for i in range(self.num_fragments):
            self._since_base[i] += 1
            self._since_push[i] += 1
            if self._tokens_reported:
                self._tokens_base[i] = (self._tokens_base[i] or 0) + tokens
        self.apply_ready()
        local = self.step % self.sync_every_h
        for i, offset in enumerate(self.offsets):
            if local == offset:
                self.push(i)
        self._last_step_end = time.monotonic()

    def push(self, i: int, *, final: bool = False) -> None:
        """Queue fragment i's pseudo-gradient (``base - local``) for upload (non-blocking).

        Nothing is pushed when the fragment has not trained since its base was loaded (a new
        global just overwrote it): the steps since the last push then count towards the next.
        """
        if self._since_base[i] == 0:
            self.pushes_skipped += 1
            return
        with torch.no_grad():
            delta = {
                n: self.base[i][n] - p.detach().to("cpu", torch.float32)
                for n, p in zip(self._names[i], self._params[i])
            }
        fields = {
            "fragment": i,
            "base": self.versions[i],
            "learner": self.learner,
            "steps": self._since_base[i],
            "tokens": self._tokens_base[i],
            "steps_since_push": self._since_push[i],
            "step_seconds": self._step_s or 0.0,
            "learner_step": self.step,
            "final": final,
        }
        self._since_push[i] = 0
        self.last_push_step = self.step
        with self._queue_cv:
            replaced = self._queue.get(i)
            if replaced is not None:
                self.pushes_replaced += 1
                if replaced[1]["base"] == fields["base"]:  # the newer push covers its work
                    fields["steps_since_push"] += replaced[1]["steps_since_push"]
                # (from an older base its work is not in the newer push: it is lost)
            self._queue[i] = (delta, fields)
            self._queue_cv.notify_all()

    def _take_global(self, i: int, v: int, tensors: dict[str, torch.Tensor]) -> None:
        """Fragment i becomes global version v (mixed in by alpha)."""
        self._load_fragment(i, tensors, alpha=self.alpha)
        self.base[i] = tensors
        self.versions[i] = v
        self._since_base[i] = 0
        # The steps since the last push were trained on the fragment just replaced: their
        # work is gone (alpha = 0) or only partly kept (alpha > 0, not counted), so they do
        # not count towards the next push's `steps_since_push`.
        self._since_push[i] = 0
        self._tokens_base[i] = 0 if self._tokens_reported else None
        self.applied += 1

    def apply_ready(self) -> None:
        """Take every new global fragment the fetcher has downloaded (between inner steps)."""
        with self._lock:
            ready, self._ready = self._ready, {}
        before = min(self.versions) if self.versions else 0
        for i, (v, tensors) in sorted(ready.items()):
            if v > self.versions[i]:
                self._take_global(i, v, tensors)
        after = min(self.versions) if self.versions else 0
        if after > before:
            now = time.monotonic()
            for r in range(before + 1, after + 1):
                record = round_record(r, committed=True)
                record["seconds"] = now - self._round_t0
                record["participants"] = self.n_learners
                record["bytes_uploaded"] = self.bytes_uploaded
                record["bytes_downloaded"] = self.bytes_downloaded
                self.history.append(record)
            self._round_t0 = now

    # ------------------------------------------------------------------ background threads
    def _upload_loop(self) -> None:
        while True:
            with self._queue_cv:
                while not self._queue and not self._stop.is_set():
                    self._queue_cv.wait(0.5)
                if not self._queue:
                    return
                i = min(self._queue)
                delta, fields = self._queue.pop(i)
                self._uploading += 1
            try:
                self._write_push(i, delta, fields)
            finally:
                with self._queue_cv:
                    self._uploading -= 1
                    self._queue_cv.notify_all()

    def _write_push(self, i: int, delta: dict[str, torch.Tensor], fields: dict[str, Any]) -> None:
        backoff = 0.1
        while True:
            try:
                pid, nbytes = self.docs.push(delta, seq=0, **fields)
                break
            except OSError as e:  # transient store error: retry (a newer push may replace it)
                self.pushes_failed += 1
                log.warning("learner %d: push of fragment %d failed: %r", self.learner, i, e)
                with self._queue_cv:
                    if i in self._queue:  # superseded while we retried
                        newer = self._queue[i][1]
                        if newer["base"] == fields["base"]:  # its work includes ours
                            newer["steps_since_push"] += fields["steps_since_push"]
                        self.pushes_replaced += 1
                        return
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, 5.0)
        self.pushes += 1
        self.written.append(pid.name)
        self.bytes_uploaded += nbytes
        try:
            self.docs.write_progress(
                self.learner, step=int(fields["learner_step"]), done=False, last_push=pid.name
            )
        except OSError as e:
            log.warning("learner %d: progress document not written: %r", self.learner, e)

    def _fetch_loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.fetch_new_globals()
            except OSError as e:
                log.warning("learner %d: polling for new globals failed: %r", self.learner, e)

    def fetch_new_globals(self, heads: list[int] | None = None) -> int:
        """Download every fragment version newer than what this learner holds or has ready
        (``heads`` None: read heads.json). Returns how many were downloaded."""
        heads = self.docs.read_heads(self.num_fragments) if heads is None else heads
        if heads is None:
            return 0
        got = 0
        for i, v in enumerate(heads):
            with self._lock:
                have = max(self.versions[i], self._ready.get(i, (-1, {}))[0])
            if v <= have or self._bad_versions.get(i) == v:
                continue
            try:
                tensors = self.docs.fetch_global(i, v, self._reference[i])
            except CorruptContributionError as e:
                log.warning("learner %d: %s; waiting for the next version", self.learner, e)
                self._bad_versions[i] = v
                continue
            if tensors is None:  # announced but gone (pruned): the next poll sees a newer head
                continue
            self.bytes_downloaded += sum(t.numel() * t.element_size() for t in tensors.values())
            digest = tensors_digest(tensors)
            with self._lock:
                self._ready[i] = (v, tensors)
                self.loaded[f"{i}/{v}"] = digest
            got += 1
        return got

    def _beat(self) -> None:
        try:
            write_heartbeat(
                self.store,
                LEARNER_ROLE,
                self.learner,
                state=self._state,
                step=self.step,
                versions=list(self.versions),
                pushes=self.pushes,
                applied=self.applied,
                step_s=self._step_s,
            )
        except (OSError, ValueError) as e:
            log.warning("learner %d: heartbeat failed: %r", self.learner, e)

    def _heartbeat_loop(self) -> None:
        every = self.heartbeat_every_s or 1.0
        while True:
            self._beat()
            if self._stop.wait(every):
                return

    # ------------------------------------------------------------------ the end
    def wait_for_uploads(self, timeout_s: float) -> bool:
        """Block until every queued push is written (True) or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        with self._queue_cv:
            while self._queue or self._uploading:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue_cv.wait(min(left, 0.5))
        return True

    def finish(self) -> None:
        """Final pushes, "done", then wait for the run's final versions and hold them."""
        self.apply_ready()
        for i in range(self.num_fragments):
            if self._since_push[i] > 0:
                self.push(i, final=True)  # (skipped if nothing trained since its base)
        if not self.wait_for_uploads(self.drain_timeout_s):
            log.warning(
                "learner %d: final pushes not written within %.0fs",
                self.learner,
                self.drain_timeout_s,
            )
        self.docs.write_progress(self.learner, step=self.step, done=True)
        self.trained_until = time.time()
        self._state = "done"
        if self.heartbeat_every_s is not None:
            self._beat()
        deadline = time.monotonic() + self.drain_timeout_s
        final = None
        while time.monotonic() < deadline:
            final = self.docs.read_final(self.num_fragments)
            if final is not None and final["learners"].get(self.learner, -1) >= self.step:
                break
            final = None
            time.sleep(self.poll_interval_s)
        if final is None:
            log.warning(
                "learner %d: no final versions within drain_timeout_s=%.0f; keeping the "
                "newest globals",
                self.learner,
                self.drain_timeout_s,
            )
            heads = self.docs.read_heads(self.num_fragments)
        else:
            heads = list(final["versions"])
        if heads is not None:
            self.fetch_new_globals(heads)
            self.apply_ready()
        if final is not None and self.versions != heads:
            raise CorruptContributionError(
                f"learner {self.learner}: cannot read the final versions {heads} "
                f"(holding {self.versions})"
            )
        self.final_versions = list(self.versions) if final is not None else None

    # ------------------------------------------------------------------ outer-loop surface
    def callback(self) -> Any:
        """A Hugging Face `TrainerCallback` that runs this learner inside ``trainer.train()``."""
        from composer_replication.diloco.callback import DiLoCoCallback

        return DiLoCoCallback(self)

    @property
    def round(self) -> int:
        """The lowest global version over fragments (full rounds merged so far)."""
        return min(self.versions) if self.versions else 0

    @property
    def local_step(self) -> int:
        return self.step % self.sync_every_h

    def load_global_weights(self) -> None:
        """Copy the global fragments this learner holds into the model."""
        self._require_bound()
        for i in range(self.num_fragments):
            self._load_fragment(i, self.base[i], alpha=0.0)

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global weights this learner holds (copies), keyed ``f<fragment>.<name>``."""
        self._require_bound()
        return {f"f{i}.{n}": t.clone() for i, b in enumerate(self.base) for n, t in b.items()}

    def outer_optimizer_state(self) -> dict[str, dict[str, object]]:
        """The synchronizer owns the outer momentum (in the store); a checkpoint records the
        global version of every fragment it holds."""
        return {f"fragment_{i}": {"version": v} for i, v in enumerate(self.versions)}

    def _require_bound(self) -> None:
        if not self._bound:
            raise RuntimeError("the learner is not bound to an optimizer yet")
