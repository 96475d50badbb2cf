"""Typed configuration: dataclasses + YAML + dotted overrides (AReaL-style names)."""

from tapioca.config.loader import load_config, to_yaml
from tapioca.config.schema import (
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
