"""Whether the trainer's (dp, cp, tp) mesh can split a model: its shape's divisibility by
the tensor / context parallel sizes, and, for a live model, its MLPs.

Consumes a model's shape (heads, key/value heads, intermediate size, vocabulary: from the
config, :func:`check_model_parallel`) or a live ``transformers`` causal LM (walked for the
same numbers and for mixture-of-experts layers, :func:`check_parallel_model`), and the
mesh (``config.distributed.FSDPConfig``, or anything with ``tp``, ``cp`` and
``describe()``); emits nothing, or a ConfigError that names the setting to change.
Keyed by nothing.

Here, not in ``config/``, because one of the two walks a live model (torch modules);
``config/distributed.py`` checks the tiny model's shape at load with
:func:`check_model_parallel`, and this module imports torch only inside
:func:`check_parallel_model`.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..schemas.errors import ConfigError
from ..schemas.errors import require_config as _require


class Mesh(Protocol):
    """The trainer's mesh as these checks read it (config.distributed.FSDPConfig)."""

    @property
    def tp(self) -> int: ...

    @property
    def cp(self) -> int: ...

    def describe(self) -> str: ...


def check_model_parallel(fsdp: Mesh, *, n_heads: int, n_kv_heads: int, intermediate_size: int,
                         vocab_size: int | None, where: str) -> None:
    """Refuse a model shape the mesh cannot split (``where`` names the model in the message)."""
    tp, cp = fsdp.tp, fsdp.cp
    if tp > 1:
        for what, n in (("attention heads", n_heads), ("key/value heads", n_kv_heads),
                        ("intermediate_size", intermediate_size), ("vocabulary", vocab_size)):
            _require(n is None or n % tp == 0,
                     f"{where} has {n} {what}, not divisible by fsdp.tensor_parallel_size={tp}: "
                     "pick a tensor_parallel_size that divides it (or 1)")
    if cp > 1:
        _require(n_heads % (tp * cp) == 0,
                 f"{where} has {n_heads} attention heads, not divisible by tensor_parallel_size x "
                 f"context_parallel_size = {tp * cp} (Ulysses gives each cp rank heads / cp of a "
                 "tp rank's heads): lower context_parallel_size")
        kv_local = n_kv_heads // tp
        _require(kv_local % cp == 0 or cp % kv_local == 0,
                 f"{where} has {kv_local} key/value heads per tp rank, which context_parallel_size="
                 f"{cp} neither divides nor is a multiple of: pick a cp that divides {kv_local} "
                 f"or is a multiple of it")


def check_parallel_model(model: Any, fsdp: Mesh) -> None:
    """Refuse a model the mesh cannot split (``model``: a transformers causal LM)."""
    from .forward import decoder_body

    cfg = model.config
    attn = decoder_body(model).layers[0].self_attn
    check_model_parallel(fsdp, n_heads=attn.q_proj.out_features // attn.head_dim,
                         n_kv_heads=attn.k_proj.out_features // attn.head_dim,
                         intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
                         vocab_size=model.get_output_embeddings().weight.shape[0],
                         where=f"the model ({cfg.model_type})")
    sparse = [type(lay.mlp).__name__ for lay in decoder_body(model).layers
              if not all(hasattr(lay.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))]
    if sparse:
        raise ConfigError(f"tensor / context parallelism ({fsdp.describe()}) runs dense SwiGLU MLPs "
                          f"(gate/up/down); this model has {sparse[0]} layers (mixture of experts): "
                          "train it data parallel (tensor_parallel_size=1, context_parallel_size=1)")
