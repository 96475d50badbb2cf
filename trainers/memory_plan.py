"""The trainer's memory on one GPU, estimated from the model's shape and the config
(``tapioca plan``; docs/distributed.md has a table from it). Pure arithmetic: no torch.

Consumes a :class:`ModelShape` (a HF ``config.json``, a preset, or the tiny model's
fields) and a :class:`TrainShape` (``actor`` + ``fsdp`` sections, or given directly);
emits a :class:`MemoryPlan`: bytes per GPU of the weights, the gradients, the optimizer
state and the activations of one micro-batch, their peak, and whether it fits.

What is counted, per GPU (one rank of the (dp, cp, tp) mesh):

* **one process** (world size 1, the plain actor): the weights in ``actor.param_dtype``;
  fp32 weights under bf16 autocast keep a bf16 copy of every layer weight for backward;
  AdamW's two moments in the weights' dtype (bf16 weights with ``fp32_master_weights``:
  fp32 moments and the fp32 masters, MasterAdamW; none on the GPU with
  ``offload_optimizer``); the gradients in the weights' dtype.
* **sharded** (FSDP2, world size > 1): the weights in ``actor.param_dtype`` (fp32 unless
  bfloat16 is asked for), gradients and moments split over all ranks as above (tp splits
  the matrices, dp x cp shards the rest); the compute copies in
  ``fsdp.param_dtype`` of the root (embedding, LM head; kept for the whole step) and of
  two decoder layers at a time (the current and the prefetched one); one layer's
  unsharded gradient and its fp32 reduce copy in backward.
* **activations**: what autograd keeps per token of each decoder layer of the packed
  forward, tensor by tensor (HF RMSNorm saves its fp32 input and normalised output;
  the projections their input; flash varlen q, k, v, out and the log-sum-exp; the SwiGLU
  MLP gate, silu, up and product), per switch (liger, recompute_swiglu, activation
  checkpointing, autocast), then divided among ranks: the sequence-parallel parts by
  tp x cp, the all-gathered projection inputs by cp only (DTensor keeps them whole),
  heads and MLP channels by tp x cp (Ulysses: N tokens x heads / cp).
* **the LM head**: the scored rows' hidden states, the chunked logprobs' buffers
  (``logprob_chunk_tokens`` x vocab / tp: two fp32 and one in the matmul dtype; the
  Triton kernel: one bf16; ``logprob_keep_logits``: every chunk's), the fp32 weight
  gradient accumulator.
* **peak** = what stays (weights, optimizer state, autocast copies) + the larger of
  (a) the start of backward: every micro-batch activation + the LM head's backward
  buffers and gradient (+ all gradients when several micro-batches accumulate), and
  (b) the optimizer step: all gradients + its temporaries (foreach AdamW: one fp32
  copy of the parameters; MasterAdamW: one 512 MiB bucket of fp32 gradients).

Not counted: the CUDA context and the caching allocator's reserve (``torch.cuda.
max_memory_allocated`` does not count them either), NCCL's buffers (~1-2 GiB per GPU
under several ranks), fragmentation. Checked against measured peaks at tp = cp = 1 by
``benchmarks/plan_vs_measured.py`` (target: within 15%); the activation bytes are
checked tensor by tensor on the CPU (tests/unit/test_memory_plan.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..models.families import moe_of

GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (``float32``, ``bfloat16``, ``float16``)."""
    return _BYTES[dtype]

# MasterAdamW steps in buckets of this many elements (trainers/optim.py BUCKET_ELEMS).
_MASTER_BUCKET_ELEMS = 1 << 27


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's shape (Qwen2 / Qwen3 / Llama; MoE: Qwen3-MoE)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0  # MoE: experts per layer (0: a dense SwiGLU MLP)
    experts_per_token: int = 0
    moe_intermediate: int = 0
    # A vision-language model's vision tower (models/vision.py vision_tower_params): in
    # its weights everywhere, trained unless vlm.freeze_vision_encoder (TrainShape.frozen_params).
    vision_params: int = 0

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return h * q + 2 * h * kv + q * h + bias + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def mlp_params(self) -> int:
        if self.experts:
            return self.experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Embedding and LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        """Every weight: the decoder's and a vision tower's."""
        return self.layers * self.layer_params + self.embedding_params + self.hidden + self.vision_params

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "") -> "ModelShape":
        """From a ``config.json`` dict (Qwen2 / Qwen3 / Llama / Qwen3-MoE)."""
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        moe = moe_of(cfg)
        experts = moe.experts if moe else 0
        model_type = str(cfg.get("model_type", ""))
        return cls(
            name=name or model_type, vocab=int(cfg["vocab_size"]), hidden=hidden,
            layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg.get("intermediate_size") or 0),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),  # Qwen2, -MoE, -VL text
            qk_norm=model_type.startswith("qwen3"), experts=experts,
            experts_per_token=moe.top_k if moe else 0,
            moe_intermediate=int(cfg.get("moe_intermediate_size") or 0) if experts else 0)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelShape":
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()), name=Path(path).name)


