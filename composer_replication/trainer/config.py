"""Composer settings: the `ComposerConfig` (a TRL ``GRPOConfig``) and the resolved `ComposerSettings`.

`ComposerConfig` is for users who configure through TRL's argument parser (``TrlParser`` /
``HfArgumentParser``); every composer field is also a keyword of `ComposerReplicationTrainer`,
and keyword arguments override the config. The trainer resolves both into one immutable
`ComposerSettings`, validated once at construction (the compose_loss keywords through
``loss.ComposeConfig``), so a bad value fails before the first rollout.

The loss settings of channels 2 and 3 are declared once, in the loss library
(``loss.loss_settings.Channel23Settings``: type, default, check, help); both classes here inherit
them, so a setting added there is a trainer keyword, a `ComposerConfig` field and a command-line
flag with nothing to write here. Channel 1 is TRL's loss: ``GRPOConfig``'s own fields.

CPU-safe defaults: GRPOConfig defaults ``bf16=True`` and ``gradient_checkpointing=True`` (GPU
settings). `ComposerConfig` leaves them unset and resolves them in ``__post_init__``: without a
CUDA device both become False; with one, TRL's defaults apply. Explicit values always win.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from composer_replication.data.hints import HintTemplate, coerce_hint_template
from composer_replication.loss import (
    FUSED_JSD_BACKENDS,
    TAID_T_START,
    Channel1Settings,
    Channel23Settings,
    ComposeConfig,
    WriteOnce,
    sdpo_wrappers,
    setting_names,
)

try:
    from trl import GRPOConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "composer_replication.trainer needs TRL; install it with "
        "`pip install composer-replication[train]`."
    ) from exc

# The trainer's one runtime loss keyword that is not a user's loss setting: the step on the TAID
# schedule (given, or driven by `TAIDCallback`). Its default is the loss library's.
_TAID_SCHEDULE_STEP: int | None = ComposeConfig().taid_schedule_step

# compose_loss keywords of channel 1, which is TRL's own loss (GRPOConfig configures it): the
# loss library's `Channel1Settings` and the sampling temperature.
CHANNEL1_KEYS: tuple[str, ...] = (*setting_names(Channel1Settings), "temperature")
# compose_loss keywords the trainer forwards unchanged: the loss library's `Channel23Settings`
# (its fields are `ComposerSettings`' and `ComposerConfig`'s by inheritance) and the TAID step.
LOSS_KEYS: tuple[str, ...] = (*setting_names(Channel23Settings), "taid_schedule_step")


@dataclass(kw_only=True)
class ComposerSettings(Channel23Settings, WriteOnce):
    """Every composer knob, resolved (config, then keyword overrides). See docs/trainer.md.

    The loss settings are the loss library's `Channel23Settings` (inherited: one declaration
    each); immutable after construction (`WriteOnce`: a frozen dataclass cannot inherit them)."""

    taid_schedule_step: int | None = _TAID_SCHEDULE_STEP
    # Channel-2 plumbing.
    sdpo_teacher: str = "policy"
    sdpo_ema_rate: float = 0.05
    sdpo_success_threshold: float = 0.5
    # The teacher-advantage gate (trainer `_gate_on_teacher`): hinted rows whose teacher is
    # sampled and scored per generation batch (0: not measured, the gate stays open), whether
    # channel 2 distils nothing while its hinted teacher is not better than its student, and over
    # how many probed rows that is decided (trainer/gate.py: open while the window's mean
    # teacher-minus-student difference exceeds its standard error).
    sdpo_teacher_probe: int = 8
    sdpo_gate: bool = True
    sdpo_gate_window: int = 64
    # Run the context prefix that several hinted rows share once (loss.sdpo_term's share_prefix):
    # the same logits up to float rounding, but RL amplifies rounding into another trajectory
    # (docs/trainer.md), so it is opt-in.
    sdpo_share_prefix: bool = False
    # Channel 2 from the last hidden states through the output layer (loss.fused_sdpo_term: no
    # (B, T, V) logits for the divergence) wherever it applies; False: always from the logits.
    sdpo_fused: bool = True
    # Its backend (loss.FUSED_JSD_BACKENDS): "auto" = our Triton kernels on CUDA, else PyTorch.
    sdpo_fused_backend: str = "auto"
    # Channel 3 from the last hidden states through the output layer (loss.fused_replay_term: no
    # (N, T, V) logits for either side of a pair) wherever it applies; False: from the logits.
    replay_fused: bool = True
    hint_template: HintTemplate = field(default_factory=HintTemplate)
    # Channel 1 on the rows a dataset marks as hinted examples (its `data.HINTED_EXAMPLE_COLUMN`,
    # written by `Task.to_dataset` with `hint_share`): True (the default, TRL's behaviour) gives
    # them advantage like any row; False zeroes their GRPO advantage, so a prompt shown with its
    # solution teaches reading the hint through channels 2 and 3 only (a dataset without the
    # column: no row is hinted).
    hint_grpo: bool = True
    # Channel-3 plumbing.
    replay_max_length: int | None = None
    replay_skip_if_not_worse: bool = True
    # Replay only traces the verifier scored at least this (None: every trace).
    replay_min_trace_reward: float | None = None

    def __post_init__(self) -> None:
        if self.sdpo_teacher not in ("policy", "ema"):
            raise ValueError(f"sdpo_teacher must be 'policy' or 'ema', got {self.sdpo_teacher!r}")
        if not 0.0 < self.sdpo_ema_rate <= 1.0:
            raise ValueError(f"sdpo_ema_rate must be in (0, 1], got {self.sdpo_ema_rate}")
        if (
            isinstance(self.sdpo_teacher_probe, bool)
            or not isinstance(self.sdpo_teacher_probe, int)
            or self.sdpo_teacher_probe < 0
        ):
            raise ValueError(
                f"sdpo_teacher_probe must be an int >= 0, got {self.sdpo_teacher_probe!r}"
            )
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
        return sdpo_wrappers.get(self.sdpo_wrapper).needs_schedule(self)

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
class ComposerConfig(GRPOConfig, Channel23Settings):
    """`GRPOConfig` + the composer fields (same names and defaults as the trainer keywords,
    `ComposerSettings`'): the loss settings by inheritance from the loss library's
    `Channel23Settings` (type, default and help declared once), the others below."""

    taid_schedule_step: int | None = field(
        default=_TAID_SCHEDULE_STEP,
        metadata={"help": "Linear TAID schedule step (with taid_total_steps)."},
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
    sdpo_teacher_probe: int = field(
        default=_SETTINGS_DEFAULTS.sdpo_teacher_probe,
        metadata={
            "help": "Hinted rows per generation batch whose teacher is sampled and scored "
            "(sdpo/teacher_advantage); 0 = not measured."
        },
    )
    sdpo_gate: bool = field(
        default=_SETTINGS_DEFAULTS.sdpo_gate,
        metadata={
            "help": "Channel 2 distils only while its measured teacher advantage over the last "
            "sdpo_gate_window probed rows exceeds its standard error."
        },
    )
    sdpo_gate_window: int = field(
        default=_SETTINGS_DEFAULTS.sdpo_gate_window,
        metadata={"help": "Probed hinted rows the teacher gate decides on (trainer/gate.py)."},
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
    replay_fused: bool = field(
        default=_SETTINGS_DEFAULTS.replay_fused,
        metadata={
            "help": "Channel 3 from hidden states through the output layer where it applies."
        },
    )
    hint_grpo: bool = field(
        default=_SETTINGS_DEFAULTS.hint_grpo,
        metadata={
            "help": "Channel-1 advantage on the dataset's hinted examples (column "
            "hinted_example); False zeroes it: they train through channels 2 and 3 only."
        },
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
    replay_min_trace_reward: float | None = field(
        default=_SETTINGS_DEFAULTS.replay_min_trace_reward,
        metadata={"help": "Replay only traces scored at least this (unscored ones never)."},
    )
    trace_files: list[str] | None = field(
        default=None, metadata={"help": "Trace JSONL file(s) to replay in channel 3."}
    )
    gradient_checkpointing: bool | None = field(  # type: ignore[assignment]
        default=None,
        metadata={"help": "Gradient checkpointing (default: True with CUDA, False on CPU)."},
    )

    def __post_init__(self) -> None:
        # The loss settings' own checks (loss_settings.Channel23Settings): a bad value fails when
        # the arguments are parsed. TRL's __post_init__ chain ends in TrainingArguments', which
        # does not call on, so the base's is called here.
        Channel23Settings.__post_init__(self)
        cuda = _cuda_available()
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = cuda
        if self.bf16 is None and not self.fp16 and not cuda:
            self.bf16 = False
        super().__post_init__()
