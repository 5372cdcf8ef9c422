"""The run configuration: one typed, frozen dataclass per TOML section.

`composer-replication train` reads a TOML file into `RunConfig` (see `loader.py`); every value
is type-checked once here, at the edge, so the replicas receive plain validated values. The
embedded default (`default.toml`, next to this module) is the CPU demo: a tiny Qwen2 model, a
built-in task, 2 local replicas synchronised by DiLoCo through `file://` under `./runs/`.

Each field carries `metadata["help"]`; the config reference in docs/cli.md is generated from it
(`python -m composer_replication.config.reference --write docs/cli.md`). Cross-field rules
(e.g. "`backend.n_replicas` >= 1") live in each section's `__post_init__` and raise
`ValueError` naming the key.

Nothing here is a second copy of a name or a default owned elsewhere:
- `[loss]` keys take their defaults and checks from the loss library's `ComposeConfig`, and their
  choices from its choice tuples (`LOSS_TYPES`, `SDPO_WRAPPERS`, `DPO_VARIANTS`);
- `backend.kind` choices are the executor registry's names (`executors.registry.BACKENDS`);
- `diloco.codec` choices are the exchange's codecs (`exchange.codecs.CODECS`);
- `diloco.sparseloco_density/chunk/bits` take their defaults and checks from the exchange's
  `sparse.SparseSpec` (`sparseloco_ef_decay` is the replica's, and its default lives here);
- `diloco.aggregate*` / `diloco.screen*` take their choices, defaults and checks from the
  exchange's `robust.AggregatePolicy`.
The choice types are `Literal`s built from those tuples at import time (mypy sees `str`); the
loader checks values against them and suggests the nearest name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from composer_replication.exchange import codecs
from composer_replication.exchange.codecs import CODECS
from composer_replication.exchange.robust import AGGREGATES, SCREENS, AggregatePolicy
from composer_replication.exchange.sparse import BITS, SparseSpec
from composer_replication.executors.registry import BACKEND_NAMES
from composer_replication.loss import (
    DPO_VARIANTS,
    LOSS_TYPES,
    SDPO_WRAPPERS,
    TAID_T_END,
    TAID_T_START,
    ComposeConfig,
)

__all__ = [
    "GENERATION_ENGINES",
    "LOSS_KEYS_SET_BY_THE_RUN",
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
GENERATION_ENGINES: tuple[str, ...] = ("generate", "paged", "paged_eager")

if TYPE_CHECKING:
    GenerationEngine = str
    BackendName = str
    CodecName = str
    AggregateName = str
    ScreenName = str
    LossType = str
    SdpoWrapper = str
    DpoVariant = str
else:  # the registries' names as Literal choices (the loader validates against them)
    GenerationEngine = Literal[GENERATION_ENGINES]
    BackendName = Literal[BACKEND_NAMES]
    CodecName = Literal[CODECS]
    AggregateName = Literal[AGGREGATES]
    ScreenName = Literal[SCREENS]
    LossType = Literal[LOSS_TYPES]
    SdpoWrapper = Literal[SDPO_WRAPPERS]
    DpoVariant = Literal[DPO_VARIANTS]

# The loss library's defaults: every [loss] key's default is read from here.
_LOSS = ComposeConfig()
# The exchange's screening defaults: every [diloco] aggregate*/screen* default comes from here.
_POLICY = AggregatePolicy()
_SPARSE = SparseSpec()

# ComposeConfig keys that are not [loss] keys, and what sets them in a run instead.
LOSS_KEYS_SET_BY_THE_RUN = {
    "temperature": "train.temperature (TRL samples and scores rollouts at one temperature)",
    "taid_schedule_step": "the trainer's step (the TAID schedule runs over loss.taid_total_steps)",
}


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a default and a help string (dicts/lists get a factory)."""
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {message}")


@dataclass(frozen=True)
class RunSection:
    """Naming and seeding of the run; its folder is `<runs_dir>/<name>/`."""

    name: str = _f("", "run name; empty = 'run-YYYYmmdd-HHMMSS' (a fresh folder every time)")
    runs_dir: str = _f("runs", "folder that holds run folders (relative to the working directory)")
    seed: int = _f(0, "seed for the model init, the task split and sampling")

    def __post_init__(self) -> None:
        _check(
            "/" not in self.name and "\\" not in self.name and self.name not in (".", ".."),
            "run.name",
            f"{self.name!r} must be a plain folder name (no path separators)",
        )


