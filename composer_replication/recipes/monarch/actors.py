"""The Monarch actors of the recipe: one composer-replication run as actors on a process mesh.

Every actor is built from the run configuration (``config_doc``: the `RunConfig` as the plain
dict `config.to_dict` makes; validated again by `from_dict` in each actor's process):

- `GeneratorActor` (one per process): a copy of the policy that samples the rollouts. Each call
  carries the trainer's current weights (its ``state_dict``, sent only when they changed since
  the generator's last call), so rollouts are on-policy. It applies the tokenizer's chat
  template, samples with the trainer's ``GenerationConfig``, cuts each completion after its
  first EOS (kept, as TRL does) and returns the sampled tokens' log-probs.
- `RewarderActor` (one per process): the task's verifier; returns ``(reward, feedback)`` per
  completion, the feedback feeding channel 2's hints.
- `TeacherPoolActor` (one for the mesh): the run's channel-3 teachers (`[[teachers.endpoints]]`,
  else the task oracle) behind one `TeacherPool` with the task's verifier, asked lazily; every
  trainer shares its traces, so each teacher answers each prompt once for the whole run.
- `TrainerActor` (one per process, rank = the process's rank = the DiLoCo replica): the
  `ComposerReplicationTrainer` (all three loss channels) with TRL's generation replaced by
  its co-located generator (``rollout_func``), its reward by its co-located rewarder and its
  teacher pool by the shared one, and the DiLoCo outer loop synchronising the replicas through
  the object store (`ObjectStoreManager` over `ObjectStoreAllReduce`, `store_uri`).

`TrainerActor.train` runs the whole training and returns, per committed outer round, the sha256
of the global weights (`global_digest`) and the mean reward of that round's rollouts; the
driver (`recipes/monarch/train.py`) checks that every replica holds the same global weights
after every round.

Failure behaviour: an error inside an actor reaches the caller as Monarch's ``ActorError``
carrying the remote traceback; a dead process is a Monarch supervision event, which fails the
pending calls to its actors (the driver then stops the mesh). A replica that is alive but does
not contribute makes its peers' round time out after ``diloco.timeout_s`` (the object store's
rule), as in any composer-replication run.
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypedDict, TypeVar

try:
    from monarch.actor import Actor, current_rank, endpoint
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the Monarch recipe needs torchmonarch: pip install composer-replication[monarch]"
    ) from exc

from composer_replication.data.turns import stop_token_ids
from composer_replication.json_types import JSONDict, JSONValue

if TYPE_CHECKING:
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerBase,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from trl import GRPOTrainer

    from composer_replication.config import RunConfig
    from composer_replication.data.traces import Prompt, TraceJson, TraceRecord, TraceStore
    from composer_replication.diloco.outer_loop import DiLoCoOuterLoop
    from composer_replication.tasks.task import TokenDecoder

_P = ParamSpec("_P")
_R_co = TypeVar("_R_co", covariant=True)
_H_co = TypeVar("_H_co", covariant=True)


# What this module calls on Monarch's handles (torchmonarch ships no type information): an
# endpoint's ``call_one(...)`` returns a future whose ``get()`` is the endpoint's return value.
class _Future(Protocol[_R_co]):
    def get(self) -> _R_co: ...


class _Endpoint(Protocol, Generic[_P, _R_co]):
    def call_one(self, *args: _P.args, **kwargs: _P.kwargs) -> _Future[_R_co]: ...


class _Mesh(Protocol[_H_co]):
    """An actor mesh with one actor per process; ``slice(procs=rank)`` is that rank's."""

    def slice(self, *, procs: int) -> _H_co: ...


class _GeneratorHandle(Protocol):
    """A `GeneratorActor`'s handle."""

    generate: _Endpoint[
        [Sequence[Prompt], dict[str, torch.Tensor] | None, int, GenerationConfig],
        dict[str, list[list[int]] | list[list[float]]],
    ]


class _RewarderHandle(Protocol):
    """A `RewarderActor`'s handle."""

    name: _Endpoint[[], str]
    score: _Endpoint[
        [list[Prompt], list[object], dict[str, list[object]]],
        list[tuple[float | None, str | None]],
    ]