# Published shapes (the models' config.json values).
PRESETS = {
    "qwen2-0.5b": ModelShape("qwen2-0.5b", 151936, 896, 24, 14, 2, 64, 4864, tied=True, qkv_bias=True),
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", 151936, 1536, 28, 12, 2, 128, 8960, tied=True, qkv_bias=True),
    "qwen2.5-3b": ModelShape("qwen2.5-3b", 151936, 2048, 36, 16, 2, 128, 11008, tied=True, qkv_bias=True),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 152064, 3584, 28, 28, 4, 128, 18944, qkv_bias=True),
    "qwen2.5-32b": ModelShape("qwen2.5-32b", 152064, 5120, 64, 40, 8, 128, 27648, qkv_bias=True),
    "qwen2.5-72b": ModelShape("qwen2.5-72b", 152064, 8192, 80, 64, 8, 128, 29568, qkv_bias=True),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 151936, 2048, 48, 32, 4, 128, 6144, qk_norm=True,
                                experts=128, experts_per_token=8, moe_intermediate=768),
}


@dataclass(frozen=True)
class TrainShape:
    """What the trainer does with the model (defaults: ActorConfig / FSDPConfig's)."""

    tokens: int  # packed tokens of the largest micro-batch (actor.mb_max_tokens)
    scored_tokens: int | None = None  # of them predicting a trained token (None: all)
    micro_batches: int = 1  # per optimizer step: > 1 keeps every gradient during the forward
    dp: int = 1
    tp: int = 1
    cp: int = 1
    param_dtype: str = "float32"  # actor.param_dtype
    autocast_dtype: str = ""  # actor.autocast_dtype
    fsdp_param_dtype: str = "bfloat16"  # the sharded trainer's compute dtype
    fp32_master_weights: bool = True
    offload_optimizer: bool = False
    fused_optimizer: bool = True
    liger: bool = False
    recompute_swiglu: bool = False
    checkpoint_every: int = 0  # activation checkpointing of every n-th layer (0: off)
    attention: str = "varlen"  # varlen (flash, CUDA) | sdpa (padded inside attention)
    padded_tokens: int | None = None  # sdpa: sequences x longest (None: = tokens)
    logprob_kernel: str = "torch"  # torch | triton
    keep_logits: bool = False
    chunk_tokens: int = 4096
    # actor.lora.enabled: the adapter's parameters (0: full training) and the sum of its
    # ranks over one decoder layer's targeted projections (what each saves per token).
    lora_params: int = 0
    lora_layer_rank: int = 0
    # Weights with no gradient nor optimizer state besides the LoRA base: a frozen vision
    # tower (vlm.freeze_vision_encoder; its forward keeps no activations either).
    frozen_params: int = 0

    def trained_params(self, m: "ModelShape") -> int:
        """The parameters with gradients and optimizer state: the adapter, else every
        weight but the frozen ones."""
        return self.lora_params or m.params - self.frozen_params

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def compute_bytes(self) -> int:
        """Bytes of an activation element: the dtype the layers compute in."""
        if self.sharded:
            return _BYTES[self.autocast_dtype or self.fsdp_param_dtype]
        return _BYTES[self.autocast_dtype or self.param_dtype]

    @property
    def autocast(self) -> bool:
        """fp32 weights (and residual stream) with low-precision matmuls."""
        weights = self.fsdp_param_dtype if self.sharded else self.param_dtype
        return bool(self.autocast_dtype) and weights == "float32"

    def describe(self) -> str:
        ac = f" ac/{self.checkpoint_every}" if self.checkpoint_every else ""
        return (f"dp={self.dp} tp={self.tp} cp={self.cp}, {self.tokens} tokens/micro-batch, "
                f"{'sharded ' + self.fsdp_param_dtype if self.sharded else self.param_dtype} weights"
                f"{' + ' + self.autocast_dtype + ' autocast' if self.autocast_dtype else ''}{ac}"
                f"{' liger' if self.liger else ''}{' recompute_swiglu' if self.recompute_swiglu else ''}"
                f"{f' LoRA ({self.lora_params / 1e6:.1f}M adapter parameters)' if self.lora_params else ''}"
                f", {self.attention} attention, {self.logprob_kernel} logprobs")