@dataclass(frozen=True)
class ModelConfig:
    """The policy: 'tiny' (built locally, no download), a hub id, or a local folder."""

    name: str = _f("tiny", "'tiny', a Hugging Face hub id (org/name) or a local model folder")
    hidden_size: int = _f(64, "tiny model only: hidden size")
    num_layers: int = _f(2, "tiny model only: number of transformer layers")
    num_heads: int = _f(4, "tiny model only: attention heads")
    num_kv_heads: int = _f(2, "tiny model only: key/value heads")
    tokenizer: Literal["char", "bpe"] = _f(
        "char",
        "tiny model only: 'char' (one token per character) or 'bpe' (trained locally on "
        "the task's training text, cached)",
    )
    vocab_size: int = _f(512, "tiny model with tokenizer 'bpe': the largest vocabulary")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = _f(
        "float32", "parameter dtype for hub/local models"
    )
    trust_remote_code: bool = _f(False, "passed to from_pretrained for hub/local models")

    def __post_init__(self) -> None:
        _check(bool(self.name.strip()), "model.name", "must not be empty (use 'tiny')")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            _check(getattr(self, key) >= 1, f"model.{key}", "must be >= 1")

    @property
    def is_tiny(self) -> bool:
        return self.name == "tiny"


@dataclass(frozen=True)
class TaskConfig:
    """A verifiable task (composer_replication.tasks): built in, or an OpenEnv environment."""

    name: str = _f(
        "arithmetic",
        "built-in task name (see composer_replication.tasks.TASKS), 'reasoning_gym:DATASET', or "
        "'openenv:URL_OR_IMAGE' for an OpenEnv environment (docs/recipes/openenv.md)",
    )
    n_train: int = _f(256, "training prompts")
    n_eval: int = _f(32, "held-out evaluation prompts (disjoint from training)")
    options: dict[str, Any] = _f({}, "task-specific options passed to get_task(...)")
    shard: Literal["disjoint", "shared"] = _f(
        "disjoint",
        "'disjoint': replica k trains on every n-th training prompt from k (data islands, the "
        "DiLoCo setting); 'shared': every replica samples from all of them",
    )

    def __post_init__(self) -> None:
        _check(self.n_train >= 1, "task.n_train", "must be >= 1")
        _check(self.n_eval >= 0, "task.n_eval", "must be >= 0")


@dataclass(frozen=True)
class TrainConfig:
    """The inner loop each replica runs (TRL GRPO settings)."""

    max_steps: int = _f(200, "inner optimizer steps per replica")
    learning_rate: float = _f(3e-3, "inner AdamW learning rate")
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = _f(
        "constant",
        "inner learning-rate schedule over train.max_steps (transformers' lr_scheduler_type)",
    )
    warmup_steps: int = _f(
        0, "inner steps of linear warm-up (needs a *_with_warmup, linear or cosine schedule)"
    )
    max_grad_norm: float = _f(
        1.0, "clip each inner step's gradient to this global L2 norm (0 = off)"
    )
    batch_size: int = _f(16, "completions per step per replica (a multiple of num_generations)")
    num_generations: int = _f(8, "completions per prompt (the GRPO group size)")
    max_completion_length: int = _f(8, "generated tokens per completion")
    temperature: float = _f(1.0, "sampling temperature for rollouts")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    eval_every_rounds: int = _f(
        1, "evaluate the global model every N outer rounds (0 = only at end)"
    )
    eval_max_examples: int = _f(
        32, "eval prompts used per evaluation (at most task.n_eval of them)"
    )
    torch_threads: int = _f(1, "torch intra-op threads per replica (0 = torch default)")
    generation: GenerationEngine = _f(
        "generate",
        "rollout engine: 'generate' (TRL's default: transformers' generate on a left-padded "
        "batch), 'paged' (transformers' continuous batching over a paged KV cache, TRL's "
        "use_transformers_continuous_batching, formerly use_transformers_paged; CUDA graphs "
        "captured each generation) or 'paged_eager' (the same without CUDA graphs)",
    )

    def __post_init__(self) -> None:
        _check(self.max_steps >= 1, "train.max_steps", "must be >= 1")
        _check(self.learning_rate > 0, "train.learning_rate", "must be > 0")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _check(
            self.warmup_steps == 0 or self.lr_scheduler != "constant",
            "train.warmup_steps",
            f"{self.warmup_steps} with lr_scheduler = 'constant', which ignores warm-up: use "
            "'constant_with_warmup'",
        )
        _check(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 = no clipping)")
        _check(self.num_generations >= 2, "train.num_generations", "must be >= 2 (GRPO groups)")
        _check(
            self.batch_size >= 1 and self.batch_size % self.num_generations == 0,
            "train.batch_size",
            f"{self.batch_size} must be a positive multiple of train.num_generations "
            f"({self.num_generations})",
        )
        for key in ("max_completion_length", "gradient_accumulation_steps"):
            _check(getattr(self, key) >= 1, f"train.{key}", "must be >= 1")
        _check(self.temperature > 0, "train.temperature", "must be > 0")
        _check(self.eval_every_rounds >= 0, "train.eval_every_rounds", "must be >= 0")
        _check(self.eval_max_examples >= 0, "train.eval_max_examples", "must be >= 0")
        _check(self.torch_threads >= 0, "train.torch_threads", "must be >= 0")


