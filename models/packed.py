"""Packed (padding-free) forward of a ``transformers`` Llama-family causal LM.

Consumes a Qwen2 / Qwen3 / Llama ``*ForCausalLM`` (its modules and weights are used as
they are, nothing is copied) and a packed micro-batch: ``input_ids_N`` (sequences
concatenated), ``position_ids_N`` (restarting at 0 for each sequence) and a
:class:`~tapioca.models.attention.PackedSeqs`; emits ``hidden_NH``, the final-norm
hidden states of every packed token (the LM head is applied by the caller on the
rows it scores, see :func:`tapioca.models.forward.packed_token_logprobs`).

:class:`PackedCausalLM` is an ``nn.Module`` whose children are the HF model's own
embedding, layers (each wrapped in a :class:`PackedDecoderLayer`), final norm and LM
head, so its parameters are the HF model's parameters. The HF model stays the
canonical owner (state dicts, checkpoints, published weights); this module is the
training forward. An FSDP2 trainer shards it the usual way: ``fully_shard`` each
``packed.layers[i]``, then the root; the forward calls every layer through
``__call__``, so FSDP's hooks (and activation checkpointing, and ``torch.compile`` of
a layer) all attach to :class:`PackedDecoderLayer`.

Vision-language models (Qwen2.5-VL, Qwen3-VL; models/vision.py) pack too: the HF vision
tower runs on the micro-batch's images (:class:`PackedImages`, without gradient when
frozen), its embeddings replace the placeholder tokens' in the packed stream, the rotary
comes from the 3-D positions of each sequence (restarting per sequence, as 1-D ones do),
and Qwen3-VL's deepstack features are added to the first layers' outputs there. The
vision tower's attention runs per image inside HF's own module, so it is not packed
across images beyond what HF does (one call over the batch's patches).

Switches (``ActorConfig``): ``attention_backend`` (``models/attention.py``),
``liger_kernels`` (``models/fused_ops.py``), ``compile_layers`` (``torch.compile`` of
each decoder layer; the compiled code is shared by all layers of one shape),
``gradient_checkpointing`` (every ``gradient_checkpointing_every_n_layers``-th layer is
recomputed in backward) and ``recompute_swiglu``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..schemas.errors import ConfigError
from .attention import PackedSeqs, attention, resolve_backend
from .forward import decoder_body
from .fused_ops import TorchOps, make_ops

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen2_5_vl", "qwen3_vl")


@dataclass
class PackedImages:
    """A packed micro-batch's images: the processor's tensors of every image in sequence
    order, where their placeholder tokens are in the stream, and the 3-D positions of
    every token (trainers/vision_batch.py builds it)."""

    pixel_values: torch.Tensor  # [patches, C*T*p*p]
    grid_thw: torch.Tensor  # [images, 3]
    index_I: torch.Tensor  # int64 [I]: packed positions of the placeholder tokens
    positions_3N: torch.Tensor  # int64 [3, N]


def check_supported(model: nn.Module) -> None:
    """Refuse a model this forward would compute wrongly, saying what to do instead."""
    cfg = model.config
    how = "set actor.packed_sequences=false to train it with the padded HF forward"
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"the packed forward supports {', '.join(SUPPORTED_MODEL_TYPES)} "
                          f"models, not {cfg.model_type!r}: {how}")
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    if getattr(text, "hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"the packed forward needs a SwiGLU MLP (hidden_act silu), not "
                          f"{text.hidden_act!r}: {how}")
    for layer in decoder_body(model).layers:
        if getattr(layer.self_attn, "sliding_window", None):
            raise ConfigError(f"the packed forward has no sliding-window attention: {how}")


class PackedDecoderLayer(nn.Module):
    """One decoder layer on packed tokens, with the HF layer's weights."""

    def __init__(self, layer: nn.Module, ops: TorchOps, attn_backend: str, attn_dtype: torch.dtype | None,
                 recompute_swiglu: bool) -> None:
        super().__init__()
        self.layer = layer
        attn = layer.self_attn
        self.head_dim = attn.head_dim
        self.n_heads = attn.q_proj.out_features // attn.head_dim
        self.n_kv_heads = attn.k_proj.out_features // attn.head_dim
        self.scaling = float(attn.scaling)
        self.qk_norm = hasattr(attn, "q_norm")
        self.ops = ops
        self.attn_backend = attn_backend
        self.attn_dtype = attn_dtype
        self.recompute_swiglu = recompute_swiglu

    def forward(self, h_NH: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor,
                seqs: PackedSeqs) -> torch.Tensor:
        layer, ops, n = self.layer, self.ops, h_NH.shape[0]
        attn = layer.self_attn
        x_NH = ops.rms_norm(h_NH, layer.input_layernorm)
        q = attn.q_proj(x_NH).view(n, self.n_heads, self.head_dim)
        k = attn.k_proj(x_NH).view(n, self.n_kv_heads, self.head_dim)
        v = attn.v_proj(x_NH).view(n, self.n_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: RMSNorm over each head before the rotation
            q, k = ops.rms_norm(q, attn.q_norm), ops.rms_norm(k, attn.k_norm)
        q, k = ops.rope(q, k, cos_ND, sin_ND)
        dtype = self.attn_dtype or v.dtype
        o = attention(self.attn_backend, q.to(dtype), k.to(dtype), v.to(dtype), seqs, self.scaling)
        attn_out_NH = attn.o_proj(o.reshape(n, self.n_heads * self.head_dim))
        x_NH, h_NH = ops.add_rms_norm(attn_out_NH, h_NH, layer.post_attention_layernorm)
        return h_NH + ops.mlp(x_NH, layer.mlp, self.recompute_swiglu)


class PackedCausalLM(nn.Module):
    """The packed training forward of ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, *, attention_backend: str = "auto", liger: bool = False,
                 compile_layers: bool = False, checkpoint_every_n_layers: int = 0,
                 recompute_swiglu: bool = False, autocast_dtype: str = "") -> None:
        super().__init__()
        check_supported(model)
        body = decoder_body(model)
        self.embed_tokens = body.embed_tokens
        self.rotary_emb = body.rotary_emb
        self.norm = body.norm
        self.lm_head = model.get_output_embeddings()
        self.ops = make_ops(liger)
        from .vision import is_vision_model, mrope_section_of, vision_tower

        # VL models: the tower (trained unless its parameters are frozen) and the sections.
        self.visual = vision_tower(model) if is_vision_model(model) else None
        self.mrope_section = mrope_section_of(model.config) if self.visual is not None else None
        # vlm.freeze_vision_encoder froze it before this module was built: no graph for it.
        self.visual_frozen = self.visual is not None and not any(
            p.requires_grad for p in self.visual.parameters())
        param = self.embed_tokens.weight
        # Attention runs in the autocast dtype, else in the parameters' dtype.
        attn_dtype = getattr(torch, autocast_dtype) if autocast_dtype else param.dtype
        first = body.layers[0].self_attn
        self.attention_backend = resolve_backend(
            attention_backend, param.device, attn_dtype,
            first.q_proj.out_features // first.head_dim, first.k_proj.out_features // first.head_dim,
            first.head_dim)
        self.layers = nn.ModuleList(
            PackedDecoderLayer(layer, self.ops, self.attention_backend,
                               attn_dtype if autocast_dtype else None, recompute_swiglu)
            for layer in body.layers)
        self.checkpoint_every_n_layers = checkpoint_every_n_layers
        self.compiled = compile_layers
        if compile_layers:
            for layer in self.layers:
                layer.compile()

    def describe(self) -> str:
        """One line for logs / benchmarks: which kernels run."""
        ac = self.checkpoint_every_n_layers
        return (f"attention={self.attention_backend} ops={self.ops.name}{' compiled' if self.compiled else ''}"
                f"{' ac/' + str(ac) if ac else ''}")

    def forward(self, input_ids_N: torch.Tensor, position_ids_N: torch.Tensor,
                seqs: PackedSeqs, images: PackedImages | None = None) -> torch.Tensor:
        h_NH = self.embed_tokens(input_ids_N)
        deep = None
        if images is not None:
            h_NH, deep = self._with_images(h_NH, images)
            from .vision import mrope_cos_sin

            cos_ND, sin_ND = mrope_cos_sin(self.rotary_emb, images.positions_3N, h_NH, self.mrope_section)
        else:
            cos_1ND, sin_1ND = self.rotary_emb(h_NH[None], position_ids_N[None])
            cos_ND, sin_ND = cos_1ND[0], sin_1ND[0]
        every = self.checkpoint_every_n_layers
        for i, layer in enumerate(self.layers):
            if every and i % every == 0 and torch.is_grad_enabled():
                h_NH = checkpoint(layer, h_NH, cos_ND, sin_ND, seqs, use_reentrant=False)
            else:
                h_NH = layer(h_NH, cos_ND, sin_ND, seqs)
            if deep is not None and i < len(deep):  # Qwen3-VL's deepstack
                h_NH = h_NH.index_add(0, images.index_I, deep[i].to(h_NH.dtype))
        return self.ops.rms_norm(h_NH, self.norm)

    def _with_images(self, h_NH: torch.Tensor, images: PackedImages):
        """The stream's embeddings with the tower's over the placeholders, and deepstack."""
        from .vision import image_features

        if self.visual is None:
            raise ConfigError("this micro-batch has images but the model has no vision tower")
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.visual_frozen):
            feats_ID, deep = image_features(self, images.pixel_values, images.grid_thw)
        return h_NH.index_copy(0, images.index_I, feats_ID.to(h_NH.dtype)), deep
