"""Teacher clients for channel 3 traces: one protocol, three implementations, and a pool."""

from composer_replication.data.teachers.base import (
    TeacherClient,
    TeacherCompletion,
    TeacherError,
)
from composer_replication.data.teachers.hf_model import HFModelTeacher
from composer_replication.data.teachers.openai_compat import OpenAICompatibleTeacher, TeacherUsage
from composer_replication.data.teachers.oracle import OracleTeacher
from composer_replication.data.teachers.pool import PoolStats, TeacherPool, bake_traces

__all__ = [
    "HFModelTeacher",
    "OpenAICompatibleTeacher",
    "OracleTeacher",
    "PoolStats",
    "TeacherClient",
    "TeacherCompletion",
    "TeacherError",
    "TeacherPool",
    "TeacherUsage",
    "bake_traces",
]
