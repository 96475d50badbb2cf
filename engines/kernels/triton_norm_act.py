"""Triton residual-add + RMSNorm and SiLU-and-mul (row-wise, memory-bound ops).

Consumes activations ``[rows, D]`` (any leading shape, flattened; last dim contiguous) in
fp32 / bf16 / fp16; emits new tensors in the same dtype. Same contract and rounding as
:mod:`tapioca.engines.kernels.reference` (HF's Qwen2RMSNorm / MLP order): every
intermediate that HF rounds to the activation dtype is rounded here too, so bf16 outputs
match HF except for the last bit of a reduction order.

One program per row (rms_norm) or per row x column block (silu_and_mul): grids depend
only on shapes, nothing is read on the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps,
                     stride_x, stride_res, stride_out, stride_res_out,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # HF adds in the activation dtype: an fp32 add rounded once, like PyTorch does.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / D
    h = h * tl.math.rsqrt(variance + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # HF: weight * hidden.to(input_dtype) -- round to x's dtype before the weight multiply.
    out = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
             residual_TD: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`tapioca.engines.kernels.reference.rms_norm`; returns new tensors."""
    dim = x_TD.shape[-1]
    x_RD = _rows(x_TD)
    rows = x_RD.shape[0]
    out_RD = torch.empty((rows, dim), dtype=x_TD.dtype, device=x_TD.device)
    if residual_TD is not None:
        res_RD = _rows(residual_TD)
        res_out_RD = torch.empty_like(out_RD)
    else:
        res_RD = res_out_RD = x_RD  # unused by the kernel
    block_d = triton.next_power_of_2(dim)
    if rows:
        _rms_norm_kernel[(rows,)](
            x_RD, res_RD, weight_D, out_RD, res_out_RD, dim, eps,
            x_RD.stride(0), res_RD.stride(0), out_RD.stride(0), res_out_RD.stride(0),
            HAS_RESIDUAL=residual_TD is not None, BLOCK_D=block_d,
            num_warps=4 if block_d <= 2048 else 8)
    out_TD = out_RD.view(x_TD.shape)
    if residual_TD is None:
        return out_TD, x_TD
    return out_TD, res_out_RD.view(x_TD.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # HF: act_fn(gate) * up, each rounded to the activation dtype.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x_TI2: torch.Tensor, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """See :func:`tapioca.engines.kernels.reference.silu_and_mul`; ``[..., 2I] -> [..., I]``."""
    inter = x_TI2.shape[-1] // 2
    x_RI2 = _rows(x_TI2)
    rows = x_RI2.shape[0]
    out_RI = torch.empty((rows, inter), dtype=x_TI2.dtype, device=x_TI2.device)
    if rows:
        grid = (rows, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x_RI2, out_RI, inter, x_RI2.stride(0), out_RI.stride(0),
                                   BLOCK=block, num_warps=num_warps)
    return out_RI.view(*x_TI2.shape[:-1], inter)
