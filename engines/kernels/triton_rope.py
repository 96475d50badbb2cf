"""Triton rotary embedding + paged KV-cache write in one kernel.

Consumes one forward's q ``[T, H, D]``, k / v ``[T, K, D]`` (strided views of the fused
qkv output are fine, last dim contiguous), positions ``[T]``, the fp32 cos/sin table
``[P, D]`` and the slot mapping ``[T]``; rotates q and k in place (HF ``rotate_half``:
first half / second half) and writes the rotated k and v into
``[num_blocks, block_size, K, D]`` caches, skipping slot -1 (graph padding rows).

One program per token handles all its heads, so q, k, v and the table row are read once
and the cache written once. cos/sin are rounded to the activation dtype and each product
rounded like HF's ``q * cos + rotate_half(q) * sin`` in that dtype (bf16 matches HF bit
for bit). Grid = T; no host reads (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, tok, c, s, cache_ptr, stride_cb, stride_ct,
                  stride_ch, block, offset, slot_ok,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
                  STORE: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, HALF)
    hmask = (heads < NUM_HEADS)[:, None]
    base = ptr + tok * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(base, mask=hmask, other=0.0)
    x2 = tl.load(base + HALF, mask=hmask, other=0.0)
    dt = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # (x * cos) + (rotate_half(x) * sin), every product and the sum rounded to x's dtype.
    o1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    tl.store(base, o1, mask=hmask)
    tl.store(base + HALF, o2, mask=hmask)
    if STORE:
        cache = (cache_ptr + block * stride_cb + offset * stride_ct
                 + heads[:, None] * stride_ch + cols[None, :])
        cmask = hmask & slot_ok
        tl.store(cache, o1.to(cache_ptr.dtype.element_ty), mask=cmask)
        tl.store(cache + HALF, o2.to(cache_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_table, stride_cb, stride_ct, stride_ch,
                       stride_vcb, stride_vct, stride_vch,
                       NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    slot_ok = slot >= 0
    block = tl.where(slot_ok, slot // BLOCK_SIZE, 0)
    offset = tl.where(slot_ok, slot % BLOCK_SIZE, 0)
    cols = tl.arange(0, HALF)
    dt = q_ptr.dtype.element_ty
    # HF hands cos/sin to apply_rotary_pos_emb already cast to the activation dtype.
    c = tl.load(table_ptr + pos * stride_table + cols).to(dt).to(tl.float32)[None, :]
    s = tl.load(table_ptr + pos * stride_table + HALF + cols).to(dt).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, tok, c, s, k_cache_ptr, 0, 0, 0, block, offset,
                  slot_ok, NUM_Q_HEADS, BLOCK_QH, HALF, False)
    _rotate_heads(k_ptr, stride_kt, stride_kh, tok, c, s, k_cache_ptr, stride_cb, stride_ct,
                  stride_ch, block, offset, slot_ok, NUM_KV_HEADS, BLOCK_KH, HALF, True)
    heads = tl.arange(0, BLOCK_KH)
    dims = tl.arange(0, 2 * HALF)
    vmask = (heads < NUM_KV_HEADS)[:, None] & slot_ok
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=vmask, other=0.0)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch
             + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=vmask)


def rope_and_store_kv(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                      positions_T: torch.Tensor, cos_sin_PD: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping_T: torch.Tensor, num_warps: int = 4) -> None:
    """See :func:`tapioca.engines.kernels.reference.rope_and_store_kv`."""
    num_tokens, num_heads, head_dim = q_THD.shape
    num_kv_heads = k_TKD.shape[1]
    for name, t in (("q", q_THD), ("k", k_TKD), ("v", v_TKD), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_and_store_kv: {name}'s last dim must be contiguous (stride 1)")
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_and_store_kv: head_dim {head_dim} must be a power of two")
    if q_THD.dtype != k_TKD.dtype:
        raise ValueError("rope_and_store_kv: q and k must share a dtype")
    if num_tokens == 0:
        return
    _rope_store_kernel[(num_tokens,)](
        q_THD, k_TKD, v_TKD, positions_T, cos_sin_PD, slot_mapping_T, k_cache, v_cache,
        q_THD.stride(0), q_THD.stride(1), k_TKD.stride(0), k_TKD.stride(1),
        v_TKD.stride(0), v_TKD.stride(1), cos_sin_PD.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        BLOCK_QH=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, BLOCK_SIZE=k_cache.shape[1], num_warps=num_warps)
