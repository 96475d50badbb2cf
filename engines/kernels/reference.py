"""Plain-PyTorch reference of the paged engine's fused ops (the CPU path and the oracle).

Consumes activations, the paged KV cache and the per-forward metadata the engine builds
(block tables, context lengths, slot mapping; layout in :mod:`tapioca.engines.kernels`);
emits the same outputs as the Triton kernels. Works for fp32 / bf16 on CPU and CUDA.
No host reads except in :func:`paged_prefill_attention` (prefill is never captured), so
the decode-path ops can sit in a CUDA graph even on this path.

Numerics follow Hugging Face's Qwen2 modules where they are the contract: RMSNorm
normalises in fp32, casts to the input dtype, then multiplies by the weight; rotary casts
cos/sin to the activation dtype and rounds every product like ``q * cos +
rotate_half(q) * sin``; the MLP is ``silu(gate) * up`` in the activation dtype.
Attention and sampling compute softmax in fp32. MoE (Qwen3-MoE): the router's softmax,
top-k and renormalisation are :func:`tapioca.models.moe.route` (the trainer's); each
expert's SwiGLU rounds like HF's (gate / up, ``silu(gate)``, the product, the down
projection in the activation dtype), each pair's output times its fp32 routing weight is
rounded once to the activation dtype, and a token's k pairs are summed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models.moe import route

__all__ = [
    "rms_norm", "rope_and_store_kv", "paged_decode_attention", "paged_prefill_attention",
    "silu_and_mul", "sample_tokens", "gumbel_noise", "moe_route", "fused_moe",
]


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
             residual_TD: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x [+ residual]) * weight, x [+ residual])``; any leading shape, last dim D.

    The residual add is in x's dtype (HF's ``residual + hidden_states``); the norm in fp32,
    cast to x's dtype, then times ``weight_D`` (HF Qwen2RMSNorm order), output in x's dtype.
    """
    if residual_TD is not None:
        x_TD = x_TD + residual_TD
    h_TD = x_TD.float()
    h_TD = h_TD * torch.rsqrt(h_TD.pow(2).mean(-1, keepdim=True) + eps)
    out_TD = (weight_D * h_TD.to(x_TD.dtype)).to(x_TD.dtype)
    return out_TD, x_TD


def _rotate(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    half = x_THD.shape[-1] // 2
    rotated_THD = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + rotated_THD * sin_TD[:, None, :]


def store_kv(k_TKD: torch.Tensor, v_TKD: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping_T: torch.Tensor) -> None:
    """Write token t's k/v into flat slot ``slot_mapping_T[t]`` of the caches; skip slot -1.

    Graph safe (no boolean indexing, which would read the mask on the host): rows with
    slot -1 re-write the first valid row's value into that row's slot (a duplicate index
    with an identical value, so the result does not depend on the write order), or, when
    no row is valid, slot 0's own current value back into slot 0.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if slot_mapping_T.numel() == 0:
        return
    slot_T = slot_mapping_T.long()
    valid_T = slot_T >= 0
    any_valid = valid_T.any()
    # First valid row (0 when none), as a 1-element index: a 0-dim tensor index could be
    # turned into a host int.
    first_1 = valid_T.int().argmax().view(1)
    fill_slot_1 = torch.where(any_valid, slot_T.index_select(0, first_1), 0)
    index_T = torch.where(valid_T, slot_T, fill_slot_1)
    valid_T11 = valid_T[:, None, None]
    for new_TKD, flat in ((k_TKD, k_flat), (v_TKD, v_flat)):
        new_TKD = new_TKD.to(flat.dtype)
        fill_1KD = torch.where(any_valid, new_TKD.index_select(0, first_1), flat[:1])
        flat.index_copy_(0, index_T, torch.where(valid_T11, new_TKD, fill_1KD))


def rope_and_store_kv(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                      positions_T: torch.Tensor, cos_sin_PD: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping_T: torch.Tensor) -> None:
    """Rotate q and k in place (HF ``rotate_half``), then store k and v at their slots.

    ``cos_sin_PD`` fp32 ``[max_positions, D]``: ``[:, :D/2]`` cos, ``[:, D/2:]`` sin of the
    first half's frequencies. q/k/v may be strided views of a fused qkv output (last dim
    contiguous). Caches ``[num_blocks, block_size, K, D]``; slot -1 is not written.
    """
    half = q_THD.shape[-1] // 2
    table_TD = cos_sin_PD[positions_T.long()]
    cos_TD = table_TD[:, :half].repeat(1, 2).to(q_THD.dtype)  # HF casts cos/sin to x's dtype
    sin_TD = table_TD[:, half:].repeat(1, 2).to(q_THD.dtype)
    q_THD.copy_(_rotate(q_THD, cos_TD, sin_TD))
    k_TKD.copy_(_rotate(k_TKD, cos_TD.to(k_TKD.dtype), sin_TD.to(k_TKD.dtype)))
    store_kv(k_TKD, v_TKD, k_cache, v_cache, slot_mapping_T)


def _gather_context(cache: torch.Tensor, block_tables_BM: torch.Tensor) -> torch.Tensor:
    """``[B, M * block_size, K, D]``: each row's cached tokens in position order."""
    rows, max_blocks = block_tables_BM.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    blocks = cache[block_tables_BM.long()]  # [B, M, bs, K, D]
    return blocks.reshape(rows, max_blocks * block_size, num_kv_heads, head_dim)


