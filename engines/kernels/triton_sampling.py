"""Triton one-pass sampling: Gumbel-max over the full vocabulary with the fp32 logprob.

Consumes the last-position logits ``[B, V]`` (fp32 / bf16), per-row temperatures ``[B]``
(``<= 0`` = greedy) and an int64 seed tensor ``[1]`` on the device; emits ``(tokens_B
int64, logprobs_B fp32)`` with ``logprobs_B = log_softmax(logits / T)[token]`` (T = 1 for
greedy rows), the behaviour-logprob convention of :mod:`tapioca.engines.base`.

One program per row streams its logits once: an online max / sum-exp gives the
normaliser, and per-lane running maxima of ``logits / T + Gumbel`` give the sample
(argmax of the scores, smallest index on ties, as ``torch.argmax``). Greedy rows skip the
noise. The noise is counter-based: Philox4x32-10 (``tl.philox``) keyed by the seed, with
counter (vocab index // 4, row, offset, 0) and its four outputs feeding four adjacent
entries, so a draw depends only on (seed, offset, row, index): graph safe, reproducible,
no generator state. The engine advances the seed tensor inside its graph every step.
Keyed per row instead (``seed`` and ``offset`` int64 ``[B]`` tensors, ``PER_ROW``): a row's
counter is (vocab index // 4, its counter's low and high words, 0x5EED) under its own
seed, so its draw does not depend on its place in the batch or on the other rows (the
paged engine: the request's seed and the position of the token sampled).

Uniforms: 31 random bits ``w`` in (0, 1); ``E = -log1p(-w)`` ~ Exp(1) is resolved down to
2^-32 (a series below 1/32, where ``1 - w`` would lose the bits), and ``g = -log(E)``.
The top of the Gumbel tail, where a low-probability token wins, is where resolution
matters; the fp32 ``-log(-log(u))`` of a 24-bit uniform would cap it at ~16.6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel(bits):
    """Gumbel(0, 1) from uint32 random bits (31 used)."""
    w = ((bits >> 1).to(tl.int32).to(tl.float32) + 0.5) * 4.656612873077393e-10  # 2^-31
    w = tl.minimum(w, 0.99999994)  # the conversion may round up to 1.0
    series = w * (1.0 + w * (0.5 + w * (0.33333334 + w * 0.25)))  # -log1p(-w), w < 1/32
    e = tl.where(w < 0.03125, series, -tl.log(1.0 - w))
    return -tl.log(e)


@triton.jit
def _scan_row(logits_row, vocab, inv_t, seed, c1, c2, c3, SAMPLE: tl.constexpr, QUARTER: tl.constexpr):
    """(token, max, sum-exp) of one row; tiles ``[QUARTER, 4]``, index ``v0 + 4 i + j``."""
    lanes = tl.arange(0, QUARTER)
    tile = 4 * lanes[:, None] + tl.arange(0, 4)[None, :]
    m = tl.max(tl.full([QUARTER], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([QUARTER], tl.float32), axis=0)
    best_score = tl.full([QUARTER, 4], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER, 4], tl.int32)
    zero = tl.zeros([QUARTER], tl.uint32)
    for v0 in range(0, vocab, 4 * QUARTER):
        idx = v0 + tile
        mask = idx < vocab
        x = tl.load(logits_row + idx, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(tl.max(x, axis=1), axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf prefix: no NaN
        s = s * tl.exp(m - m_safe) + tl.sum(tl.sum(tl.exp(x - m_safe), axis=1), axis=0)
        m = m_new
        if SAMPLE:
            # One Philox call gives the four entries of a lane: counter v0 / 4 + i.
            r0, r1, r2, r3 = tl.philox(seed, (v0 // 4 + lanes).to(tl.uint32), zero + c1, zero + c2, zero + c3)
            bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [QUARTER, 4])
            score = x + _gumbel(bits)
        else:
            score = x
        score = tl.where(mask, score, float("-inf"))
        # Per entry, strictly greater keeps the earlier index; entries are merged at the end.
        better = score > best_score
        best_score = tl.where(better, score, best_score)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(tl.max(best_score, axis=1), axis=0)
    token = tl.min(tl.min(tl.where(best_score == top, best_idx, vocab), axis=1), axis=0)
    return token, m, s


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, seed_ptr, counter_ptr, tokens_ptr, logprobs_ptr, vocab, stride_row,
                   offset, PER_ROW: tl.constexpr, QUARTER: tl.constexpr):
    row = tl.program_id(0)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.load(temp_ptr + row).to(tl.float32)
    greedy = temp <= 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    if PER_ROW:  # the row's own key: (its seed; its counter's two words), no row index
        seed = tl.load(seed_ptr + row)
        counter = tl.load(counter_ptr + row).to(tl.uint64)
        c1 = (counter & 0xFFFFFFFF).to(tl.uint32)
        c2 = (counter >> 32).to(tl.uint32)
        c3 = 0x5EED
    else:
        seed = tl.load(seed_ptr)
        c1 = row.to(tl.uint32)
        c2 = offset
        c3 = 0
    if greedy:
        token, m, s = _scan_row(logits_row, vocab, inv_t, seed, c1, c2, c3, False, QUARTER)
    else:
        token, m, s = _scan_row(logits_row, vocab, inv_t, seed, c1, c2, c3, True, QUARTER)
    token = tl.minimum(token, vocab - 1)  # an all-NaN row still names a real token
    x = tl.load(logits_row + token).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, x - m - tl.log(s))


def sample_tokens(logits_BV: torch.Tensor, temperature_B: torch.Tensor, seed_1: torch.Tensor,
                  offset: int | torch.Tensor = 0, block_v: int = 4096,
                  num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`tapioca.engines.kernels.reference.sample_tokens` (a different noise
    stream: Philox here). ``block_v`` (vocab entries per tile, a multiple of 4 and a power
    of two) / ``num_warps`` are tuning knobs."""
    rows, vocab = logits_BV.shape
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    per_row = isinstance(offset, torch.Tensor)
    if per_row:  # a key per row: seed_1 and offset are [B] int64 device tensors
        counter = offset.contiguous()
        seed_1 = seed_1.contiguous()
        offset = 0
    else:
        counter = seed_1  # unused
        if not 0 <= offset < 2 ** 32:
            raise ValueError(f"sample_tokens: offset {offset} must fit in 32 bits")
    tokens_B = torch.empty(rows, dtype=torch.int64, device=logits_BV.device)
    logprobs_B = torch.empty(rows, dtype=torch.float32, device=logits_BV.device)
    if rows:
        _sample_kernel[(rows,)](logits_BV, temperature_B, seed_1, counter, tokens_B, logprobs_B, vocab,
                                logits_BV.stride(0), offset, PER_ROW=per_row, QUARTER=block_v // 4,
                                num_warps=num_warps)
    return tokens_B, logprobs_B
