"""Plain-PyTorch reference of the paged engine's ops (docs/engine.md, "Ops").

Consumes packed token tensors (``T`` tokens of a forward, ``B`` rows of a decode step)
and the paged KV cache (per layer ``[num_blocks, block_size, kv_heads, head_dim]``);
emits the op's output or writes the cache in place. The CPU path of the engine and the
oracle of the Triton versions. No host reads anywhere (no ``.item()``, no boolean
indexing), so a CUDA graph can capture every op: the decode step is captured whole
even before the Triton kernels exist.

STAND-IN written by the `engine` helper to the agreed signatures; the `kernels`
helper's reference replaces it.
"""

from __future__ import annotations

import torch


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
             residual_TD: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)`` (or ``(rmsnorm(x) * weight, x)``):
    HF's order -- the add in x's dtype, normalise in fp32, cast, then scale."""
    r_TD = x_TD if residual_TD is None else x_TD + residual_TD
    h_TD = r_TD.float()
    h_TD = h_TD * torch.rsqrt(h_TD.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * h_TD.to(x_TD.dtype), r_TD


def rope_and_store_kv(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                      positions_T: torch.Tensor, cos_sin_PD: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """Rotate q and k in place (HF ``rotate_half``), then write k and v at their slots.

    ``q`` / ``k`` may be strided views (the engine passes slices of the fused qkv
    output). Slot -1 rows are not written: they are redirected to slot 0 with slot 0's
    own current value (a no-op write), which is exact as long as no real row of the
    same call targets slot 0 -- the engine never hands out block 0.
    """
    half = q_THD.shape[-1] // 2
    cs_TD = cos_sin_PD[positions_T]
    cos_T1H, sin_T1H = cs_TD[:, None, :half], cs_TD[:, None, half:]
    for x in (q_THD, k_TKD):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        o1 = x1 * cos_T1H - x2 * sin_T1H  # both computed before either half is overwritten
        o2 = x2 * cos_T1H + x1 * sin_T1H
        x[..., :half] = o1
        x[..., half:] = o2
    valid_T = slot_mapping_T >= 0
    slot_T = torch.where(valid_T, slot_mapping_T, torch.zeros_like(slot_mapping_T)).long()
    for cache, new_TKD in ((k_cache, k_TKD), (v_cache, v_TKD)):
        flat = cache.view(-1, *cache.shape[2:])
        keep_TKD = flat[0].expand_as(new_TKD)
        flat.index_copy_(0, slot_T, torch.where(valid_T[:, None, None], new_TKD.to(flat.dtype), keep_TKD))


def _gather_kv(cache: torch.Tensor, block_tables_BM: torch.Tensor) -> torch.Tensor:
    """``[B, K, M * block_size, D]``: each row's blocks, in table order."""
    b, m = block_tables_BM.shape
    x = cache[block_tables_BM.long()]  # [B, M, bs, K, D]
    return x.reshape(b, m * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_decode_attention(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per row over its first ``context_lens`` cached tokens; GQA; softmax in
    fp32. Rows with context 0 (graph padding) give zeros."""
    b, h, d = q_BHD.shape
    k_BKLD = _gather_kv(k_cache, block_tables_BM).float()
    v_BKLD = _gather_kv(v_cache, block_tables_BM).float()
    kv = k_BKLD.shape[1]
    q_BKGD = q_BHD.float().reshape(b, kv, h // kv, d)
    scores_BKGL = (q_BKGD @ k_BKLD.transpose(-1, -2)) * scale
    valid_BL = torch.arange(k_BKLD.shape[2], device=q_BHD.device)[None, :] < context_lens_B[:, None]
    scores_BKGL = scores_BKGL.masked_fill(~valid_BL[:, None, None, :], float("-inf"))
    # A padding row has no valid key: give it one (its output is zeroed below) so no NaN.
    scores_BKGL[..., 0] = torch.where(context_lens_B[:, None, None] > 0, scores_BKGL[..., 0], 0.0)
    out_BKGD = scores_BKGL.softmax(-1) @ v_BKLD
    out_BKGD = out_BKGD * (context_lens_B > 0)[:, None, None, None]
    return out_BKGD.reshape(b, h, d).to(q_BHD.dtype)


def paged_prefill_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables_SM: torch.Tensor, cu_seqlens_q_S1: torch.Tensor,
                            context_lens_S: torch.Tensor, scale: float, max_q_len: int) -> torch.Tensor:
    """Packed variable-length causal attention over the cache (cached prefix included).

    Sequence s owns queries ``cu[s]:cu[s+1]``; its query i sits at absolute position
    ``context_lens[s] - q_len[s] + i`` and sees every cached position <= its own. The
    reference pads the queries to ``[S, max_q_len]`` and runs SDPA with a mask.
    """
    t, h, d = q_THD.shape
    s = context_lens_S.shape[0]
    dev = q_THD.device
    k_SKLD = _gather_kv(k_cache, block_tables_SM)
    v_SKLD = _gather_kv(v_cache, block_tables_SM)
    ends_S = cu_seqlens_q_S1[1:].to(torch.int64)
    tok_T = torch.arange(t, device=dev)
    seq_T = torch.searchsorted(ends_S, tok_T, right=True)
    idx_T = tok_T - cu_seqlens_q_S1.to(torch.int64)[seq_T]
    q_SQHD = q_THD.new_zeros(s, max_q_len, h, d)
    q_SQHD[seq_T, idx_T] = q_THD
    q_len_S = ends_S - cu_seqlens_q_S1[:-1].to(torch.int64)
    qpos_SQ = (context_lens_S.to(torch.int64) - q_len_S)[:, None] + torch.arange(max_q_len, device=dev)
    kpos_L = torch.arange(k_SKLD.shape[2], device=dev)
    # Padding queries (i >= q_len) see keys <= their position too: finite, and dropped.
    mask_S1QL = (kpos_L[None, None, :] <= qpos_SQ[:, :, None])[:, None]
    out_SHQD = torch.nn.functional.scaled_dot_product_attention(
        q_SQHD.transpose(1, 2), k_SKLD, v_SKLD, attn_mask=mask_S1QL, scale=scale, enable_gqa=True)
    return out_SHQD.transpose(1, 2)[seq_T, idx_T]


def silu_and_mul(x_TI2: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[gate | up]`` layout."""
    i = x_TI2.shape[-1] // 2
    return torch.nn.functional.silu(x_TI2[..., :i]) * x_TI2[..., i:]


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic): the products wrap.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_ROW_STRIDE = 0x2545F4914F6CDD1D


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def counter_uniform(seed_1: torch.Tensor, offset: int, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` fp32 uniforms in (0, 1) from splitmix64 of (seed, offset, row, col).

    40 random bits per draw, so the smallest draw is 2^-41 (fp32 keeps full relative
    precision near 0, where the Gumbel tail is decided).
    """
    dev = seed_1.device
    # Linear in (seed, offset, row, col) with large odd multipliers, then mixed: (seed + 1,
    # offset 0) and (seed, offset 1) are different draws.
    base = seed_1.to(torch.int64) * _MIX2 + (offset * _GOLDEN) % (1 << 63)
    base_R1 = base + torch.arange(rows, device=dev)[:, None] * _ROW_STRIDE
    z = base_R1 + torch.arange(cols, device=dev)[None, :]
    z += _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    bits = _shr(z, 24)  # the top 40 bits
    return (bits.float() + 0.5) * (2.0 ** -40)


def sample_tokens(logits_BV: torch.Tensor, temperature_B: torch.Tensor, seed_1: torch.Tensor,
                  offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens_B int64, logprobs_B fp32)``: Gumbel-max over the full vocabulary at
    temperature T; T == 0 rows take the argmax (logprob at T = 1). Noise is keyed by
    (``seed_1``, ``offset``, row, vocab index): graph-safe and reproducible."""
    b, v = logits_BV.shape
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()
    scaled_BV = logits_BV / temp_B[:, None]
    log_z_B = torch.logsumexp(scaled_BV, dim=-1)
    u_BV = counter_uniform(seed_1, offset, b, v)
    # Gumbel = -log(E), E = -log(1 - u) ~ Exp(1); log1p keeps E's small values exact.
    gumbel_BV = -torch.log(-torch.log1p(-u_BV))
    tok_B = torch.where(greedy_B, logits_BV.argmax(-1), (scaled_BV + gumbel_BV).argmax(-1))
    logp_B = scaled_BV.gather(-1, tok_B[:, None]).squeeze(-1) - log_z_B
    return tok_B, logp_B