def paged_decode_attention(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per row over its ``context_lens_B[b]`` cached tokens; GQA; fp32 softmax.

    ``q_BHD`` ``[B, H, D]`` with ``H = K * group``; ``block_tables_BM`` int32 ``[B, M]``;
    returns ``[B, H, D]`` in q's dtype; rows with context 0 give zeros.
    """
    rows, num_heads, head_dim = q_BHD.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_BLKD = _gather_context(k_cache, block_tables_BM).float()
    v_BLKD = _gather_context(v_cache, block_tables_BM).float()
    length = k_BLKD.shape[1]
    q_BKGD = q_BHD.float().view(rows, num_kv_heads, group, head_dim)
    scores_BKGL = torch.einsum("bkgd,blkd->bkgl", q_BKGD, k_BLKD) * scale
    live_BL = torch.arange(length, device=q_BHD.device)[None, :] < context_lens_B.long()[:, None]
    scores_BKGL = scores_BKGL.masked_fill(~live_BL[:, None, None, :], float("-inf"))
    # Slots past the context are garbage (possibly NaN bits of a fresh cache): 0 * NaN = NaN.
    v_BLKD = v_BLKD.masked_fill(~live_BL[:, :, None, None], 0.0)
    # Context-0 rows (graph padding): every score is -inf; give them zeros, not NaN.
    probs_BKGL = torch.softmax(scores_BKGL, dim=-1).nan_to_num(0.0)
    out_BKGD = torch.einsum("bkgl,blkd->bkgd", probs_BKGL, v_BLKD)
    return out_BKGD.reshape(rows, num_heads, head_dim).to(q_BHD.dtype)


def paged_prefill_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables_SM: torch.Tensor, cu_seqlens_q_S1: torch.Tensor,
                            context_lens_S: torch.Tensor, scale: float,
                            max_q_len: int) -> torch.Tensor:
    """Causal attention of packed variable-length queries over their cached tokens.

    Sequence s owns queries ``cu_seqlens_q_S1[s]:cu_seqlens_q_S1[s+1]`` (int32 ``[S+1]``);
    its query i sits at position ``context_lens_S[s] - q_len + i`` and sees every cached
    position <= its own (a cached prefix included). ``q_THD`` ``[T, H, D]``; returns
    ``[T, H, D]`` in q's dtype (rows outside every sequence are zeros). One host read of
    the lengths (prefill is never captured).
    """
    del max_q_len  # the loop below reads the lengths themselves
    num_tokens, num_heads, head_dim = q_THD.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out_THD = torch.zeros(q_THD.shape, dtype=q_THD.dtype, device=q_THD.device)
    cu = cu_seqlens_q_S1.tolist()
    ctx = context_lens_S.tolist()
    for s in range(len(ctx)):
        start, end, n_ctx = cu[s], cu[s + 1], ctx[s]
        q_len = end - start
        if q_len == 0:
            continue
        table_1M = block_tables_SM[s:s + 1]
        k_LKD = _gather_context(k_cache, table_1M)[0, :n_ctx].float()
        v_LKD = _gather_context(v_cache, table_1M)[0, :n_ctx].float()
        q_QKGD = q_THD[start:end].float().view(q_len, num_kv_heads, group, head_dim)
        scores_KGQL = torch.einsum("qkgd,lkd->kgql", q_QKGD, k_LKD) * scale
        pos_Q = torch.arange(q_len, device=q_THD.device) + (n_ctx - q_len)
        causal_QL = torch.arange(n_ctx, device=q_THD.device)[None, :] <= pos_Q[:, None]
        scores_KGQL = scores_KGQL.masked_fill(~causal_QL, float("-inf"))
        probs_KGQL = torch.softmax(scores_KGQL, dim=-1).nan_to_num(0.0)
        out_QKGD = torch.einsum("kgql,lkd->qkgd", probs_KGQL, v_LKD)
        out_THD[start:end] = out_QKGD.reshape(q_len, num_heads, head_dim).to(q_THD.dtype)
    return out_THD


def silu_and_mul(x_TI2: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` in x's dtype (HF's ``act_fn(gate) * up``)."""
    inter = x_TI2.shape[-1] // 2
    return F.silu(x_TI2[..., :inter]) * x_TI2[..., inter:]


def moe_route(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights_TK fp32, ids_TK int32)``: softmax (fp32), top-k, renormalised when
    ``norm_topk_prob`` (HF's Qwen3-MoE router, :func:`tapioca.models.moe.route`)."""
    weights_TK, ids_TK, _ = route(logits_TE, top_k, norm_topk_prob)
    return weights_TK.float(), ids_TK.int()


def fused_moe(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
              weights_TK: torch.Tensor, ids_TK: torch.Tensor, gather: bool | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token: ``[T, H]`` in x's
    dtype. ``w13_E2IH`` ``[E, 2I, H]`` (gate rows then up rows), ``w2_EHI`` ``[E, H, I]``.

    ``gather`` (default: on CUDA) gathers every pair's expert weights and runs batched
    matmuls: no host reads (graph safe), ``T * k`` weight copies. Otherwise pairs are
    sorted by expert and each expert's rows go through one matmul (the per-expert counts
    are read on the host, which costs nothing on a CPU)."""
    num_tokens, top_k = ids_TK.shape
    ids_P = ids_TK.reshape(-1).long()
    x_PH = x_TH.repeat_interleave(top_k, dim=0)
    if gather if gather is not None else x_TH.is_cuda:
        h_P2I = torch.bmm(w13_E2IH[ids_P], x_PH.unsqueeze(-1)).squeeze(-1)
        y_PH = torch.bmm(w2_EHI[ids_P], silu_and_mul(h_P2I).unsqueeze(-1)).squeeze(-1)
    else:
        order_P = torch.argsort(ids_P, stable=True)
        counts = torch.bincount(ids_P, minlength=w13_E2IH.shape[0]).tolist()
        y_sorted = torch.empty_like(x_PH)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = order_P[start:start + n]
                a_NI = silu_and_mul(x_PH[rows] @ w13_E2IH[e].T)
                y_sorted[start:start + n] = a_NI @ w2_EHI[e].T
            start += n
        y_PH = torch.empty_like(y_sorted).index_copy_(0, order_P, y_sorted)
    weighted_PH = (y_PH.float() * weights_TK.reshape(-1, 1).float()).to(x_TH.dtype)
    return weighted_PH.view(num_tokens, top_k, -1).float().sum(1).to(x_TH.dtype)


_MASK32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(seed_1: torch.Tensor, offset: int, rows: int, vocab: int) -> torch.Tensor:
    """fp32 Gumbel(0, 1) noise ``[rows, vocab]`` from a counter-based hash of
    (seed, offset, row, vocab index): the same arguments give the same noise on any
    device, and no generator state is touched (graph safe; the seed is a device tensor).

    Not the Triton kernel's Philox stream (cheaper on a CPU). A 31-bit uniform ``w`` in
    (0, 1) gives ``E = -log1p(-w)`` ~ Exp(1), resolved down to 2^-32 (the top of the
    Gumbel tail ``-log E`` is where resolution matters), then ``g = -log E``.
    """
    seed = seed_1.reshape(()).long()
    key = _mix32(((seed >> 32) & _MASK32) ^ _mix32((seed & _MASK32) ^ _mix32(torch.full_like(seed, offset & _MASK32))))
    row_R1 = torch.arange(rows, device=seed_1.device, dtype=torch.int64)[:, None]
    key_R1 = _mix32(key ^ _mix32(row_R1 * 0x9E3779B9 & _MASK32))
    return _gumbel_from(key_R1, key, vocab)


def _gumbel_from(key_R1: torch.Tensor, key2: torch.Tensor, vocab: int) -> torch.Tensor:
    idx_1V = torch.arange(vocab, device=key_R1.device, dtype=torch.int64)[None, :]
    bits_RV = _mix32(_mix32(idx_1V ^ key_R1) ^ key2)
    w_RV = ((bits_RV >> 1).double() + 0.5) * 2.0 ** -31
    return (-torch.log(-torch.log1p(-w_RV))).float()


def _row_keys(seed_B: torch.Tensor, counter_B: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per row from its own (seed, counter) only: ``[B, 1]`` int64."""
    seed, ctr = seed_B.long().reshape(-1, 1), counter_B.long().reshape(-1, 1)
    key = _mix32((ctr >> 32) & _MASK32)
    key = _mix32((ctr & _MASK32) ^ key)
    key = _mix32((seed & _MASK32) ^ key)
    return _mix32(((seed >> 32) & _MASK32) ^ key)


def row_gumbel_noise(seed_B: torch.Tensor, counter_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 Gumbel(0, 1) noise ``[B, vocab]`` where row b depends only on ``(seed_B[b],
    counter_B[b])`` and the vocab index: not on the row's place in the batch nor on the
    other rows. The paged engine keys a row by its request's seed and the position of the
    token it samples, so a trajectory's draws do not depend on what it was batched with
    (docs/provenance.md). Vectorised integer hashing, no generator, graph safe."""
    key_R1 = _row_keys(seed_B, counter_B)
    return _gumbel_from(_mix32(key_R1 ^ 0x5BD1E995), key_R1, vocab)


def row_uniform(seed_B: torch.Tensor, counter_B: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row from ``(seed_B[b], counter_B[b])`` alone
    (53 bits from two hashes): the top-k / top-p path's inverse-CDF draw, batch-independent
    like :func:`row_gumbel_noise` (a different stream: salted)."""
    key_R1 = _row_keys(seed_B, counter_B)
    hi = _mix32(key_R1 ^ 0x68E31DA4)[:, 0] >> 11  # 21 bits
    lo = _mix32(key_R1 ^ 0xB5297A4D)[:, 0]        # 32 bits
    return ((hi * 2**32 + lo).double() + 0.5) * 2.0 ** -53


def sample_tokens(logits_BV: torch.Tensor, temperature_B: torch.Tensor, seed: torch.Tensor,
                  offset: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``softmax(logits / T)`` over the full vocabulary.

    Gumbel-max (argmax of ``logits / T + g``); rows with ``T <= 0`` take the argmax (first
    index on ties) and report their logprob at T = 1. Returns ``(tokens_B int64,
    logprobs_B fp32)`` with ``logprobs_B = log_softmax(logits / T)[token]`` in fp32.
    Two ways to key the noise: ``seed`` int64 ``[1]`` with ``offset`` a host int naming
    the draw (rows told apart by their index; the caller advances the seed), or
    ``seed`` and ``offset`` int64 ``[B]`` device tensors, a key per row
    (:func:`row_gumbel_noise`: a row's draw does not depend on the batch).
    """
    rows, vocab = logits_BV.shape
    logits_BV = logits_BV.float()
    greedy_B = temperature_B <= 0
    temp_B1 = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B).float()[:, None]
    scaled_BV = logits_BV / temp_B1
    logp_BV = torch.log_softmax(scaled_BV, dim=-1)
    if isinstance(offset, torch.Tensor):
        noise_BV = row_gumbel_noise(seed, offset, vocab)
    else:
        noise_BV = gumbel_noise(seed, offset, rows, vocab)
    noisy_BV = scaled_BV + noise_BV
    score_BV = torch.where(greedy_B[:, None], logits_BV, noisy_BV)
    tokens_B = score_BV.argmax(dim=-1)
    return tokens_B, logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
