"""Triton kernels for the per-chunk softmax work of :mod:`tapioca.algorithms.logprobs`.

Consumes one chunk's logits ``z_CV`` (the LM-head matmul output, in the matmul dtype:
bf16 under autocast) and its labels; emits per-row ``lse``, ``logprob`` and ``entropy``
(forward), or overwrites ``z_CV`` with ``dL/dz`` (backward). One program per row walks
the vocabulary in blocks with an online (running max) log-sum-exp, in fp32 registers.

Why: the PyTorch chunk path upcasts the ``[C, V]`` logits to fp32 and makes ~8 passes
over them (max, exp, sum, gather, and the entropy's div / sub / mul / sum), then as many
in backward: ~30 GB of memory traffic per 4k-token chunk at a 152k vocabulary. Here the
forward reads the bf16 logits once and the backward reads and writes them once: the
softmax costs ~1/10 of the time, and no fp32 ``[C, V]`` buffer exists at all. The math
(fp32, same formulas) is the PyTorch path's; only summation order differs.

Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _fwd_kernel(z_ptr, z_stride, labels_ptr, lse_ptr, logp_ptr, ent_ptr, V: tl.constexpr, ignore_index,
                COMPUTE_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK)
    # Running max m, sum of exp(z - m) s, and sum of exp(z - m) * z t (for the entropy
    # H = lse - sum p z), rescaled whenever the max grows.
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    t = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        z = tl.load(z_row + idx, mask=inside, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        alpha = tl.exp(m - m_new)
        e = tl.where(inside, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, 0)
        if COMPUTE_ENTROPY:
            t = t * alpha + tl.sum(e * tl.where(inside, z, 0.0), 0)  # e is 0 outside
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    z_y = tl.load(z_row + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, tl.where(valid, z_y - lse, 0.0))
    if COMPUTE_ENTROPY:
        tl.store(ent_ptr + row, lse - t / s)


@triton.jit
def _bwd_kernel(z_ptr, z_stride, labels_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, V: tl.constexpr, ignore_index,
                HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    g_lp = 0.0
    if HAS_G_LP:
        g_lp = tl.where(valid, tl.load(g_lp_ptr + row), 0.0)
    g_ent = 0.0
    ent = 0.0
    if HAS_G_ENT:
        g_ent = tl.load(g_ent_ptr + row)
        ent = tl.load(ent_ptr + row)
    # dz_k = -p_k * (g_lp + g_H * (log p_k + H)) + [k == y] * g_lp
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        z = tl.load(z_row + idx, mask=inside, other=0.0).to(tl.float32)
        logp = z - lse
        p = tl.exp(logp)
        coef = g_lp + g_ent * (logp + ent)
        dz = -p * coef
        if HAS_G_LP:
            dz = tl.where(idx == label, dz + g_lp, dz)
        tl.store(z_row + idx, dz.to(z_ptr.dtype.element_ty), mask=inside)


def chunk_forward(z_CV: torch.Tensor, labels_C: torch.Tensor, ignore_index: int, compute_entropy: bool,
                  out_dtype: torch.dtype):
    """``(logprobs_C, lse_C, entropy_C or None)`` of one chunk of logits."""
    n_rows, vocab = z_CV.shape
    lse = torch.empty(n_rows, dtype=torch.float32, device=z_CV.device)
    logp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if compute_entropy else lse  # unused pointer when off
    if n_rows:
        _fwd_kernel[(n_rows,)](z_CV, z_CV.stride(0), labels_C, lse, logp, ent, vocab, ignore_index,
                               COMPUTE_ENTROPY=compute_entropy, BLOCK=_block(vocab), num_warps=8)
    return (logp.to(out_dtype), lse.to(out_dtype), ent.to(out_dtype) if compute_entropy else None)


def chunk_backward_(z_CV: torch.Tensor, labels_C: torch.Tensor, lse_C: torch.Tensor,
                    entropy_C: torch.Tensor | None, g_lp_C: torch.Tensor | None,
                    g_ent_C: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """Overwrite the chunk's logits ``z_CV`` with ``dL/dz`` and return it."""
    n_rows, vocab = z_CV.shape
    f32 = lse_C.float().contiguous()
    dummy = f32
    if n_rows:
        _bwd_kernel[(n_rows,)](
            z_CV, z_CV.stride(0), labels_C, f32,
            entropy_C.float().contiguous() if g_ent_C is not None else dummy,
            g_lp_C.float().contiguous() if g_lp_C is not None else dummy,
            g_ent_C.float().contiguous() if g_ent_C is not None else dummy,
            vocab, ignore_index, HAS_G_LP=g_lp_C is not None, HAS_G_ENT=g_ent_C is not None,
            BLOCK=_block(vocab), num_warps=8)
    return z_CV


def _block(vocab: int) -> int:
    return min(BLOCK_V, triton.next_power_of_2(vocab))
