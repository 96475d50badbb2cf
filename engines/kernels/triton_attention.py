"""Triton paged attention: decode (one query per row, split-K) and packed varlen prefill.

Consumes queries, the paged KV cache ``[num_blocks, block_size, K, D]`` and its block
tables (layout in :mod:`tapioca.engines.kernels`); emits the attention output in q's
dtype. Softmax in fp32 (exp2 with log2(e) folded into the scale); P is cast to the
cache dtype for the P @ V product, as flash-attention does.

Decode (vLLM / SGLang "grouped" paged decode, flash-decoding): a program per (row, KV
head, split) computes all ``group`` query heads of that KV head at once (padded to 16
rows for ``tl.dot``), so each K/V block is read from memory once. With few rows the
context is split across programs and a second kernel merges the partial softmaxes by
their log-sum-exp; the split count depends only on shapes (CUDA-graph safe). Context-0
rows (graph padding) read nothing and write zeros.

Prefill (flash-attention, varlen): a program per (query tile, sequence, KV head); its
tile packs (token, head-of-group) pairs so the group shares each K/V tile; keys below the
tile's first position need no causal mask (first loop), the rest are masked (second).
Query i of sequence s is at position ``context_len - q_len + i``, so a cached prefix
(context_len > q_len) is attended through the block table like any other key.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(cache_ptr, table_row_ptr, tok, tmask, kvh, dims, stride_cb, stride_ct, stride_ch,
                  BLOCK_SIZE: tl.constexpr):
    """``[BLOCK_N, D]`` K or V of positions ``tok`` (one KV head) through the block table."""
    blk = tl.load(table_row_ptr + tok // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    ptrs = (cache_ptr + blk[:, None] * stride_cb + (tok % BLOCK_SIZE)[:, None] * stride_ct
            + kvh * stride_ch + dims[None, :])
    return tl.load(ptrs, mask=tmask[:, None], other=0.0)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
                   qk_scale, stride_qb, stride_qh, stride_table,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_ob, stride_oh,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + row)
    # Each split takes a whole number of BLOCK_N tiles of this row's context.
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=gmask[:, None], other=0.0)
    table_row = table_ptr + row * stride_table

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        k = _load_kv_tile(k_cache_ptr, table_row, tok, tmask, kvh, dims, stride_kb, stride_kt,
                          stride_kh, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 units
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(v_cache_ptr, table_row, tok, tmask, kvh, dims, stride_vb, stride_vt,
                          stride_vh, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    safe_l = tl.where(l > 0, l, 1.0)
    out = acc / safe_l[:, None]  # an empty range leaves acc = 0: zeros, not NaN
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        # mid_o [B, H, NUM_SPLITS, D] fp32, mid_lse [B, H, NUM_SPLITS] fp32 (log2 units).
        base = (row * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + base[:, None] * HEAD_DIM + dims[None, :], out, mask=gmask[:, None])
        lse = tl.where(l > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(mid_lse_ptr + base, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    smask = splits < NUM_SPLITS
    base = (row * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + base + splits, mask=smask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # context-0 rows: every weight 0
    w = tl.exp2(lse - top)
    o = tl.load(mid_o_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(rows: int, num_kv_heads: int, max_context: int, device: torch.device,
                  block_n: int, min_tokens_per_split: int = 256, max_splits: int = 16) -> int:
    """How many programs share one row's context: enough for ~2 programs per SM, at
    least ``min_tokens_per_split`` keys each. A function of shapes only (graph safe)."""
    if device.type != "cuda":
        return 1 if max_context <= min_tokens_per_split else 2  # interpreter: exercise both paths
    programs = rows * num_kv_heads
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return 1
    by_length = max(1, max_context // max(min_tokens_per_split, block_n))
    return max(1, min(max_splits, triton.cdiv(target, programs), by_length))


def _check(head_dim: int, num_heads: int, num_kv_heads: int, op: str) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"{op}: head_dim {head_dim} must be a power of two >= 16 (tl.dot tiles)")
    if num_heads % num_kv_heads:
        raise ValueError(f"{op}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def paged_decode_attention(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor,
                           scale: float, num_splits: int | None = None, block_n: int = 64,
                           num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """See :func:`tapioca.engines.kernels.reference.paged_decode_attention`.

    ``num_splits`` / ``block_n`` / ``num_warps`` / ``num_stages`` are tuning knobs
    (benchmarks/engine_kernels.py --configs); the default split count is :func:`decode_splits`.
    """
    rows, num_heads, head_dim = q_BHD.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _check(head_dim, num_heads, num_kv_heads, "paged_decode_attention")
    group = num_heads // num_kv_heads
    out_BHD = torch.empty(q_BHD.shape, dtype=q_BHD.dtype, device=q_BHD.device)  # contiguous for o_proj
    if rows == 0:
        return out_BHD
    if num_splits is None:
        num_splits = decode_splits(rows, num_kv_heads, block_tables_BM.shape[1] * block_size,
                                   q_BHD.device, block_n)
    if num_splits > 1:
        mid_o = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=q_BHD.device)
        mid_lse = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=q_BHD.device)
    else:
        mid_o = mid_lse = out_BHD  # unused
    _decode_kernel[(rows, num_kv_heads, num_splits)](
        q_BHD, k_cache, v_cache, block_tables_BM, context_lens_B, out_BHD, mid_o, mid_lse,
        scale * LOG2E, q_BHD.stride(0), q_BHD.stride(1), block_tables_BM.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out_BHD.stride(0), out_BHD.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_N=block_n, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(q_BHD.dtype), num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _decode_reduce_kernel[(rows, num_heads)](
            mid_o, mid_lse, out_BHD, out_BHD.stride(0), out_BHD.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=1)
    return out_BHD


@triton.jit
def _prefill_tile(acc, m, l, q, k_cache_ptr, v_cache_ptr, table_row, kvh, dims, pos, lo, hi,
                  qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Online-softmax over keys ``[lo, hi)``; with ``CAUSAL`` key j needs j <= pos."""
    for n0 in range(lo, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < hi
        k = _load_kv_tile(k_cache_ptr, table_row, tok, tmask, kvh, dims, stride_kb, stride_kt,
                          stride_kh, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        keep = tmask[None, :]
        if CAUSAL:
            keep = keep & (tok[None, :] <= pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row can see no key of this tile (its position is before the tile): m_new may
        # still be -inf there; keep exp2's argument finite so it yields 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(v_cache_ptr, table_row, tok, tmask, kvh, dims, stride_vb, stride_vt,
                          stride_vh, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, cu_ptr, ctx_ptr, out_ptr, qk_scale,
                    stride_qt, stride_qh, stride_table, stride_kb, stride_kt, stride_kh,
                    stride_vb, stride_vt, stride_vh, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len * GROUP:
        ctx = tl.load(ctx_ptr + seq)
        r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (token, head-of-group) rows
        rmask = r < q_len * GROUP
        tok_q = r // GROUP
        heads = kvh * GROUP + r % GROUP
        pos = ctx - q_len + tok_q
        dims = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + tok_q).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=rmask[:, None], other=0.0)
        table_row = table_ptr + seq * stride_table
        first_pos = ctx - q_len + tile * BLOCK_M // GROUP
        last_pos = ctx - q_len + tl.minimum((tile + 1) * BLOCK_M - 1, q_len * GROUP - 1) // GROUP
        # Keys [0, full_end) lie at or before every row's position: no mask but the length.
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        acc, m, l = _prefill_tile(acc, m, l, q, k_cache_ptr, v_cache_ptr, table_row, kvh, dims, pos,
                                  0, full_end, qk_scale, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, BLOCK_N, BLOCK_SIZE, False,
                                  DOT_PRECISION)
        acc, m, l = _prefill_tile(acc, m, l, q, k_cache_ptr, v_cache_ptr, table_row, kvh, dims, pos,
                                  full_end, last_pos + 1, qk_scale, stride_kb, stride_kt, stride_kh,
                                  stride_vb, stride_vt, stride_vh, BLOCK_N, BLOCK_SIZE, True,
                                  DOT_PRECISION)
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def paged_prefill_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables_SM: torch.Tensor, cu_seqlens_q_S1: torch.Tensor,
                            context_lens_S: torch.Tensor, scale: float, max_q_len: int,
                            block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                            num_stages: int = 2) -> torch.Tensor:
    """See :func:`tapioca.engines.kernels.reference.paged_prefill_attention`.

    Rows of ``q_THD`` outside every sequence are left as zeros. Tuning knobs as in
    :func:`paged_decode_attention`.
    """
    num_tokens, num_heads, head_dim = q_THD.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _check(head_dim, num_heads, num_kv_heads, "paged_prefill_attention")
    group = num_heads // num_kv_heads
    num_seqs = context_lens_S.shape[0]
    out_THD = torch.zeros(q_THD.shape, dtype=q_THD.dtype, device=q_THD.device)
    if num_tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return out_THD
    grid = (triton.cdiv(max_q_len * group, block_m), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q_THD, k_cache, v_cache, block_tables_SM, cu_seqlens_q_S1, context_lens_S, out_THD,
        scale * LOG2E, q_THD.stride(0), q_THD.stride(1), block_tables_SM.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out_THD.stride(0), out_THD.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        DOT_PRECISION=_dot_precision(q_THD.dtype), num_warps=num_warps, num_stages=num_stages)
    return out_THD
