"""A hand-written decoder (Qwen2, Qwen3, Llama) over the paged KV cache.

Consumes a ``transformers`` causal LM once, at construction (its config and tensors),
then packed token batches: :class:`PrefillInputs` (variable-length prompts, no padding,
a cached prefix allowed) and :class:`DecodeInputs` (one token per row). Emits logits
(the last position of each prefilled sequence, every decode row) and writes each
token's keys / values into the paged cache at its slot. Calls only the dispatcher API
of :mod:`tapioca.engines.kernels`; matmuls stay cuBLAS (``F.linear``).

Weights: q/k/v are fused into one ``[q + k + v, hidden]`` matrix (+ bias for Qwen2),
gate/up into one ``[2 * intermediate, hidden]``; everything else is the HF model's own
tensor (moved to the device; on the same device no copy). :meth:`load_hf_state_dict`
takes the HF state-dict names and copies each tensor IN PLACE into its slice of the
fused parameter, so CUDA graphs captured over these tensors stay valid.

The rotary table is built from the HF model's own ``rotary_emb`` (every rope scaling
type the model supports, at the model's own inv_freq precision) for positions up to
``max_position_embeddings``; dynamic NTK scaling is evaluated once at that length
(like vLLM), not per sequence length.

Vision-language models (Qwen2.5-VL, Qwen3-VL; models/vision.py): the decoder is the
text model's (names ``model.language_model.*``), and the HF vision tower itself is
kept (``model.visual.*``, moved to the device, loaded in place like every tensor). A
prefill with images (:class:`PrefillImages`) writes the tower's embeddings over the
placeholder tokens' and, for Qwen3-VL, adds the deepstack features to the first
layers' outputs there; its rotary comes from a per-token table of the 3-D positions
(``rope_table_TD``, the model's own ``rotary_emb``). Decode rows are text: the 1-D
table at each row's position plus its rope delta (the caller's positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..schemas.errors import EngineError
from . import kernels

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# Vision-language models whose text model is a Qwen2 / Qwen3 (the tower runs as HF's).
VL_TEXT_MODEL_TYPES = ("qwen2_5_vl_text", "qwen3_vl_text")


def text_config(model: torch.nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`PagedDecoder` cannot run ``model`` (None when it can)."""
    cfg = text_config(model)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in VL_TEXT_MODEL_TYPES:
        return (f"model_type {model_type!r} (the paged engine runs {', '.join(SUPPORTED_MODEL_TYPES)}, "
                "Qwen2.5-VL and Qwen3-VL)")
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if any(t != "full_attention" for t in layer_types) or getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention layers"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    body = _text_body(model)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "no model.layers / model.rotary_emb (not a *ForCausalLM of transformers)"
    if set(_hf_names(model)) != set(model.state_dict()):
        extra = sorted(set(model.state_dict()) - set(_hf_names(model)))[:3]
        return f"parameters the decoder does not know (e.g. {extra})"
    return None


def _text_body(model: torch.nn.Module):
    body = getattr(model, "model", None)
    return getattr(body, "language_model", body)


def _prefix(model: torch.nn.Module) -> str:
    """Where the decoder's tensors are in the state dict."""
    return "model.language_model." if hasattr(getattr(model, "model", None), "language_model") else "model."


def _vision_names(model: torch.nn.Module) -> list[str]:
    visual = getattr(getattr(model, "model", None), "visual", None)
    return [] if visual is None else ["model.visual." + n for n in visual.state_dict()]