@dataclass
class MemoryPlan:
    model: ModelShape
    train: TrainShape
    parts: dict[str, float] = field(default_factory=dict)  # bytes
    peak: float = 0.0
    peak_at: str = ""

    def fits(self, gpu_gib: float) -> bool:
        return self.peak <= gpu_gib * GIB

    def table(self, gpu_gib: float | None = None) -> str:
        rows = [f"{self.model.name}: {self.model.params / 1e9:.2f}B parameters; {self.train.describe()}"]
        for name, value in self.parts.items():
            rows.append(f"  {name:<34s} {value / GIB:9.2f} GiB")
        rows.append(f"  {'peak (' + self.peak_at + ')':<34s} {self.peak / GIB:9.2f} GiB")
        if gpu_gib is not None:
            verdict = "fits" if self.fits(gpu_gib) else "does NOT fit"
            rows.append(f"  {verdict} in {gpu_gib:g} GiB ({100 * self.peak / (gpu_gib * GIB):.0f}%)")
        return "\n".join(rows)


# ------------------------------------------------------------------ activations


def layer_activation_bytes(m: ModelShape, t: TrainShape) -> tuple[float, float, float]:
    """Bytes autograd keeps per token of one decoder layer, as ``(seq, gathered, split)``:
    the sequence-parallel part (divided by tp x cp), the all-gathered projection inputs
    (divided by cp), the per-head / per-channel part (divided by tp x cp)."""
    a, h = t.compute_bytes, m.hidden
    seq = gathered = split = 0.0
    # The two RMSNorms (HF's: fp32 input copy + normalised output; liger: input + rstd)
    # and the projections' inputs (the norms' outputs; under autocast each projection
    # saves its own bf16 cast of it: 3 for q/k/v, 2 for gate/up).
    if t.liger:
        seq += 2 * (a * h + 4)
        gathered += 2 * a * h
    elif t.autocast:
        seq += 2 * (4 * h + 4 * h + 4)  # the fp32 residual itself + normalised output (fp32)
        gathered += (3 + 2) * a * h
    elif a == 4:
        seq += 2 * (4 * h + 4 * h + 4)  # fp32: the input is saved as it is
        gathered += 2 * 4 * h
    else:
        seq += 2 * (4 * h + a * h + 4)  # the fp32 copy of the bf16 input + bf16 normalised
        gathered += 2 * a * h
    # Attention: flash varlen keeps q, k, v (after rotary), out (o_proj's input too) and the
    # fp32 log-sum-exp; sdpa (the CPU reference) keeps padded q, k and v repeated to every
    # query head, out and its log-sum-exp, plus the packed q, k, v its padding copies from
    # and the packed out that o_proj reads.
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    if t.attention == "sdpa":
        pad = (t.padded_tokens or t.tokens) / t.tokens
        split += pad * (4 * q * a + 4 * m.heads) + (q + 2 * kv) * a + q * a
    else:
        split += (q + 2 * kv) * a + q * a + 4 * m.heads
    if m.qk_norm:  # Qwen3: RMSNorm per head of q and k (fp32 copy + normalised)
        split += (m.heads + m.kv_heads) * m.head_dim * (4 + a)
    # MLP: gate out (silu's input), silu out, up out, their product (down's input).
    per_channel = 2 if t.recompute_swiglu else (3 if t.liger else 4)
    if m.experts:
        k = m.experts_per_token
        split += k * (per_channel * m.moe_intermediate * a + h * a) + 2 * 4 * m.experts
    else:
        split += per_channel * m.intermediate * a
    # LoRA: each targeted projection's adapter keeps its rank-wide A output for B (its
    # input is the projection's, saved once).
    split += t.lora_layer_rank * a
    return seq, gathered, split