class _TeacherPoolHandle(Protocol):
    """The `TeacherPoolActor`'s handle."""

    teachers: _Endpoint[[], list[str]]
    traces: _Endpoint[[list[Prompt]], list[TraceJson]]


__all__ = [
    "GeneratorActor",
    "ReplicaResult",
    "RewarderActor",
    "RoundRecord",
    "TeacherPoolActor",
    "TrainerActor",
    "check_supported",
    "global_digest",
]


class RoundRecord(TypedDict):
    """One committed outer round as a trainer saw it (`TrainerActor.train`'s ``rounds``)."""

    round: int
    step: int
    global_sha256: str
    reward_mean: float | None
    rollouts: int


class ReplicaResult(TypedDict):
    """What `TrainerActor.train` returns for one replica."""

    rank: int
    rounds: list[RoundRecord]
    final_sha256: str
    channels: dict[str, float]


# The dataset columns the task's reward function reads (tasks/task.py `Task.reward_func`); only
# these cross to the rewarder (TRL also passes callables and trainer state, which stay here).
REWARD_COLUMNS = ("example_id", "answer", "task_meta")
# What `TrainerActor.train` reports of the channels (the trainer's metrics, docs/trainer.md).
CHANNEL_METRICS = ("sdpo/active", "sdpo/gate_open", "replay/active", "replay/trace_coverage")


def check_supported(config: RunConfig) -> None:
    """ValueError naming every setting of ``config`` this recipe does not run (docs/recipes/
    monarch.md, "Limits"); the message says what to set instead."""
    bad = []
    d = config.diloco
    if d.mode != "sync":
        bad.append(f"diloco.mode = {d.mode!r} (the recipe runs synchronous DiLoCo: set 'sync')")
    if d.manager != "object_store":
        bad.append(f"diloco.manager = {d.manager!r} (set 'object_store')")
    if d.exchange.screen != "none":
        bad.append(
            f"diloco.screen = {d.exchange.screen!r} (set 'none'; use `composer-replication train`)"
        )
    if config.security.sign:
        bad.append("security.sign = true (set false; use `composer-replication train`)")
    if config.chaos.events:
        bad.append("[[chaos.events]] (remove them; use `composer-replication train`)")
    if config.backend.n_replicas < 1:
        bad.append(f"backend.n_replicas = {config.backend.n_replicas} (must be >= 1)")
    if bad:
        raise ValueError("the Monarch recipe does not support: " + "; ".join(bad))


def _config(config_doc: Mapping[str, JSONValue]) -> RunConfig:
    from composer_replication.config import RunConfig, from_dict

    config = from_dict(RunConfig, config_doc)
    if config.train.torch_threads > 0:
        import torch

        torch.set_num_threads(config.train.torch_threads)
    return config


def _rank() -> int:
    return int(current_rank().rank)


def global_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over named tensors in key order (names, dtypes, shapes and bytes): equal digests
    mean bit-identical weights."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class GeneratorActor(Actor):
    """Samples rollouts from a copy of the policy (see the module docstring)."""

    def __init__(self, config_doc: Mapping[str, JSONValue]) -> None:
        import torch

        from composer_replication.assembly.build import build_model

        config = _config(config_doc)
        self.rank = _rank()
        model, self.tokenizer = build_model(config)
        # a causal LM: its generate() comes from GenerationMixin, which PreTrainedModel's type
        # does not carry
        self.model: Any = model
        self.model.eval()
        self.version: int | None = None
        self._rng = torch.Generator().manual_seed(config.run.seed + 1000 * self.rank + 1)

    @endpoint
    def generate(
        self,
        prompts: list[Prompt],
        weights: dict[str, torch.Tensor] | None,
        version: int,
        generation_config: GenerationConfig,
    ) -> dict[str, list[list[int]] | list[list[float]]]:
        """One completion per prompt (prompts arrive repeated ``num_generations`` times, as TRL
        hands them out): ``prompt_ids``, ``completion_ids``, ``logprobs`` (sampled tokens)."""
        import torch

        if weights is not None:
            self.model.load_state_dict(weights)
            self.version = version
        elif version != self.version:
            raise ValueError(
                f"generator {self.rank} holds weights version {self.version}, asked for "
                f"{version} without weights: send the state_dict when it changes"
            )
        tok = self.tokenizer
        prompt_ids = [_chat_ids(tok, p) for p in prompts]
        width = max(len(ids) for ids in prompt_ids)
        pad = tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
        config = copy.deepcopy(generation_config)
        config.return_dict_in_generate, config.output_scores = True, True
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self._rng))
        # Sampling draws from torch's global generator, which the trainer on this process uses
        # too: fork it and seed the fork from this actor's own stream, so the rollouts are
        # reproducible per rank and the trainer's random state is left as it was.
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids, attention_mask=mask, generation_config=config
            )
            scores = self.model.compute_transition_scores(
                out.sequences, out.scores, normalize_logits=True
            )
        completions = out.sequences[:, width:]
        eos = _eos_ids(tok, generation_config)
        completion_ids, logprobs = [], []
        for row, row_lp in zip(completions.tolist(), scores.tolist()):
            end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            completion_ids.append(row[:end])
            logprobs.append([float(x) for x in row_lp[:end]])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def _chat_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of a prompt as the policy sees it: chat messages through the chat template
    (with the generation prompt), plain text as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _eos_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig) -> set[int]:
    """Where a rollout ends: the generation config's EOS ids, the tokenizer's EOS and the chat
    template's end of turn (data/turns.py), as the trainer and evaluation cut."""
    return set(stop_token_ids(tokenizer, getattr(generation_config, "eos_token_id", None)))


