"""Top-k mixture-of-experts layers (Qwen3-MoE): routing, the training forward, expert names.

Consumes a ``transformers`` sparse MoE block (``block.gate``: the router, weight
``[E, H]``; ``block.experts``: ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]``, the fused layout of transformers 5) and the packed hidden states
``x_NH`` of a micro-batch; emits the block's output ``[N, H]`` and a :class:`RouterOut`
(the top-k expert ids per token, the router's losses and its load). Keyed by nothing:
pure functions plus one autograd function.

Routing (:func:`route`, also the paged engine's): ``softmax`` over the router logits in
fp32, the top-k experts, their probabilities renormalised to sum to 1 when the model's
``norm_topk_prob`` says so (HF's Qwen3-MoE router). Replay: given ``replay_ids_NK`` the
probabilities are read at those ids instead of the top-k's, so the router's gradient
flows through the live scores at the replayed indices (routing replay, R2/R3); a token
whose replayed ids are -1 (no recorded route) takes the top-k, and the top-k of every
token is kept (``RouterOut.live_ids_NK``) for the rollout-vs-train agreement metric.
With expert parallelism the experts run on the ranks that hold them
(:mod:`tapioca.models.expert_parallel`).

The expert FFN (:class:`_GroupedSwiGLU`): token-expert pairs sorted by expert, two
grouped GEMMs (``torch.nn.functional.grouped_mm`` on CUDA in bf16; a loop over experts
elsewhere, which reads the per-expert counts on the host once per layer: free on a CPU,
one sync per layer on a GPU in fp32), SwiGLU between them. Dropless: every pair is
computed (no capacity factor). For backward the FFN keeps the layer input and the
gate/up output only; the sorted copy of the input and ``silu(gate) * up`` are rebuilt
there. The weighted sum of a token's k expert outputs keeps those outputs (the routing
weights' gradient needs them).

Router losses, per MoE layer, over every token of the micro-batch (Megatron's
definitions, whose names AReaL uses): load balancing ``E * sum_e f_e * P_e`` with
``f_e`` the share of the N * k assignments that went to expert e and ``P_e`` the mean
router probability of e (1.0 when balanced); z-loss ``mean_t logsumexp(logits_t)^2``.

Expert names: transformers 5 keeps an MoE layer's experts fused
(``mlp.experts.gate_up_proj``), its checkpoints on disk (and transformers 4's modules)
one tensor per expert (``mlp.experts.{e}.gate_proj.weight``). :func:`expert_aliases`
maps the per-expert names onto views of the fused tensors, so weights under either
naming load into either engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..schemas.errors import ConfigError

# actor.moe.router_dtype values, the names config/moe.py admits (Megatron's spelling first;
# "none": the activation dtype).
ROUTER_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64,
                 "float64": torch.float64, "none": None}


def router_dtype(name: str) -> torch.dtype | None:
    if name not in ROUTER_DTYPES:
        raise ConfigError(f"actor.moe.router_dtype={name!r}: use fp32, fp64 or none (the activation dtype)")
    return ROUTER_DTYPES[name]


def is_sparse_block(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp`` is a top-k MoE block this module runs (router ``gate`` + fused
    ``experts``, no shared expert): Qwen3-MoE's."""
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    return (gate is not None and experts is not None and hasattr(gate, "top_k")
            and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
            and not hasattr(mlp, "shared_expert"))


# ------------------------------------------------------------------ routing


def route(logits_NE: torch.Tensor, top_k: int, norm_topk_prob: bool,
          replay_ids_NK: torch.Tensor | None = None, *, with_live: bool = False):
    """``(weights_NK, ids_NK int64, probs_NE)`` (fp32, or fp64 for fp64 logits): the top-k experts of each token
    and their routing weights; with ``replay_ids_NK`` those experts instead (weights =
    the live probabilities there, differentiable), except on the tokens whose replayed
    ids are -1 (no recorded route: the router's own choice). ``with_live``: a fourth
    value, the router's own top-k ids (what replay overrode). No host reads (graph safe)."""
    probs_NE = torch.softmax(logits_NE.to(torch.promote_types(logits_NE.dtype, torch.float32)), dim=-1)
    live_NK = None
    if replay_ids_NK is None:
        weights_NK, ids_NK = torch.topk(probs_NE, top_k, dim=-1)
        live_NK = ids_NK
    else:
        replay_NK = replay_ids_NK.long()
        live_NK = torch.topk(probs_NE.detach(), top_k, dim=-1).indices
        ids_NK = torch.where(replay_NK[:, :1] >= 0, replay_NK, live_NK)
        weights_NK = probs_NE.gather(-1, ids_NK)
    if norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    if with_live:
        return weights_NK, ids_NK, probs_NE, live_NK
    return weights_NK, ids_NK, probs_NE


