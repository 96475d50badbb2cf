"""The causal-LM families Tapioca builds tiny models of, and which of them run in-process.

Consumes nothing at import (no transformers import: the config layer reads
:data:`ARCHS`); emits, per family, the ``transformers`` config class and the keyword
arguments of a tiny random config (:func:`tiny_config`, used by
:func:`tapioca.models.factory.build_tiny_model`), and the one start-up check of a
model's family against the in-process engines (:func:`in_process_reason`); a model
directory's ``config.json`` as a dict and its decoder's part (:func:`read_config_json`,
:func:`text_part`: what the feature table and the memory plan read). The one reading
of "is this a vision-language model?" (:func:`vision_of`: its :class:`VisionSpec` or
None) and of "is this a mixture-of-experts model?" (:func:`moe_of`: its
:class:`MoeShape` or None), from a ``config.json`` dict, a live model's
``config.to_dict()`` or a tiny arch's (:func:`tiny_arch_doc`); ``config/policy.py``'s
``PolicySpec`` carries their answers to the roles. Which path a
family takes (the paged engine / packed trainer, or TorchEngine / the padded HF
forward) is decided from the model itself by ``unsupported_reason`` in
``engines/model_runner.py`` and ``models/packed.py``; docs/models.md tabulates it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

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
# The tiny families with experts (model.num_experts applies to these only).
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "olmoe", "qwen3_next", "gpt_oss")
# Vision-language families (docs/vlm.md, models/vision.py): the model_type values of a
# Qwen2.5-VL / Qwen3-VL config.json, and the tiny archs of a vision tower in front of a
# Qwen2 / Qwen3 decoder, built by models/factory.py's own config (not in the text families'
# table of docs/models.md).
VL_ARCHS = ("qwen2_5_vl", "qwen3_vl")
# Their vision tower's patch sizes where a config.json leaves one out (transformers'
# defaults of each family, which the tiny models keep).
_PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}

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


# ---------------------------------------------------------------- what the policy is


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's vision tower as its tokens see it: the placeholder token
    ids and the patch sizes that placeholders and positions depend on (models/vision.py).
    The token ids are None only where no config.json names them yet (a tiny arch before
    its checkpoint is written, read at load); every spec an engine or trainer gets is read
    from a checkpoint's config and has them."""

    model_type: str
    image_token_id: int | None
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    merge_size: int
    patch_size: int
    temporal_patch_size: int

    def tokens_for(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens of one image of processor grid ``(t, h, w)``."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // (self.merge_size ** 2)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(i for i in (self.vision_start_token_id, self.vision_end_token_id, self.image_token_id,
                                 self.video_token_id) if i is not None)


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts decoder's shape: experts per MoE layer, experts per token, which
    of its ``num_layers`` hidden layers are MoE layers (the others are dense)."""

    experts: int
    top_k: int
    layers: tuple[int, ...]
    num_layers: int


def vision_of(doc: dict) -> VisionSpec | None:
    """The :class:`VisionSpec` of a ``config.json`` dict (or a live config's ``to_dict()``);
    None for a text-only model. The one test of "is this a vision-language model?"."""
    model_type = str(doc.get("model_type", ""))
    if model_type not in VL_ARCHS:
        return None
    v = doc.get("vision_config") or {}

    def token(name: str) -> int | None:
        return None if doc.get(name) is None else int(doc[name])

    return VisionSpec(
        model_type=model_type, image_token_id=token("image_token_id"), video_token_id=token("video_token_id"),
        vision_start_token_id=token("vision_start_token_id"), vision_end_token_id=token("vision_end_token_id"),
        merge_size=int(v.get("spatial_merge_size") or 2),
        patch_size=int(v.get("patch_size") or _PATCH_SIZE[model_type]),
        temporal_patch_size=int(v.get("temporal_patch_size") or 2))


def moe_layer_indices(config: dict) -> list[int]:
    """The sparse layers of a decoder's ``config.json`` fields (a dict, :func:`text_part`):
    every layer not in ``mlp_only_layers`` whose ``(index + 1)`` is a multiple of
    ``decoder_sparse_step`` (HF's rule); [] for a dense model."""
    if not _experts(config):
        return []
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return [i for i in range(int(config.get("num_hidden_layers", 0)))
            if i not in dense and (i + 1) % step == 0]


def _experts(config: dict) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts.
    return int(next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                     if config.get(k)), 0))


def moe_of(doc: dict) -> MoeShape | None:
    """The :class:`MoeShape` of a ``config.json`` dict (its decoder's part,
    :func:`text_part`); None for a dense model. The one test of "is this a
    mixture-of-experts model?"."""
    text = text_part(doc)
    layers = moe_layer_indices(text)
    if not layers:
        return None
    return MoeShape(experts=_experts(text), top_k=int(text.get("num_experts_per_tok") or 0),
                    layers=tuple(layers), num_layers=int(text.get("num_hidden_layers") or 0))


def tiny_arch_doc(arch: str, *, num_layers: int, num_experts: int, num_experts_per_tok: int) -> dict:
    """What :func:`vision_of` / :func:`moe_of` read of the tiny model of ``arch`` before
    it is written (``model.arch`` at load): its model_type, layers, and experts for the MoE
    families (:data:`MOE_ARCHS`; every layer an MoE layer, as :func:`tiny_config` builds
    them). The vocabulary and the vision token ids come with the task's tokenizer, later."""
    experts = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok) if arch in MOE_ARCHS else {}
    return {"model_type": arch, "num_hidden_layers": num_layers, **experts}


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