class RewarderActor(Actor):
    """The task's verifier as an actor (see the module docstring)."""

    def __init__(self, config_doc: Mapping[str, JSONValue]) -> None:
        from composer_replication.assembly.build import build_task

        self.task = build_task(_config(config_doc))
        self._reward = self.task.reward_func()

    @endpoint
    def name(self) -> str:
        return str(self._reward.__name__)

    @endpoint
    def score(
        self, prompts: list[Prompt], completions: list[object], columns: dict[str, list[object]]
    ) -> list[tuple[float | None, str | None]]:
        """``(reward, feedback)`` per completion; ``columns``: the `REWARD_COLUMNS` rows."""
        unknown = sorted(set(columns) - set(REWARD_COLUMNS))
        if unknown:
            raise ValueError(f"rewarder: unknown columns {unknown}; known: {list(REWARD_COLUMNS)}")
        out = self._reward(prompts=prompts, completions=completions, **columns)
        return [(None if r is None else float(r), fb) for r, fb in out]


class TeacherPoolActor(Actor):
    """The run's channel-3 teachers, shared by every trainer (see the module docstring)."""

    def __init__(self, config_doc: Mapping[str, JSONValue]) -> None:
        from composer_replication.assembly.build import build_task, teacher_pool

        config = _config(config_doc)
        task = build_task(config)
        # The baked traces of teachers.traces_path are loaded by each trainer itself; this pool
        # only answers prompts those lack.
        self.store, self.pool = teacher_pool(config, task)

    @endpoint
    def teachers(self) -> list[str]:
        """The teachers' names ([] when the run has none: channel 3 uses baked traces only)."""
        return [] if self.pool is None else [t.name for t in self.pool.teachers]

    @endpoint
    def stats(self) -> JSONDict:
        """The pool's statistics (`PoolStats.as_dict`) and ``prompts``: the prompts it holds
        traces for."""
        if self.pool is None:
            return {"prompts": 0}
        return {**self.pool.stats.as_dict(), "prompts": len(self.store.prompt_keys)}

    @endpoint
    def traces(self, prompts: list[Prompt]) -> list[TraceJson]:
        """Every trace for ``prompts`` (JSON records), asking the teachers for those not yet
        answered; each teacher answers each prompt once for the whole mesh."""
        from composer_replication.data.traces import prompt_key

        if self.pool is None:
            return []
        self.pool.ensure(prompts)
        keys = dict.fromkeys(prompt_key(p) for p in prompts)
        return [r.to_json() for k in keys for r in self.store.traces(k)]


