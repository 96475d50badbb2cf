"""Each role process gets only its own section of the run's configuration.

The launcher writes the whole :class:`TrainConfig` once; a role's builder
(:mod:`tapioca.runtime.builders`) makes its section here and hands it to the role,
which never sees the rest. Sections are frozen and keyword-only, like the config they
are cut from: the values come from the config (whose dataclasses hold every default
and validate it, cross-section checks included, in :class:`TrainConfig`), so a section
restates no default and validates nothing again. Its scalar fields are required; its
config sections default to that config's own defaults (handy for tests).

The sections of the roles that run the policy (the feeder, the rollout workers, the
trainer, the proxy) carry its :class:`~tapioca.config.policy.PolicySpec`, resolved once
by the builder from the model directory (config/policy.py); without one (a test, a
direct caller) a section gets what the config alone tells (``resolve_policy(cfg,
read_dir=False)``). Their ``lora`` is the spec's adapter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..schemas.errors import ConfigError
from .distributed import FSDPConfig
from .lora import LoraSpec
from .policy import PolicySpec, resolve_policy
from .schema import (
    ActorConfig,
    AdvantageConfig,
    AgentConfig,
    ArchiveConfig,
    CriticConfig,
    DatasetConfig,
    DistillConfig,
    EvalConfig,
    EvaluatorConfig,
    GenerationConfig,
    ModelConfig,
    ProxyConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    VlmConfig,
    admission_of,
)
from .stats_logger import StatsLoggerConfig
from .supervised import SFTConfig
from .weights import WeightsConfig


@dataclass(frozen=True, kw_only=True)
class FeederSection:
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model_path: str
    n_samples: int
    max_head_offpolicyness: int
    seed: int
    # The run id on the bus (TrainConfig.bus_run_id): the feeder's group ids carry it.
    run_id: str
    # Where a dataset's images are stored and what is accepted (docs/vlm.md).
    vlm: VlmConfig = field(default_factory=VlmConfig)
    # What the policy is (config/policy.py): its vision tower encodes the prompts' images.
    policy: PolicySpec = field(default_factory=PolicySpec)


@dataclass(frozen=True, kw_only=True)
class RolloutSection:
    model: ModelConfig = field(default_factory=ModelConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int
    # What the policy is (config/policy.py); its adapter (actor.lora.enabled) is the one the
    # engine serves (None: full weights).
    policy: PolicySpec = field(default_factory=PolicySpec)
    # The image store the prompts' images are read from (docs/vlm.md).
    vlm: VlmConfig = field(default_factory=VlmConfig)
    # Record routed experts on trajectories: rollout.return_routed_experts, or
    # actor.moe.router_replay R3 (which needs them); routes beyond the inline limit go to
    # <run_dir>/blobs ("": no run directory, every route inline).
    record_routes: bool = False
    run_dir: str = ""

    @property
    def lora(self) -> LoraSpec | None:
        return self.policy.adapter


@dataclass(frozen=True, kw_only=True)
class RewardSection:
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass(frozen=True, kw_only=True)
class AdvantageSection:
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    # The generation limit (gconfig.max_new_tokens): the overlong penalty's L_max.
    max_new_tokens: int
    # gconfig.n_samples (checked against dynamic sampling by TrainConfig).
    n_samples: int


@dataclass(frozen=True, kw_only=True)
class TrainerSection:
    actor: ActorConfig = field(default_factory=ActorConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    max_head_offpolicyness: int
    prompts_per_step: int
    total_train_steps: int
    # Trainer logprobs use the rollout temperature, so ratios compare like with like.
    temperature: float
    run_dir: str
    seed: int
    stop_at_reward: float | None
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
    # The image store and freeze_vision_encoder of a vision-language policy (docs/vlm.md).
    vlm: VlmConfig = field(default_factory=VlmConfig)
    # W&B / MLflow besides metrics.jsonl and TensorBoard (trainers/metrics_sink.py).
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    # How the trainer publishes its versions (weights/publisher.py).
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    # What the policy is (config/policy.py); its adapter (actor.lora.enabled) is the one
    # trained and published (None: full weights).
    policy: PolicySpec = field(default_factory=PolicySpec)
    # agent.mode online: a group past the tail gate is trained within
    # actor.late_reward_max_offpolicyness or dead-lettered with the reason.
    online: bool = False
    # rollout.enable_sleep_mode: an engine on the trainer's GPU takes its KV cache back
    # when the next version comes, so the trainer returns its cached free memory to the
    # device after each step, before publishing (torch.cuda.empty_cache).
    release_memory_after_step: bool = False

    @property
    def lora(self) -> LoraSpec | None:
        return self.policy.adapter


@dataclass(frozen=True, kw_only=True)
class ProxySection:
    """What `tapioca proxy` needs: the engine's model and sampling defaults, the head
    gate's eta and B, and its own HTTP/session settings."""

    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    max_head_offpolicyness: int
    prompts_per_step: int
    run_id: str
    seed: int
    # What the policy is (config/policy.py); its adapter (actor.lora.enabled) is the one the
    # engine serves (None: full weights).
    policy: PolicySpec = field(default_factory=PolicySpec)
    # Where the images of image_url parts are stored and what is accepted (docs/vlm.md).
    vlm: VlmConfig = field(default_factory=VlmConfig)
    # agent.mode online: sessions ended without a reward wait on the log for one (no
    # reward 0 at end); admission: proxy.admission resolved (config/schema.py admission_of).
    online: bool = False
    admission: str = "wait"
    # How long after its end a session still takes a reward: the advantage processor's
    # wait (advantage.reward_timeout_s, else group_timeout_s) less a margin.
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)

    @property
    def lora(self) -> LoraSpec | None:
        return self.policy.adapter