def expert_counts(ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E]``: assignments per expert (a scatter-add: no host read, unlike bincount)."""
    flat = ids_NK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_NE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Megatron's switch load-balancing loss ``E * sum_e f_e * P_e`` (1.0 when balanced)."""
    n, num_experts = probs_NE.shape
    share_E = counts_E.to(probs_NE.dtype) / max(1, n * top_k)
    return num_experts * (share_E * probs_NE.mean(0)).sum()


def z_loss(logits_NE: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss ``mean_t logsumexp(logits_t)^2``."""
    logits_NE = logits_NE.to(torch.promote_types(logits_NE.dtype, torch.float32))
    return torch.logsumexp(logits_NE, dim=-1).square().mean()


# ------------------------------------------------------------------ the expert FFN


def _use_grouped_mm(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """grouped_mm runs on CUDA in bf16 with 16-byte aligned rows (CPU builds refuse
    several layouts and have no backward for some; the loop is used there)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")):
        return False
    return all(w.dtype == torch.bfloat16 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 for w in weights)


def _gmm(a_PK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor,
         splits: list[int] | None) -> torch.Tensor:
    """``[P, N]``: rows of group e (``offs`` delimits them) times ``b_EKN[e]``."""
    if splits is None:
        return F.grouped_mm(a_PK, b_EKN, offs=offs_E)
    parts = torch.split(a_PK, splits)
    return torch.cat([p @ b_EKN[e] for e, p in enumerate(parts)])


def _gmm_wgrad(g_PN: torch.Tensor, a_PK: torch.Tensor, offs_E: torch.Tensor,
               splits: list[int] | None) -> torch.Tensor:
    """``[E, N, K]``: per group e, ``g_e^T @ a_e`` (the weight gradient; zeros for an
    expert no token chose)."""
    if splits is None:
        return F.grouped_mm(g_PN.t(), a_PK, offs=offs_E)
    gs, as_ = torch.split(g_PN, splits), torch.split(a_PK, splits)
    return torch.stack([g.t() @ a for g, a in zip(gs, as_)])


def _silu_mul(h_P2I: torch.Tensor) -> torch.Tensor:
    inter = h_P2I.shape[-1] // 2
    return F.silu(h_P2I[:, :inter]) * h_P2I[:, inter:]


class _GroupedSwiGLU(torch.autograd.Function):
    """``y_P = down_e(silu(gate_e(x)) * up_e(x))`` for every token-expert pair, pairs in
    expert order (``order_P``: the flat pair index ``t * k + j`` of each sorted pair)."""

    @staticmethod
    def forward(ctx, x_NH, w13_E2IH, w2_EHI, order_P, top_k, offs_E, splits):
        xs_PH = x_NH.index_select(0, order_P // top_k)
        h_P2I = _gmm(xs_PH, w13_E2IH.transpose(1, 2), offs_E, splits)
        y_PH = _gmm(_silu_mul(h_P2I), w2_EHI.transpose(1, 2), offs_E, splits)
        ctx.save_for_backward(x_NH, order_P, h_P2I, w13_E2IH, w2_EHI, offs_E)
        ctx.splits, ctx.top_k = splits, top_k
        return y_PH

    @staticmethod
    @once_differentiable
    def backward(ctx, gy_PH):
        x_NH, order_P, h_P2I, w13_E2IH, w2_EHI, offs_E = ctx.saved_tensors
        splits, top_k = ctx.splits, ctx.top_k
        gy_PH = gy_PH.contiguous()
        inter = h_P2I.shape[-1] // 2
        a_PI = _silu_mul(h_P2I)  # rebuilt, not kept
        g_w2 = _gmm_wgrad(gy_PH, a_PI, offs_E, splits) if ctx.needs_input_grad[2] else None
        del a_PI
        ga_PI = _gmm(gy_PH, w2_EHI, offs_E, splits)
        # d silu(g) = s (1 + g (1 - s)); the product rule in fp32 (bf16 math in fp32).
        gate, up = h_P2I[:, :inter].float(), h_P2I[:, inter:].float()
        sig = torch.sigmoid(gate)
        g32 = ga_PI.float()
        gh_P2I = torch.cat([g32 * up * sig * (1 + gate * (1 - sig)), g32 * gate * sig],
                           dim=-1).to(h_P2I.dtype)
        del gate, up, sig, g32, ga_PI
        tok_P = order_P // top_k
        g_w13 = _gmm_wgrad(gh_P2I, x_NH.index_select(0, tok_P), offs_E, splits) if ctx.needs_input_grad[1] else None
        g_x = None
        if ctx.needs_input_grad[0]:
            gxs_PH = _gmm(gh_P2I, w13_E2IH, offs_E, splits)
            # Deterministic (no atomics): back to pair order, then each token's k pairs summed.
            g_x = gxs_PH.index_select(0, _inverse(order_P)).view(x_NH.shape[0], top_k, -1).sum(1)
            g_x = g_x.to(x_NH.dtype)
        return g_x, g_w13, g_w2, None, None, None, None


def _inverse(order_P: torch.Tensor) -> torch.Tensor:
    inv_P = torch.empty_like(order_P)
    inv_P[order_P] = torch.arange(order_P.numel(), device=order_P.device)
    return inv_P


@dataclass
class RouterOut:
    """One MoE layer's routing of one forward: ``ids_NK`` (the experts each token used),
    ``counts_E`` (assignments per expert, detached), and the unscaled router losses
    (0-dim tensors, differentiable through the router)."""

    ids_NK: torch.Tensor
    counts_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    # The router's own top-k of each token (= ids_NK unless routes were replayed).
    live_ids_NK: torch.Tensor | None = None


def moe_forward(block: torch.nn.Module, x_NH: torch.Tensor, *, router_dtype: torch.dtype | None,
                replay_ids_NK: torch.Tensor | None = None, expert_parallel=None) -> tuple[torch.Tensor, RouterOut]:
    """The sparse block's output for packed tokens ``x_NH`` and its :class:`RouterOut`.

    The router runs in ``router_dtype`` (None: x's dtype), outside autocast; the experts
    in the autocast dtype when autocast is on, else in the weights' dtype.
    ``expert_parallel``: this rank holds a slice of the experts and the tokens go to
    them by all-to-all (:class:`tapioca.models.expert_parallel.ExpertParallel`; the
    experts then compute in x's dtype, the one FSDP2 gathers the other weights in)."""
    gate, experts = block.gate, block.experts
    top_k, num_experts = int(gate.top_k), int(gate.weight.shape[0])
    dev_type = x_NH.device.type
    rdt = router_dtype or x_NH.dtype
    with torch.autocast(dev_type, enabled=False):
        logits_NE = F.linear(x_NH.to(rdt), gate.weight.to(rdt))
    weights_NK, ids_NK, probs_NE, live_NK = route(logits_NE, top_k, bool(getattr(gate, "norm_topk_prob", True)),
                                                  replay_ids_NK, with_live=True)
    w13, w2 = experts.gate_up_proj, experts.down_proj
    if expert_parallel is not None:  # DTensors: this rank's experts
        w13, w2 = w13.to_local(), w2.to_local()
    dtype = torch.get_autocast_dtype(dev_type) if torch.is_autocast_enabled(dev_type) else w13.dtype
    if expert_parallel is not None and not torch.is_autocast_enabled(dev_type):
        dtype = x_NH.dtype
    x_c = x_NH.to(dtype)
    w13_c, w2_c = w13.to(dtype), w2.to(dtype)
    counts_E = expert_counts(ids_NK, num_experts)
    with torch.autocast(dev_type, enabled=False):
        if expert_parallel is not None:
            y_NKH = expert_parallel.experts(x_c, w13_c, w2_c, ids_NK, counts_E)
        else:
            flat_P = ids_NK.reshape(-1)
            _, order_P = torch.sort(flat_P, stable=True)
            offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
            # The loop path's one host read per layer (free on a CPU).
            splits = None if _use_grouped_mm(x_c, w13_c, w2_c) else counts_E.tolist()
            y_PH = _GroupedSwiGLU.apply(x_c, w13_c, w2_c, order_P, top_k, offs_E, splits)
            y_NKH = y_PH.index_select(0, _inverse(order_P)).view(x_NH.shape[0], top_k, -1)
        # Weights in the router's dtype (fp32 by default: the weighted sum is in fp32; with
        # "none" in x's dtype, as HF rounds them).
        out_NH = (y_NKH * weights_NK.to(rdt)[..., None]).sum(1)
    router = RouterOut(ids_NK=ids_NK, counts_E=counts_E.detach(),
                       aux_loss=load_balancing_loss(probs_NE, counts_E, top_k), z_loss=z_loss(logits_NE),
                       live_ids_NK=live_NK)
    return out_NH.to(x_NH.dtype), router


def router_metrics(counts_LE: torch.Tensor, tokens: int, top_k: int) -> dict[str, float]:
    """``actor/moe_*`` load statistics of a step from assignments per layer and expert
    (``counts_LE``, summed over the step's training forwards; ``tokens`` routed per
    layer): the normalised entropy of each layer's load (1 = balanced; mean over
    layers), the largest share any expert got (max over layers; 1/E = balanced), and
    the assignments not computed (dropless: 0). One host read."""
    counts = counts_LE.double()
    num_experts = counts.shape[-1]
    share_LE = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    ent_L = -(share_LE * share_LE.clamp(min=1e-30).log()).sum(-1)
    norm = torch.log(torch.tensor(float(num_experts), dtype=torch.float64))
    stats = torch.stack([(ent_L / norm).mean(), share_LE.max(), counts.sum()]).tolist()
    return {"actor/moe_load_entropy": stats[0], "actor/moe_max_expert_share": stats[1],
            "actor/moe_dropped_tokens": float(tokens * top_k * counts_LE.shape[0] - stats[2])}


def router_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The MoE routers' parameters of any transformers MoE family (``mlp.gate`` of
    Qwen2/3-MoE, OLMoE, Qwen3-Next; ``mlp.router`` of gpt-oss): what actor.moe.freeze_router
    holds fixed. Shared-expert gates are not routers and train."""
    return [p for name, p in model.named_parameters()
            if re.search(r"\.mlp\.(gate|router)\.(weight|bias)$", name)]


# ------------------------------------------------------------------ expert names

_FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<which>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<which>gate_proj|up_proj|down_proj)\.weight$")


def expert_aliases(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert names (``...experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``,
    ``down_proj`` ``[H, I]``) for every fused expert tensor in ``tensors``
    (``...experts.gate_up_proj`` ``[E, 2I, H]``, ``...experts.down_proj`` ``[E, H, I]``),
    each a view into the fused tensor: copying into an alias writes the fused weights."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if m is None or t.dim() != 3:
            continue
        prefix = m["p"]
        for e in range(t.shape[0]):
            if m["which"] == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            else:
                inter = t.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
    return out


def fuse_expert_tensors(sd: dict[str, torch.Tensor], layer_prefix: str) -> dict[str, torch.Tensor] | None:
    """``{gate_up_proj, down_proj}`` stacked from the per-expert tensors of
    ``layer_prefix + "experts."`` in ``sd`` (transformers 4's modules), or None when
    ``sd`` has none."""
    gates, ups, downs = {}, {}, {}
    for name, t in sd.items():
        m = _PER_EXPERT.match(name)
        if m is None or m["p"] != layer_prefix + "experts":
            continue
        {"gate_proj": gates, "up_proj": ups, "down_proj": downs}[m["which"]][int(m["e"])] = t
    if not gates:
        return None
    n = len(gates)
    return {"gate_up_proj": torch.stack([torch.cat([gates[e], ups[e]]) for e in range(n)]),
            "down_proj": torch.stack([downs[e] for e in range(n)])}