class _RemoteReward:
    """The trainer's reward function: its co-located `RewarderActor` (one call per batch)."""

    def __init__(
        self,
        rewarder: _RewarderHandle,
        name: str,
        tokenizer: TokenDecoder | None = None,
        stop_ids: Sequence[int] = (),
    ) -> None:
        self.rewarder = rewarder
        self.__name__ = name
        self.tokenizer = tokenizer
        self.stop_ids = list(stop_ids)
        self.rewards: list[float] = []  # every scored rollout since the last `pop`

    def __call__(
        self, prompts: Sequence[Prompt], completions: Sequence[object], **columns: Any
    ) -> list[tuple[float | None, str | None]]:
        from composer_replication.tasks.task import decode_completion

        ids = columns.get("completion_ids")
        if self.tokenizer is not None and ids is not None:
            # the text evaluation judges (end markers kept), not TRL's decode without them
            completions = [decode_completion(self.tokenizer, row, self.stop_ids) for row in ids]
        rows = {k: list(columns[k]) for k in REWARD_COLUMNS if k in columns}
        out = self.rewarder.score.call_one(list(prompts), list(completions), rows).get()
        if not columns.get("teacher_probe"):  # the trainer scoring channel 2's teacher
            self.rewards.extend(r for r, _ in out if r is not None)
        return [(r, fb) for r, fb in out]

    def pop(self) -> list[float]:
        rewards, self.rewards = self.rewards, []
        return rewards


class _RemoteTeacherPool:
    """What the trainer needs of a `TeacherPool` (``store``, ``ensure``), served by the shared
    `TeacherPoolActor`; records are validated (`TraceRecord.from_json`) before use."""

    def __init__(self, actor: _TeacherPoolHandle, store: TraceStore) -> None:
        self.actor = actor
        self.store = store

    def ensure(self, prompts: Sequence[Prompt]) -> list[TraceRecord]:
        from composer_replication.data.traces import TraceRecord, prompt_key

        missing = [p for p in prompts if prompt_key(p) not in self.store]
        if not missing:
            return []
        new = []
        for i, obj in enumerate(self.actor.traces.call_one(missing).get()):
            record = TraceRecord.from_json(obj, where=f"teacher pool record {i}")
            if self.store.add(record):
                new.append(record)
        return new


class _Rollouts:
    """TRL's ``rollout_func``: the trainer's prompts to its co-located `GeneratorActor`, with
    the policy's weights whenever they changed since the last call."""

    def __init__(self, generator: _GeneratorHandle) -> None:
        self.generator = generator
        self.sent_step: int | None = None

    def __call__(
        self, prompts: Sequence[Prompt], trainer: GRPOTrainer
    ) -> dict[str, list[list[int]] | list[list[float]]]:
        step = int(trainer.state.global_step)
        weights = None
        if step != self.sent_step:
            model = trainer.accelerator.unwrap_model(trainer.model)
            weights = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
        out = self.generator.generate.call_one(
            prompts, weights, step, trainer.generation_config
        ).get()
        self.sent_step = step
        return dict(out)


class _RoundRecorder:
    """A `TrainerCallback` (built lazily: transformers is imported inside the actor) recording,
    after each committed outer round, the global weights' digest and the round's mean reward."""

    def __init__(self, outer: DiLoCoOuterLoop, reward: _RemoteReward) -> None:
        self.outer = outer
        self.reward = reward
        self.rounds: list[RoundRecord] = []

    def record(self, step: int) -> None:
        r = self.outer.round
        if r > (self.rounds[-1]["round"] if self.rounds else 0):
            rewards = self.reward.pop()
            self.rounds.append(
                {
                    "round": r,
                    "step": step,
                    "global_sha256": global_digest(self.outer.global_parameters()),
                    "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                    "rollouts": len(rewards),
                }
            )


def _callback(recorder: _RoundRecorder) -> TrainerCallback:
    from transformers import TrainerCallback

    class RoundCallback(TrainerCallback):
        def on_step_end(
            self,
            args: TrainingArguments,
            state: TrainerState,
            control: TrainerControl,
            **kwargs: object,
        ) -> None:
            recorder.record(int(state.global_step))

    return RoundCallback()