@dataclass(frozen=True)
class LossConfig:
    """The composer loss: `loss.ComposeConfig`'s keys, defaults and checks (see docs/api.md)."""

    loss_type: LossType = _f(_LOSS.loss_type, "channel-1 aggregation (TRL's loss_type)")
    epsilon_low: float = _f(_LOSS.epsilon_low, "lower PPO clip (TRL's epsilon)")
    epsilon_high: float | None = _f(_LOSS.epsilon_high, "upper PPO clip (unset = epsilon_low)")
    delta: float | None = _f(
        _LOSS.delta, "two-sided GRPO: cap (> 1) on the unclipped ratio (unset = off)"
    )
    kl_beta: float = _f(_LOSS.kl_beta, "KL-to-reference weight in channel 1 (TRL's beta)")
    alpha_sdpo: float = _f(
        _LOSS.alpha_sdpo, "channel 2 (hint self-distillation) weight; 0 disables it"
    )
    beta_replay: float = _f(_LOSS.beta_replay, "channel 3 (trace replay) weight; 0 disables it")
    sdpo_jsd_beta: float = _f(
        _LOSS.sdpo_jsd_beta, "generalized JSD beta (0 forward KL, 1 reverse KL)"
    )
    sdpo_temperature: float = _f(_LOSS.sdpo_temperature, "channel 2 softmax temperature")
    sdpo_token_clip: float | None = _f(
        _LOSS.sdpo_token_clip, "per-token clip of the channel-2 divergence (unset = none)"
    )
    sdpo_top_k: int | None = _f(
        _LOSS.sdpo_top_k, "top-k vocabulary for channel 2 (unset = full vocab)"
    )
    sdpo_add_tail: bool = _f(
        _LOSS.sdpo_add_tail, "top-k channel 2: add one bucket for the rest of the vocabulary"
    )
    sdpo_wrapper: SdpoWrapper = _f(_LOSS.sdpo_wrapper, "channel-2 wrapper")
    sdpo_max_context_length: int | None = _f(
        _LOSS.sdpo_max_context_length,
        "cap (tokens) on a channel-2 hinted teacher context: longer ones lose their middle "
        "(first half = question, last half = end of the hint); unset = no cap",
    )
    taid_t: float | None = _f(_LOSS.taid_t, "fixed TAID interpolation t in [0, 1]")
    taid_total_steps: int | None = _f(
        _LOSS.taid_total_steps,
        f"TAID schedule length: t goes {TAID_T_START} -> {TAID_T_END} over this many inner "
        "steps (used when taid_t is unset)",
    )
    entropy_opd_h_max: float = _f(
        _LOSS.entropy_opd_h_max, "entropy_opd wrapper: teacher-entropy gate in nats"
    )
    replay_dpo_beta: float = _f(_LOSS.replay_dpo_beta, "DPO beta for channel 3")
    dpo_variant: DpoVariant = _f(
        _LOSS.dpo_variant,
        "channel-3 preference loss ('dpo' scores a frozen reference copy of the model; "
        "'simpo' is reference-free)",
    )
    simpo_beta: float = _f(_LOSS.simpo_beta, "SimPO beta")
    simpo_gamma: float = _f(_LOSS.simpo_gamma, "SimPO margin gamma")
    label_smoothing: float = _f(_LOSS.label_smoothing, "channel-3 label smoothing in [0, 0.5)")

    def __post_init__(self) -> None:
        _check(self.alpha_sdpo >= 0, "loss.alpha_sdpo", "must be >= 0")
        _check(self.beta_replay >= 0, "loss.beta_replay", "must be >= 0")
        scheduled = self.sdpo_wrapper == "taid" and self.taid_t is None
        if scheduled and self.taid_total_steps is None:
            raise ValueError(
                "loss.sdpo_wrapper: 'taid' needs loss.taid_t or loss.taid_total_steps "
                "(a fixed t or a schedule length)"
            )
        # Every other rule is the loss library's (a scheduled TAID starts at step 0).
        kwargs = self.compose_kwargs()
        if scheduled:
            kwargs["taid_schedule_step"] = 0
        try:
            ComposeConfig(**kwargs)
        except ValueError as exc:  # "<key> must be ...": name it as the TOML key
            key, _, rest = str(exc).partition(" ")
            where = f"loss.{key}: {rest}" if key in self.__dataclass_fields__ else f"loss: {exc}"
            raise ValueError(where) from None

    def compose_kwargs(self) -> dict[str, Any]:
        """The compose_loss keyword arguments (unset optionals omitted)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class EndpointConfig:
    """An OpenAI-compatible teacher endpoint (channel 3 traces)."""

    name: str = _f("teacher", "label recorded in the traces")
    base_url: str = _f("", "e.g. https://openrouter.ai/api/v1 or http://127.0.0.1:8000/v1")
    model: str = _f("", "model name sent to the endpoint")
    api_key_env: str = _f("OPENAI_API_KEY", "environment variable holding the API key")
    max_tokens: int = _f(256, "completion tokens per trace")
    temperature: float = _f(0.7, "sampling temperature")

    def __post_init__(self) -> None:
        # from_dict prefixes these with the entry's path, e.g. "teachers.endpoints[0]".
        _check(bool(self.base_url), "base_url", "must be set")
        _check(bool(self.model), "model", "must be set")


@dataclass(frozen=True)
class TeachersConfig:
    """Where channel 3's teacher traces come from."""

    oracle: bool = _f(True, "replay the task's oracle solutions when no endpoint/traces are given")
    traces_path: str = _f("", "pre-baked traces JSONL (from `composer-replication bake-traces`)")
    endpoints: list[EndpointConfig] = _f([], "OpenAI-compatible teachers ([[teachers.endpoints]])")


