"""The algorithm sections of a training run's configuration (re-exported by
:mod:`tapioca.config.schema`, where callers import them from).

``advantage.adv_norm`` (:class:`NormConfig`), ``advantage.reward_norm``
(:class:`RewardNormConfig`), ``actor.rejection_sampling``
(:class:`RejectionSamplingConfig`), and the sections of the extra models:
``critic`` (:class:`CriticConfig`), ``ref`` (:class:`RefConfig`), ``distill``
(:class:`DistillConfig`). AReaL's field names; each ``__post_init__`` validates its
section and says how to fix a bad value (the math checks are the algorithms' own,
e.g. :func:`tapioca.algorithms.rejection_sampling.check_rejection_sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from ..schemas.errors import ConfigError
from ..schemas.errors import require_config as _require


@dataclass(frozen=True, kw_only=True)
class NormConfig:
    """Reward-to-advantage normalisation, AReaL's ``NormConfig`` names.

    ``mean_level`` / ``std_level``: ``group`` (the samples of one prompt), ``batch``
    (one training batch) or ``none`` (``null`` is read as ``none``). Group levels are
    applied by the advantage processor, which sees one group at a time; batch levels
    by the trainer over each training batch, after the group levels (and after GAE
    for ``estimator: gae``). ``A = (r - b) / (std + eps)`` with ``b`` the (leave-one-
    out) mean and the std taken around ``b`` (population std unless ``std_unbiased``).
    ``group_size`` is accepted so AReaL configs load (``${gconfig.n_samples}``), but
    groups are keyed by ``group_id``: when set it must equal ``gconfig.n_samples``
    (checked by ``TrainConfig``) and it changes nothing else.
    ``group_unit``: what one element of the group levels' mean and std is: ``sequence``
    (the default: one value per sample, the GRPO paper's, verl's and TRL's) or
    ``token`` (AReaL's: every trained token, so a sample weighs its trained tokens;
    docs/algorithms.md says why the default differs). Batch levels are always per token.
    """

    #: The config key this section sits under (error messages name it).
    where: ClassVar[str] = "advantage.adv_norm"

    mean_level: Optional[str] = "group"
    mean_leave1out: bool = False
    std_level: Optional[str] = "group"
    std_unbiased: bool = False
    eps: float = 1e-6
    # AReaL's name; only checked against gconfig.n_samples (see the class docstring).
    group_size: Optional[int] = None
    # Group levels over samples (sequence) or over trained tokens (token: AReaL's math).
    group_unit: str = "sequence"

    def __post_init__(self) -> None:
        from ..algorithms.errors import AlgorithmInputError

        # null is read as none (frozen: normalised once, here).
        object.__setattr__(self, "mean_level", self.mean_level or "none")
        object.__setattr__(self, "std_level", self.std_level or "none")
        if self.group_size is not None and self.group_size < 1:
            raise ConfigError(f"{self.where}.group_size={self.group_size} must be >= 1 "
                              "(or null: groups are the samples of one prompt)")
        try:
            self._check()
        except AlgorithmInputError as exc:
            raise ConfigError(f"{self.where}: {exc}") from None

    def _check(self) -> None:
        from ..algorithms.advantages import check_norm

        check_norm(**self.as_kwargs())

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``normalize_group`` / ``normalize_batch``."""
        return {"mean_level": self.mean_level, "std_level": self.std_level,
                "mean_leave1out": self.mean_leave1out, "std_unbiased": self.std_unbiased,
                "eps": self.eps, "group_unit": self.group_unit}

    def spec(self) -> str:
        """One canonical line naming this normalisation (``SampleEvent.adv_norm``: the
        trainer checks the processor normalised as its own config says)."""
        # The unit only when it is not the default: specs of older events stay equal.
        unit = f" unit={self.group_unit}" if self.group_unit != "sequence" else ""
        return (f"mean={self.mean_level} std={self.std_level} "
                f"leave1out={int(self.mean_leave1out)} unbiased={int(self.std_unbiased)} "
                f"eps={self.eps:g}{unit}")


def reward_norm_spec(norm: Optional[NormConfig]) -> str:
    """``SampleEvent.reward_norm``: the reward normalisation's :meth:`NormConfig.spec`,
    or ``"none"`` when it is unset or does nothing (both levels none), so a processor
    and a trainer that agree it is off compare equal."""
    if norm is None or (norm.mean_level == "none" and norm.std_level == "none"):
        return "none"
    return norm.spec()


@dataclass(frozen=True, kw_only=True)
class RewardNormConfig(NormConfig):
    """``advantage.reward_norm`` (AReaL's ``actor.reward_norm``): the same fields as
    ``adv_norm``, applied by the advantage processor to each group's shaped rewards
    (after ``reward_bias``/``reward_scaling``/``reward_clip``) before the estimator, so
    the normalised reward is what GRPO's group levels, the trainer's batch levels and
    GAE see. The processor sees one group at a time, so only ``group`` and ``none``
    levels exist here (a ``batch`` level is refused; use ``adv_norm`` batch levels).
    Unset (the default): rewards go to the estimator as shaped.
    """

    where: ClassVar[str] = "advantage.reward_norm"

    def _check(self) -> None:
        from ..algorithms.advantages import check_reward_norm

        check_reward_norm(**self.as_kwargs())


@dataclass(frozen=True, kw_only=True)
class RejectionSamplingConfig:
    """``actor.rejection_sampling`` (AReaL's names and defaults): drop or clamp tokens
    whose proximal-vs-behaviour divergence is out of bounds. IcePop = {level: token,
    action: mask, metric: ratio, lower: 0.5, upper: 5}, the published bounds; KPop = metric binary_kl. See
    tapioca.algorithms.rejection_sampling for the formulas."""

    # token: each token on its own; sequence: one decision per sequence.
    level: str = "token"
    # mask: out-of-bounds tokens get loss 0; clamp: their weight is clamped (ratio only).
    action: str = "mask"
    # ratio (pi_prox/pi_behav) | kl_k1 | kl_k2 | kl_k3 | binary_kl
    metric: str = "ratio"
    # Sequence-level aggregation of the metric: sum | mean | max (ratio: in log space).
    agg: str = "mean"
    upper: float = 5.0
    lower: Optional[float] = None

    def __post_init__(self) -> None:
        from ..algorithms.errors import AlgorithmInputError
        from ..algorithms.rejection_sampling import check_rejection_sampling

        try:
            check_rejection_sampling(self)
        except AlgorithmInputError as exc:
            raise ConfigError(f"actor.{exc}") from None


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """The value model of PPO with a critic (``advantage.estimator: gae``); AReaL's
    ``critic`` section (``eps_clip`` is the value-clip range, AReaL's ``value_eps_clip``)."""

    # A local HF directory for the value model's backbone. Empty: the policy's
    # (model.path), read when the trainer starts.
    path: str = ""
    # True: the backbone starts from the checkpoint's weights (the value head is new,
    # zero-initialised, so V starts at 0). False: random backbone from its config.
    init_critic_from_actor: bool = True
    eps_clip: float = 0.5
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = 1.0
    ppo_n_minibatches: int = 1
    # Tokens per micro-batch (prompt + output) for the value model's forward/backward.
    mb_max_tokens: int = 16384

    def __post_init__(self) -> None:
        _require(self.eps_clip > 0, "critic.eps_clip (value clip) must be > 0")
        _require(self.lr > 0, "critic.lr must be > 0")
        _require(self.ppo_n_minibatches >= 1, "critic.ppo_n_minibatches must be >= 1")
        _require(self.mb_max_tokens >= 16, "critic.mb_max_tokens must be >= 16")


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    """The frozen reference policy for ``actor.kl_ctl > 0`` (AReaL's ``ref`` section)."""

    # A local HF directory. Empty: the initial policy (model.path), frozen.
    path: str = ""


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """On-policy distillation in the RL loop: a teacher scores the sampled tokens and
    each token gets ``rl_weight * A_rl + kd_weight * A_kd`` with
    ``A_kd_t = -(logp_student_t - logp_teacher_t)`` (per-token reverse-KL estimate).
    ``rl_weight: 0`` is pure on-policy KD."""

    # A local HF directory with the same vocabulary as the policy. Required when
    # kd_weight > 0.
    teacher_path: str = ""
    kd_weight: float = 0.0
    rl_weight: float = 1.0

    def __post_init__(self) -> None:
        _require(self.kd_weight >= 0, "distill.kd_weight must be >= 0 (0 = no distillation)")
        _require(self.rl_weight >= 0, "distill.rl_weight must be >= 0")
        _require(self.rl_weight > 0 or self.kd_weight > 0,
                 "distill.rl_weight and distill.kd_weight are both 0: nothing would train; "
                 "set rl_weight 1 (RL) or kd_weight > 0 (distillation)")
        _require(self.kd_weight == 0 or bool(self.teacher_path),
                 "distill.teacher_path is required when distill.kd_weight > 0: point it to "
                 "a local HF model directory with the policy's vocabulary")
