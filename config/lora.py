"""LoRA runs: the adapter as every role sees it, cut from ``actor.*`` and ``gconfig.lora_name``.

``actor.use_lora`` (AReaL's names: ``actor.peft_type``, ``actor.lora_rank``,
``actor.lora_alpha``, ``actor.target_modules``; ``gconfig.lora_name``) trains a low-rank
adapter on the frozen base ``model.path``. The trainer, the rollout workers and the agent
proxy each get a :class:`LoraSpec` in their section (None: a full-weights run), so a
role never reads another's config section; :func:`check_lora_run` holds the value rules that
span sections. The defaults live in :class:`~tapioca.config.schema.ActorConfig`,
:class:`~tapioca.config.schema.GenerationConfig` and
:class:`~tapioca.config.servers.InferenceServerConfig`; nothing here restates one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schemas.errors import require_config as _require


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    peft_type: str
    rank: int
    alpha: int
    # actor.target_modules as configured (["all-linear"] or module names); peft resolves
    # them against the model (tapioca.models.lora.resolve_targets).
    target_modules: tuple[str, ...]
    # gconfig.lora_name: version v is "{name}-v{v}".
    name: str
    # rollout.server.max_lora_rank: the largest rank an engine takes.
    max_rank: int
    # Adapter versions a server keeps loaded (rollout.server.max_loaded_loras, or eta + 2).
    max_loaded: int


def lora_spec(cfg: Any) -> LoraSpec | None:
    """The run's adapter (``cfg`` a TrainConfig), or None when ``actor.use_lora`` is off."""
    a = cfg.actor
    if not a.use_lora:
        return None
    srv = cfg.rollout.server
    return LoraSpec(peft_type=a.peft_type, rank=a.lora_rank, alpha=a.lora_alpha,
                    target_modules=tuple(a.target_modules), name=cfg.gconfig.lora_name,
                    max_rank=srv.max_lora_rank,
                    max_loaded=srv.max_loaded_loras or cfg.rollout.max_head_offpolicyness + 2)


def check_lora_run(cfg: Any) -> None:
    """The rules of a LoRA run that span sections (``cfg`` a TrainConfig), each refused
    with the way out."""
    a, srv = cfg.actor, cfg.rollout.server
    _require(a.lora_rank <= srv.max_lora_rank,
             f"actor.lora_rank={a.lora_rank} is above rollout.server.max_lora_rank={srv.max_lora_rank}, "
             "the largest rank the engines accept: raise max_lora_rank or lower lora_rank")
    eta = cfg.rollout.max_head_offpolicyness
    _require(srv.max_loaded_loras == 0 or srv.max_loaded_loras >= eta + 2,
             f"rollout.server.max_loaded_loras={srv.max_loaded_loras} < max_head_offpolicyness + 2 = "
             f"{eta + 2}: a request sent with an adapter up to eta versions old must still find it "
             "loaded; raise it (or 0: eta + 2)")
    # Which features a LoRA run does not combine with (a critic, tensor / context
    # parallelism, tree training, a vision-language or mixture-of-experts model, target
    # modules the model lacks) are rows of config/features.py.
