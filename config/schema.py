"""The configuration of a training run: dataclasses, one section per concern.

Field names follow AReaL where AReaL has one (``gconfig.n_samples``,
``rollout.max_head_offpolicyness``, ``actor.eps_clip``); new names carry their unit
(``prompts_per_step``, ``max_new_tokens``, ``timeout_s``). Each ``__post_init__``
validates its own section and says how to fix a bad value. Each role process is
handed only the sections it needs (see :mod:`tapioca.config.sections`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tapioca.bus.settings import BusConfig
from tapioca.schemas.errors import ConfigError


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass
class ModelConfig:
    # A local Hugging Face directory (config + weights + tokenizer). Empty: the
    # launcher creates the tiny built-in model for `tiny_task` under the run dir.
    path: str = ""
    arch: str = "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    dtype: str = "float32"
    init_seed: int = 0

    def __post_init__(self) -> None:
        _require(self.arch in ("qwen2", "qwen3", "llama"),
                 f"model.arch={self.arch!r}: use qwen2, qwen3 or llama")
        _require(self.dtype in ("float32", "bfloat16", "float16"),
                 f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")


@dataclass
class DatasetConfig:
    # synthetic (built-in), gsm8k, or a file: jsonl / parquet / hf_disk
    type: str = "synthetic"
    path: str = ""
    split: str = "train"
    # Groups (prompts) per training step: B in the head gate k < (eta + v + 1) * B.
    prompts_per_step: int = 16
    max_epochs: int = 1000
    shuffle: bool = True
    prompt_key: str = "question"
    answer_key: str = "answer"
    # Keyword arguments of a built-in task, e.g. {op: copy} for the synthetic task.
    task_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.type in ("synthetic", "gsm8k", "jsonl", "parquet", "hf_disk"),
                 f"train_dataset.type={self.type!r}: use synthetic, gsm8k, jsonl, parquet "
                 "or hf_disk")
        _require(self.type == "synthetic" or bool(self.path),
                 f"train_dataset.path is required for train_dataset.type={self.type}")
        _require(self.prompts_per_step >= 1, "train_dataset.prompts_per_step must be >= 1")
        _require(self.max_epochs >= 1, "train_dataset.max_epochs must be >= 1")


@dataclass
class GenerationConfig:
    n_samples: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(self.n_samples >= 1, "gconfig.n_samples must be >= 1")
        _require(self.max_new_tokens >= 1, "gconfig.max_new_tokens must be >= 1")
        _require(self.temperature >= 0, "gconfig.temperature must be >= 0")
        _require(0 < self.top_p <= 1, "gconfig.top_p must be in (0, 1]")


@dataclass
class RolloutConfig:
    # eta: how many versions a trained token may lag the trainer. 0 = synchronous RL.
    max_head_offpolicyness: int = 2
    workers: int = 1
    max_batch_size: int = 256
    # Continue in-flight sequences across a weight update (their later tokens carry
    # the new version) instead of waiting for them to finish.
    interruptible: bool = True
    device: str = "cpu"
    torch_threads: int = 1

    def __post_init__(self) -> None:
        _require(self.max_head_offpolicyness >= 0,
                 "rollout.max_head_offpolicyness must be >= 0 (0 = synchronous)")
        _require(self.workers >= 1, "rollout.workers must be >= 1")


@dataclass
class RewardConfig:
    # Built-in scorer: "auto" picks the task's own reward (synthetic / math).
    scorer: str = "auto"
    workers: int = 1
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _require(self.timeout_s > 0, "reward.timeout_s must be > 0")


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"  # grpo | dr_grpo | rloo
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: Optional[float] = None
    eps: float = 1e-6
    std_unbiased: bool = False
    # A group still missing trajectories or rewards this long after its first event is
    # dropped (counted as rejected by the trainer, so the head gate frees its slot).
    group_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _require(self.group_timeout_s > 0, "advantage.group_timeout_s must be > 0")
        _require(self.estimator in ("grpo", "dr_grpo", "rloo"),
                 f"advantage.estimator={self.estimator!r}: use grpo, dr_grpo or rloo")
        _require(self.reward_clip is None or self.reward_clip > 0,
                 "advantage.reward_clip must be > 0 (or null for no clipping)")
        _require(self.reward_scaling != 0, "advantage.reward_scaling must not be 0")


@dataclass
class ActorConfig:
    lr: float = 5e-4
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = 1.0
    eps_clip: float = 0.2
    eps_clip_higher: Optional[float] = None
    c_clip: Optional[float] = None
    behav_imp_weight_cap: Optional[float] = None
    # Tokens per micro-batch (prompt + output); gradients accumulate across them.
    mb_max_tokens: int = 16384
    # Tokens per chunk when computing logprobs / entropy from hidden states.
    logprob_chunk_tokens: int = 4096
    ppo_n_minibatches: int = 1
    recompute_logprob: bool = True
    device: str = "cpu"
    # Master weights and optimizer state stay in param_dtype; forward/backward run
    # under autocast_dtype when set (e.g. bfloat16 on GPU). Published weights use
    # model.dtype, the inference dtype.
    param_dtype: str = "float32"
    autocast_dtype: str = ""
    torch_threads: int = 1
    # 1 makes restarts exact. Larger values save time, but a crash (kill -9) between
    # checkpoints re-trains the groups of the steps after the last checkpoint.
    checkpoint_every_steps: int = 1

    def __post_init__(self) -> None:
        _require(self.lr > 0, "actor.lr must be > 0")
        _require(0 < self.eps_clip < 1, "actor.eps_clip must be in (0, 1)")
        _require(self.eps_clip_higher is None or self.eps_clip_higher > 0,
                 "actor.eps_clip_higher must be > 0 (or null: same as eps_clip)")
        _require(self.c_clip is None or self.c_clip > 1,
                 "actor.c_clip (dual clip) must be > 1 (or null: off)")
        _require(self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1,
                 "actor.behav_imp_weight_cap must be > 1 (or null: off)")
        _require(self.mb_max_tokens >= 16, "actor.mb_max_tokens must be >= 16")
        _require(self.ppo_n_minibatches >= 1, "actor.ppo_n_minibatches must be >= 1")
        _require(self.checkpoint_every_steps >= 1, "actor.checkpoint_every_steps must be >= 1")
        _require(self.param_dtype in ("float32", "bfloat16"),
                 "actor.param_dtype must be float32 or bfloat16")
        _require(self.autocast_dtype in ("", "bfloat16", "float16"),
                 "actor.autocast_dtype must be empty (off), bfloat16 or float16")


@dataclass
class TrainConfig:
    experiment_name: str = "demo"
    trial_name: str = "trial0"
    seed: int = 1
    # Weights, checkpoints, metrics and logs go to run_dir/experiment_name/trial_name.
    run_dir: str = "runs"
    total_train_steps: int = 100
    # Stop early once the mean reward of a step reaches this (None: run all steps).
    stop_at_reward: Optional[float] = None
    bus: BusConfig = field(default_factory=BusConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)

    def __post_init__(self) -> None:
        _require(self.total_train_steps >= 1, "total_train_steps must be >= 1")

    @property
    def run_id(self) -> str:
        return f"{self.experiment_name}.{self.trial_name}"

    @property
    def run_path(self) -> str:
        import os

        return os.path.join(self.run_dir, self.experiment_name, self.trial_name)

