"""The `[teachers]` section: where channel 3's teacher traces come from.

The teacher clients' own config, beside them (`openai_compat.OpenAICompatibleTeacher` for an
endpoint, `oracle.OracleTeacher`, `pool.TeacherPool`); the run schema (`config.schema.RunConfig`)
composes it. Each key's default and help are written once, here (`fields.setting`).
"""

from __future__ import annotations

from dataclasses import dataclass

from composer_replication.fields import require, setting

__all__ = ["EndpointConfig", "TeachersConfig"]


@dataclass(frozen=True)
class EndpointConfig:
    """An OpenAI-compatible teacher endpoint (channel 3 traces)."""

    name: str = setting("teacher", "label recorded in the traces")
    base_url: str = setting("", "e.g. https://openrouter.ai/api/v1 or http://127.0.0.1:8000/v1")
    model: str = setting("", "model name sent to the endpoint")
    api_key_env: str = setting("OPENAI_API_KEY", "environment variable holding the API key")
    max_tokens: int = setting(256, "completion tokens per trace")
    temperature: float = setting(0.7, "sampling temperature")

    def __post_init__(self) -> None:
        # from_dict prefixes these with the entry's path, e.g. "teachers.endpoints[0]".
        require(bool(self.base_url), "base_url", "must be set")
        require(bool(self.model), "model", "must be set")


@dataclass(frozen=True)
class TeachersConfig:
    """Where channel 3's teacher traces come from."""

    oracle: bool = setting(
        True, "replay the task's oracle solutions when no endpoint/traces are given"
    )
    traces_path: str = setting(
        "", "pre-baked traces JSONL (from `composer-replication bake-traces`)"
    )
    endpoints: list[EndpointConfig] = setting(
        [], "OpenAI-compatible teachers ([[teachers.endpoints]])"
    )
    min_reward: float | None = setting(
        None,
        "replay only traces the task's verifier scored at least this (a trace it rejects, or "
        "one not scored, is never a target; rejection-sampling fine-tuning's filter); unset = "
        "every trace",
    )
