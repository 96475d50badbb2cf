"""The optimizer section of a trainer: ``actor.optimizer`` (AReaL's ``OptimizerConfig``).

AReaL's names and meaning (``areal/api/cli_args.py``): ``type``, ``lr``,
``weight_decay``, ``beta1``, ``beta2``, ``eps``, ``gradient_clipping`` (the max global
gradient norm), ``lr_scheduler_type`` (constant | linear | cosine),
``warmup_steps_proportion`` (warm-up steps = ``int(proportion * total_train_steps)``, the
lr rising linearly from 0) and ``min_lr_ratio`` (the floor of the decay, a fraction of
``lr``). The schedule itself is :func:`tapioca.trainers.optim.lr_factor`.

Defaults are Tapioca's where they differ from AReaL's, so a run behaves as it did
before the section existed: ``lr`` 5e-4 (AReaL 1e-3), ``weight_decay`` 0 (AReaL 0.01),
``warmup_steps_proportion`` 0 (AReaL 0.001, which rounds to no warm-up below 1000
steps anyway). ``min_lr_ratio`` also floors the ``linear`` decay (AReaL's FSDP engine
decays ``linear`` to 0 whatever it says, its Megatron engine floors it).

Used by the RL actor (:class:`~tapioca.config.schema.ActorConfig`) and the supervised
trainers' actor (:class:`~tapioca.config.supervised.SupervisedActorConfig`). The flat names
these replace (``actor.lr``, ``actor.weight_decay``, ``actor.adam_betas``,
``actor.max_grad_norm``) are still read for one release, with a warning
(:mod:`tapioca.config.loader`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas.errors import require_config as _require

LR_SCHEDULERS = ("constant", "linear", "cosine")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    # adam: AdamW (decoupled weight decay), AReaL's "adam"; with param_dtype bfloat16 on
    # fp32 master weights (actor.fp32_master_weights), which covers AReaL's "adam_bf16".
    type: str = "adam"
    lr: float = 5e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # The max global gradient norm (clipped before every optimizer step).
    gradient_clipping: float = 1.0
    lr_scheduler_type: str = "constant"
    warmup_steps_proportion: float = 0.0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        _require(self.type == "adam",
                 f"actor.optimizer.type={self.type!r}: only adam (AdamW) is implemented")
        _require(self.lr > 0, "actor.optimizer.lr must be > 0")
        _require(self.weight_decay >= 0, "actor.optimizer.weight_decay must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
                 "actor.optimizer.beta1 and beta2 must be in [0, 1)")
        _require(self.eps > 0, "actor.optimizer.eps must be > 0")
        _require(self.gradient_clipping > 0, "actor.optimizer.gradient_clipping (max gradient "
                 "norm) must be > 0")
        _require(self.lr_scheduler_type in LR_SCHEDULERS,
                 f"actor.optimizer.lr_scheduler_type={self.lr_scheduler_type!r}: use one of "
                 f"{', '.join(LR_SCHEDULERS)}")
        _require(0 <= self.warmup_steps_proportion < 1,
                 "actor.optimizer.warmup_steps_proportion must be in [0, 1)")
        _require(0 <= self.min_lr_ratio <= 1, "actor.optimizer.min_lr_ratio must be in [0, 1]")

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)