def activation_parts(m: ModelShape, t: TrainShape) -> tuple[float, float]:
    """``(saved by the forward, recomputed in backward)``: every decoder layer's saved
    activations of one micro-batch on one rank; with activation checkpointing, the one
    layer whose activations the backward recomputes at a time."""
    seq, gathered, split = layer_activation_bytes(m, t)
    n = t.tokens / t.cp  # tokens of this rank's context-parallel slice
    full_layer = seq * n / t.tp + gathered * n + split * n / t.tp
    every = t.checkpoint_every
    if not every:
        return m.layers * full_layer, 0.0
    checkpointed = math.ceil(m.layers / every)
    residual = 4 if t.autocast else t.compute_bytes
    # A checkpointed layer keeps its input only (sequence-split under tp).
    return checkpointed * residual * m.hidden * n / t.tp + (m.layers - checkpointed) * full_layer, full_layer


def activation_bytes(m: ModelShape, t: TrainShape) -> float:
    return sum(activation_parts(m, t))


def head_bytes(m: ModelShape, t: TrainShape) -> tuple[float, float]:
    """The LM head's ``(saved, backward transient)`` bytes on one rank: the final norm,
    the scored rows' hidden states (and what all layers share); then the chunk buffers, the gradient of the
    hidden states and the fp32 weight-gradient accumulator of its backward."""
    a, h = t.compute_bytes, m.hidden
    n = t.tokens / t.cp
    rows = (t.scored_tokens if t.scored_tokens is not None else t.tokens) / t.cp
    vocab = m.vocab / t.tp
    norm = (a * h + 4) if t.liger else ((8 * h + 4) if a == 4 or t.autocast else (4 * h + a * h + 4))
    # + what every layer shares: the rotary cos / sin and the packed indices.
    rotary = 2 * m.head_dim * (4 if t.autocast else a) + 8
    saved = norm * n / t.tp + rows * (h * a + 3 * 4) + rotary * n
    chunk = min(t.chunk_tokens, rows)
    mm = 4 if (a == 4 and not t.autocast) else 2
    if t.logprob_kernel == "triton":
        buffers = chunk * vocab * mm
        if t.keep_logits:
            saved += rows * vocab * mm
    else:
        buffers = chunk * vocab * (4 + 4 + (0 if mm == 4 else mm))
    weights_bytes = _BYTES[t.fsdp_param_dtype if t.sharded else t.param_dtype]
    w_copy = vocab * h * mm if mm != weights_bytes else 0  # the weight in the matmul dtype
    # fp32 accumulator over the chunks; none for LoRA's frozen head.
    grad_w = 0 if t.lora_params else vocab * h * 4
    grad_h = rows * h * 4 + n * h * a  # fp32, then scattered into the [n, H] gradient
    return saved, buffers + w_copy + grad_w + grad_h


def layer_backward_bytes(m: ModelShape, t: TrainShape) -> float:
    """The largest transient of one layer's backward: the MLP's gradients ([n, I / tp]
    for the product, gate and up)."""
    inter = m.experts_per_token * m.moe_intermediate if m.experts else m.intermediate
    return 3 * (t.tokens / t.cp) * inter / t.tp * t.compute_bytes


# ------------------------------------------------------------------ the plan


def _split_params(m: ModelShape, t: TrainShape) -> tuple[float, float, float]:
    """Parameters on one tp rank: ``(all, one layer, root)`` (norms replicated)."""
    norms = 2 * m.hidden + (2 * m.head_dim if m.qk_norm else 0)
    layer = (m.layer_params - norms) / t.tp + norms
    root = m.embedding_params / t.tp + m.hidden
    return m.layers * layer + root, layer, root


def _adam_state(w: int, t: TrainShape) -> tuple[bool, int]:
    """(fp32 masters?, bytes of optimizer state a trained parameter) for weights of ``w``
    bytes: MasterAdamW keeps fp32 masters and two fp32 moments beside low-precision
    weights; torch's AdamW two moments ``zeros_like`` the weights."""
    masters = w < 4 and t.fp32_master_weights
    return masters, 12 if masters else 2 * w