@dataclass(frozen=True, kw_only=True)
class ArchiveSection:
    """What the archiver needs: its own settings and the resolved output directory."""

    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    dir: str
    # The run's image store: the images events name are copied into <dir>/images.
    image_store: str = ""


@dataclass(frozen=True, kw_only=True)
class AgentSection:
    """What an agent runner needs: its workflow, the prompts, the sampling settings of
    its chat calls, and where the proxy is (address and admin key)."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    run_id: str
    seed: int


@dataclass(frozen=True, kw_only=True)
class EvalSection:
    """What an evaluation needs (`tapioca eval`, the evaluator role): the held-out
    dataset, what to measure, the sampling of its completions (``eval_gconfig`` over
    ``gconfig``, with ``n_samples`` = ``eval.k``), the engine's model and rollout settings,
    and for the evaluator its triggers and the facts they are computed from."""

    valid_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sampling: GenerationConfig = field(default_factory=GenerationConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int
    run_dir: str
    total_train_steps: int
    # train_dataset.prompts_per_step: an epoch is (train prompts / this) steps.
    prompts_per_step: int


def _policy(cfg: TrainConfig, policy: PolicySpec | None) -> PolicySpec:
    """The builder's resolved policy, else what the config alone tells."""
    return policy if policy is not None else resolve_policy(cfg, read_dir=False)


def feeder_section(cfg: TrainConfig, policy: PolicySpec | None = None) -> FeederSection:
    return FeederSection(train_dataset=cfg.train_dataset, model_path=cfg.model.path,
                         n_samples=cfg.gconfig.n_samples,
                         max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
                         seed=cfg.seed, run_id=cfg.bus_run_id, vlm=cfg.vlm, policy=_policy(cfg, policy))


def rollout_section(cfg: TrainConfig, policy: PolicySpec | None = None) -> RolloutSection:
    return RolloutSection(model=cfg.model, gconfig=cfg.gconfig, rollout=cfg.rollout, seed=cfg.seed,
                          vlm=cfg.vlm, record_routes=records_routes(cfg), run_dir=cfg.run_path,
                          policy=_policy(cfg, policy))


def records_routes(cfg: TrainConfig) -> bool:
    """Whether the run's engines record routed experts (the rollout workers, the proxy)."""
    return cfg.rollout.return_routed_experts or cfg.actor.moe.router_replay == "R3"


def reward_section(cfg: TrainConfig) -> RewardSection:
    return RewardSection(reward=cfg.reward)


