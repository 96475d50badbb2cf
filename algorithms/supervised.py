"""Supervised token losses: masked NLL (SFT), per-sequence log-probabilities (DPO), and
the forward KL(teacher ‖ student) over the vocabulary (knowledge distillation).

Consumes per-token log-probabilities ``logprobs_BT`` of the dataset tokens with a loss
mask ``mask_BT`` (bool or 0/1, True = trained), or — for distillation — the hidden
states of the trained positions and both models' LM-head weights. Emits scalar losses
(token means over the mask) and per-sequence / per-token tensors. No I/O.

Conventions (each has a golden test):

* **Token mean over the mask**: ``loss = -Σ mask·logp / Σ mask``; a batch with no
  trained token gives exactly 0 (with a zero gradient), never NaN.
* **Sequence log-probability**: ``Σ_t mask·logp`` (DPO sigmoid), or that sum divided by
  the sequence's trained tokens with ``average=True`` (TRL's IPO); an empty sequence
  gives 0.
* **Forward KL** per token, with ``p = softmax(z_teacher / τ)``, ``q = softmax(z_student / τ)``::

      KL(p ‖ q) = Σ_v p_v (log p_v - log q_v)

  ``τ`` is the distillation temperature; the loss is *not* multiplied by ``τ²``
  (Hinton's rescaling) — set ``kd_coef`` instead. :func:`forward_kl_from_hidden`
  computes it ``chunk_tokens`` tokens at a time with a custom autograd function that
  recomputes each chunk's logits in backward, so neither the student's nor the
  teacher's ``[N, V]`` fp32 logits are ever materialised for the whole batch (two
  ``[chunk, V]`` buffers per model at a time). Gradient:
  ``d KL / d z_student = (q - p) / τ``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .errors import AlgorithmInputError


def _check_same_shape(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise AlgorithmInputError(f"{name}: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}.")


def masked_nll(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood over the trained tokens (0 when there are none)."""
    _check_same_shape("masked_nll", logprobs_BT, mask_BT)
    mask = mask_BT.bool()
    # where(), not multiply: a padded position's logprob may be anything (even -inf).
    picked = torch.where(mask, logprobs_BT, torch.zeros_like(logprobs_BT))
    return -picked.sum() / mask.sum().clamp(min=1)


