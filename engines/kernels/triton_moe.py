"""Triton top-k routing and grouped expert GEMMs (Qwen3-MoE) for the paged engine.

Consumes the router logits ``[T, E]`` (fp32), the layer input ``x_TH`` and the fused
expert weights (``w13_E2IH`` ``[E, 2I, H]``: gate rows then up rows; ``w2_EHI``
``[E, H, I]``); emits the routing (``weights_TK`` fp32, ``ids_TK`` int32) and the
block's output ``[T, H]`` in x's dtype. Same contract and rounding as
:func:`tapioca.engines.kernels.reference.fused_moe`.

Four launches per MoE layer, none reading the host (CUDA-graph safe: every grid depends
on shapes only):

1. :func:`moe_route`: one program per token: fp32 softmax over the experts, the top-k
   by repeated argmax (smallest index on ties), renormalised.
2. ``_align_kernel`` (one program): the ``T * k`` token-expert pairs laid out by expert,
   each expert's run padded to a multiple of ``BLOCK_M`` (vLLM's ``moe_align_block_size``):
   per-expert counts by atomics, exclusive prefix sums, the expert of every ``BLOCK_M``
   block, then each pair placed by an atomic cursor. The order of pairs inside an expert's
   run is not fixed, but every output row is computed alone (the same dot products in the
   same order whatever row of the tile it sits in), so results do not depend on it. The
   layout has a static upper bound ``T * k + E * (BLOCK_M - 1)`` slots; blocks past the
   real total exit at once, padding slots hold the sentinel ``T * k``.
3. ``_moe_gemm`` (GATED, up): per (block, column tile) of one expert, ``x @ gate^T`` and ``x @ up^T``
   together (the rows of x gathered by token), then ``silu(gate) * up`` in the epilogue:
   ``[T * k, I]`` by pair.
4. ``_moe_gemm`` (down): ``act @ down^T`` times the pair's routing weight: ``[T * k, H]``; the
   k pairs of a token are then summed in fp32 (``sum``: deterministic, no atomics).

Decode is bound by the expert bytes read: with 64+ rows nearly every expert is hit, and
each expert's weights are read once per column tile (one ``BLOCK_M`` block holds all
its pairs). Tile sizes are autotuned per (pairs per expert bucket, N, K) on CUDA, at the
first call of a shape (the capture's warm-up runs outside the graph, so tuning never
runs inside one); the interpreter runs one small configuration.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ------------------------------------------------------------------ routing


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l,
                  TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    logits = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(mask, p, -1.0)
    kk = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    picked_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    # The k largest by repeated argmax, kept in registers (TOP_K is small: 8 for Qwen3).
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # smallest index on ties
        picked_w = tl.where(kk == j, best, picked_w)
        picked_i = tl.where(kk == j, idx, picked_i)
        p = tl.where(offs == idx, -1.0, p)
    if NORM:
        picked_w = picked_w / tl.sum(tl.where(kk < TOP_K, picked_w, 0.0), axis=0)
    tl.store(weights_ptr + row * TOP_K + kk, picked_w, mask=kk < TOP_K)
    tl.store(ids_ptr + row * TOP_K + kk, picked_i, mask=kk < TOP_K)


def moe_route(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`tapioca.engines.kernels.reference.moe_route`."""
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    tokens, num_experts = logits_TE.shape
    weights_TK = torch.empty((tokens, top_k), dtype=torch.float32, device=logits_TE.device)
    ids_TK = torch.empty((tokens, top_k), dtype=torch.int32, device=logits_TE.device)
    if tokens:
        _route_kernel[(tokens,)](logits_TE, weights_TK, ids_TK, num_experts, logits_TE.stride(0),
                                 TOP_K=top_k, NORM=bool(norm_topk_prob),
                                 BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
                                 BLOCK_K=triton.next_power_of_2(top_k), num_warps=1)
    return weights_TK, ids_TK


# ------------------------------------------------------------------ pairs by expert