@dataclass(frozen=True)
class DilocoConfig:
    """The outer loop: every H inner steps replicas exchange pseudo-gradients (global - local)."""

    sync_every_h: int = _f(20, "inner steps between outer synchronisations (H)")
    outer_optimizer: Literal["nesterov", "sgd", "adam"] = _f(
        "nesterov",
        "the outer optimizer: 'nesterov' (SGD + Nesterov momentum, DiLoCo's), 'sgd' (heavy-ball "
        "momentum; 0 = plain averaging at lr 1) or 'adam'",
    )
    outer_lr: float = _f(0.7, "outer learning rate")
    outer_momentum: float = _f(0.9, "outer momentum ('nesterov', 'sgd')")
    outer_betas: list[float] = _f([0.9, 0.999], "outer Adam betas ('adam')")
    outer_eps: float = _f(1e-8, "outer Adam epsilon ('adam')")
    codec: CodecName = _f(
        "fp32",
        "pseudo-gradient encoding (exchange.codecs); 'sparseloco' = SparseLoCo: chunk-wise top-k "
        "+ few-bit values with local error feedback, outer step plain SGD at "
        "sparseloco_outer_lr (no outer momentum; outer_optimizer/outer_lr/outer_momentum are "
        "not used)",
    )
    sparseloco_density: float = _f(
        _SPARSE.density, "codec = 'sparseloco': fraction of each chunk sent (top-k by magnitude)"
    )
    sparseloco_chunk: int = _f(_SPARSE.chunk, "codec = 'sparseloco': elements per top-k chunk")
    sparseloco_bits: int = _f(
        _SPARSE.bits, f"codec = 'sparseloco': bits per sent value, one of {list(BITS)}"
    )
    sparseloco_ef_decay: float = _f(
        0.95,
        "codec = 'sparseloco': error-feedback decay beta in e = beta * e + delta (in [0, 1])",
    )
    sparseloco_outer_lr: float = _f(
        1.0,
        "codec = 'sparseloco': lr of the outer SGD step on the mean of the replicas' messages "
        "(1 = apply it as is; docs/diloco.md has the benchmark's sweep)",
    )
    min_replicas: int | None = _f(None, "contributions needed to commit a round (unset = all)")
    weighting: Literal["equal", "tokens"] = _f("equal", "how contributions are weighted")
    timeout_s: float = _f(600.0, "how long a round waits for contributions")
    manager: Literal["object_store", "torchft"] = _f(
        "object_store",
        "who averages the replicas: 'object_store' (they meet only in store.uri) or 'torchft' "
        "(torchft's Manager and lighthouse; replicas must reach each other over TCP)",
    )
    lighthouse: str = _f(
        "",
        "torchft lighthouse 'http://HOST:PORT' (manager = 'torchft'); empty = the driver runs "
        "one on 127.0.0.1 (local backend only)",
    )
    mode: Literal["sync", "decoupled"] = _f(
        "sync",
        "'sync': every round is a barrier; 'decoupled': learners never wait, a synchronizer "
        "merges each fragment once a quorum has pushed (docs/diloco.md, Decoupled DiLoCo)",
    )
    fragments: int = _f(
        1, "decoupled: P strided fragments; one is pushed every sync_every_h / fragments steps"
    )
    quorum: int | None = _f(
        None,
        "decoupled: learners that must push a fragment before it is merged (unset = all but one)",
    )
    grace_gamma: float = _f(
        0.8, "decoupled: grace window = grace_gamma * max(0, grace_tau * step - quorum - sync)"
    )
    grace_tau: float = _f(2.0, "decoupled: inner steps a fragment may stay in flight (tau)")
    merge: Literal["mean", "rda"] = _f(
        "mean", "decoupled: 'mean' or 'rda' (radial-directional averaging) of the pushes"
    )
    late: Literal["drop", "carry"] = _f(
        "carry", "decoupled: a push based on an already merged version is merged next or dropped"
    )
    alpha: float = _f(
        0.0, "decoupled: a learner takes a new global as lerp(global, local, alpha); 0 = overwrite"
    )
    synchronizer: Literal["driver", "external"] = _f(
        "driver",
        "decoupled: 'driver' runs the synchronizer beside the driver; 'external': you run "
        "`composer-replication synchronizer RUN` yourself",
    )
    lease_ttl_s: float = _f(
        10.0,
        "decoupled: a silent synchronizer's lease expires after this (then another takes over)",
    )
    aggregate: AggregateName = _f(
        _POLICY.method, "how screened contributions are merged (docs/object-store.md)"
    )
    aggregate_outlier_ratio: float = _f(
        _POLICY.outlier_ratio,
        "leave out a contribution whose L2 norm exceeds this x the round's median (0 = off)",
    )
    aggregate_trim_fraction: float = _f(
        _POLICY.trim_fraction, "trimmed_mean: fraction of values dropped at each end"
    )
    aggregate_clip_ratio: float = _f(
        _POLICY.clip_ratio, "norm_clip: clip each contribution's norm to this x the median"
    )
    aggregate_token_cap: float = _f(
        _POLICY.token_cap, "weighting = 'tokens': cap claims at this x the median claim (0 = off)"
    )
    screen: ScreenName = _f(
        _POLICY.screen,
        "'loss': also leave out contributions that alone raise a held-out loss (Templar-style)",
    )
    screen_loss_tolerance: float = _f(
        _POLICY.loss_tolerance, "screen = 'loss': tolerated rise, as a fraction of the loss"
    )
    screen_examples: int = _f(4, "screen = 'loss': held-out examples in the probe batch")

    @property
    def nesterov(self) -> bool:
        """Nesterov momentum in the outer step (outer_optimizer = 'nesterov')."""
        return self.outer_optimizer == "nesterov"

    def __post_init__(self) -> None:
        _check(self.sync_every_h >= 1, "diloco.sync_every_h", "must be >= 1")
        _check(self.fragments >= 1, "diloco.fragments", "must be >= 1")
        _check(
            self.sync_every_h % self.fragments == 0,
            "diloco.fragments",
            f"{self.fragments} must divide diloco.sync_every_h ({self.sync_every_h})",
        )
        if self.quorum is not None:
            _check(self.quorum >= 1, "diloco.quorum", "must be >= 1")
        _check(0.0 <= self.grace_gamma <= 1.0, "diloco.grace_gamma", "must be in [0, 1]")
        _check(self.grace_tau >= 0, "diloco.grace_tau", "must be >= 0")
        _check(0.0 <= self.alpha <= 1.0, "diloco.alpha", "must be in [0, 1]")
        _check(self.lease_ttl_s > 0, "diloco.lease_ttl_s", "must be > 0")
        if self.mode == "sync":
            _check(self.fragments == 1, "diloco.fragments", "is used with diloco.mode = "
                   "'decoupled' only")  # fmt: skip
        else:
            _check(
                self.manager == "object_store",
                "diloco.mode",
                "'decoupled' learners meet only in the object store: use manager = 'object_store'",
            )
            _check(
                self.outer_optimizer != "adam",
                "diloco.outer_optimizer",
                "'adam' runs in sync mode only; the decoupled synchronizer's outer step is "
                "SGD with (Nesterov) momentum: use 'nesterov' or 'sgd'",
            )
            _check(
                self.screen == "none",
                "diloco.screen",
                "the loss screen runs in the synchronous exchange only; decoupled mode screens "
                "by norm (diloco.aggregate_outlier_ratio): set diloco.screen = 'none'",
            )
            _check(
                self.merge == "mean" or self.aggregate == "mean",
                "diloco.merge",
                "'rda' averages directions itself: use diloco.aggregate = 'mean' with it",
            )
        _check(self.outer_lr > 0, "diloco.outer_lr", "must be > 0")
        try:
            self.sparse_spec()
        except ValueError as exc:  # "sparseloco <field> must be ...": name the TOML key
            field_name = str(exc).split(" ")[1]
            raise ValueError(f"diloco.sparseloco_{field_name}: {exc}") from None
        _check(
            0.0 <= self.sparseloco_ef_decay <= 1.0,
            "diloco.sparseloco_ef_decay",
            "must be in [0, 1]",
        )
        _check(self.sparseloco_outer_lr > 0, "diloco.sparseloco_outer_lr", "must be > 0")
        if codecs.get(self.codec).needs_error_feedback:
            _check(
                self.mode == "sync",
                "diloco.codec",
                "'sparseloco' runs in sync mode only: a decoupled push is the whole change since "
                "the last global version the learner loaded (a later push repeats an earlier "
                "one's work, and a queued push can be replaced by a newer one), so a per-push "
                "error-feedback accumulator would count work twice; use diloco.mode = 'sync'",
            )
            _check(
                self.outer_optimizer != "adam",
                "diloco.outer_optimizer",
                "'adam' contradicts codec = 'sparseloco', whose outer step is plain SGD at "
                "sparseloco_outer_lr (the error feedback replaces the outer momentum); use "
                "'nesterov' or 'sgd' (neither is used with it) or another codec",
            )
        _check(0.0 <= self.outer_momentum < 1.0, "diloco.outer_momentum", "must be in [0, 1)")
        _check(
            self.outer_optimizer != "nesterov" or self.outer_momentum > 0,
            "diloco.outer_momentum",
            "0 with outer_optimizer = 'nesterov'; use outer_optimizer = 'sgd' for no momentum",
        )
        _check(
            len(self.outer_betas) == 2 and all(0.0 <= b < 1.0 for b in self.outer_betas),
            "diloco.outer_betas",
            f"{self.outer_betas} must be two numbers in [0, 1)",
        )
        _check(self.outer_eps > 0, "diloco.outer_eps", "must be > 0")
        if self.min_replicas is not None:
            _check(self.min_replicas >= 1, "diloco.min_replicas", "must be >= 1")
        _check(self.timeout_s > 0, "diloco.timeout_s", "must be > 0")
        if self.lighthouse:
            from urllib.parse import urlparse

            url = urlparse(self.lighthouse)
            try:
                port = url.port
            except ValueError:
                port = None
            _check(
                url.scheme in ("http", "https") and bool(url.hostname) and port is not None,
                "diloco.lighthouse",
                f"{self.lighthouse!r} is not an address like 'http://10.0.0.5:29510'",
            )
            _check(
                self.manager == "torchft",
                "diloco.lighthouse",
                "is only used with diloco.manager = 'torchft'; remove it or set the manager",
            )
        try:
            self.aggregate_policy()
        except ValueError as exc:  # "<field> must be ...": name it as the TOML key
            field_name, _, rest = str(exc).partition(" ")
            key = {"method": "aggregate", "loss_tolerance": "screen_loss_tolerance"}.get(
                field_name, f"aggregate_{field_name}"
            )
            raise ValueError(f"diloco.{key}: {rest}") from None
        _check(self.screen_examples >= 1, "diloco.screen_examples", "must be >= 1")
        if self.manager == "torchft":
            _check(
                self.aggregate == "mean" and self.screen == "none",
                "diloco.aggregate",
                "robust aggregation and screening run in the object-store exchange; torchft "
                "averages over gloo (use manager = 'object_store')",
            )
            _check(
                self.codec == "fp32",
                "diloco.codec",
                f"{self.codec!r} applies to the object-store exchange; torchft averages fp32 "
                "over gloo (use codec = 'fp32' or manager = 'object_store')",
            )
            _check(
                self.weighting == "equal",
                "diloco.weighting",
                "torchft averages replicas equally; 'tokens' needs manager = 'object_store'",
            )

    def sparse_spec(self) -> SparseSpec:
        """What codec 'sparseloco' keeps (the exchange's `sparse.SparseSpec`)."""
        return SparseSpec(
            density=self.sparseloco_density, chunk=self.sparseloco_chunk, bits=self.sparseloco_bits
        )

    def aggregate_policy(self, **bounds: Any) -> AggregatePolicy:
        """The exchange's policy for these keys (``bounds``: the run's claim bounds)."""
        return AggregatePolicy(
            method=self.aggregate, weighting=self.weighting,
            outlier_ratio=self.aggregate_outlier_ratio, trim_fraction=self.aggregate_trim_fraction,
            clip_ratio=self.aggregate_clip_ratio, token_cap=self.aggregate_token_cap,
            screen=self.screen, loss_tolerance=self.screen_loss_tolerance, **bounds,
        )  # fmt: skip


