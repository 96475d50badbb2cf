"""Typed configuration: dataclasses + YAML + dotted overrides (AReaL-style names)."""

from .loader import load_config, to_yaml
from .schema import (
    ActorConfig,
    AdvantageConfig,
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)

__all__ = [name for name in dir() if not name.startswith("_")]