def masked_token_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of ``values_BT`` over the masked positions (0 when there are none)."""
    _check_same_shape("masked_token_mean", values_BT, mask_BT)
    mask = mask_BT.bool()
    return torch.where(mask, values_BT, torch.zeros_like(values_BT)).sum() / mask.sum().clamp(min=1)


def sequence_logprobs(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                      average: bool = False) -> torch.Tensor:
    """Per-sequence ``Σ_t mask·logp`` (``[B]``), or its mean over trained tokens."""
    _check_same_shape("sequence_logprobs", logprobs_BT, mask_BT)
    mask = mask_BT.bool()
    sums_B = torch.where(mask, logprobs_BT, torch.zeros_like(logprobs_BT)).sum(-1)
    if average:
        return sums_B / mask.sum(-1).clamp(min=1)
    return sums_B


def forward_kl_from_logits(student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor,
                           *, temperature: float = 1.0) -> torch.Tensor:
    """Reference / small-case per-token KL(teacher ‖ student), from full logits."""
    _check_same_shape("forward_kl_from_logits", student_logits_NV, teacher_logits_NV)
    if not temperature > 0:
        raise AlgorithmInputError(f"forward_kl_from_logits: temperature={temperature!r} must be > 0.")
    dtype = torch.promote_types(student_logits_NV.dtype, torch.float32)
    log_q = torch.log_softmax(student_logits_NV.to(dtype) / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits_NV.detach().to(dtype) / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


class _ChunkedForwardKL(torch.autograd.Function):
    """Per-token KL(softmax(h_t W_t^T / τ) ‖ softmax(h_s W_s^T / τ)), chunk by chunk."""

    @staticmethod
    def forward(ctx, s_hidden_NH, s_weight_VH, t_hidden_NH, t_weight_VH, temperature, chunk_tokens):
        cdtype = torch.promote_types(torch.promote_types(s_hidden_NH.dtype, s_weight_VH.dtype),
                                     torch.float32)
        n = s_hidden_NH.shape[0]
        ws_VH, wt_VH = s_weight_VH.to(cdtype), t_weight_VH.detach().to(cdtype)
        kl_N = s_hidden_NH.new_empty(n, dtype=cdtype)
        s_lse_N = s_hidden_NH.new_empty(n, dtype=cdtype)
        t_lse_N = s_hidden_NH.new_empty(n, dtype=cdtype)
        with torch.no_grad():
            for start in range(0, n, chunk_tokens):
                end = min(start + chunk_tokens, n)
                zs_CV = (s_hidden_NH[start:end].to(cdtype) / temperature) @ ws_VH.T
                zt_CV = (t_hidden_NH[start:end].detach().to(cdtype) / temperature) @ wt_VH.T
                s_lse_C = torch.logsumexp(zs_CV, dim=-1)
                t_lse_C = torch.logsumexp(zt_CV, dim=-1)
                # log p - log q = (zt - lse_t) - (zs - lse_s), computed in the zt buffer.
                zt_CV.sub_(t_lse_C.unsqueeze(-1))          # log p
                zs_CV.sub_(s_lse_C.unsqueeze(-1))          # log q
                diff_CV = zt_CV - zs_CV
                kl_N[start:end] = (zt_CV.exp_() * diff_CV).sum(-1)
                s_lse_N[start:end], t_lse_N[start:end] = s_lse_C, t_lse_C
                del zs_CV, zt_CV, diff_CV
        ctx.save_for_backward(s_hidden_NH, s_weight_VH, t_hidden_NH, t_weight_VH, s_lse_N, t_lse_N)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return kl_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl_N):
        s_hidden_NH, s_weight_VH, t_hidden_NH, t_weight_VH, s_lse_N, t_lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_kl_N is None or not (need_h or need_w):
            return None, None, None, None, None, None
        cdtype, tau = s_lse_N.dtype, ctx.temperature
        n = s_hidden_NH.shape[0]
        ws_VH, wt_VH = s_weight_VH.to(cdtype), t_weight_VH.detach().to(cdtype)
        grad_h_NH = torch.empty_like(s_hidden_NH, dtype=cdtype) if need_h else None
        grad_w_VH = torch.zeros_like(ws_VH) if need_w else None
        for start in range(0, n, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n)
            hs_CH = s_hidden_NH[start:end].to(cdtype) / tau
            q_CV = (hs_CH @ ws_VH.T).sub_(s_lse_N[start:end].unsqueeze(-1)).exp_()
            p_CV = ((t_hidden_NH[start:end].detach().to(cdtype) / tau) @ wt_VH.T
                    ).sub_(t_lse_N[start:end].unsqueeze(-1)).exp_()
            # d KL / d (z_s / τ) = q - p; chain rule through z_s = (h / τ) W^T.
            g_CV = q_CV.sub_(p_CV).mul_(grad_kl_N[start:end].to(cdtype).unsqueeze(-1))
            if need_h:
                grad_h_NH[start:end] = (g_CV @ ws_VH) / tau
            if need_w:
                grad_w_VH.addmm_(g_CV.T, hs_CH)
            del q_CV, p_CV, g_CV
        return (grad_h_NH.to(s_hidden_NH.dtype) if need_h else None,
                grad_w_VH.to(s_weight_VH.dtype) if need_w else None, None, None, None, None)


def forward_kl_from_hidden(
    student_hidden_NH: torch.Tensor,
    student_head_VH: torch.Tensor,
    teacher_hidden_NH: torch.Tensor,
    teacher_head_VH: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Per-token KL(teacher ‖ student) ``[N]`` from the hidden states of the trained
    positions (``N`` tokens, already selected by the mask) and the LM heads.

    Gradients flow to ``student_hidden_NH`` and ``student_head_VH``; the teacher is a
    constant. The two heads must share the vocabulary (same ``V``); their hidden sizes
    may differ. Output dtype is fp32 (fp64 for fp64 inputs).
    """
    if not temperature > 0:
        raise AlgorithmInputError(f"forward_kl_from_hidden: temperature={temperature!r} must be > 0.")
    if chunk_tokens < 1:
        raise AlgorithmInputError(f"forward_kl_from_hidden: chunk_tokens={chunk_tokens!r} must be >= 1.")
    if (student_head_VH.dim() != 2 or teacher_head_VH.dim() != 2
            or student_head_VH.shape[0] != teacher_head_VH.shape[0]
            or student_hidden_NH.shape != (student_hidden_NH.shape[0], student_head_VH.shape[1])
            or teacher_hidden_NH.shape != (student_hidden_NH.shape[0], teacher_head_VH.shape[1])):
        raise AlgorithmInputError(
            "forward_kl_from_hidden: need student hidden [N, Hs], head [V, Hs], teacher hidden "
            f"[N, Ht], head [V, Ht]; got {tuple(student_hidden_NH.shape)}, "
            f"{tuple(student_head_VH.shape)}, {tuple(teacher_hidden_NH.shape)}, "
            f"{tuple(teacher_head_VH.shape)}.")
    return _ChunkedForwardKL.apply(student_hidden_NH, student_head_VH, teacher_hidden_NH,
                                   teacher_head_VH, float(temperature), int(chunk_tokens))
