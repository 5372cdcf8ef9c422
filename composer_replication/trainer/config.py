"""Composer settings: the `ComposerConfig` (a TRL ``GRPOConfig``) and the resolved `ComposerSettings`.

`ComposerConfig` is for users who configure through TRL's argument parser (``TrlParser`` /
``HfArgumentParser``); every composer field is also a keyword of `ComposerReplicationTrainer`,
and keyword arguments override the config. The trainer resolves both into one frozen
`ComposerSettings`, validated once at construction (the compose_loss keywords through
``loss.ComposeConfig``), so a bad value fails before the first rollout.

CPU-safe defaults: GRPOConfig defaults ``bf16=True`` and ``gradient_checkpointing=True`` (GPU
settings). `ComposerConfig` leaves them unset and resolves them in ``__post_init__``: without a
CUDA device both become False; with one, TRL's defaults apply. Explicit values always win.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from composer_replication.data.hints import HintTemplate, coerce_hint_template
from composer_replication.loss import FUSED_JSD_BACKENDS, TAID_T_START, ComposeConfig

# The loss keywords' defaults live in one place (the loss library); the trainer repeats the
# names (they are its public keywords) but not the values.
_LOSS_DEFAULTS = ComposeConfig()

try:
    from trl import GRPOConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "composer_replication.trainer needs TRL; install it with "
        "`pip install composer-replication[train]`."
    ) from exc

# compose_loss keywords of channel 1, which is TRL's own loss (GRPOConfig configures it).
CHANNEL1_KEYS: tuple[str, ...] = (
    "loss_type",
    "epsilon_low",
    "epsilon_high",
    "delta",
    "kl_beta",
    "temperature",
)
# compose_loss keywords the trainer forwards unchanged: every other `ComposeConfig` key, in its
# order (the loss library's list, not a copy of it).
LOSS_KEYS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(ComposeConfig) if f.name not in CHANNEL1_KEYS
)


@dataclass(frozen=True, kw_only=True)
class ComposerSettings:
    """Every composer knob, resolved (config, then keyword overrides). See docs/trainer.md."""

    alpha_sdpo: float = _LOSS_DEFAULTS.alpha_sdpo
    beta_replay: float = _LOSS_DEFAULTS.beta_replay
    sdpo_jsd_beta: float = _LOSS_DEFAULTS.sdpo_jsd_beta
    sdpo_temperature: float = _LOSS_DEFAULTS.sdpo_temperature
    sdpo_token_clip: float | None = _LOSS_DEFAULTS.sdpo_token_clip
    sdpo_top_k: int | None = _LOSS_DEFAULTS.sdpo_top_k
    sdpo_add_tail: bool = _LOSS_DEFAULTS.sdpo_add_tail
    sdpo_wrapper: str = _LOSS_DEFAULTS.sdpo_wrapper
    sdpo_max_context_length: int | None = _LOSS_DEFAULTS.sdpo_max_context_length
    taid_t: float | None = _LOSS_DEFAULTS.taid_t
    taid_schedule_step: int | None = _LOSS_DEFAULTS.taid_schedule_step
    taid_total_steps: int | None = _LOSS_DEFAULTS.taid_total_steps
    entropy_opd_h_max: float = _LOSS_DEFAULTS.entropy_opd_h_max
    replay_dpo_beta: float = _LOSS_DEFAULTS.replay_dpo_beta
    dpo_variant: str = _LOSS_DEFAULTS.dpo_variant
    simpo_beta: float = _LOSS_DEFAULTS.simpo_beta
    simpo_gamma: float = _LOSS_DEFAULTS.simpo_gamma
    label_smoothing: float = _LOSS_DEFAULTS.label_smoothing
    # Channel-2 plumbing.
    sdpo_teacher: str = "policy"
    sdpo_ema_rate: float = 0.05
    sdpo_success_threshold: float = 0.5
    # Run the context prefix that several hinted rows share once (loss.sdpo_term's share_prefix):
    # the same logits up to float rounding, but RL amplifies rounding into another trajectory
    # (docs/trainer.md), so it is opt-in.
    sdpo_share_prefix: bool = False
    # Channel 2 from the last hidden states through the output layer (loss.fused_sdpo_term: no
    # (B, T, V) logits for the divergence) wherever it applies; False: always from the logits.
    sdpo_fused: bool = True
    # Its backend (loss.FUSED_JSD_BACKENDS): "auto" = our Triton kernels on CUDA, else PyTorch.
    sdpo_fused_backend: str = "auto"
    hint_template: HintTemplate = field(default_factory=HintTemplate)
    # Channel-3 plumbing.
    replay_max_length: int | None = None
    replay_skip_if_not_worse: bool = True

    def __post_init__(self) -> None:
        if self.sdpo_teacher not in ("policy", "ema"):
            raise ValueError(f"sdpo_teacher must be 'policy' or 'ema', got {self.sdpo_teacher!r}")
        if not 0.0 < self.sdpo_ema_rate <= 1.0:
            raise ValueError(f"sdpo_ema_rate must be in (0, 1], got {self.sdpo_ema_rate}")
        if self.sdpo_fused_backend not in FUSED_JSD_BACKENDS:
            raise ValueError(
                f"sdpo_fused_backend must be one of {', '.join(FUSED_JSD_BACKENDS)}, got "
                f"{self.sdpo_fused_backend!r}"
            )
        if self.replay_max_length is not None and self.replay_max_length < 1:
            raise ValueError("replay_max_length must be >= 1 or None")
        kwargs = self.loss_kwargs()
        if self.taid_scheduled:  # t comes from the TAIDCallback schedule at run time
            kwargs["taid_t"] = TAID_T_START
        ComposeConfig.from_kwargs(kwargs)  # validates every loss keyword now, not at step 1

    def loss_kwargs(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in LOSS_KEYS}

    @property
    def taid_scheduled(self) -> bool:
        """TAID with neither taid_t nor taid_schedule_step: t is driven by `TAIDCallback`."""
        return (
            self.sdpo_wrapper == "taid" and self.taid_t is None and self.taid_schedule_step is None
        )

    @classmethod
    def resolve(cls, args: object, overrides: Mapping[str, object]) -> ComposerSettings:
        """Settings from ``args`` (a `ComposerConfig`, or any object lacking the fields) + overrides."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(
                f"unknown ComposerReplicationTrainer keyword(s): {', '.join(unknown)} "
                f"(composer keywords: {', '.join(sorted(names))})"
            )
        values = {n: getattr(args, n) for n in names if hasattr(args, n)}
        values.update(overrides)
        values["hint_template"] = coerce_hint_template(values.get("hint_template"))
        return cls(**values)