@dataclass(frozen=True)
class SecurityConfig:
    """Signed contributions (docs/security.md)."""

    sign: bool = _f(
        False,
        "Ed25519-sign every contribution, commit record, state and manifest; the driver makes "
        "one key per rank and hands each replica only its own (object-store exchange)",
    )


@dataclass(frozen=True)
class BackendConfig:
    """Where the replicas run (an executor from the registry in composer_replication.executors)."""

    kind: BackendName = _f("local", "executor backend (docs/backends.md)")
    n_replicas: int = _f(2, "number of DiLoCo replicas")
    timeout_s: float = _f(3600.0, "wall-clock limit for the whole run (replicas then cancelled)")
    max_restarts: int = _f(
        2,
        "the driver relaunches a replica that fails (killed, crashed) up to this many times per "
        "rank; it rejoins from the newest global state (0 = a failure is final)",
    )
    options: dict[str, Any] = _f({}, "executor constructor arguments (image, gpu, namespace, ...)")
    resources: dict[str, Any] = _f({}, "per-replica resources passed to launch_replicas")
    env: dict[str, str] = _f({}, "extra environment variables for every replica")
    forward_env: list[str] = _f(
        [],
        "names of driver environment variables (e.g. AWS_ACCESS_KEY_ID) copied to every "
        "replica; hf-jobs receives them as encrypted job secrets",
    )

    def __post_init__(self) -> None:
        _check(self.n_replicas >= 1, "backend.n_replicas", f"{self.n_replicas} must be >= 1")
        _check(self.timeout_s > 0, "backend.timeout_s", "must be > 0")
        _check(self.max_restarts >= 0, "backend.max_restarts", "must be >= 0")


