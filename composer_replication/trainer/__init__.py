"""`ComposerReplicationTrainer` (TRL GRPOTrainer + channels 2 and 3), its config and callbacks."""

from composer_replication.trainer.callbacks import EMATeacherCallback, TAIDCallback
from composer_replication.trainer.config import ComposerConfig, ComposerSettings
from composer_replication.trainer.trainer import ComposerReplicationTrainer

__all__ = [
    "ComposerConfig",
    "ComposerReplicationTrainer",
    "ComposerSettings",
    "EMATeacherCallback",
    "TAIDCallback",
]
