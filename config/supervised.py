"""Configuration of the supervised trainers: SFT, DPO, Bradley-Terry reward model, and
knowledge distillation (``tapioca sft|dpo|rm|distill``).

They share the RL run's sections where the meaning is the same — ``model``
(:class:`ModelConfig`), ``bus`` (:class:`BusConfig`), ``run_dir`` /
``experiment_name`` / ``trial_name``, ``actor.optimizer`` (AReaL's optimizer section) —
and add a ``train_dataset`` section for their data. Algorithm switches use TRL's
names (``beta``, ``loss_type``, ``label_smoothing``, ``center_rewards_coefficient``).
Each ``__post_init__`` validates its own fields and says how to fix a bad value.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ..bus.settings import BusConfig
from ..schemas.errors import require_config as _require
from .evaluation import EvalConfig, EvalGenerationConfig, EvaluatorConfig
from .optimizer import OptimizerConfig
from .schema import DatasetConfig, ModelConfig, RolloutConfig
from .stats_logger import StatsLoggerConfig

DATA_SOURCES = ("file", "synthetic", "topics", "archive")


@dataclass(frozen=True, kw_only=True)
class SupervisedDatasetConfig:
    # file: JSONL / Parquet / save_to_disk rows; synthetic: the built-in task (answers
    # as responses; a wrong answer as the rejected response of a pair); topics: a run's
    # trajectories.v1 + rewards.v1 on the broker; archive: a Parquet archive of them.
    source: str = "synthetic"
    path: str = ""
    split: str = "train"
    # Examples (SFT, distillation) or pairs (DPO, reward model) per optimizer step.
    batch_size: int = 16
    # Token budget of prompt + response; longer examples are skipped and counted.
    max_length: int = 1024
    shuffle: bool = True
    # 0 = every example the source yields.
    max_examples: int = 0
    # Column names of file rows. A row has `messages` (chat; the last message is the
    # assistant's response) or `prompt` + `response` (falling back to `answer`); a
    # preference row has `prompt` + `chosen` + `rejected` (strings or message lists).
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    # Logs (topics / archive): only this run's trajectories ("" = every run found), read
    # under this topic prefix ("" = bus.topic_prefix).
    run_id: str = ""
    topic_prefix: str = ""
    # SFT from logs (rejection-sampling fine-tuning): keep trajectories with reward >= this.
    min_reward: float = 1.0
    # Logs with several reward sources: {scorer: weight}, as advantage.reward_weights
    # (empty = the first reward of a trajectory from any scorer).
    reward_weights: dict[str, float] = field(default_factory=dict)
    # topics: the end of a topic is "nothing new for this long".
    read_idle_s: float = 1.0
    # Keyword arguments of the synthetic task, e.g. {op: max}.
    task_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.source in DATA_SOURCES,
                 f"train_dataset.source={self.source!r}: use one of {', '.join(DATA_SOURCES)}")
        _require(self.source not in ("file", "archive") or bool(self.path),
                 f"train_dataset.path is required for train_dataset.source={self.source} "
                 "(a .jsonl/.parquet file, or an archive directory / Parquet file)")
        _require(self.batch_size >= 1, "train_dataset.batch_size must be >= 1")
        _require(self.max_length >= 2, "train_dataset.max_length must be >= 2 tokens")
        _require(self.max_examples >= 0, "train_dataset.max_examples must be >= 0 (0 = all)")
        _require(self.read_idle_s > 0, "train_dataset.read_idle_s must be > 0")
        _require(math.isfinite(self.min_reward), "train_dataset.min_reward must be a finite number")


@dataclass(frozen=True, kw_only=True)
class SupervisedActorConfig:
    """The fields of the RL ``actor`` section that mean the same in a supervised trainer."""

    # AReaL's actor.optimizer (config/optimizer.py); was actor.lr, actor.adam_betas, ...
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Tokens per micro-batch (prompt + response, both sides of a pair); gradients
    # accumulate across micro-batches of one step.
    mb_max_tokens: int = 16384
    # Tokens per chunk when computing logprobs / KL from hidden states.
    logprob_chunk_tokens: int = 4096
    device: str = "cpu"
    param_dtype: str = "float32"
    autocast_dtype: str = ""
    torch_threads: int = 1

    def __post_init__(self) -> None:
        _require(self.mb_max_tokens >= 16, "actor.mb_max_tokens must be >= 16")
        _require(self.logprob_chunk_tokens >= 1, "actor.logprob_chunk_tokens must be >= 1")
        _require(self.param_dtype in ("float32", "bfloat16"),
                 "actor.param_dtype must be float32 or bfloat16")
        _require(self.autocast_dtype in ("", "bfloat16", "float16"),
                 "actor.autocast_dtype must be empty (off), bfloat16 or float16")
        _require(self.torch_threads >= 1, "actor.torch_threads must be >= 1")


@dataclass(frozen=True, kw_only=True)
class SupervisedTrainConfig:
    experiment_name: str = "supervised"
    trial_name: str = "trial0"
    seed: int = 1
    # Weights, checkpoints, metrics and the final model go to run_dir/experiment/trial.
    run_dir: str = "runs"
    total_train_steps: int = 100
    # > 0: stop after this many passes over the data (or total_train_steps, if fewer).
    total_train_epochs: int = 0
    # > 0: stop once training has run this long (seconds, start-up not counted), saving
    # weights, checkpoint and final/ as at the end (a rerun resumes from there).
    time_limit_s: float = 0.0
    # Save weights (+ a WeightsEvent when a broker is configured) and a checkpoint
    # every this many steps; the last step is always saved.
    save_every_steps: int = 50
    keep_weight_versions: int = 8
    # When model.path is empty: the task whose alphabet the tiny model's char
    # tokenizer covers (the model is created under the run directory).
    tiny_task: str = "synthetic"
    bus: BusConfig = field(default_factory=BusConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: SupervisedActorConfig = field(default_factory=SupervisedActorConfig)
    train_dataset: SupervisedDatasetConfig = field(default_factory=SupervisedDatasetConfig)
    # Metrics to Weights & Biases / MLflow too (off by default; config/stats_logger.py).
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)

    def __post_init__(self) -> None:
        _require(self.total_train_steps >= 1, "total_train_steps must be >= 1")
        _require(self.total_train_epochs >= 0, "total_train_epochs must be >= 0 (0 = off)")
        _require(self.save_every_steps >= 1, "save_every_steps must be >= 1")
        _require(self.keep_weight_versions >= 0, "keep_weight_versions must be >= 0 (0 = keep all)")
        _require(self.time_limit_s >= 0 and math.isfinite(self.time_limit_s),
                 "time_limit_s must be >= 0 seconds (0 = no limit)")

    @property
    def run_id(self) -> str:
        return f"{self.experiment_name}.{self.trial_name}"

    @property
    def run_path(self) -> str:
        return os.path.join(self.run_dir, self.experiment_name, self.trial_name)


# The eval metrics SFT can stop at: greedy, or pass@j / avg@j / maj@j with j <= eval.k.
_STOP_METRIC = re.compile(r"greedy|(pass|avg|maj)@(\d+)")


@dataclass(frozen=True, kw_only=True)
class SFTConfig(SupervisedTrainConfig):
    """Supervised fine-tuning: masked NLL over response tokens only.

    Held-out evaluation while training (docs/supervised-trainers.md): with
    ``valid_dataset`` and an ``evaluator`` trigger (``freq_steps``, ``freq_secs``,
    ``eval_before_train``; the RL run's sections, the same meaning) the trainer's current
    weights are loaded into an engine of ``rollout.*`` in this process and scored as
    `tapioca eval` scores them (``eval``, ``eval_gconfig``); the last step is always
    evaluated. ``stop_at_eval`` ends training at the first evaluation whose
    ``eval/<stop_at_eval_metric>`` reaches it: ``total_train_steps`` is then a cap."""

    experiment_name: str = "sft"
    valid_dataset: Optional[DatasetConfig] = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Sampling of the eval.k completions; null fields take GenerationConfig's defaults
    # (max_new_tokens 8: set eval_gconfig.max_new_tokens for anything longer).
    eval_gconfig: EvalGenerationConfig = field(default_factory=EvalGenerationConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    # The evaluation's engine (rollout.device must be actor.device: one process).
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Stop at the first evaluation with eval/<stop_at_eval_metric> >= this (null: never).
    stop_at_eval: Optional[float] = None
    stop_at_eval_metric: str = "greedy"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(not self.evaluator.enabled or self.valid_dataset is not None,
                 "evaluator.* asks for held-out evaluations but valid_dataset is not set: set "
                 "valid_dataset (e.g. valid_dataset.type=arith valid_dataset.split=test) or unset "
                 "the evaluator's triggers")
        _require(self.evaluator.freq_epochs is None,
                 "evaluator.freq_epochs counts RL epochs of prompts; during SFT use "
                 "evaluator.freq_steps or evaluator.freq_secs")
        _require(self.valid_dataset is None or self.rollout.device == self.actor.device,
                 f"the held-out evaluation's engine runs in the trainer's process: set "
                 f"rollout.device={self.actor.device} (now {self.rollout.device})")
        _require(self.stop_at_eval is None or self.evaluator.enabled,
                 "stop_at_eval needs held-out evaluations: set valid_dataset and evaluator.freq_steps "
                 "(or evaluator.freq_secs)")
        _require(self.stop_at_eval is None or math.isfinite(self.stop_at_eval),
                 "stop_at_eval must be a finite number (or null: never stop early)")
        match = _STOP_METRIC.fullmatch(self.stop_at_eval_metric)
        _require(match is not None, f"stop_at_eval_metric={self.stop_at_eval_metric!r}: use greedy, "
                 "pass@J, avg@J or maj@J")
        assert match is not None
        _require(match.group(2) is None or int(match.group(2)) <= self.eval.k,
                 f"stop_at_eval_metric={self.stop_at_eval_metric} needs eval.k >= {match.group(2)}")
        _require(self.stop_at_eval_metric != "greedy" or self.eval.greedy or self.stop_at_eval is None,
                 "stop_at_eval_metric=greedy needs eval.greedy=true")


@dataclass(frozen=True, kw_only=True)
class DPOConfig(SupervisedTrainConfig):
    """Direct preference optimisation against a frozen reference model."""

    experiment_name: str = "dpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo
    label_smoothing: float = 0.0
    # Empty: a frozen copy of the initial policy (model.path); else a local HF directory.
    ref_model_path: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.beta > 0, "beta must be > 0")
        _require(self.loss_type in ("sigmoid", "ipo"), f"loss_type={self.loss_type!r}: use sigmoid or ipo")
        _require(0 <= self.label_smoothing < 0.5, "label_smoothing must be in [0, 0.5)")
        _require(self.label_smoothing == 0 or self.loss_type == "sigmoid",
                 "label_smoothing applies to loss_type=sigmoid only; set it to 0 for ipo")


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig(SupervisedTrainConfig):
    """Bradley-Terry reward model: a sequence-classification head (one label) on the
    policy's backbone."""

    experiment_name: str = "rm"
    center_rewards_coefficient: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self.center_rewards_coefficient >= 0, "center_rewards_coefficient must be >= 0")


@dataclass(frozen=True, kw_only=True)
class DistillConfig(SupervisedTrainConfig):
    """Knowledge distillation on a fixed dataset: forward KL(teacher ‖ student) on dataset tokens,
    optionally mixed with the NLL of those tokens."""

    experiment_name: str = "distill"
    # A local HF directory with the teacher (same tokenizer / vocabulary as the student).
    teacher_path: str = ""
    kd_coef: float = 1.0
    nll_coef: float = 0.0
    # Softmax temperature of both models inside the KL (no tau^2 rescaling).
    temperature: float = 1.0
    teacher_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(bool(self.teacher_path), "teacher_path is required: a local Hugging Face model directory")
        _require(self.kd_coef >= 0 and self.nll_coef >= 0, "kd_coef and nll_coef must be >= 0")
        _require(self.kd_coef + self.nll_coef > 0, "kd_coef + nll_coef must be > 0")
        _require(self.temperature > 0, "temperature must be > 0")
        _require(self.teacher_dtype in (None, "float32", "bfloat16", "float16"),
                 "teacher_dtype must be null (= model.dtype), float32, bfloat16 or float16")
