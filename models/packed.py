"""Packed (padding-free) forward of a ``transformers`` Llama-family causal LM.

Consumes a Qwen2 / Qwen3 / Llama / Mistral / Qwen3-MoE ``*ForCausalLM`` (its modules and
weights are used as they are, nothing is copied) and a packed micro-batch: ``input_ids_N`` (sequences
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

MoE layers (Qwen3-MoE) run :func:`tapioca.models.moe.moe_forward`: the router in
``actor.moe.router_dtype`` (fp32 by default), grouped expert GEMMs, no token dropped.
After each forward, ``routers`` holds every MoE layer's :class:`~tapioca.models.moe.RouterOut`
(top-k ids, load, the unscaled load-balancing and z losses): :meth:`router_loss` is what
the actor adds to its loss, :meth:`take_router_metrics` the load statistics of the
training forwards since the last call. ``forward(..., replay_topk_LNK=...)`` routes each
MoE layer's tokens to the given experts instead (routing replay), the router's gradient
flowing through its live probabilities at those experts; a token whose replayed ids are
-1 is routed live. :meth:`recorded_routes` is the last forward's choice in that layout
(R2 records it in the trainer's first pass), :meth:`route_agreement` how many replayed
tokens the router would have sent to the same experts in every layer.
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
from .moe import RouterOut, is_sparse_block, moe_forward, router_dtype, router_metrics

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe", "qwen2_5_vl", "qwen3_vl")


# The metrics :meth:`PackedCausalLM.router_loss_values` returns, in its order.
ROUTER_LOSS_NAMES = ("moe_aux_loss", "moe_z_loss")


@dataclass
class PackedImages:
    """A packed micro-batch's images: the processor's tensors of every image in sequence
    order, where their placeholder tokens are in the stream, and the 3-D positions of
    every token (trainers/vision_batch.py builds it)."""

    pixel_values: torch.Tensor  # [patches, C*T*p*p]
    grid_thw: torch.Tensor  # [images, 3]
    index_I: torch.Tensor  # int64 [I]: packed positions of the placeholder tokens
    positions_3N: torch.Tensor  # int64 [3, N]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this forward would compute ``model`` wrongly (None when it runs it)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return (f"the packed forward supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
                f"{cfg.model_type!r}")
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg  # a VLM's decoder
    if getattr(text, "hidden_act", "silu") not in ("silu", "swish"):
        return f"the packed forward needs a SwiGLU MLP (hidden_act silu), not {text.hidden_act!r}"
    window = getattr(text, "sliding_window", None)
    if window is not None and window < getattr(text, "max_position_embeddings", window + 1):
        return f"the packed forward has no sliding-window attention (sliding_window={window})"
    for layer in decoder_body(model).layers:
        if getattr(layer.self_attn, "sliding_window", None):
            return "the packed forward has no sliding-window attention"
        mlp = layer.mlp
        if not (is_sparse_block(mlp) or all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))):
            return (f"the packed forward runs dense SwiGLU MLPs and fused top-k expert blocks "
                    f"(transformers 5's Qwen3-MoE), not {type(mlp).__name__}")
    return None


def check_supported(model: nn.Module) -> None:
    """Refuse a model this forward would compute wrongly, saying what to do instead."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ConfigError(f"{reason}: set actor.packed_sequences=false to train it with the padded HF forward")