def plan(m: ModelShape, t: TrainShape) -> MemoryPlan:
    """The per-GPU memory of training ``m`` as ``t`` says (see the module docstring)."""
    p = MemoryPlan(m, t)
    acts = activation_bytes(m, t)
    head_saved, head_transient = head_bytes(m, t)
    layer_transient = layer_backward_bytes(m, t)
    if t.sharded:
        total, layer, root = _split_params(m, t)
        shard = total / (t.dp * t.cp)
        # LoRA under FSDP (no tp / cp: the feature table refuses them): the frozen base is
        # sharded with the adapter, and only the adapter has gradients and Adam state.
        adapter = t.lora_params / (t.dp * t.cp)
        trained = adapter if t.lora_params else shard
        c = _BYTES[t.fsdp_param_dtype]
        # The shards keep actor.param_dtype (fp32 unless bfloat16 is asked for; the sharded
        # gradients take their dtype).
        w = _BYTES[t.param_dtype]
        dt = "fp32" if w == 4 else "bf16"
        masters, state = _adam_state(w, t)
        p.parts[f"weights ({dt} shard)"] = w * (shard + adapter)
        p.parts["weights (gathered root + 2 layers)"] = c * (root + 2 * layer)
        p.parts[f"gradients ({dt} shard)"] = w * trained
        p.parts["optimizer (Adam moments" + (" + fp32 masters)" if masters else ")")] = state * trained
        stays = sum(p.parts.values())
        # One layer's unsharded gradient and its fp32 reduce copy; under tp DTensor's
        # row-wise embedding backward builds a whole-vocabulary gradient.
        backward_extra = (0.0 if t.lora_params else layer * (c + 4)) \
            + (m.vocab * m.hidden * c if t.tp > 1 else 0)
        step_extra = 0.0
        grads_resident = 0.0
        # The root's unsharded LM-head gradient, reduce-scattered only after the whole
        # backward; none for LoRA's frozen head.
        head_grad = 0.0 if t.lora_params else c * m.vocab * m.hidden / t.tp
    else:
        w = _BYTES[t.param_dtype]
        # LoRA: the base is frozen in its dtype; only the adapter has gradients and state.
        n_params = t.trained_params(m)
        p.parts["weights"] = w * (m.params + t.lora_params)
        if t.autocast:
            p.parts["autocast bf16 weight copies"] = 2 * m.layers * m.layer_params
        masters, state = _adam_state(w, t)
        p.parts["gradients" + (" (adapter)" if t.lora_params else "")] = w * n_params
        on_gpu_state = 0 if (masters and t.offload_optimizer) else state
        p.parts["optimizer (moments" + (" + fp32 masters)" if masters else ")")] = on_gpu_state * n_params
        stays = p.parts["weights"] + p.parts.get("autocast bf16 weight copies", 0.0) + on_gpu_state * n_params
        grads = w * n_params
        grads_resident = grads if t.micro_batches > 1 else 0.0
        head_grad = 0.0 if t.micro_batches > 1 or t.lora_params else w * m.vocab * m.hidden
        backward_extra = 0.0
        if masters:
            step_extra = min(n_params, _MASTER_BUCKET_ELEMS) * 4 * (1 if t.fused_optimizer else 2)
        else:
            step_extra = 0.0 if t.fused_optimizer else 4 * n_params
        step_extra += grads
    p.parts["activations (one micro-batch)"] = acts
    p.parts["LM head (saved)"] = head_saved
    p.parts["backward transient"] = max(head_transient + head_grad, layer_transient) + backward_extra
    at_backward = acts + head_saved + p.parts["backward transient"] + grads_resident
    p.peak, p.peak_at = max((stays + at_backward, "start of backward"), (stays + step_extra, "optimizer step"))
    return p