def _channel_means(log_history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each `CHANNEL_METRICS` key over the trainer's log records that have it."""
    out = {}
    for key in CHANNEL_METRICS:
        values = [float(r[key]) for r in log_history if key in r]
        if values:
            out[key] = sum(values) / len(values)
    return out


class TrainerActor(Actor):
    """One DiLoCo replica: `ComposerReplicationTrainer` + the outer loop (see the module
    docstring). ``generators`` / ``rewarders``: meshes with one actor per process (this
    trainer uses the one on its own process); ``teacher_pool``: the shared `TeacherPoolActor`."""

    def __init__(
        self,
        config_doc: Mapping[str, JSONValue],
        store_uri: str,
        generators: _Mesh[_GeneratorHandle],
        rewarders: _Mesh[_RewarderHandle],
        teacher_pool: _TeacherPoolHandle,
    ) -> None:
        self.config_doc = dict(config_doc)
        self.store_uri = store_uri
        self.rank = _rank()
        self.generator = generators.slice(procs=self.rank)
        self.rewarder = rewarders.slice(procs=self.rank)
        self.teacher_pool = teacher_pool

    @endpoint
    def train(self) -> ReplicaResult:
        """Train this replica for ``train.max_steps`` inner steps; returns ``{"rank", "rounds":
        [{"round", "step", "global_sha256", "reward_mean", "rollouts"}], "final_sha256",
        "channels"}`` (``channels``: the run's mean of each `CHANNEL_METRICS` the trainer
        logged)."""
        from transformers import set_seed
        from transformers.trainer_callback import PrinterCallback

        from composer_replication.assembly.build import (
            build_model,
            build_task,
            composer_kwargs,
            hint_template,
            train_split,
            trainer_args,
        )
        from composer_replication.data.traces import TraceStore
        from composer_replication.diloco import make_diloco_outer_loop
        from composer_replication.exchange import ObjectStoreAllReduce, ObjectStoreManager
        from composer_replication.trainer import ComposerReplicationTrainer

        config = _config(self.config_doc)
        check_supported(config)
        # TRL marks rollout_func experimental and says so on every trainer; once is in the docs.
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        rank, n, d = self.rank, config.backend.n_replicas, config.diloco
        seed = config.run.seed + 1000 * rank
        set_seed(seed)
        task = build_task(config)
        model, tok = build_model(config)
        allreduce = ObjectStoreAllReduce(
            self.store_uri,
            world_size=n,
            rank=rank,
            config=d.exchange.allreduce_config(  # min_replicas: all replicas but one by default
                n,
                keep_rounds=config.store.keep_rounds,
                policy=d.exchange.aggregate_policy(max_inner_steps=d.sync_every_h),
            ),
            # default: all replicas but one
            storage_options=config.store.storage_options or None,
        )
        manager = ObjectStoreManager(allreduce=allreduce)
        try:
            outer = make_diloco_outer_loop(
                None,
                manager,
                d.sync_every_h,
                model=model,
                outer=d.outer.build_outer_optimizer(),
            )
            stops = stop_token_ids(tok, model.generation_config.eos_token_id)
            reward = _RemoteReward(self.rewarder, self.rewarder.name.call_one().get(), tok, stops)
            store = TraceStore()
            if config.teachers.traces_path:
                store = TraceStore.load([config.teachers.traces_path])
            pool: Any = None  # duck-types TeacherPool (store, ensure)
            if self.teacher_pool.teachers.call_one().get():
                pool = _RemoteTeacherPool(self.teacher_pool, store)
            recorder = _RoundRecorder(outer, reward)
            with tempfile.TemporaryDirectory(prefix=f"composer-monarch{rank}-") as scratch:
                trainer = ComposerReplicationTrainer(
                    model=model,
                    processing_class=tok,
                    reward_funcs=[reward],
                    train_dataset=train_split(config, task, rank),
                    args=trainer_args(config, scratch, config.train.max_steps, seed),
                    callbacks=[outer.callback(), _callback(recorder)],
                    trace_store=store,
                    teacher_pool=pool,
                    rollout_func=_Rollouts(self.generator),
                    hint_template=hint_template(config),
                    **composer_kwargs(config),
                )
                trainer.remove_callback(PrinterCallback)  # the driver prints the round table
                trainer.train()
            return {
                "rank": rank,
                "rounds": recorder.rounds,
                "final_sha256": global_digest(outer.global_parameters()),
                "channels": _channel_means(trainer.state.log_history),
            }
        finally:
            manager.close()
