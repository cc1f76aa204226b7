"""The :class:`Trainer` (a run's parts and one RL step) and how it is built from a config.

    from policygrad.trainer import Trainer

(The config and the errors live in :mod:`policygrad.config` and :mod:`policygrad.errors`; their
names stay importable from here.)
"""

from policygrad.config import ConfigError, TrainConfig, load_config
from policygrad.errors import CheckpointError, TrainingError
from policygrad.trainer.loop import Trainer

__all__ = ["CheckpointError", "ConfigError", "TrainConfig", "Trainer", "TrainingError", "load_config"]
