"""The causal-LM families Tapioca builds tiny models of, and which of them run in-process.

Consumes nothing at import (no transformers import: the config layer reads
:data:`ARCHS`); emits, per family, the ``transformers`` config class and the keyword
arguments of a tiny random config (:func:`tiny_config`, used by
:func:`tapioca.models.factory.build_tiny_model`), and the one start-up check of a
model's family against the in-process engines (:func:`in_process_reason`); a model
directory's ``config.json`` as a dict and its decoder's part (:func:`read_config_json`,
:func:`text_part`: what the feature table and the memory plan read). Which path a
family takes (the paged engine / packed trainer, or TorchEngine / the padded HF
forward) is decided from the model itself by ``unsupported_reason`` in
``engines/model_runner.py`` and ``models/packed.py``; docs/models.md tabulates it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from ..schemas.errors import ConfigError

# arch (the model_type transformers writes in config.json, gemma3's text model aside)
# -> its transformers config class.
CONFIG_CLASSES = {
    "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig", "mistral": "MistralConfig",
    "qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig", "olmoe": "OlmoeConfig",
    "gemma3": "Gemma3TextConfig", "qwen3_next": "Qwen3NextConfig", "qwen3_5": "Qwen3_5TextConfig",
    "gpt_oss": "GptOssConfig",
}
ARCHS = tuple(CONFIG_CLASSES)
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "olmoe", "qwen3_next", "gpt_oss")
# Vision-language archs (docs/vlm.md, models/vision.py): a tiny vision tower in front of a
# Qwen2 / Qwen3 decoder, built by models/factory.py's own config (not in the text families'
# table of docs/models.md).
VL_ARCHS = ("qwen2_5_vl", "qwen3_vl")

# Tiny sliding windows and hybrid layouts, so that a few-token test exercises them.
TINY_SLIDING_WINDOW = 8


def _moe(s: dict) -> dict:
    return dict(num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                moe_intermediate_size=s["moe_intermediate_size"])


def _alternating(s: dict, kinds: tuple[str, str]) -> list[str]:
    return [kinds[i % 2] for i in range(s["num_hidden_layers"])]


_LINEAR_ATTENTION = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_conv_kernel_dim=4)

# arch -> extra config keyword arguments from the shared sizes (hidden_size, heads, ...).
_EXTRA: dict[str, Callable[[dict], dict]] = {
    "qwen2": lambda s: {}, "qwen3": lambda s: {}, "llama": lambda s: {},
    "mistral": lambda s: dict(sliding_window=None),  # Mistral-7B-v0.3's full attention
    "qwen3_moe": lambda s: dict(_moe(s), norm_topk_prob=True),  # as Qwen3-30B-A3B
    "qwen2_moe": lambda s: dict(_moe(s), shared_expert_intermediate_size=s["intermediate_size"]),
    "olmoe": lambda s: dict(num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                            intermediate_size=s["moe_intermediate_size"]),
    "gemma3": lambda s: dict(sliding_window=TINY_SLIDING_WINDOW, query_pre_attn_scalar=s["head_dim"],
                             layer_types=_alternating(s, ("sliding_attention", "full_attention"))),
    "qwen3_next": lambda s: dict(_moe(s), shared_expert_intermediate_size=s["intermediate_size"],
                                 layer_types=_alternating(s, ("linear_attention", "full_attention")),
                                 **_LINEAR_ATTENTION),
    "qwen3_5": lambda s: dict(layer_types=_alternating(s, ("linear_attention", "full_attention")),
                              **_LINEAR_ATTENTION),
    "gpt_oss": lambda s: dict(num_local_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                              intermediate_size=s["moe_intermediate_size"], sliding_window=TINY_SLIDING_WINDOW,
                              layer_types=_alternating(s, ("sliding_attention", "full_attention")),
                              # gpt-oss's YaRN assumes a 4k original context; a tiny one has 256.
                              rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
}


def config_class(arch: str):
    """The transformers config class of ``arch``; a clear error when unknown or when the
    installed transformers has no such family."""
    if arch not in CONFIG_CLASSES:
        raise ConfigError(f"unknown model arch {arch!r}; use one of {', '.join(ARCHS)}")
    import transformers

    cls = getattr(transformers, CONFIG_CLASSES[arch], None)
    if cls is None:
        raise ConfigError(f"model arch {arch!r} needs a newer transformers (this one, "
                          f"{transformers.__version__}, has no {CONFIG_CLASSES[arch]}): pip install -U transformers")
    return cls


def tiny_config(arch: str, sizes: dict[str, Any], **common: Any):
    """A ``transformers`` config of ``arch`` at ``sizes`` (hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size, num_experts,
    num_experts_per_tok, moe_intermediate_size) plus ``common`` keyword arguments."""
    base = {k: sizes[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "intermediate_size")}
    return config_class(arch)(**{**base, **_EXTRA[arch](sizes), **common})


def read_config_json(path: str | os.PathLike) -> dict:
    """A model directory's ``config.json`` as a dict (no transformers import)."""
    return json.loads((Path(path) / "config.json").read_text())


def text_part(doc: dict) -> dict:
    """The decoder's fields of a ``config.json`` dict: a vision-language model's
    ``text_config`` merged over the top level (the top level wins where it has the
    decoder's own ``hidden_size``)."""
    text = doc.get("text_config") or {}
    return {**doc, **text} if "hidden_size" not in doc else {**text, **doc}


def in_process_reason(config) -> str | None:
    """Why neither in-process engine (the paged engine, TorchEngine) can generate with a
    model of this config (None when one can): their caches hold attention keys and
    values only, not the recurrent state of linear-attention layers."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text, "layer_types", None) or ())
    if "linear_attention" in layer_types:
        family = getattr(text, "model_type", "?").removesuffix("_text")
        return (f"model family {family!r} has linear-attention layers (hybrid Gated DeltaNet), whose "
                "recurrent state the in-process engines do not keep: use rollout.engine=vllm or "
                "rollout.engine=sglang (both serve it); its training runs as usual")
    return None


def check_in_process(model_path: str) -> None:
    """Start-up check of a run whose rollout engine is in-process: a ConfigError naming the
    family and what to use when neither engine can generate with the model at
    ``model_path`` (reads its config.json only)."""
    from transformers import AutoConfig

    reason = in_process_reason(AutoConfig.from_pretrained(model_path, local_files_only=True))
    if reason is not None:
        raise ConfigError(f"{reason} (model {model_path})")