def advantage_section(cfg: TrainConfig) -> AdvantageSection:
    return AdvantageSection(advantage=cfg.advantage, max_new_tokens=cfg.gconfig.max_new_tokens,
                            n_samples=cfg.gconfig.n_samples)


def trainer_section(cfg: TrainConfig, policy: PolicySpec | None = None) -> TrainerSection:
    temperature = cfg.gconfig.temperature if cfg.gconfig.temperature > 0 else 1.0
    return TrainerSection(actor=cfg.actor, model=cfg.model,
                          max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
                          prompts_per_step=cfg.train_dataset.prompts_per_step,
                          total_train_steps=cfg.total_train_steps, temperature=temperature,
                          run_dir=cfg.run_path, seed=cfg.seed, stop_at_reward=cfg.stop_at_reward,
                          advantage=cfg.advantage, critic=cfg.critic, ref=cfg.ref,
                          distill=cfg.distill, bus_run_id=cfg.bus_run_id, fsdp=cfg.fsdp,
                          stats_logger=cfg.stats_logger, weights=cfg.weights,
                          online=cfg.agent.online, vlm=cfg.vlm, policy=_policy(cfg, policy),
                          release_memory_after_step=bool(cfg.rollout.enable_sleep_mode))


def proxy_section(cfg: TrainConfig, policy: PolicySpec | None = None) -> ProxySection:
    return ProxySection(proxy=cfg.proxy, model=cfg.model, gconfig=cfg.gconfig, rollout=cfg.rollout,
                        max_head_offpolicyness=cfg.rollout.max_head_offpolicyness,
                        prompts_per_step=cfg.train_dataset.prompts_per_step,
                        run_id=cfg.bus_run_id, seed=cfg.seed, online=cfg.agent.online,
                        admission=admission_of(cfg.proxy, cfg.agent), advantage=cfg.advantage,
                        vlm=cfg.vlm, policy=_policy(cfg, policy))


def archive_section(cfg: TrainConfig) -> ArchiveSection:
    return ArchiveSection(archive=cfg.archive,
                          dir=cfg.archive.dir or os.path.join(cfg.run_path, "archive"),
                          image_store=cfg.vlm.image_store)


def agent_section(cfg: TrainConfig) -> AgentSection:
    return AgentSection(agent=cfg.agent, train_dataset=cfg.train_dataset, gconfig=cfg.gconfig,
                        proxy=cfg.proxy, run_id=cfg.bus_run_id, seed=cfg.seed)


def eval_section(cfg: TrainConfig) -> EvalSection:
    if cfg.valid_dataset is None:
        raise ConfigError("no evaluation dataset: set valid_dataset in the config (e.g. "
                          "valid_dataset.type=gsm8k valid_dataset.split=test) or pass --data PATH")
    sampling = GenerationConfig(n_samples=cfg.eval.k, **cfg.eval_gconfig.resolve(cfg.gconfig))
    return EvalSection(valid_dataset=cfg.valid_dataset, eval=cfg.eval, sampling=sampling,
                       evaluator=cfg.evaluator, model=cfg.model, rollout=cfg.rollout,
                       seed=cfg.seed, run_dir=cfg.run_path,
                       total_train_steps=cfg.total_train_steps,
                       prompts_per_step=cfg.train_dataset.prompts_per_step)


def sft_eval_section(cfg: SFTConfig) -> EvalSection:
    """The held-out evaluation of an SFT run (runtime/sft_eval.py): its sections as an
    RL run's evaluator gets them, sampling over GenerationConfig's defaults."""
    if cfg.valid_dataset is None:
        raise ConfigError("no evaluation dataset: set valid_dataset in the SFT config (e.g. "
                          "valid_dataset.type=arith valid_dataset.split=test)")
    sampling = GenerationConfig(n_samples=cfg.eval.k, **cfg.eval_gconfig.resolve(GenerationConfig()))
    return EvalSection(valid_dataset=cfg.valid_dataset, eval=cfg.eval, sampling=sampling,
                       evaluator=cfg.evaluator, model=cfg.model, rollout=cfg.rollout,
                       seed=cfg.seed, run_dir=cfg.run_path, total_train_steps=cfg.total_train_steps,
                       prompts_per_step=cfg.train_dataset.batch_size)
