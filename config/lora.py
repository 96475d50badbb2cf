"""LoRA runs: the ``actor.lora`` section, and the adapter as every role sees it.

``actor.lora.enabled`` trains a low-rank adapter (``actor.lora.peft_type``,
``rank``, ``alpha``, ``target_modules``; the adapter's name ``gconfig.lora_name``) on
the frozen base ``model.path``. :class:`LoraConfig` is the section, the one source of
these defaults and of their value checks. AReaL's flat names (``actor.use_lora``,
``actor.peft_type``, ``actor.lora_rank``, ``actor.lora_alpha``, ``actor.target_modules``)
are still read for one release, with a warning (:mod:`tapioca.config.loader`).

The trainer, the rollout workers and the agent proxy each get a :class:`LoraSpec` in
their section (None: a full-weights run), cut once by :func:`lora_spec` from this section,
``gconfig.lora_name`` and ``rollout.server``, so a role never reads another's config
section; :func:`check_lora_run` holds the value rules that span sections. The spec has no
defaults of its own: :class:`LoraConfig`, :class:`~tapioca.config.schema.GenerationConfig`
and :class:`~tapioca.config.servers.InferenceServerConfig` hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..schemas.errors import require_config as _require


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """``actor.lora``: peft's LoRA (prime-rl's ``lora`` section; AReaL's ``use_lora``,
    ``lora_rank``, ``lora_alpha``, ``target_modules`` without the prefix)."""

    # Train a low-rank adapter (peft) on the frozen base model.path instead of every
    # weight: checkpoints, weight events and final/ then carry the adapter only.
    enabled: bool = False
    # peft's PeftType: lora only (a name for DoRA and the like later).
    peft_type: str = "lora"
    rank: int = 32
    alpha: int = 16
    # peft's target_modules: module names (q_proj, v_proj, ...) or [all-linear] (every
    # linear layer but the LM head).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])

    def __post_init__(self) -> None:
        _require(self.peft_type == "lora",
                 f"actor.lora.peft_type={self.peft_type!r}: only lora is supported")
        _require(self.rank >= 1, "actor.lora.rank must be >= 1 (16 or 32 are usual)")
        _require(self.alpha > 0, "actor.lora.alpha must be > 0 (the adapter's scale is alpha / rank)")
        _require(bool(self.target_modules) and all(bool(m) for m in self.target_modules),
                 "actor.lora.target_modules must name modules (e.g. [q_proj, v_proj]) or be [all-linear]")


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    peft_type: str
    rank: int
    alpha: int
    # actor.lora.target_modules as configured (["all-linear"] or module names); peft
    # resolves them against the model (tapioca.models.lora.resolve_targets).
    target_modules: tuple[str, ...]
    # gconfig.lora_name: version v is "{name}-v{v}".
    name: str
    # rollout.server.max_lora_rank: the largest rank an engine takes.
    max_rank: int
    # Adapter versions a server keeps loaded (rollout.server.max_loaded_loras, or eta + 2).
    max_loaded: int


def lora_spec(cfg: Any) -> LoraSpec | None:
    """The run's adapter (``cfg`` a TrainConfig), or None when ``actor.lora.enabled`` is off."""
    lora = cfg.actor.lora
    if not lora.enabled:
        return None
    srv = cfg.rollout.server
    return LoraSpec(peft_type=lora.peft_type, rank=lora.rank, alpha=lora.alpha,
                    target_modules=tuple(lora.target_modules), name=cfg.gconfig.lora_name,
                    max_rank=srv.max_lora_rank,
                    max_loaded=srv.max_loaded_loras or cfg.rollout.max_head_offpolicyness + 2)


def check_lora_run(cfg: Any) -> None:
    """The rules of a LoRA run that span sections (``cfg`` a TrainConfig), each refused
    with the way out."""
    lora, srv = cfg.actor.lora, cfg.rollout.server
    _require(lora.rank <= srv.max_lora_rank,
             f"actor.lora.rank={lora.rank} is above rollout.server.max_lora_rank={srv.max_lora_rank}, "
             "the largest rank the engines accept: raise max_lora_rank or lower actor.lora.rank")
    eta = cfg.rollout.max_head_offpolicyness
    _require(srv.max_loaded_loras == 0 or srv.max_loaded_loras >= eta + 2,
             f"rollout.server.max_loaded_loras={srv.max_loaded_loras} < max_head_offpolicyness + 2 = "
             f"{eta + 2}: a request sent with an adapter up to eta versions old must still find it "
             "loaded; raise it (or 0: eta + 2)")
    # Which features a LoRA run does not combine with (a critic, tensor / context
    # parallelism, tree training, a vision-language or mixture-of-experts model, target
    # modules the model lacks) are rows of config/features.py.