class PackedDecoderLayer(nn.Module):
    """One decoder layer on packed tokens, with the HF layer's weights."""

    def __init__(self, layer: nn.Module, ops: TorchOps, attn_backend: str, attn_dtype: torch.dtype | None,
                 recompute_swiglu: bool, moe_router_dtype: torch.dtype | None = torch.float32) -> None:
        super().__init__()
        self.layer = layer
        self.is_moe = is_sparse_block(layer.mlp)
        self.moe_router_dtype = moe_router_dtype
        self.router_out: RouterOut | None = None  # the last forward's (MoE layers)
        # Set by models/expert_parallel.shard_experts: this rank holds a slice of the experts.
        self.expert_parallel = None
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
                seqs: PackedSeqs, replay_NK: torch.Tensor | None = None) -> torch.Tensor:
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
        if self.is_moe:
            # Stashed, not returned: the layer's output stays one tensor for FSDP and
            # checkpointing (a checkpointed layer's recompute in backward re-stashes; the
            # model reads the stash right after its own forward).
            out_NH, self.router_out = moe_forward(layer.mlp, x_NH, router_dtype=self.moe_router_dtype,
                                                  replay_ids_NK=replay_NK, expert_parallel=self.expert_parallel)
            return h_NH + out_NH
        return h_NH + ops.mlp(x_NH, layer.mlp, self.recompute_swiglu)


