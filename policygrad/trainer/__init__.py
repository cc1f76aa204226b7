"""Training runs: the typed config, the :class:`Trainer` that runs one, and their errors.

    from policygrad.trainer import Trainer, TrainConfig, load_config, ConfigError
"""

from policygrad.trainer.config import ConfigError, TrainConfig, load_config
from policygrad.trainer.errors import CheckpointError, TrainingError
from policygrad.trainer.loop import Trainer

__all__ = ["CheckpointError", "ConfigError", "TrainConfig", "Trainer", "TrainingError", "load_config"]
