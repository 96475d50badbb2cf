"""The elementwise pieces of a Llama-family decoder layer: plain PyTorch or liger-kernel.

Consumes tensors and the ``transformers`` modules that hold the weights (RMSNorm, MLP);
emits tensors. :class:`TorchOps` calls the Hugging Face modules themselves (their exact
numerics: the reference, CPU CI, and what ``torch.compile`` fuses); :class:`LigerOps`
runs liger-kernel's Triton kernels on the same weights (CUDA): RMSNorm, residual add +
RMSNorm in one pass, rotary embedding in place, SwiGLU.

:class:`SwiGLUDown` (``recompute_swiglu``) is a memory switch for both: the MLP's
``silu(gate) * up`` product (``intermediate_size`` x 2 bytes per token and layer, the
largest activation of the layer) is not kept for backward but recomputed there from
gate and up, which are kept anyway.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..schemas.errors import ConfigError

LIGER_HINT = "pip install liger-kernel (a pure-Python wheel; its Triton kernels need CUDA)"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _SwiGLUDown(torch.autograd.Function):
    """``down(silu(a) * b)`` keeping ``a, b`` only; ``silu(a) * b`` is recomputed in
    backward for the down projection's weight gradient."""

    @staticmethod
    def forward(ctx, a_NI, b_NI, weight_HI, bias_H, ops):
        c_NI = ops.silu_mul_fwd(a_NI, b_NI)
        w = weight_HI.to(c_NI.dtype)
        out_NH = F.linear(c_NI, w, None if bias_H is None else bias_H.to(c_NI.dtype))
        ctx.save_for_backward(a_NI, b_NI, weight_HI)
        ctx.ops = ops
        ctx.has_bias = bias_H is not None
        return out_NH

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_NH):
        a_NI, b_NI, weight_HI = ctx.saved_tensors
        grad_NH = grad_NH.contiguous()
        c_NI = ctx.ops.silu_mul_fwd(a_NI, b_NI)
        g2 = grad_NH.reshape(-1, grad_NH.shape[-1])
        grad_w = (g2.T @ c_NI.reshape(-1, c_NI.shape[-1]).to(g2.dtype)).to(weight_HI.dtype)
        grad_bias = g2.sum(0).to(weight_HI.dtype) if ctx.has_bias else None
        del c_NI
        grad_c = grad_NH @ weight_HI.to(grad_NH.dtype)
        grad_a, grad_b = ctx.ops.silu_mul_bwd(a_NI, b_NI, grad_c)
        return grad_a, grad_b, grad_w, grad_bias, None


class TorchOps:
    """Plain PyTorch (the Hugging Face modules' own forward where there is one)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module):
        """``(norm(residual + x), residual + x)``."""
        h = residual + x
        return self.rms_norm(h, norm), h

    @staticmethod
    def rope(q_NHD: torch.Tensor, k_NKD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor):
        cos, sin = cos_ND[:, None], sin_ND[:, None]
        return q_NHD * cos + _rotate_half(q_NHD) * sin, k_NKD * cos + _rotate_half(k_NKD) * sin

    @staticmethod
    def silu_mul_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b

    @staticmethod
    def silu_mul_bwd(a: torch.Tensor, b: torch.Tensor, grad_c: torch.Tensor):
        dtype = torch.promote_types(a.dtype, torch.float32)  # bf16 math in fp32, fp64 stays
        a32, b32, gc = a.to(dtype), b.to(dtype), grad_c.to(dtype)
        sig = torch.sigmoid(a32)
        grad_b = (gc * a32 * sig).to(b.dtype)
        grad_a = (gc * b32 * (sig * (1 + a32 * (1 - sig)))).to(a.dtype)  # d silu = s (1 + a (1 - s))
        return grad_a, grad_b

    def mlp(self, x_NH: torch.Tensor, mlp: torch.nn.Module, recompute: bool) -> torch.Tensor:
        if not recompute:
            return mlp(x_NH)
        a, b = mlp.gate_proj(x_NH), mlp.up_proj(x_NH)
        down = mlp.down_proj
        return _SwiGLUDown.apply(a, b, down.weight, down.bias, self)


class LigerOps(TorchOps):
    """liger-kernel's Triton kernels (CUDA; under ``TRITON_INTERPRET=1`` also CPU)."""

    name = "liger"

    def __init__(self) -> None:
        if importlib.util.find_spec("liger_kernel") is None:
            raise ConfigError(f"actor.liger_kernels needs the liger-kernel package: {LIGER_HINT}")
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction, swiglu_backward, swiglu_forward

        self._rms = LigerRMSNormFunction
        self._add_rms = LigerFusedAddRMSNormFunction
        self._rope = LigerRopeFunction
        self._silu_mul = LigerSiLUMulFunction
        self._swiglu_fwd, self._swiglu_bwd = swiglu_forward, swiglu_backward

    def rms_norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        # casting "llama": rstd in fp32, as the HF Llama / Qwen RMSNorm computes it.
        # in_place: dY's buffer takes dX (no other reader of dY in this layer's graph).
        return self._rms.apply(x, norm.weight, norm.variance_epsilon, 0.0, "llama", True)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module):
        if x.dtype != residual.dtype:  # fp32 residual stream under autocast: keep it fp32
            x = x.to(residual.dtype)
        return self._add_rms.apply(x, residual, norm.weight, norm.variance_epsilon, 0.0, "llama", False)

    def rope(self, q_NHD, k_NKD, cos_ND, sin_ND):
        # Liger takes [B, heads, T, D] views of [B, T, heads, D] memory and rotates in place
        # (the projections' outputs are not saved for their backward, so that is safe).
        q, k = self._rope.apply(q_NHD.contiguous()[None].transpose(1, 2),
                                k_NKD.contiguous()[None].transpose(1, 2), cos_ND[None], sin_ND[None])
        return q.transpose(1, 2)[0], k.transpose(1, 2)[0]

    def silu_mul_fwd(self, a, b):
        return self._swiglu_fwd(a.contiguous(), b.contiguous())[2]

    def silu_mul_bwd(self, a, b, grad_c):
        # liger writes the gradients into a's and b's buffers: they are this backward's
        # saved tensors, read for the last time here (once_differentiable).
        return self._swiglu_bwd(a, b, grad_c.contiguous())

    def mlp(self, x_NH, mlp, recompute):
        a, b = mlp.gate_proj(x_NH), mlp.up_proj(x_NH)
        down = mlp.down_proj
        if recompute:
            return _SwiGLUDown.apply(a, b, down.weight, down.bias, self)
        return down(self._silu_mul.apply(a, b))


def liger_by_default(device, model: torch.nn.Module | None = None, *, parallel: bool = False,
                     compile_layers: bool = False) -> bool:
    """What ``actor.liger_kernels: null`` means: on where it runs -- a CUDA device with
    liger-kernel installed, a text model (the VL rotary is multimodal), one process per
    layer's weights (tensor parallelism holds DTensors) and no ``compile_layers`` (which
    fuses the same ops)."""
    if not str(device).startswith("cuda") or parallel or compile_layers:
        return False
    if model is not None:
        from .vision import vision_spec

        if vision_spec(getattr(model, "config", None)) is not None:
            return False
    return importlib.util.find_spec("liger_kernel") is not None


def make_ops(liger: bool) -> TorchOps:
    return LigerOps() if liger else TorchOps()
