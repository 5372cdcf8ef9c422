"""The run configuration: one typed, immutable dataclass per TOML section.

`composer-replication train` reads a TOML file into `RunConfig` (see `loader.py`); every value
is type-checked once here, at the edge, so the replicas receive plain validated values. The
embedded default (`default.toml`, next to this module) is the CPU demo: a tiny Qwen2 model, a
built-in task, 2 local replicas synchronised by DiLoCo through `file://` under `./runs/`.

Each field carries `metadata["help"]`; the config reference in docs/cli.md is generated from it
(`python -m composer_replication.config.reference --write docs/cli.md`). Cross-field rules
(e.g. "`backend.n_replicas` >= 1") live in each section's `__post_init__` and raise
`ValueError` naming the key.

The sections of a component are its own configs, beside it (with their defaults, help and
checks), composed here: `[diloco]` is `diloco.section.DilocoConfig`, composed of the outer
optimizer's, the exchange's, SparseLoCo's, the decoupled mode's and torchft's configs (the
outer-loop mode it names checks its rules across sections here,
`diloco.mode_registry.outer_loop_mode`); `[store]` is `exchange.settings.StoreConfig`
(``keep_rounds`` defaults to `exchange.settings.KEEP_ROUNDS`, which the synchronizer keeps too);
`[security]` is `exchange.signing.SecurityConfig`; `[backend]` is
`executors.registry.BackendConfig` (``kind`` one of the registry's names); `[chaos]` is
`faults.events.ChaosConfig`; `[model]` is `models.model_config.ModelConfig`; `[task]` is
`tasks.task_config.TaskConfig`; `[teachers]` is `data.teachers.teachers_config.TeachersConfig`
(its `[[teachers.endpoints]]` entries `EndpointConfig`); `[loss]` is
`loss.loss_section.LossConfig`, the loss library's `LossSettings` (the one list of loss
settings: each key's type, choices, default, help and check, declared once in
loss/loss_settings.py), by inheritance. Nothing here is a second copy of a name or a default
owned elsewhere. The sections defined here are those with no component below config/ to sit
beside: `[run]`, `[logging]` and `[checkpoint]` are run/'s (above config/, which config/ may not
import) and `[train]` is read by assembly/ and run/ (see each class). They are re-exported here
(`__all__`), the composition root, for the callers that build a `RunConfig` by hand.
The loader checks values against the `Literal` choices and suggests the nearest name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from composer_replication.data.teachers.teachers_config import EndpointConfig, TeachersConfig
from composer_replication.diloco.mode_protocol import OuterLoopMode, RunShape
from composer_replication.diloco.mode_registry import outer_loop_mode
from composer_replication.diloco.section import DilocoConfig
from composer_replication.exchange.settings import StoreConfig
from composer_replication.exchange.signing import SecurityConfig
from composer_replication.executors.registry import BackendConfig
from composer_replication.faults.events import (
    PROXY_ACTIONS,
    UNTARGETED_ACTIONS,
    ChaosConfig,
    ChaosEventConfig,
)
from composer_replication.fields import require, setting
from composer_replication.loss.loss_section import LossConfig
from composer_replication.models.model_config import ModelConfig
from composer_replication.tasks.task_config import TaskConfig

__all__ = [
    "GENERATION_ENGINES",
    "LOSS_KEYS_SET_BY_THE_RUN",
    "RENAMED_KEYS",
    "BackendConfig",
    "ChaosConfig",
    "ChaosEventConfig",
    "CheckpointConfig",
    "DilocoConfig",
    "EndpointConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "RunConfig",
    "RunSection",
    "SecurityConfig",
    "StoreConfig",
    "TaskConfig",
    "TeachersConfig",
    "TrainConfig",
]

# [train] generation: how TRL samples the rollouts. The names are here (the schema's choices);
# what each one sets in TRL is assembly.build.GENERATION_ARGS, keyed by them (a test checks that
# the two agree). docs/trainer.md, "On a GPU", says which to pick.
GenerationEngine = Literal["generate", "static", "paged", "paged_eager", "vllm", "vllm_server"]
GENERATION_ENGINES: tuple[GenerationEngine, ...] = get_args(GenerationEngine)

# Names a setting had as a component's argument before the component took its TOML key's name
# (issue 21: one name from the TOML to the code), with the key to write instead; the loader's
# did-you-mean uses them.
RENAMED_KEYS = {
    "gamma": "diloco.grace_gamma",
    "tau": "diloco.grace_tau",
    "outlier_ratio": "diloco.aggregate_outlier_ratio",
    "trim_fraction": "diloco.aggregate_trim_fraction",
    "clip_ratio": "diloco.aggregate_clip_ratio",
    "token_cap": "diloco.aggregate_token_cap",
    "loss_tolerance": "diloco.screen_loss_tolerance",
    "num_fragments": "diloco.fragments",
    "keep": "store.keep_rounds",
    "keep_steps": "store.keep_rounds",
}

# ComposeConfig keys that are not [loss] keys, and what sets them in a run instead.
LOSS_KEYS_SET_BY_THE_RUN = {
    "temperature": "train.temperature (TRL samples and scores rollouts at one temperature)",
    "taid_schedule_step": "the trainer's step (the TAID schedule runs over loss.taid_total_steps)",
}


@dataclass(frozen=True)
class RunSection:
    """Naming and seeding of the run; its folder is `<runs_dir>/<name>/`.

    Stays here: its component is the run (`run/folder.py`, the driver; `seed` is also handed to
    what assembly/ builds), above config/, which config/ may not import."""

    name: str = setting("", "run name; empty = 'run-YYYYmmdd-HHMMSS' (a fresh folder every time)")
    runs_dir: str = setting(
        "runs", "folder that holds run folders (relative to the working directory)"
    )
    seed: int = setting(0, "seed for the model init, the task split and sampling")

    def __post_init__(self) -> None:
        require(
            "/" not in self.name and "\\" not in self.name and self.name not in (".", ".."),
            "run.name",
            f"{self.name!r} must be a plain folder name (no path separators)",
        )


@dataclass(frozen=True)
class TrainConfig:
    """The inner loop each replica runs (TRL GRPO settings).

    Stays here: no one component owns these keys. assembly/build.py translates most of them into
    TRL's `GRPOConfig` (trainer/ takes that, not this section), and run/ reads the rest
    (`max_steps`, the evaluation cadence, `torch_threads`); both sit above config/."""

    max_steps: int = setting(200, "inner optimizer steps per replica")
    learning_rate: float = setting(3e-3, "inner AdamW learning rate")
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = setting(
        "constant",
        "inner learning-rate schedule over train.max_steps (transformers' lr_scheduler_type)",
    )
    warmup_steps: int = setting(
        0, "inner steps of linear warm-up (needs a *_with_warmup, linear or cosine schedule)"
    )
    max_grad_norm: float = setting(
        1.0, "clip each inner step's gradient to this global L2 norm (0 = off)"
    )
    batch_size: int = setting(
        16, "completions per step per replica (a multiple of num_generations)"
    )
    num_generations: int = setting(8, "completions per prompt (the GRPO group size)")
    max_completion_length: int = setting(8, "generated tokens per completion")
    temperature: float = setting(1.0, "sampling temperature for rollouts")
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step")
    eval_every_rounds: int = setting(
        1, "evaluate the global model every N outer rounds (0 = only at end)"
    )
    eval_max_examples: int = setting(
        32, "eval prompts used per evaluation (at most task.n_eval of them)"
    )
    torch_threads: int = setting(1, "torch intra-op threads per replica (0 = torch default)")
    generation: GenerationEngine = setting(
        "generate",
        "rollout engine: 'generate' (TRL's default: transformers' generate on a left-padded "
        "batch), 'static' (the same with a static key/value cache and the decoding forward "
        "compiled by torch.compile on a GPU: TRL's cache_implementation='static'), 'paged' "
        "(transformers' continuous batching over a paged KV cache, TRL's "
        "use_transformers_continuous_batching, formerly use_transformers_paged; CUDA graphs "
        "captured each generation), 'paged_eager' (the same without CUDA graphs), 'vllm' (TRL's "
        "use_vllm with vllm_mode='colocate': vLLM in the trainer's process; extra vllm) or "
        "'vllm_server' (vllm_mode='server': a separate `trl vllm-serve` process; extra vllm)",
    )

    def __post_init__(self) -> None:
        require(self.max_steps >= 1, "train.max_steps", "must be >= 1")
        require(self.learning_rate > 0, "train.learning_rate", "must be > 0")
        require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        require(
            self.warmup_steps == 0 or self.lr_scheduler != "constant",
            "train.warmup_steps",
            f"{self.warmup_steps} with lr_scheduler = 'constant', which ignores warm-up: use "
            "'constant_with_warmup'",
        )
        require(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 = no clipping)")
        require(self.num_generations >= 2, "train.num_generations", "must be >= 2 (GRPO groups)")
        require(
            self.batch_size >= 1 and self.batch_size % self.num_generations == 0,
            "train.batch_size",
            f"{self.batch_size} must be a positive multiple of train.num_generations "
            f"({self.num_generations})",
        )
        for key in ("max_completion_length", "gradient_accumulation_steps"):
            require(getattr(self, key) >= 1, f"train.{key}", "must be >= 1")
        require(self.temperature > 0, "train.temperature", "must be > 0")
        require(self.eval_every_rounds >= 0, "train.eval_every_rounds", "must be >= 0")
        require(self.eval_max_examples >= 0, "train.eval_max_examples", "must be >= 0")
        require(self.torch_threads >= 0, "train.torch_threads", "must be >= 0")


@dataclass(frozen=True)
class LoggingConfig:
    """What the driver shows and records.

    Stays here: its component is run/ (the driver's display, metrics and report), above
    config/, which config/ may not import."""

    progress: Literal["auto", "live", "plain", "none"] = setting(
        "auto", "auto = live display on a terminal, plain log lines otherwise"
    )
    tensorboard: bool = setting(True, "write TensorBoard event files under <run>/tensorboard/")
    report: bool = setting(True, "draw the report (plots + summary.md) when training ends")
    log_every: int = setting(1, "replicas record train metrics every N inner steps")
    flush_every_s: float = setting(2.0, "replicas upload buffered metrics at most this often")

    def __post_init__(self) -> None:
        require(self.log_every >= 1, "logging.log_every", "must be >= 1")
        require(self.flush_every_s > 0, "logging.flush_every_s", "must be > 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """HF save_pretrained checkpoints (safetensors) of the global model + outer optimizer state.

    Stays here: its component is run/ (the driver's checkpoints), above config/, which config/
    may not import."""

    every_rounds: int = setting(
        1, "checkpoint every N committed outer rounds (0 = only at the end)"
    )
    keep_last: int = setting(2, "checkpoints kept in the store (the final one is always kept)")
    save_final: bool = setting(True, "checkpoint the final global model")

    def __post_init__(self) -> None:
        require(self.every_rounds >= 0, "checkpoint.every_rounds", "must be >= 0")
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")


@dataclass(frozen=True)
class RunConfig:
    """The whole run configuration (one attribute per TOML section)."""

    run: RunSection = field(default_factory=RunSection, metadata={"help": "run naming"})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "policy model"})
    task: TaskConfig = field(default_factory=TaskConfig, metadata={"help": "the task"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "inner loop"})
    loss: LossConfig = field(default_factory=LossConfig, metadata={"help": "composer loss"})
    teachers: TeachersConfig = field(default_factory=TeachersConfig, metadata={"help": "teachers"})
    diloco: DilocoConfig = field(default_factory=DilocoConfig, metadata={"help": "outer loop"})
    backend: BackendConfig = field(default_factory=BackendConfig, metadata={"help": "executor"})
    store: StoreConfig = field(default_factory=StoreConfig, metadata={"help": "object store"})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "logging"})
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "checkpoints"}
    )
    chaos: ChaosConfig = field(default_factory=ChaosConfig, metadata={"help": "fault injection"})
    security: SecurityConfig = field(default_factory=SecurityConfig, metadata={"help": "signing"})

    def __post_init__(self) -> None:
        h = self.diloco.sync_every_h
        if self.train.max_steps % h:
            lower = max(h, self.train.max_steps // h * h)
            raise ValueError(
                f"train.max_steps: {self.train.max_steps} is not a multiple of "
                f"diloco.sync_every_h ({h}); the steps after the last sync would be discarded "
                f"(use e.g. train.max_steps={lower} or {lower + h})"
            )
        mode = outer_loop_mode(self.diloco)  # its rules on [diloco] (ValueError naming the key)
        mode.check_run(
            RunShape(
                n_replicas=self.backend.n_replicas,
                backend=self.backend.kind,
                local_backend=self.backend.kind == "local",
                signed=self.security.sign,
                model_blocks=self.model.num_layers if self.model.is_tiny else None,
            )
        )
        if self.task.shard == "disjoint":
            per_step = self.train.batch_size // self.train.num_generations
            n = self.backend.n_replicas
            require(
                self.task.n_train // n >= per_step,
                "task.shard",
                f"'disjoint' gives each of the {n} replicas {self.task.n_train // n} training "
                f"prompts, fewer than the {per_step} one step draws: raise task.n_train or use "
                "task.shard = 'shared'",
            )
        self._check_hinted_examples()
        self._check_chaos(mode)
        if self.diloco.exchange.min_replicas is not None:
            require(
                self.diloco.exchange.min_replicas <= self.backend.n_replicas,
                "diloco.min_replicas",
                f"{self.diloco.exchange.min_replicas} exceeds backend.n_replicas "
                f"({self.backend.n_replicas})",
            )

    def _check_hinted_examples(self) -> None:
        """Hinted examples kept out of channel 1 (`task.hint_grpo = false`) are learnt through
        channel 3's replay of their teacher traces alone: without it they would be dead rows."""
        if not self.task.hint_share or self.task.hint_grpo:
            return
        t = self.teachers
        require(
            self.loss.beta_replay != 0 and bool(t.oracle or t.endpoints or t.traces_path),
            "task.hint_grpo",
            f"is false with task.hint_share = {self.task.hint_share}, so the hinted examples "
            "train through channel 3's replay only, but channel 3 has no teacher "
            f"(loss.beta_replay = {self.loss.beta_replay}, teachers.oracle = {t.oracle}, no "
            "teachers.endpoints or teachers.traces_path): set task.hint_share = 0 (no hinted "
            "examples), task.hint_grpo = true, or give channel 3 a teacher",
        )

    def _check_chaos(self, mode: OuterLoopMode) -> None:
        """The chaos schedule against the backend, the restarts, the ranks and the mode."""
        if not self.chaos.events:
            return
        require(
            self.backend.kind == "local",
            "chaos.events",
            f"fault injection needs the local backend (signals to replica processes), not "
            f"{self.backend.kind!r}",
        )
        local = self.backend.options.get("max_restarts", 0)
        restarts = self.backend.max_restarts + (local if isinstance(local, int) else 0)
        n = self.backend.n_replicas
        # a mode that may finish without a replica lost for good (sync, min_replicas < n)
        elastic = mode.may_finish_without(n - 1, n)
        for i, ev in enumerate(self.chaos.events):
            if ev.action == "kill":
                require(
                    (isinstance(restarts, int) and restarts >= 1) or elastic,
                    f"chaos.events[{i}]",
                    "a killed replica must come back: set backend.max_restarts to at least "
                    "the number of kill events, or let the run go on without it "
                    "(diloco.min_replicas < backend.n_replicas)",
                )
            if ev.action not in UNTARGETED_ACTIONS:
                require(
                    ev.target.isdigit() and int(ev.target) < self.backend.n_replicas,
                    f"chaos.events[{i}].target",
                    f"{ev.target!r} is not a replica rank in [0, {self.backend.n_replicas})",
                )
            if ev.action == "kill_synchronizer":
                service = mode.driver_service()
                require(
                    service is not None and service.name == "synchronizer",
                    f"chaos.events[{i}].action",
                    "kill_synchronizer needs diloco.mode = 'decoupled' with the driver's "
                    "synchronizer",
                )
            if ev.action in PROXY_ACTIONS:
                require(
                    self.store.uri.startswith(("s3://", "s3a://")),
                    f"chaos.events[{i}].action",
                    f"{ev.action} acts on the connection to an S3 endpoint; a file:// store "
                    f"has no connection to {ev.action} (use an s3:// store.uri)",
                )

    @property
    def quorum(self) -> int:
        """Replicas the run needs alive (the outer-loop mode's `quorum`)."""
        return outer_loop_mode(self.diloco).quorum(self.backend.n_replicas)

    @property
    def n_rounds(self) -> int:
        """Outer rounds in the run (max_steps is a multiple of sync_every_h)."""
        return self.train.max_steps // self.diloco.sync_every_h