def train_shape(actor, fsdp, *, tokens: int | None = None, micro_batches: int = 2,
                model: ModelShape | None = None, freeze_vision: bool = False) -> TrainShape:
    """A :class:`TrainShape` from the ``actor`` and ``fsdp`` config sections, as the
    trainer will run them: on CUDA the ``auto`` logprob kernel is Triton at tp 1, and
    ``auto`` attention is flash varlen where the layers compute in bf16 / fp16 (in fp32
    the packed forward runs padded sdpa); ``liger_kernels: null`` is on where it runs.
    ``model``: the shape a LoRA adapter (``actor.lora.enabled``) and a frozen vision tower
    (``freeze_vision``: ``vlm.freeze_vision_encoder``) are counted on."""
    from ..models.fused_ops import liger_by_default

    cuda = str(actor.device).startswith("cuda")
    kernel = actor.logprob_kernel
    if kernel == "auto":
        kernel = "triton" if cuda and fsdp.tp == 1 else "torch"
    compute = actor.autocast_dtype or (fsdp.param_dtype if fsdp.world_size > 1 else actor.weights_dtype)
    attention = actor.attention_backend
    if attention == "auto":
        attention = "varlen" if cuda and compute in ("bfloat16", "float16") else "sdpa"
    every = actor.gradient_checkpointing_every_n_layers if actor.gradient_checkpointing else 0
    lora_params = lora_rank = 0
    if actor.lora.enabled and model is not None:
        lora_params, lora_rank = lora_shape(model, actor.lora.rank, actor.lora.target_modules)
    return TrainShape(
        tokens=tokens or actor.mb_max_tokens, micro_batches=micro_batches, dp=fsdp.dp, tp=fsdp.tp,
        cp=fsdp.cp, param_dtype=actor.weights_dtype, autocast_dtype=actor.autocast_dtype,
        fsdp_param_dtype=fsdp.param_dtype, fp32_master_weights=actor.fp32_master_weights,
        offload_optimizer=actor.offload_optimizer, fused_optimizer=actor.fused_optimizer,
        liger=(actor.liger_kernels if actor.liger_kernels is not None
               else liger_by_default(actor.device, parallel=fsdp.tp > 1, compile_layers=actor.compile_layers)),
        recompute_swiglu=actor.recompute_swiglu, checkpoint_every=every,
        attention="sdpa" if attention == "sdpa" else "varlen", logprob_kernel=kernel,
        keep_logits=actor.logprob_keep_logits, chunk_tokens=actor.logprob_chunk_tokens,
        lora_params=lora_params, lora_layer_rank=lora_rank,
        frozen_params=model.vision_params if freeze_vision and model is not None else 0)


# A decoder layer's linear projections as peft names them: (input, output) features.
def projections(m: ModelShape) -> dict[str, tuple[int, int]]:
    q, kv, h = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden
    inter = m.intermediate if not m.experts else 0  # MoE experts are no nn.Linear to target
    out = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if inter:
        out.update({"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)})
    return out


def lora_targets(m: ModelShape, target_modules) -> dict[str, tuple[int, int]]:
    """The projections of one layer an adapter of ``actor.lora.target_modules`` wraps
    (``all-linear``: every one; peft leaves the LM head out)."""
    names = list(target_modules)
    proj = projections(m)
    return proj if "all-linear" in names else {n: proj[n] for n in names if n in proj}


def lora_shape(m: ModelShape, rank: int, target_modules) -> tuple[int, int]:
    """``(adapter parameters, sum of the ranks over one layer's targets)``: A is
    ``[rank, in]`` and B ``[out, rank]`` for every targeted projection of every layer."""
    targets = lora_targets(m, target_modules)
    per_layer = sum(rank * (i + o) for i, o in targets.values())
    return m.layers * per_layer, rank * len(targets)


def tiny_shape(model) -> ModelShape:
    """The launcher's tiny model (``model.*``; its vocabulary, the task's alphabet, is
    taken as 256 here: an upper bound)."""
    return ModelShape("tiny (model.*)", 256, model.hidden_size, model.num_layers, model.num_heads,
                      model.num_kv_heads, model.hidden_size // model.num_heads, model.intermediate_size,
                      tied=model.tie_word_embeddings, qkv_bias=model.arch == "qwen2",
                      qk_norm=model.arch == "qwen3")


def layouts(world: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, cp) of ``world`` ranks with tp, cp powers of two."""
    out = []
    tp = 1
    while tp <= world:
        cp = 1
        while tp * cp <= world:
            if world % (tp * cp) == 0:
                out.append((world // (tp * cp), tp, cp))
            cp *= 2
        tp *= 2
    return out


def valid_layout(m: ModelShape, tp: int, cp: int) -> bool:
    """Whether the trainer takes this model at (tp, cp) (config/distributed.py's rules;
    tensor and context parallelism run dense MLPs only: MoE models train data parallel)."""
    if m.experts and (tp > 1 or cp > 1):
        return False
    if m.heads % (tp * cp) or m.kv_heads % tp or m.vocab % tp or (m.intermediate % tp and not m.experts):
        return False
    kv = m.kv_heads // tp
    return kv % cp == 0 or cp % kv == 0


def with_layout(t: TrainShape, dp: int, tp: int, cp: int) -> TrainShape:
    return replace(t, dp=dp, tp=tp, cp=cp)
