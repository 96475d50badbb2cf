"""Each role process gets only its own section of the run's configuration.

The launcher writes the whole :class:`TrainConfig` once; a role's entry point builds
its section here and never sees the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class FeederSection:
    train_dataset: DatasetConfig
    model_path: str
    n_samples: int
    max_head_offpolicyness: int
    seed: int


@dataclass
class RolloutSection:
    model: ModelConfig
    gconfig: GenerationConfig
    rollout: RolloutConfig
    seed: int


@dataclass
class RewardSection:
    reward: RewardConfig


@dataclass
class AdvantageSection:
    advantage: AdvantageConfig


@dataclass
class TrainerSection:
    actor: ActorConfig
    model: ModelConfig
    max_head_offpolicyness: int
    prompts_per_step: int
    total_train_steps: int
    # Trainer logprobs use the rollout temperature, so ratios compare like with like.
    temperature: float
    run_dir: str
    seed: int
    stop_at_reward: float | None = None


def feeder_section(cfg: TrainConfig) -> FeederSection:
    return FeederSection(cfg.train_dataset, cfg.model.path, cfg.gconfig.n_samples,
                         cfg.rollout.max_head_offpolicyness, cfg.seed)


def rollout_section(cfg: TrainConfig) -> RolloutSection:
    return RolloutSection(cfg.model, cfg.gconfig, cfg.rollout, cfg.seed)


def reward_section(cfg: TrainConfig) -> RewardSection:
    return RewardSection(cfg.reward)


def advantage_section(cfg: TrainConfig) -> AdvantageSection:
    return AdvantageSection(cfg.advantage)


def trainer_section(cfg: TrainConfig) -> TrainerSection:
    temperature = cfg.gconfig.temperature if cfg.gconfig.temperature > 0 else 1.0
    return TrainerSection(cfg.actor, cfg.model, cfg.rollout.max_head_offpolicyness,
                          cfg.train_dataset.prompts_per_step, cfg.total_train_steps,
                          temperature, cfg.run_path, cfg.seed, cfg.stop_at_reward)