class PackedCausalLM(nn.Module):
    """The packed training forward of ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, *, attention_backend: str = "auto", liger: bool = False,
                 compile_layers: bool = False, checkpoint_every_n_layers: int = 0,
                 recompute_swiglu: bool = False, autocast_dtype: str = "",
                 moe_router_dtype: str = "fp32") -> None:
        super().__init__()
        check_supported(model)
        body = decoder_body(model)
        self.embed_tokens = body.embed_tokens
        self.rotary_emb = body.rotary_emb
        self.norm = body.norm
        self.lm_head = model.get_output_embeddings()
        self.ops = make_ops(liger)
        from .vision import mrope_section_of, vision_spec, vision_tower

        # VL models: the tower (trained unless its parameters are frozen) and the sections.
        self.visual = vision_tower(model) if vision_spec(model.config) is not None else None
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
                               attn_dtype if autocast_dtype else None, recompute_swiglu,
                               router_dtype(moe_router_dtype))
            for layer in body.layers)
        self.moe_layers = [i for i, layer in enumerate(self.layers) if layer.is_moe]
        self.routers: list[RouterOut] = []
        self._replayed_LNK: torch.Tensor | None = None  # the last forward's replay_topk_LNK
        self._counts_LE: torch.Tensor | None = None  # training forwards' assignments
        self._routed_tokens = 0
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
                seqs: PackedSeqs, images: PackedImages | None = None,
                replay_topk_LNK: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_NH``. ``images``: a VL micro-batch's images (tower embeddings over the
        placeholders, 3-D rotary, deepstack). ``replay_topk_LNK``: top-k expert ids ``[MoE
        layers, N, k]`` to route by instead of the router's own choice (routing replay)."""
        h_NH = self.embed_tokens(input_ids_N)
        deep = None
        if images is not None:
            h_NH, deep = self._with_images(h_NH, images)
            from .vision import mrope_cos_sin

            cos_ND, sin_ND = mrope_cos_sin(self.rotary_emb, images.positions_3N, h_NH, self.mrope_section)
        elif self.mrope_section is not None:  # a VL model's text-only micro-batch: t = h = w
            from .vision import mrope_cos_sin

            cos_ND, sin_ND = mrope_cos_sin(self.rotary_emb, position_ids_N.expand(3, -1), h_NH,
                                           self.mrope_section)
        else:
            cos_1ND, sin_1ND = self.rotary_emb(h_NH[None], position_ids_N[None])
            cos_ND, sin_ND = cos_1ND[0], sin_1ND[0]
        every = self.checkpoint_every_n_layers
        replay = {i: replay_topk_LNK[j] for j, i in enumerate(self.moe_layers)} if replay_topk_LNK is not None else {}
        for i, layer in enumerate(self.layers):
            if every and i % every == 0 and torch.is_grad_enabled():
                h_NH = checkpoint(layer, h_NH, cos_ND, sin_ND, seqs, replay.get(i), use_reentrant=False)
            else:
                h_NH = layer(h_NH, cos_ND, sin_ND, seqs, replay.get(i))
            if deep is not None and i < len(deep):  # Qwen3-VL's deepstack
                h_NH = h_NH.index_add(0, images.index_I, deep[i].to(h_NH.dtype))
        if self.moe_layers:
            self.routers = [self.layers[i].router_out for i in self.moe_layers]
            self._replayed_LNK = replay_topk_LNK
            if torch.is_grad_enabled():  # the load of the trained forwards
                counts_LE = torch.stack([r.counts_E for r in self.routers])
                self._counts_LE = counts_LE if self._counts_LE is None else self._counts_LE + counts_LE
                self._routed_tokens += int(input_ids_N.shape[0])
        return self.ops.rms_norm(h_NH, self.norm)

    @property
    def moe_shape(self) -> tuple[int, int, int] | None:
        """``(MoE layers, top_k, experts per layer)``; None without MoE layers."""
        if not self.moe_layers:
            return None
        gate = self.layers[self.moe_layers[0]].layer.mlp.gate
        return len(self.moe_layers), int(gate.top_k), int(gate.weight.shape[0])

    def recorded_routes(self) -> torch.Tensor:
        """int64 ``[MoE layers, N, k]``: the experts the last forward routed each token to."""
        return torch.stack([r.ids_NK.detach() for r in self.routers])

    def route_agreement(self) -> torch.Tensor | None:
        """int64 ``[2]`` of the last forward: tokens it replayed, and of those the tokens
        whose live top-k (as a set) equals the replayed experts in every MoE layer. No
        host read. None when it replayed nothing."""
        replay_LNK = self._replayed_LNK
        if replay_LNK is None or not self.routers:
            return None
        live_LNK = torch.stack([r.live_ids_NK for r in self.routers])
        same_LN = (live_LNK.sort(-1).values == replay_LNK.long().sort(-1).values).all(-1)
        replayed_N = replay_LNK[0, :, 0] >= 0
        return torch.stack([replayed_N.sum(), (same_LN.all(0) & replayed_N).sum()])

    def router_loss(self, aux_coeff: float, z_coeff: float) -> torch.Tensor | None:
        """``aux_coeff * sum_l aux_l + z_coeff * sum_l z_l`` over the MoE layers of the last
        forward (Megatron sums the layers' losses); None when both are off or no MoE."""
        if not self.routers or not (aux_coeff or z_coeff):
            return None
        return sum(aux_coeff * r.aux_loss + z_coeff * r.z_loss for r in self.routers)

    def router_loss_values(self) -> torch.Tensor | None:
        """The last forward's unscaled router losses (:data:`ROUTER_LOSS_NAMES`), mean over
        MoE layers, as one fp32 vector left on the device (None: no MoE layer)."""
        if not self.routers:
            return None
        return torch.stack([torch.stack([r.aux_loss.detach().float(), r.z_loss.detach().float()])
                            for r in self.routers]).mean(0)

    def take_router_metrics(self, reduce=None) -> dict[str, float]:
        """Load statistics of the training forwards since the last call
        (:func:`tapioca.models.moe.router_metrics`), then start counting afresh.
        ``reduce``: sums a tensor over ranks (the sharded actor's), so the statistics are
        those of the whole step."""
        if self._counts_LE is None:
            return {}
        top_k = int(self.routers[0].ids_NK.shape[-1])
        counts_LE, tokens = self._counts_LE, self._routed_tokens
        if reduce is not None:
            flat = reduce(torch.cat([counts_LE.flatten(), counts_LE.new_tensor([tokens])]))
            counts_LE, tokens = flat[:-1].view_as(counts_LE), int(flat[-1])
        metrics = router_metrics(counts_LE, tokens, top_k)
        self._counts_LE, self._routed_tokens = None, 0
        return metrics

    def _with_images(self, h_NH: torch.Tensor, images: PackedImages):
        """The stream's embeddings with the tower's over the placeholders, and deepstack."""
        from .vision import image_features

        if self.visual is None:
            raise ConfigError("this micro-batch has images but the model has no vision tower")
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.visual_frozen):
            feats_ID, deep = image_features(self, images.pixel_values, images.grid_thw)
        return h_NH.index_copy(0, images.index_I, feats_ID.to(h_NH.dtype)), deep