@triton.jit
def _align_kernel(ids_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, total_ptr, P, E, num_slots, num_blocks,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    tl.store(cursor_ptr + offs_e, 0, mask=mask_e)
    for start in range(0, num_slots, BLOCK):  # every slot a padding slot first
        o = start + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + o, P, mask=o < num_slots)
    tl.debug_barrier()
    for start in range(0, P, BLOCK):  # pairs per expert
        o = start + tl.arange(0, BLOCK)
        m = o < P
        e = tl.load(ids_ptr + o, mask=m, other=0)
        tl.atomic_add(cursor_ptr + e, 1, mask=m)
    tl.debug_barrier()
    counts = tl.load(cursor_ptr + offs_e, mask=mask_e, other=0, volatile=True)  # the atomics' results
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(total_ptr, tl.sum(padded, axis=0))
    tl.debug_barrier()  # every thread has read the counts before they become cursors
    tl.store(cursor_ptr + offs_e, ends - padded, mask=mask_e)
    for start in range(0, num_blocks, BLOCK_B):  # block b's expert: how many runs end at or before it
        b = start + tl.arange(0, BLOCK_B)
        before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & mask_e[None, :]
        expert = tl.minimum(tl.sum(before.to(tl.int32), axis=1), E - 1)
        tl.store(block_expert_ptr + b, expert, mask=b < num_blocks)
    tl.debug_barrier()
    for start in range(0, P, BLOCK):  # each pair to its expert's next free slot
        o = start + tl.arange(0, BLOCK)
        m = o < P
        e = tl.load(ids_ptr + o, mask=m, other=0)
        slot = tl.atomic_add(cursor_ptr + e, 1, mask=m)
        tl.store(sorted_ptr + slot, o, mask=m)


def block_m_for(pairs: int, num_experts: int) -> int:
    """Rows per block: 16 while an expert averages at most 32 pairs (decode), larger for
    prefill (more reuse of each weight tile)."""
    per_expert = pairs / max(1, num_experts)
    if per_expert <= 32:
        return 16
    return 32 if per_expert <= 96 else 64


