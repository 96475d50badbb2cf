"""A hand-written decoder (Qwen2, Qwen3, Llama, Mistral, Qwen3-MoE) over the paged KV cache.

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

MoE layers (Qwen3-MoE; dense layers of ``mlp_only_layers`` / ``decoder_sparse_step``
stay dense): the router runs in fp32 (its own fp32 copy of ``mlp.gate.weight``, as the
trainer's ``actor.moe.router_dtype`` default: rollout and training route alike), then
:func:`kernels.moe_route` (top-k) and :func:`kernels.fused_moe` (the experts, from the
fused ``[E, 2I, H]`` / ``[E, H, I]`` tensors). Expert weights load under either naming:
the fused names of transformers 5 (``mlp.experts.gate_up_proj``) or one tensor per
expert (``mlp.experts.{e}.gate_proj.weight``: checkpoints on disk, transformers 4),
each a view into the fused tensors (:func:`tapioca.models.moe.expert_aliases`). With
``record_routes`` set, every forward that runs Python (prefill; decode without CUDA
graphs; a graph's capture) leaves the top-k expert ids of each of its tokens in each MoE
layer in ``last_routes`` (int32 ``[T, k]`` per MoE layer); a replay does not update
``last_routes`` by itself. What the engine records for routing replay is the route cache
(:meth:`attach_route_cache`): one row ``[MoE layers, k]`` per KV-cache slot, written at
the slots the step writes its keys and values to, by the forward itself (so inside a
captured decode graph too: a replay writes its routes there, and padding rows write to
a spare last row). Routes therefore follow the KV cache: a prompt prefix reused from the
prefix cache, or shared by the samples of a group, keeps the routes of the forward that
computed it, and :meth:`read_routes` gathers any sequence's routes from its slots.

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

import numpy as np
import torch
import torch.nn.functional as F

from ..models.moe import expert_aliases, fuse_expert_tensors
from ..schemas.errors import EngineError
from . import kernels

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe")
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
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < cfg.max_position_embeddings:
        return (f"sliding-window attention (sliding_window={window} < max_position_embeddings="
                f"{cfg.max_position_embeddings})")
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
        projs = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
        if p + "mlp.gate.weight" in sd:  # an MoE layer: router + experts (fused or per expert)
            names.append(p + "mlp.gate.weight")
            fused = [p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"]
            names += fused if fused[0] in sd else [n for n in sd if n.startswith(p + "mlp.experts.")]
        else:
            projs += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        for proj in projs:
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
class _MoE:
    router_w: torch.Tensor  # fp32 [E, H]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    top_k: int
    norm_topk_prob: bool


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
    gate_up_w: torch.Tensor | None  # dense MLP (None in an MoE layer)
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor | None
    down_b: torch.Tensor | None
    moe: _MoE | None = None


class PagedDecoder(torch.nn.Module):
    """Qwen2 / Qwen3 / Llama / Mistral / Qwen3-MoE decoder over a paged KV cache; see the module docstring.

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
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.norm_topk_prob = bool(getattr(cfg, "norm_topk_prob", True))
        self._targets: dict[str, list[torch.Tensor]] = {}
        self.prefix = _prefix(model)
        # VL models: the HF vision tower (run at prefill) and the text rotary (3-D tables).
        self.visual: torch.nn.Module | None = None
        self.rotary = _text_body(model).rotary_emb
        # Names that load into the targets without being the model's own (the other
        # naming of MoE experts); never returned by hf_state_dict.
        self._aliases: dict[str, torch.Tensor] = {}
        self.record_routes = False
        self.last_routes: list[torch.Tensor] = []
        # LoRA (merged at the switch): the base value of every weight an adapter changed,
        # by HF name; each switch writes base + scale * B @ A into the weight in place.
        self._lora_base: dict[str, torch.Tensor] = {}
        # [slots + 1, MoE layers, k] (None: routes not recorded); the last row takes padding's.
        self.route_cache: torch.Tensor | None = None
        self.num_experts = 0
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

    def _own(self, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The HF tensor itself on the engine's device (no copy when already there)."""
        out = t.detach().to(self.device, dtype)
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
                gate_up_w=opt("", [mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
                gate_up_b=opt("", [mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
                down_w=opt("mlp.down_proj.weight"),
                down_b=opt("mlp.down_proj.bias"),
                moe=self._moe(mlp, sd) if mlp + "gate.weight" in sd else None,
            ))

    def _moe(self, mlp: str, sd: dict) -> _MoE:
        """An MoE layer's router (fp32) and fused experts, whichever naming ``sd`` has."""
        fused = {"gate_up_proj": mlp + "experts.gate_up_proj", "down_proj": mlp + "experts.down_proj"}
        if fused["gate_up_proj"] in sd:
            w13, w2 = (self._own(fused[k], sd[fused[k]]) for k in ("gate_up_proj", "down_proj"))
            self._aliases.update(expert_aliases({fused["gate_up_proj"]: w13, fused["down_proj"]: w2}))
        else:  # one tensor per expert (transformers 4): stack them; those names stay the targets
            stacked = fuse_expert_tensors(sd, mlp)
            w13, w2 = (stacked[k].to(self.device) for k in ("gate_up_proj", "down_proj"))
            views = {fused["gate_up_proj"]: w13, fused["down_proj"]: w2}
            for name, view in expert_aliases(views).items():
                self._targets.setdefault(name, []).append(view)
            self._aliases.update(views)
        router = self._own(mlp + "gate.weight", sd[mlp + "gate.weight"], torch.float32)
        self.num_experts = int(router.shape[0])
        return _MoE(router_w=router, w13=w13, w2=w2, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob)

    def _rope_table(self, model: torch.nn.Module) -> torch.Tensor:
        """fp32 ``[max_positions, head_dim]``: cos then sin of the first half's frequencies."""
        rotary = _text_body(model).rotary_emb
        inv_freq = getattr(rotary, "inv_freq", None)
        dev = inv_freq.device if inv_freq is not None else torch.device("cpu")
        pos_1P = torch.arange(self.max_positions, device=dev)[None]
        like = torch.zeros(1, dtype=torch.float32, device=dev)
        from ..models.vision import mrope_cos_sin, mrope_section_of

        section = mrope_section_of(model.config)
        if section is not None:
            # A VL model's text positions (t = h = w), through the helper that accepts either
            # rotary signature (transformers 5.17 wants [3, B, P] positions, later ones also [B, P]).
            cos_PD, sin_PD = mrope_cos_sin(rotary, pos_1P.expand(3, -1), like, section)
        else:
            cos_1PD, sin_1PD = rotary(like, pos_1P)
            cos_PD, sin_PD = cos_1PD[0], sin_1PD[0]
        half = self.head_dim // 2
        return torch.cat([cos_PD[:, :half], sin_PD[:, :half]], dim=-1).float().to(self.device)

    # ------------------------------------------------------------------ cache and weights

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attach_kv_cache(self, kv_L2NBKD: torch.Tensor) -> None:
        """Use ``kv[l, 0]`` / ``kv[l, 1]`` as layer l's key / value cache."""
        self.k_caches = [kv_L2NBKD[i, 0] for i in range(self.num_layers)]
        self.v_caches = [kv_L2NBKD[i, 1] for i in range(self.num_layers)]

    @property
    def num_moe_layers(self) -> int:
        return sum(layer.moe is not None for layer in self.layers)

    def attach_route_cache(self, num_slots: int) -> None:
        """Record routes per KV slot from now on (before any graph is captured): uint8 ids
        up to 256 experts, else int16 (the bits of uint16)."""
        if not self.num_moe_layers:
            raise EngineError("routed experts were asked for (rollout.return_routed_experts or "
                              "actor.moe.router_replay R3) but the model has no MoE layer; turn them off")
        dtype = torch.uint8 if self.num_experts <= 256 else torch.int16
        self.route_cache = torch.zeros((num_slots + 1, self.num_moe_layers, self.top_k), dtype=dtype,
                                       device=self.device)

    def _store_routes(self, routes: list[torch.Tensor], slots_T: torch.Tensor) -> None:
        cache = self.route_cache
        ids_TLK = torch.stack(routes, 1).to(cache.dtype)
        # Padding rows (slot -1) write to the spare last row: no host read, graph safe.
        dst_T = torch.where(slots_T >= 0, slots_T, cache.shape[0] - 1)
        cache.index_copy_(0, dst_T, ids_TLK)

    def copy_route_blocks(self, src_blocks: torch.Tensor, dst_blocks: torch.Tensor, block_size: int) -> None:
        """The routes of whole KV blocks, as the engine copies their keys and values."""
        if self.route_cache is None:
            return
        blocks = self.route_cache[:-1].view(-1, block_size, *self.route_cache.shape[1:])
        blocks.index_copy_(0, dst_blocks, blocks.index_select(0, src_blocks))

    def read_routes(self, slots: np.ndarray) -> np.ndarray:
        """The routes recorded at ``slots`` (host int64), as a host array ``[n, MoE layers,
        k]`` (uint8, or uint16). On CUDA the gather runs on a side stream: its one host
        wait is for itself, not for the decode step the main stream is running (the
        slots read hold routes of steps the host has already waited for)."""
        cache = self.route_cache
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        if self.device.type != "cuda":
            out = cache.index_select(0, idx)
        else:
            stream = self._route_stream = getattr(self, "_route_stream", None) or torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                out = cache.index_select(0, idx.to(self.device)).cpu()
        host = out.numpy()
        return host.view(np.uint16) if host.dtype == np.int16 else host

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The decoder's weights under HF names (views into the fused tensors)."""
        return {name: ts[0] for name, ts in self._targets.items()}

    def _destinations(self, name: str) -> list[torch.Tensor] | None:
        if name in self._targets:
            return self._targets[name]
        return [self._aliases[name]] if name in self._aliases else None

    def load_hf_state_dict(self, state_dict) -> None:
        """Copy HF-named tensors into the decoder in place (checked before any copy).
        MoE experts may come under either naming (see the module docstring)."""
        unexpected = [k for k in state_dict if self._destinations(k) is None]
        if unexpected:
            raise EngineError(
                f"update_weights got {len(unexpected)} names the model does not have "
                f"(e.g. {unexpected[:3]}); publish the policy's own state_dict() names")
        for name, tensor in state_dict.items():
            want = tuple(self._destinations(name)[0].shape)
            if tuple(tensor.shape) != want:
                raise EngineError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {want}")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                for dst in self._destinations(name):
                    dst.copy_(tensor, non_blocking=True)
        # Whole weights are a new base: an adapter merged before is gone with the old one.
        self._lora_base.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ LoRA adapters

    def check_adapter(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Raise EngineError unless every module of ``pairs`` (module path -> ``(A, B)``,
        tapioca.models.lora.adapter_pairs) is a projection of this decoder whose shape
        ``B @ A`` has."""
        for path, (a_RI, b_OR) in pairs.items():
            dst = self._targets.get(path + ".weight")
            if dst is None:
                raise EngineError(f"the adapter targets {path}, which the paged engine does not have "
                                  "as a linear projection (target q/k/v/o_proj, gate/up/down_proj)")
            want = tuple(dst[0].shape)
            if (int(b_OR.shape[0]), int(a_RI.shape[1])) != want or int(b_OR.shape[1]) != int(a_RI.shape[0]):
                raise EngineError(f"the adapter of {path} has A {tuple(a_RI.shape)}, B {tuple(b_OR.shape)}; "
                                  f"the weight is {want}: an adapter for another model?")

    @torch.no_grad()
    def load_adapter(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Serve an adapter by merging it: each targeted weight becomes ``base + scale * B @ A``
        (one addmm from the kept base copy, computed in the weight's dtype with one rounding;
        never the old delta subtracted), in place, so captured decode graphs stay valid.
        A weight the previous adapter changed and this one does not gets its base back.
        The base copies cost the targeted weights' memory once (kept from the first switch)."""
        self.check_adapter(pairs)
        touched = set()
        for path, (a_RI, b_OR) in pairs.items():
            name = path + ".weight"
            dsts = self._targets[name]
            base = self._lora_base.get(name)
            if base is None:  # never merged: the weight is the base
                base = self._lora_base[name] = dsts[0].clone()
            a = a_RI.to(self.device, base.dtype, non_blocking=True)
            b = b_OR.to(self.device, base.dtype, non_blocking=True)
            for dst in dsts:
                torch.addmm(base, b, a, alpha=scale, out=dst)
            touched.add(name)
        for name in set(self._lora_base) - touched:
            for dst in self._targets[name]:
                dst.copy_(self._lora_base[name])
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
        routes: list[torch.Tensor] = []
        for idx, layer in enumerate(self.layers):
            x_TD, residual_TD = kernels.rms_norm(h_TD, layer.input_norm, self.eps, residual_TD)
            attn_TD = self._attention_block(layer, idx, x_TD, positions_T, slots_T, attend, table)
            x_TD, residual_TD = kernels.rms_norm(attn_TD, layer.post_norm, self.eps, residual_TD)
            if layer.moe is not None:
                h_TD, ids_TK = self._moe_block(layer.moe, x_TD)
                routes.append(ids_TK)
            else:
                gate_up_TI2 = F.linear(x_TD, layer.gate_up_w, layer.gate_up_b)
                h_TD = F.linear(kernels.silu_and_mul(gate_up_TI2), layer.down_w, layer.down_b)
            if deep is not None and idx < len(deep):  # the hidden state is h + residual
                h_TD = h_TD.index_add(0, images.index_I, deep[idx].to(h_TD.dtype))
        if self.route_cache is not None and routes:
            self._store_routes(routes, slots_T)
        if self.record_routes:
            self.last_routes = routes
        return h_TD, residual_TD

    @torch.inference_mode()
    def warm_moe_kernels(self, rows: list[int]) -> None:
        """Run the first MoE layer's kernels once per decode row count on random tokens
        whose routes spread over the experts (what the kernels tune their tiles on)."""
        moe = next((layer.moe for layer in self.layers if layer.moe is not None), None)
        if moe is None:
            return
        gen = torch.Generator(device=self.device).manual_seed(0)
        num_experts, _, hidden = moe.w13.shape
        for n in rows:
            x_TD = torch.randn(n, hidden, device=self.device, generator=gen).to(self.dtype) * 0.1
            logits_TE = torch.randn(n, num_experts, device=self.device, generator=gen)
            weights_TK, ids_TK = kernels.moe_route(logits_TE, moe.top_k, moe.norm_topk_prob)
            kernels.fused_moe(x_TD, moe.w13, moe.w2, weights_TK, ids_TK)

    def _moe_block(self, moe: _MoE, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out_TD, ids_TK)``: the experts' output and the top-k expert ids of each token."""
        logits_TE = F.linear(x_TD.float(), moe.router_w)  # fp32 router (see the module docstring)
        weights_TK, ids_TK = kernels.moe_route(logits_TE, moe.top_k, moe.norm_topk_prob)
        return kernels.fused_moe(x_TD, moe.w13, moe.w2, weights_TK, ids_TK), ids_TK

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