# ComposerConfig's composer fields take their defaults from ComposerSettings (one source).
_SETTINGS_DEFAULTS = ComposerSettings()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class ComposerConfig(GRPOConfig):
    """`GRPOConfig` + the composer fields (same names and defaults as the trainer keywords:
    `ComposerSettings`', which are `loss.ComposeConfig`'s for the loss keywords)."""

    alpha_sdpo: float = field(
        default=_LOSS_DEFAULTS.alpha_sdpo, metadata={"help": "Channel-2 (SDPO) weight."}
    )
    beta_replay: float = field(
        default=_LOSS_DEFAULTS.beta_replay, metadata={"help": "Channel-3 (trace replay) weight."}
    )
    sdpo_jsd_beta: float = field(
        default=_LOSS_DEFAULTS.sdpo_jsd_beta,
        metadata={"help": "Generalized JSD beta (0 forward KL, 1 reverse KL)."},
    )
    sdpo_temperature: float = field(
        default=_LOSS_DEFAULTS.sdpo_temperature, metadata={"help": "Channel-2 temperature."}
    )
    sdpo_token_clip: float | None = field(
        default=_LOSS_DEFAULTS.sdpo_token_clip,
        metadata={"help": "Clip per-token channel-2 divergence at this value."},
    )
    sdpo_top_k: int | None = field(
        default=_LOSS_DEFAULTS.sdpo_top_k,
        metadata={"help": "Top-k vocabulary for channel 2 (None = full vocab)."},
    )
    sdpo_add_tail: bool = field(
        default=_LOSS_DEFAULTS.sdpo_add_tail, metadata={"help": "Top-k: add a tail bucket."}
    )
    sdpo_wrapper: str = field(
        default=_LOSS_DEFAULTS.sdpo_wrapper,
        metadata={"help": "Channel-2 divergence: none | taid | entropy_opd."},
    )
    sdpo_max_context_length: int | None = field(
        default=_LOSS_DEFAULTS.sdpo_max_context_length,
        metadata={"help": "Cap (tokens) on a hinted teacher context; cut from the middle."},
    )
    taid_t: float | None = field(
        default=_LOSS_DEFAULTS.taid_t, metadata={"help": "Fixed TAID t in [0, 1]."}
    )
    taid_schedule_step: int | None = field(
        default=_LOSS_DEFAULTS.taid_schedule_step,
        metadata={"help": "Linear TAID schedule step (with taid_total_steps)."},
    )
    taid_total_steps: int | None = field(
        default=_LOSS_DEFAULTS.taid_total_steps,
        metadata={"help": "TAID schedule length (default: max_steps)."},
    )
    entropy_opd_h_max: float = field(
        default=_LOSS_DEFAULTS.entropy_opd_h_max, metadata={"help": "Entropy-OPD gate (nats)."}
    )
    replay_dpo_beta: float = field(
        default=_LOSS_DEFAULTS.replay_dpo_beta, metadata={"help": "DPO beta for channel 3."}
    )
    dpo_variant: str = field(
        default=_LOSS_DEFAULTS.dpo_variant, metadata={"help": "Channel 3: dpo | simpo."}
    )
    simpo_beta: float = field(default=_LOSS_DEFAULTS.simpo_beta, metadata={"help": "SimPO beta."})
    simpo_gamma: float = field(
        default=_LOSS_DEFAULTS.simpo_gamma, metadata={"help": "SimPO margin gamma."}
    )
    label_smoothing: float = field(
        default=_LOSS_DEFAULTS.label_smoothing, metadata={"help": "Channel-3 label smoothing."}
    )
    sdpo_teacher: str = field(
        default=_SETTINGS_DEFAULTS.sdpo_teacher,
        metadata={"help": "Channel-2 teacher: policy (no grad) | ema."},
    )
    sdpo_ema_rate: float = field(
        default=_SETTINGS_DEFAULTS.sdpo_ema_rate, metadata={"help": "EMA teacher update rate."}
    )
    sdpo_success_threshold: float = field(
        default=_SETTINGS_DEFAULTS.sdpo_success_threshold,
        metadata={"help": "Reward at or above which a rollout counts as solved."},
    )
    sdpo_share_prefix: bool = field(
        default=_SETTINGS_DEFAULTS.sdpo_share_prefix,
        metadata={"help": "Teacher forward over shared context prefixes once (opt-in)."},
    )
    sdpo_fused: bool = field(
        default=_SETTINGS_DEFAULTS.sdpo_fused,
        metadata={
            "help": "Channel 2 from hidden states through the output layer where it applies."
        },
    )
    sdpo_fused_backend: str = field(
        default=_SETTINGS_DEFAULTS.sdpo_fused_backend,
        metadata={"help": "Fused channel-2 backend: auto | torch | triton | liger."},
    )
    hint_template: str | None = field(
        default=None,
        metadata={"help": "Teacher reprompt template with {prompt}, {solution}, {feedback}."},
    )
    replay_max_length: int | None = field(
        default=_SETTINGS_DEFAULTS.replay_max_length,
        metadata={"help": "Max chosen-trace tokens (default max_completion_length)."},
    )
    replay_skip_if_not_worse: bool = field(
        default=_SETTINGS_DEFAULTS.replay_skip_if_not_worse,
        metadata={"help": "Skip a pair when the rollout scored >= the trace."},
    )
    trace_files: list[str] | None = field(
        default=None, metadata={"help": "Trace JSONL file(s) to replay in channel 3."}
    )
    gradient_checkpointing: bool | None = field(  # type: ignore[assignment]
        default=None,
        metadata={"help": "Gradient checkpointing (default: True with CUDA, False on CPU)."},
    )

    def __post_init__(self) -> None:
        cuda = _cuda_available()
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = cuda
        if self.bf16 is None and not self.fp16 and not cuda:
            self.bf16 = False
        super().__post_init__()
