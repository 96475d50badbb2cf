"""The mixture-of-experts section of the RL trainer: ``actor.moe`` (docs/models.md).

How the trainer treats the MoE layers of its policy (Qwen3-MoE on the packed forward):
the router's precision (``router_dtype``, Megatron's ``moe_router_dtype``), the router
losses (``aux_loss_coeff``, ``z_loss_coeff``: Megatron's ``moe_aux_loss_coeff`` and
``moe_z_loss_coeff``), a frozen router (``freeze_router``: verl / NeMo-RL's
``freeze_moe_router``), and routing replay (``router_replay``: verl's modes disabled / R2 /
R3; ``router_replay_missing``: what R3 does with a sequence without its routes). The
rollout side of R3 is ``rollout.return_routed_experts`` (AReaL's name), in the rollout
section.

:class:`MoeConfig` is the one source of these defaults and of their value checks; the
rules with other features are rows of config/features.py (a dense model, tree training,
a vision-language model), and those with other ``actor`` fields
:class:`~tapioca.config.schema.ActorConfig`'s. The flat names it replaces
(``actor.moe_router_dtype``, ``actor.moe_aux_loss_coeff``, ``actor.moe_z_loss_coeff``,
``actor.freeze_moe_router``, ``actor.router_replay``, ``actor.router_replay_missing``)
are still read for one release, with a warning (:mod:`tapioca.config.loader`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas.errors import require_config as _require

# Megatron's spellings first; "none": the activation dtype (models/moe.py ROUTER_DTYPES).
ROUTER_DTYPE_NAMES = ("fp32", "float32", "fp64", "float64", "none")
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    # The router's logits and softmax: fp32 (Megatron / AReaL's recommendation; the paged
    # engine routes in fp32 too) | fp64 | none (the activation dtype, as HF computes it).
    router_dtype: str = "fp32"
    # Load-balancing loss (Megatron's switch loss, 1.0 when balanced) and router z-loss,
    # each summed over MoE layers and added to the policy loss times its coefficient.
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    # Keep the routers' weights fixed: they get no optimizer updates; the experts and
    # everything else train.
    freeze_router: bool = False
    # Routing replay: disabled | R2 (the update replays the routes of the trainer's own
    # first pass over the batch, its pi_prox forward) | R3 (the recompute and the update
    # replay the rollout's routes, recorded by the engine: rollout.return_routed_experts).
    # Either way the router's gradient flows through its live probabilities at the
    # replayed experts. Packed forward, MoE models only.
    router_replay: str = "disabled"
    # R3 and a sequence without its routes (an engine that does not record them, a blob
    # that is gone): live (route it with the trainer's router; counted in
    # trainer/routes_missing) | reject (dead-letter its group).
    router_replay_missing: str = "live"

    def __post_init__(self) -> None:
        _require(self.router_dtype in ROUTER_DTYPE_NAMES,
                 f"actor.moe.router_dtype={self.router_dtype!r}: use fp32, fp64 or none (the "
                 "activation dtype)")
        _require(self.aux_loss_coeff >= 0 and self.z_loss_coeff >= 0,
                 "actor.moe.aux_loss_coeff and actor.moe.z_loss_coeff must be >= 0 (0 = off)")
        _require(self.router_replay in ROUTER_REPLAY_MODES,
                 f"actor.moe.router_replay={self.router_replay!r}: use disabled, R2 (replay the "
                 "trainer's first pass) or R3 (replay the rollout's routes)")
        _require(self.router_replay_missing in ("live", "reject"),
                 f"actor.moe.router_replay_missing={self.router_replay_missing!r}: use live (the "
                 "trainer's router) or reject (dead-letter the group)")