def align(ids_TK: torch.Tensor, num_experts: int, block_m: int):
    """``(sorted_S int32, block_expert_B int32, total_1 int32)`` (see the module docstring)."""
    pairs = ids_TK.numel()
    num_slots = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    num_blocks = num_slots // block_m
    dev = ids_TK.device
    sorted_S = torch.empty(num_slots, dtype=torch.int32, device=dev)
    block_expert_B = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    total_1 = torch.empty(1, dtype=torch.int32, device=dev)
    cursor_E = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_e = max(16, triton.next_power_of_2(num_experts))
    _align_kernel[(1,)](ids_TK.reshape(-1), cursor_E, sorted_S, block_expert_B, total_1, pairs, num_experts,
                        num_slots, num_blocks, BLOCK_M=block_m, BLOCK=1024, BLOCK_E=block_e,
                        BLOCK_B=max(16, min(128, 8192 // block_e)), num_warps=4)
    return sorted_S, block_expert_B, total_1


# ------------------------------------------------------------------ grouped GEMMs


def _configs(small: bool):
    if _INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]
    if small:  # decode: few rows per expert, bound by the weight bytes
        return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                for n, k, w, s in ((64, 128, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3),
                                   (128, 128, 4, 3), (128, 64, 4, 4), (32, 256, 4, 3), (64, 64, 4, 5))]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in ((64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 4), (64, 128, 4, 3),
                               (128, 128, 8, 3), (256, 64, 8, 3))]


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _moe_gemm(a_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr, P, N, K, TUNE_BUCKET,
              stride_ar, stride_we, stride_wn, stride_op,
              ROW_DIV: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (block of pairs, column tile) of one expert: ``out[pair] = a[pair // ROW_DIV] @ w[e]^T``.
    GATED (the up projection, ``w`` = [gate; up]): both halves, ``silu(gate) * up`` out;
    else (down): times the pair's routing weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    valid = pair < P
    pair64 = pair.to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair64 // ROW_DIV)[:, None] * stride_ar + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = w_ptrs + N * stride_wn  # GATED: the up rows follow the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        mask_w = mask_k[:, None] & mask_n[None, :]
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        acc = _dot(a, tl.load(w_ptrs, mask=mask_w, other=0.0), acc, IEEE)
        if GATED:
            acc_u = _dot(a, tl.load(u_ptrs, mask=mask_w, other=0.0), acc_u, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if GATED:
        # HF's rounding: gate and up in the activation dtype, silu(gate) rounded, times up.
        gate = acc.to(dtype).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * acc_u.to(dtype).to(tl.float32)
    else:
        # HF's rounding: the expert's output in the activation dtype, then weighted (once rounded).
        route_w = tl.load(weights_ptr + pair64, mask=valid, other=0.0)
        out = acc.to(dtype).to(tl.float32) * route_w[:, None]
    out_ptrs = out_ptr + pair64[:, None] * stride_op + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=valid[:, None] & mask_n[None, :])


def _tuned(body, small: bool):
    """``body`` autotuned over :func:`_configs` (CUDA), keyed by the shape and the bucket of
    pairs per expert (a key on the exact pair count would retune every prefill)."""
    if _INTERPRET:
        return body
    return triton.autotune(configs=_configs(small), key=["TUNE_BUCKET", "N", "K", "BLOCK_M"])(triton.jit(body.fn))


# Autotuned per phase: the up and the down GEMMs have their own shapes (and keys).
_UP = {small: _tuned(_moe_gemm, small) for small in (True, False)}
_DOWN = {small: _tuned(_moe_gemm, small) for small in (True, False)}


def fused_moe(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
              weights_TK: torch.Tensor, ids_TK: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """See :func:`tapioca.engines.kernels.reference.fused_moe`. ``block_m``: rows per block
    (default :func:`block_m_for`)."""
    num_tokens, top_k = ids_TK.shape
    num_experts, two_inter, hidden = w13_E2IH.shape
    inter = two_inter // 2
    pairs = num_tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x_TH)
    x_TH = x_TH if x_TH.stride(-1) == 1 else x_TH.contiguous()
    w13_E2IH = w13_E2IH if w13_E2IH.stride(-1) == 1 else w13_E2IH.contiguous()
    w2_EHI = w2_EHI if w2_EHI.stride(-1) == 1 else w2_EHI.contiguous()
    bm = block_m or block_m_for(pairs, num_experts)
    sorted_S, block_expert_B, total_1 = align(ids_TK, num_experts, bm)
    blocks = block_expert_B.numel()
    dev, dtype = x_TH.device, x_TH.dtype
    ieee = dtype == torch.float32  # fp32 engines: exact fp32 products, not TF32
    act_PI = torch.empty((pairs, inter), dtype=dtype, device=dev)
    out_PH = torch.empty((pairs, hidden), dtype=dtype, device=dev)
    weights_P = weights_TK.reshape(-1).float()
    small = bm == 16
    fixed = _configs(small)[0].kwargs if _INTERPRET else {}
    bucket = triton.next_power_of_2(max(1, pairs // num_experts))
    _UP[small][lambda meta: (blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        x_TH, w13_E2IH, weights_P, act_PI, sorted_S, block_expert_B, total_1, pairs, inter, hidden, bucket,
        x_TH.stride(0), w13_E2IH.stride(0), w13_E2IH.stride(1), act_PI.stride(0),
        ROW_DIV=top_k, GATED=True, IEEE=ieee, BLOCK_M=bm, **fixed)
    _DOWN[small][lambda meta: (blocks, triton.cdiv(hidden, meta["BLOCK_N"]))](
        act_PI, w2_EHI, weights_P, out_PH, sorted_S, block_expert_B, total_1, pairs, hidden, inter, bucket,
        act_PI.stride(0), w2_EHI.stride(0), w2_EHI.stride(1), out_PH.stride(0),
        ROW_DIV=1, GATED=False, IEEE=ieee, BLOCK_M=bm, **fixed)
    return out_PH.view(num_tokens, top_k, hidden).float().sum(1).to(dtype)