def _hf_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names the decoder maps (what a Qwen2/Qwen3/Llama model has, or a
    Qwen2.5-VL / Qwen3-VL one: its text model's and its vision tower's)."""
    sd = model.state_dict()
    pre = _prefix(model)
    names = [pre + "embed_tokens.weight", pre + "norm.weight"] + _vision_names(model)
    if "lm_head.weight" in sd:
        names.append("lm_head.weight")
    for i in range(len(_text_body(model).layers)):
        p = f"{pre}layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names.append(p + proj + ".weight")
            if p + proj + ".bias" in sd:
                names.append(p + proj + ".bias")
        for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            if p + norm in sd:
                names.append(p + norm)
    return names


@dataclass
class PrefillInputs:
    """``S`` sequences, ``T`` packed new tokens (a sequence's cached prefix is not in T)."""

    input_ids_T: torch.Tensor  # int64
    positions_T: torch.Tensor  # int64, absolute positions
    slot_mapping_T: torch.Tensor  # int64, block * block_size + offset
    block_tables_SM: torch.Tensor  # int32, padded with 0
    cu_seqlens_q_S1: torch.Tensor  # int32, [S + 1]
    context_lens_S: torch.Tensor  # int32, cached + new tokens
    last_index_S: torch.Tensor  # int64, index in T of each sequence's last token
    max_q_len: int
    # A prefill with images: per-token rotary (positions_T then index it: arange(T)).
    rope_table_TD: torch.Tensor | None = None
    images: "PrefillImages | None" = None


@dataclass
class PrefillImages:
    """The vision tower's output for a prefill's placeholder tokens."""

    index_I: torch.Tensor  # int64, where in T each placeholder token is
    embeds_ID: torch.Tensor  # its embedding, replacing the token's
    deepstack: list[torch.Tensor] | None = None  # Qwen3-VL: added after layer i (I x D each)


@dataclass
class DecodeInputs:
    """``B`` rows, one token each; padding rows (of a graph bucket) have slot -1, context 0."""

    input_ids_B: torch.Tensor  # int64
    positions_B: torch.Tensor  # int64
    slot_mapping_B: torch.Tensor  # int64
    block_tables_BM: torch.Tensor  # int32
    context_lens_B: torch.Tensor  # int32


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


class PagedDecoder(torch.nn.Module):
    """Qwen2 / Qwen3 / Llama decoder over a paged KV cache; see the module docstring.

    Calling the module (``decoder(inputs)``) runs :meth:`forward_prefill` or
    :meth:`forward_decode` by the inputs' type, so forward hooks see every eager
    forward; CUDA graphs call :meth:`forward_decode` directly.
    """

    def __init__(self, model: torch.nn.Module, device: str | torch.device) -> None:
        super().__init__()
        reason = unsupported_reason(model)
        if reason is not None:
            raise EngineError(f"the paged engine cannot run this model: {reason}; use TorchEngine")
        cfg = text_config(model)
        self.device = torch.device(device)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(cfg.max_position_embeddings)
        self.scale = float(getattr(_text_body(model).layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        self.dtype = next(model.parameters()).dtype
        self._targets: dict[str, list[torch.Tensor]] = {}
        self.prefix = _prefix(model)
        # VL models: the HF vision tower (run at prefill) and the text rotary (3-D tables).
        self.visual: torch.nn.Module | None = None
        self.rotary = _text_body(model).rotary_emb
        with torch.no_grad():
            sd = model.state_dict()
            self._build(model, sd)
            self.cos_sin_PD = self._rope_table(model)
        from ..models.vision import mrope_section_of, vision_spec

        self.vision = vision_spec(model.config)
        self.mrope_section = mrope_section_of(model.config)
        if self.vision is not None:
            self.visual = model.model.visual.to(self.device).eval()
            for name, tensor in self.visual.state_dict(keep_vars=True).items():
                self._targets["model.visual." + name] = [tensor.data]
            self.rotary = self.rotary.to(self.device)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    # ------------------------------------------------------------------ construction

    def _own(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The HF tensor itself on the engine's device (no copy when already there)."""
        out = t.detach().to(self.device)
        self._targets.setdefault(name, []).append(out)
        return out

    def _fuse(self, names: list[str], sd: dict) -> torch.Tensor:
        """One new tensor holding ``names`` stacked on dim 0; each name maps to its slice."""
        fused = torch.cat([sd[n].detach() for n in names], dim=0).to(self.device)
        start = 0
        for n in names:
            rows = sd[n].shape[0]
            self._targets.setdefault(n, []).append(fused[start : start + rows])
            start += rows
        return fused

    def _build(self, model: torch.nn.Module, sd: dict) -> None:
        pre = self.prefix
        self.embed = self._own(pre + "embed_tokens.weight", sd[pre + "embed_tokens.weight"])
        self.final_norm = self._own(pre + "norm.weight", sd[pre + "norm.weight"])
        tied = "lm_head.weight" not in sd or (
            sd["lm_head.weight"].data_ptr() == sd[pre + "embed_tokens.weight"].data_ptr())
        if tied:
            self.lm_head = self.embed
            if "lm_head.weight" in sd:
                self._targets["lm_head.weight"] = [self.embed]
        else:
            self.lm_head = self._own("lm_head.weight", sd["lm_head.weight"])
        self.layers: list[_Layer] = []
        for i in range(len(_text_body(model).layers)):
            p = f"{pre}layers.{i}."

            def opt(name: str, fuse: list[str] | None = None) -> torch.Tensor | None:
                if fuse is not None:
                    return self._fuse(fuse, sd) if all(n in sd for n in fuse) else None
                return self._own(p + name, sd[p + name]) if p + name in sd else None

            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(_Layer(
                input_norm=opt("input_layernorm.weight"),
                qkv_w=self._fuse([attn + f"{x}_proj.weight" for x in "qkv"], sd),
                qkv_b=opt("", [attn + f"{x}_proj.bias" for x in "qkv"]),
                q_norm=opt("self_attn.q_norm.weight"),
                k_norm=opt("self_attn.k_norm.weight"),
                o_w=opt("self_attn.o_proj.weight"),
                o_b=opt("self_attn.o_proj.bias"),
                post_norm=opt("post_attention_layernorm.weight"),
                gate_up_w=self._fuse([mlp + "gate_proj.weight", mlp + "up_proj.weight"], sd),
                gate_up_b=opt("", [mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
                down_w=opt("mlp.down_proj.weight"),
                down_b=opt("mlp.down_proj.bias"),
            ))

    def _rope_table(self, model: torch.nn.Module) -> torch.Tensor:
        """fp32 ``[max_positions, head_dim]``: cos then sin of the first half's frequencies."""
        rotary = _text_body(model).rotary_emb
        inv_freq = getattr(rotary, "inv_freq", None)
        dev = inv_freq.device if inv_freq is not None else torch.device("cpu")
        pos_1P = torch.arange(self.max_positions, device=dev)[None]
        cos_1PD, sin_1PD = rotary(torch.zeros(1, dtype=torch.float32, device=dev), pos_1P)
        half = self.head_dim // 2
        return torch.cat([cos_1PD[0, :, :half], sin_1PD[0, :, :half]], dim=-1).float().to(self.device)

    # ------------------------------------------------------------------ cache and weights

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attach_kv_cache(self, kv_L2NBKD: torch.Tensor) -> None:
        """Use ``kv[l, 0]`` / ``kv[l, 1]`` as layer l's key / value cache."""
        self.k_caches = [kv_L2NBKD[i, 0] for i in range(self.num_layers)]
        self.v_caches = [kv_L2NBKD[i, 1] for i in range(self.num_layers)]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The decoder's weights under HF names (views into the fused tensors)."""
        return {name: ts[0] for name, ts in self._targets.items()}

    def load_hf_state_dict(self, state_dict) -> None:
        """Copy HF-named tensors into the decoder in place (checked before any copy)."""
        unexpected = [k for k in state_dict if k not in self._targets]
        if unexpected:
            raise EngineError(
                f"update_weights got {len(unexpected)} names the model does not have "
                f"(e.g. {unexpected[:3]}); publish the policy's own state_dict() names")
        for name, tensor in state_dict.items():
            want = tuple(self._targets[name][0].shape)
            if tuple(tensor.shape) != want:
                raise EngineError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {want}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                for dst in self._targets[name]:
                    dst.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ forward

    def forward(self, inputs: PrefillInputs | DecodeInputs) -> torch.Tensor:
        if isinstance(inputs, PrefillInputs):
            return self.forward_prefill(inputs)
        return self.forward_decode(inputs)

    def _attention_block(self, layer: _Layer, idx: int, x_TD: torch.Tensor, positions_T: torch.Tensor,
                         slots_T: torch.Tensor, attend, table: torch.Tensor) -> torch.Tensor:
        t = x_TD.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv_TE = F.linear(x_TD, layer.qkv_w, layer.qkv_b)
        q_THD = qkv_TE[:, : h * d].view(t, h, d)
        k_TKD = qkv_TE[:, h * d : (h + kv) * d].view(t, kv, d)
        v_TKD = qkv_TE[:, (h + kv) * d :].view(t, kv, d)
        if layer.q_norm is not None:  # Qwen3: RMSNorm over each head before rope
            q_THD = kernels.rms_norm(q_THD.reshape(t * h, d), layer.q_norm, self.eps)[0].view(t, h, d)
            k_TKD = kernels.rms_norm(k_TKD.reshape(t * kv, d), layer.k_norm, self.eps)[0].view(t, kv, d)
        kernels.rope_and_store_kv(q_THD, k_TKD, v_TKD, positions_T, table,
                                  self.k_caches[idx], self.v_caches[idx], slots_T)
        out_THD = attend(q_THD, self.k_caches[idx], self.v_caches[idx])
        return F.linear(out_THD.reshape(t, h * d), layer.o_w, layer.o_b)

    def _body(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, slots_T: torch.Tensor,
              attend, table: torch.Tensor | None = None, images: PrefillImages | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out_TD, residual_TD)`` of the last layer (the final norm adds them)."""
        h_TD = F.embedding(input_ids_T, self.embed)
        if images is not None:
            h_TD = h_TD.index_copy(0, images.index_I, images.embeds_ID.to(h_TD.dtype))
        deep = images.deepstack if images is not None else None
        table = self.cos_sin_PD if table is None else table
        residual_TD = None
        for idx, layer in enumerate(self.layers):
            x_TD, residual_TD = kernels.rms_norm(h_TD, layer.input_norm, self.eps, residual_TD)
            attn_TD = self._attention_block(layer, idx, x_TD, positions_T, slots_T, attend, table)
            x_TD, residual_TD = kernels.rms_norm(attn_TD, layer.post_norm, self.eps, residual_TD)
            gate_up_TI2 = F.linear(x_TD, layer.gate_up_w, layer.gate_up_b)
            h_TD = F.linear(kernels.silu_and_mul(gate_up_TI2), layer.down_w, layer.down_b)
            if deep is not None and idx < len(deep):  # the hidden state is h + residual
                h_TD = h_TD.index_add(0, images.index_I, deep[idx].to(h_TD.dtype))
        return h_TD, residual_TD

    # ------------------------------------------------------------------ vision (VL models)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """``(embeds_ID, deepstack)`` of images in placeholder order (the HF tower)."""
        from ..models.vision import image_features

        return image_features(self, pixel_values.to(self.device), grid_thw.to(self.device))

    def rope_table(self, positions_3T: torch.Tensor) -> torch.Tensor:
        """fp32 ``[T, D]`` cos | sin halves of 3-D positions (the layout of ``cos_sin_PD``)."""
        from ..models.vision import mrope_cos_sin

        like = torch.zeros(1, dtype=torch.float32, device=self.device)
        cos_TD, sin_TD = mrope_cos_sin(self.rotary, positions_3T.to(self.device), like, self.mrope_section)
        half = self.head_dim // 2
        return torch.cat([cos_TD[:, :half], sin_TD[:, :half]], dim=-1).float()

    def forward_prefill(self, b: PrefillInputs) -> torch.Tensor:
        """Logits ``[S, V]`` at each sequence's last new token; writes the new tokens' KV."""
        def attend(q_THD, k_cache, v_cache):
            return kernels.paged_prefill_attention(q_THD, k_cache, v_cache, b.block_tables_SM,
                                                   b.cu_seqlens_q_S1, b.context_lens_S, self.scale,
                                                   b.max_q_len)
        h_TD, residual_TD = self._body(b.input_ids_T, b.positions_T, b.slot_mapping_T, attend,
                                       b.rope_table_TD, b.images)
        last_SD, _ = kernels.rms_norm(h_TD[b.last_index_S], self.final_norm, self.eps,
                                      residual_TD[b.last_index_S])
        return F.linear(last_SD, self.lm_head)

    def forward_decode(self, b: DecodeInputs) -> torch.Tensor:
        """Logits ``[B, V]``, one token per row; writes each row's KV at its slot."""
        def attend(q_BHD, k_cache, v_cache):
            return kernels.paged_decode_attention(q_BHD, k_cache, v_cache, b.block_tables_BM,
                                                  b.context_lens_B, self.scale)
        h_BD, residual_BD = self._body(b.input_ids_B, b.positions_B, b.slot_mapping_B, attend)
        out_BD, _ = kernels.rms_norm(h_BD, self.final_norm, self.eps, residual_BD)
        return F.linear(out_BD, self.lm_head)
