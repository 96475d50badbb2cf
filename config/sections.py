"""Each role process gets only its own section of the run's configuration.

The launcher writes the whole :class:`TrainConfig` once; a role's entry point builds
its section here and never sees the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tapioca.config.distributed import FSDPConfig
from tapioca.config.schema import (
    ActorConfig,
    AdvantageConfig,
    AgentConfig,
    ArchiveConfig,
    CriticConfig,
    DatasetConfig,
    DistillConfig,
    GenerationConfig,
    ModelConfig,
    ProxyConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from tapioca.schemas.errors import ConfigError


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
    # The generation limit (gconfig.max_new_tokens): the overlong penalty's L_max.
    max_new_tokens: int = 0
    # gconfig.n_samples: dynamic sampling would filter every group of one sample.
    n_samples: int = 0

    def __post_init__(self) -> None:
        a = self.advantage
        if a.overlong_reward_penalty and a.overlong_tokens is not None:
            if a.overlong_tokens > self.max_new_tokens:
                raise ConfigError(
                    f"advantage.overlong_tokens={a.overlong_tokens} exceeds "
                    f"gconfig.max_new_tokens={self.max_new_tokens}; the penalised tail "
                    "must fit inside the generation limit")
        if a.dynamic_sampling and self.n_samples == 1:
            raise ConfigError(
                "advantage.dynamic_sampling with gconfig.n_samples=1 would filter every "
                "group (one sample has no reward variance); raise n_samples or turn it off")


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
    # The trainer's token-level parts: the estimator picks GAE (with the critic) or
    # returns, the normalisation levels pick batch statistics (see token_advantages).
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    # The run id on the bus (one per broker lifetime, TrainConfig.bus_run_id); "" when
    # the trainer is used without a launcher-resolved run.
    bus_run_id: str = ""
    # fsdp.world_size > 1: the data-parallel FSDP2 trainer (trainers/fsdp_actor.py).
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


def feeder_section(cfg: TrainConfig) -> FeederSection:
    return FeederSection(cfg.train_dataset, cfg.model.path, cfg.gconfig.n_samples,
                         cfg.rollout.max_head_offpolicyness, cfg.seed)


def rollout_section(cfg: TrainConfig) -> RolloutSection:
    return RolloutSection(cfg.model, cfg.gconfig, cfg.rollout, cfg.seed)


def reward_section(cfg: TrainConfig) -> RewardSection:
    return RewardSection(cfg.reward)


def advantage_section(cfg: TrainConfig) -> AdvantageSection:
    return AdvantageSection(cfg.advantage, cfg.gconfig.max_new_tokens, cfg.gconfig.n_samples)


def trainer_section(cfg: TrainConfig) -> TrainerSection:
    temperature = cfg.gconfig.temperature if cfg.gconfig.temperature > 0 else 1.0
    return TrainerSection(cfg.actor, cfg.model, cfg.rollout.max_head_offpolicyness,
                          cfg.train_dataset.prompts_per_step, cfg.total_train_steps,
                          temperature, cfg.run_path, cfg.seed, cfg.stop_at_reward,
                          advantage=cfg.advantage, critic=cfg.critic, ref=cfg.ref,
                          distill=cfg.distill, bus_run_id=cfg.bus_run_id, fsdp=cfg.fsdp)


@dataclass
class ProxySection:
    """What `tapioca proxy` needs: the engine's model and sampling defaults, the head
    gate's eta and B, and its own HTTP/session settings."""

    proxy: ProxyConfig
    model: ModelConfig
    gconfig: GenerationConfig
    rollout: RolloutConfig
    max_head_offpolicyness: int
    prompts_per_step: int
    run_id: str
    seed: int


def proxy_section(cfg: TrainConfig) -> ProxySection:
    return ProxySection(cfg.proxy, cfg.model, cfg.gconfig, cfg.rollout,
                        cfg.rollout.max_head_offpolicyness, cfg.train_dataset.prompts_per_step,
                        cfg.bus_run_id, cfg.seed)


@dataclass
class ArchiveSection:
    """What the archiver needs: its own settings and the resolved output directory."""

    archive: ArchiveConfig
    dir: str


def archive_section(cfg: TrainConfig) -> ArchiveSection:
    import os

    return ArchiveSection(cfg.archive, cfg.archive.dir or os.path.join(cfg.run_path, "archive"))


@dataclass
class AgentSection:
    """What an agent runner needs: its workflow, the prompts, the sampling settings of
    its chat calls, and where the proxy is (address and admin key)."""

    agent: AgentConfig
    train_dataset: DatasetConfig
    gconfig: GenerationConfig
    proxy: ProxyConfig
    run_id: str
    seed: int


def agent_section(cfg: TrainConfig) -> AgentSection:
    return AgentSection(cfg.agent, cfg.train_dataset, cfg.gconfig, cfg.proxy, cfg.bus_run_id,
                        cfg.seed)