@dataclass(frozen=True)
class StoreConfig:
    """The object store the replicas meet in (one prefix per run)."""

    uri: str = _f("", "file:///..., s3://bucket/prefix/, gs://...; empty = <run folder>/store/")
    storage_options: dict[str, Any] = _f({}, "fsspec options (e.g. endpoint_url for S3)")
    keep_rounds: int = _f(4, "rounds of pseudo-gradients kept before garbage collection")

    def __post_init__(self) -> None:
        _check(self.keep_rounds >= 1, "store.keep_rounds", "must be >= 1")


@dataclass(frozen=True)
class LoggingConfig:
    """What the driver shows and records."""

    progress: Literal["auto", "live", "plain", "none"] = _f(
        "auto", "auto = live display on a terminal, plain log lines otherwise"
    )
    tensorboard: bool = _f(True, "write TensorBoard event files under <run>/tensorboard/")
    report: bool = _f(True, "draw the report (plots + summary.md) when training ends")
    log_every: int = _f(1, "replicas record train metrics every N inner steps")
    flush_every_s: float = _f(2.0, "replicas upload buffered metrics at most this often")

    def __post_init__(self) -> None:
        _check(self.log_every >= 1, "logging.log_every", "must be >= 1")
        _check(self.flush_every_s > 0, "logging.flush_every_s", "must be > 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """HF save_pretrained checkpoints (safetensors) of the global model + outer optimizer state."""

    every_rounds: int = _f(1, "checkpoint every N committed outer rounds (0 = only at the end)")
    keep_last: int = _f(2, "checkpoints kept in the store (the final one is always kept)")
    save_final: bool = _f(True, "checkpoint the final global model")

    def __post_init__(self) -> None:
        _check(self.every_rounds >= 0, "checkpoint.every_rounds", "must be >= 0")
        _check(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")


@dataclass(frozen=True)
class ChaosEventConfig:
    """One fault the chaos harness injects (run/chaos.py; local backend only)."""

    at_s: float = _f(0.0, "seconds after every replica started training")
    action: Literal["kill", "stop", "slow", "corrupt", "kill_synchronizer", "throttle"] = _f(
        "kill",
        "kill (-9), stop (SIGSTOP for duration_s), slow (factor x), corrupt (an object), "
        "kill_synchronizer (restarted after restart_after_s), throttle (the S3 endpoint)",
    )
    target: str = _f(
        "0",
        "a replica rank; for corrupt 'push', 'push:<rank>', 'global' or 'contribution'; "
        "ignored by kill_synchronizer and throttle",
    )
    during: Literal["any", "upload"] = _f(
        "any", "kill: at once ('any', i.e. mid inner step) or while the replica uploads"
    )
    duration_s: float = _f(0.0, "stop / slow / throttle: how long")
    factor: float = _f(3.0, "slow: the replica runs this many times slower")
    rate_bytes_s: float = _f(1e6, "throttle: bytes per second through the store endpoint")
    restart_after_s: float = _f(1.0, "kill_synchronizer: seconds before it is started again")

    def __post_init__(self) -> None:
        _check(self.at_s >= 0, "at_s", "must be >= 0")
        _check(self.duration_s >= 0, "duration_s", "must be >= 0")
        _check(self.factor >= 1, "factor", "must be >= 1")
        _check(self.rate_bytes_s > 0, "rate_bytes_s", "must be > 0")
        _check(self.restart_after_s >= 0, "restart_after_s", "must be >= 0")
        if self.action in ("stop", "slow", "throttle"):
            _check(self.duration_s > 0, "duration_s", f"must be > 0 for {self.action!r}")


@dataclass(frozen=True)
class ChaosConfig:
    """Fault injection while the run trains (local backend): a schedule of events."""

    events: list[ChaosEventConfig] = _f([], "the faults ([[chaos.events]] tables)")
    upload_wait_s: float = _f(
        60.0, "kill during='upload': give up if no upload is caught within this many seconds"
    )

    def __post_init__(self) -> None:
        _check(self.upload_wait_s > 0, "chaos.upload_wait_s", "must be > 0")


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
        if self.diloco.manager == "torchft" and not self.diloco.lighthouse:
            _check(
                self.backend.kind == "local",
                "diloco.lighthouse",
                f"backend {self.backend.kind!r} runs replicas the driver's own lighthouse "
                "(127.0.0.1) cannot serve; start `torchft_lighthouse` where they can reach it "
                "and set diloco.lighthouse = 'http://HOST:PORT'",
            )
        if self.diloco.mode == "decoupled":
            _check(
                not self.security.sign,
                "security.sign",
                "signs the synchronous object-store exchange; decoupled mode's pushes are not "
                "signed yet (use diloco.mode = 'sync' for a signed run)",
            )
        if self.task.shard == "disjoint":
            per_step = self.train.batch_size // self.train.num_generations
            n = self.backend.n_replicas
            _check(
                self.task.n_train // n >= per_step,
                "task.shard",
                f"'disjoint' gives each of the {n} replicas {self.task.n_train // n} training "
                f"prompts, fewer than the {per_step} one step draws: raise task.n_train or use "
                "task.shard = 'shared'",
            )
        if self.diloco.mode == "decoupled" and self.model.is_tiny:
            _check(
                self.diloco.fragments <= self.model.num_layers,
                "diloco.fragments",
                f"{self.diloco.fragments} exceeds model.num_layers ({self.model.num_layers}): "
                "each fragment needs at least one transformer block",
            )
        if self.diloco.quorum is not None:
            _check(
                self.diloco.quorum <= self.backend.n_replicas,
                "diloco.quorum",
                f"{self.diloco.quorum} exceeds backend.n_replicas ({self.backend.n_replicas})",
            )
        if self.chaos.events:
            _check(
                self.backend.kind == "local",
                "chaos.events",
                f"fault injection needs the local backend (signals to replica processes), not "
                f"{self.backend.kind!r}",
            )
            local = self.backend.options.get("max_restarts", 0)
            restarts = self.backend.max_restarts + (local if isinstance(local, int) else 0)
            n = self.backend.n_replicas
            # sync mode with min_replicas < n goes on without a replica that is lost for good
            elastic = self.diloco.mode == "sync" and (self.diloco.min_replicas or n) < n
            for i, ev in enumerate(self.chaos.events):
                if ev.action == "kill":
                    _check(
                        (isinstance(restarts, int) and restarts >= 1) or elastic,
                        f"chaos.events[{i}]",
                        "a killed replica must come back: set backend.max_restarts to at least "
                        "the number of kill events, or let the run go on without it "
                        "(diloco.min_replicas < backend.n_replicas)",
                    )
                if ev.action not in ("kill_synchronizer", "throttle", "corrupt"):
                    _check(
                        ev.target.isdigit() and int(ev.target) < self.backend.n_replicas,
                        f"chaos.events[{i}].target",
                        f"{ev.target!r} is not a replica rank in [0, {self.backend.n_replicas})",
                    )
                if ev.action == "kill_synchronizer":
                    _check(
                        self.diloco.mode == "decoupled" and self.diloco.synchronizer == "driver",
                        f"chaos.events[{i}].action",
                        "kill_synchronizer needs diloco.mode = 'decoupled' with the driver's "
                        "synchronizer",
                    )
                if ev.action == "throttle":
                    _check(
                        self.store.uri.startswith(("s3://", "s3a://")),
                        f"chaos.events[{i}].action",
                        "throttle slows the connection to an S3 endpoint; a file:// store has "
                        "no connection to throttle (use an s3:// store.uri)",
                    )
        _check(
            not (self.security.sign and self.diloco.manager == "torchft"),
            "security.sign",
            "signs the object-store exchange; torchft averages over gloo (use diloco.manager = "
            "'object_store')",
        )
        if self.diloco.min_replicas is not None:
            _check(
                self.diloco.min_replicas <= self.backend.n_replicas,
                "diloco.min_replicas",
                f"{self.diloco.min_replicas} exceeds backend.n_replicas "
                f"({self.backend.n_replicas})",
            )

    @property
    def quorum(self) -> int:
        """The decoupled quorum: `diloco.quorum`, or all learners but one (at least one)."""
        q = self.diloco.quorum
        return q if q is not None else max(1, self.backend.n_replicas - 1)

    @property
    def n_rounds(self) -> int:
        """Outer rounds in the run (max_steps is a multiple of sync_every_h)."""
        return self.train.max_steps // self.diloco.sync_every_h
