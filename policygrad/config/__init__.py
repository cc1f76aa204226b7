"""The typed config tree: sections, validation, YAML and ``--key=value`` loading.

    from policygrad.config import TrainConfig, load_config, ConfigError
"""

from policygrad.config.sections import ConfigError
from policygrad.config.train import TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config"]
