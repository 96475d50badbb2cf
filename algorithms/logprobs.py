"""Per-token log-probabilities and entropy of sampled tokens, memory-bounded.

Consumes the last hidden states ``hidden_BTH``, the LM-head weight
``lm_head_weight_VH`` and the sampled (next) tokens ``labels_BT``; emits
``logprobs_BT`` (log pi(label)) and ``entropy_BT`` (entropy of the full
next-token distribution), both differentiable in the hidden states and the
weight. ``B, T`` may be any leading shape; they are flattened to ``N`` tokens.

Why not ``log_softmax(hidden @ W.T)``: for ``N`` tokens and a vocabulary ``V``
that materialises ``N x V`` fp32 logits, plus as much again for autograd (e.g.
32k tokens x 152k vocab x 4 B = 19 GB each). Here a custom autograd function
processes ``chunk_tokens`` tokens at a time, keeps only ``N``-sized results and
the per-token log-sum-exp, and recomputes each chunk's logits in backward. Peak
extra memory is two fp32 ``chunk_tokens x V`` buffers (plus a bf16 one under autocast)
and O(V x H) for the LM head: a copy in the matmul dtype, an fp32 gradient and, under
autocast, a bf16 ``V x H`` product per chunk -- independent of the number of tokens.

Precision: the softmax, log-sum-exp, entropy and gradients are computed in fp32
(fp64 inputs stay fp64 so the function can be gradchecked), with autocast off
inside. The two LM-head matmuls run in ``matmul_dtype``: by default fp32, or the
autocast dtype when the caller runs under ``torch.autocast`` -- then the logits
are rounded to bf16 / fp16 like an autocast model's LM head (and the inference
engine's) and upcast before the softmax, as HF / verl trainers do. (Before, an
ambient autocast silently turned the forward's exp and sums into bf16 too: errors
of ~0.17 nats, measured; and its fp32 backward matmuls cost ~2x the step on GPU.)
Logits are divided by ``temperature``, as the sampler does (the small ``[C, H]``
hidden chunk is scaled before the matmul rather than the ``[C, V]`` logits after
it: equal up to rounding). Outputs are in the fp32 (or fp64) compute dtype.

Backward, per token with ``z = logits / temperature``, ``p = softmax(z)``,
``H = -sum p log p``:

* ``d logp_y / dz = onehot(y) - p``
* ``d H / dz_k = -p_k (log p_k + H)``  (from ``H = lse(z) - sum_j p_j z_j``)
* ``d / d logits = (d / dz) / temperature``; then the two matmuls back to
  hidden and weight.

Labels equal to ``ignore_index`` (padding) get logprob 0 and no gradient through
the logprob; all other labels must lie in ``[0, V)`` (not checked: a check would
need a device sync).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .errors import AlgorithmInputError


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _scaled_logits(h_CH: torch.Tensor, w_VH: torch.Tensor, temperature: float,
                   cdtype: torch.dtype) -> torch.Tensor:
    """``z_CV`` in ``cdtype`` from the matmul in ``w_VH``'s dtype; forward and backward
    must round identically, as backward recomputes z against the saved log-sum-exp."""
    return ((h_CH.to(w_VH.dtype) / temperature) @ w_VH.T).to(cdtype)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """Chunked ``(logprob, entropy)`` of ``hidden_NH @ weight_VH.T / temperature``."""

    @staticmethod
    def forward(
        ctx, hidden_NH, weight_VH, labels_N, temperature, chunk_tokens, compute_entropy, ignore_index,
        matmul_dtype, use_triton, keep_logits=False,
    ):
        # Unused outputs (e.g. entropy only logged) arrive as None in backward,
        # so their term is skipped instead of multiplied by zeros.
        ctx.set_materialize_grads(False)
        cdtype = _compute_dtype(hidden_NH, weight_VH)
        mm_dtype = matmul_dtype or cdtype
        # Kept logits (Triton path) spare backward the LM-head matmul that recomputes them.
        keep = use_triton and keep_logits and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        ctx.logits = []
        with torch.autocast(hidden_NH.device.type, enabled=False):
            if use_triton:
                outputs = _ChunkedLogprobEntropy._forward_triton(
                    hidden_NH, weight_VH.to(mm_dtype), labels_N, temperature, chunk_tokens,
                    compute_entropy, ignore_index, cdtype, ctx.logits if keep else None)
            else:
                outputs = _ChunkedLogprobEntropy._forward(
                    hidden_NH, weight_VH.to(mm_dtype), labels_N, temperature, chunk_tokens,
                    compute_entropy, ignore_index, cdtype)
        logprobs_N, lse_N, entropy_N = outputs
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, lse_N, entropy_N)
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        ctx.ignore_index = ignore_index
        ctx.compute_entropy = compute_entropy
        ctx.mm_dtype = mm_dtype
        ctx.use_triton = use_triton
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def _forward_triton(hidden_NH, w_VH, labels_N, temperature, chunk_tokens, compute_entropy,
                        ignore_index, cdtype, keep: list | None):
        """The Triton path: per chunk, the logits in the matmul dtype and one kernel;
        ``keep``: a list that receives each chunk's logits for backward."""
        from .logprobs_triton import chunk_forward

        n_tokens = hidden_NH.shape[0]
        logprobs_N = hidden_NH.new_empty(n_tokens, dtype=cdtype)
        lse_N = hidden_NH.new_empty(n_tokens, dtype=cdtype)
        entropy_N = hidden_NH.new_empty(n_tokens if compute_entropy else 0, dtype=cdtype)
        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            z_CV = (hidden_NH[start:end].to(w_VH.dtype) / temperature) @ w_VH.T
            lp_C, lse_C, ent_C = chunk_forward(z_CV, labels_N[start:end], ignore_index, compute_entropy, cdtype)
            logprobs_N[start:end] = lp_C
            lse_N[start:end] = lse_C
            if compute_entropy:
                entropy_N[start:end] = ent_C
            if keep is not None:
                keep.append(z_CV)
            del z_CV
        return logprobs_N, lse_N, entropy_N

    @staticmethod
    def _forward(hidden_NH, w_VH, labels_N, temperature, chunk_tokens, compute_entropy,
                 ignore_index, cdtype):
        n_tokens = hidden_NH.shape[0]
        logprobs_N = hidden_NH.new_empty(n_tokens, dtype=cdtype)
        lse_N = hidden_NH.new_empty(n_tokens, dtype=cdtype)
        entropy_N = hidden_NH.new_empty(n_tokens if compute_entropy else 0, dtype=cdtype)
        for start in range(0, n_tokens, chunk_tokens):
            end = min(start + chunk_tokens, n_tokens)
            # Scale the small [C, H] input rather than the [C, V] logits.
            z_CV = _scaled_logits(hidden_NH[start:end], w_VH, temperature, cdtype)
            # Hand-rolled log-sum-exp so the exp buffer can be reused for p:
            # at most two [C, V] buffers live at once (z and p).
            max_C = z_CV.amax(dim=-1)
            p_CV = (z_CV - max_C.unsqueeze(-1)).exp_()
            sum_C = p_CV.sum(dim=-1)
            lse_C = max_C + sum_C.log()
            labels_C = labels_N[start:end]
            valid_C = labels_C != ignore_index
            safe_C = torch.where(valid_C, labels_C, torch.zeros_like(labels_C))
            lp_C = z_CV.gather(-1, safe_C.unsqueeze(-1)).squeeze(-1) - lse_C
            logprobs_N[start:end] = torch.where(valid_C, lp_C, torch.zeros_like(lp_C))
            lse_N[start:end] = lse_C
            if compute_entropy:
                p_CV.div_(sum_C.unsqueeze(-1))
                z_CV.sub_(lse_C.unsqueeze(-1))  # z becomes log p in place
                entropy_N[start:end] = -p_CV.mul_(z_CV).sum(-1)
            # Free before the next chunk allocates, else four buffers peak.
            del z_CV, p_CV
        return logprobs_N, lse_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_NH, weight_VH, labels_N, lse_N, entropy_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.compute_entropy:
            grad_entropy_N = None
        if (grad_logprobs_N is None and grad_entropy_N is None) or not (need_h or need_w):
            ctx.logits = []
            return None, None, None, None, None, None, None, None, None, None
        with torch.autocast(hidden_NH.device.type, enabled=False):
            backward = _ChunkedLogprobEntropy._backward_triton if ctx.use_triton else _ChunkedLogprobEntropy._backward
            grad_h_NH, grad_w_VH = backward(
                ctx, hidden_NH, weight_VH, labels_N, lse_N, entropy_N, grad_logprobs_N,
                grad_entropy_N, need_h, need_w)
        return (
            grad_h_NH.to(hidden_NH.dtype) if need_h else None,
            grad_w_VH.to(weight_VH.dtype) if need_w else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )

    @staticmethod
    def _backward_triton(ctx, hidden_NH, weight_VH, labels_N, lse_N, entropy_N, grad_logprobs_N,
                         grad_entropy_N, need_h, need_w):
        """The Triton path: per chunk, recompute the logits in the matmul dtype, one kernel
        turns them into dL/dz in place, then the two matmuls."""
        from .logprobs_triton import chunk_backward_

        cdtype, mm_dtype = lse_N.dtype, ctx.mm_dtype
        n_tokens = hidden_NH.shape[0]
        w_VH = weight_VH.to(mm_dtype)
        grad_h_NH = torch.empty_like(hidden_NH, dtype=cdtype) if need_h else None
        single_chunk = n_tokens <= ctx.chunk_tokens
        grad_w_VH = None if single_chunk or not need_w else torch.zeros_like(weight_VH, dtype=cdtype)
        for start in range(0, n_tokens, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n_tokens)
            h_CH = hidden_NH[start:end].to(mm_dtype) / ctx.temperature
            kept = ctx.logits.pop(0) if ctx.logits else None  # overwritten in place below
            g_z_CV = chunk_backward_(
                kept if kept is not None else h_CH @ w_VH.T, labels_N[start:end], lse_N[start:end],
                entropy_N[start:end] if grad_entropy_N is not None else None,
                grad_logprobs_N[start:end] if grad_logprobs_N is not None else None,
                grad_entropy_N[start:end] if grad_entropy_N is not None else None, ctx.ignore_index)
            # z = (h / T) @ W.T, so dW += dz.T @ (h / T) and dh = (dz @ W) / T.
            if need_h:
                grad_h_NH[start:end] = (g_z_CV @ w_VH).to(cdtype) / ctx.temperature
            if need_w:
                if single_chunk:  # no accumulation: keep the matmul's output as it is
                    grad_w_VH = g_z_CV.T @ h_CH
                elif mm_dtype == cdtype:
                    grad_w_VH.addmm_(g_z_CV.T, h_CH)
                else:  # accumulate the chunks in fp32
                    grad_w_VH.add_(g_z_CV.T @ h_CH)
            del g_z_CV
        return grad_h_NH, grad_w_VH

    @staticmethod
    def _backward(ctx, hidden_NH, weight_VH, labels_N, lse_N, entropy_N, grad_logprobs_N,
                  grad_entropy_N, need_h, need_w):
        cdtype, mm_dtype = lse_N.dtype, ctx.mm_dtype
        n_tokens = hidden_NH.shape[0]
        w_VH = weight_VH.to(mm_dtype)
        grad_h_NH = torch.empty_like(hidden_NH, dtype=cdtype) if need_h else None
        grad_w_VH = torch.zeros_like(weight_VH, dtype=cdtype) if need_w else None
        for start in range(0, n_tokens, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n_tokens)
            h_CH = hidden_NH[start:end].to(mm_dtype) / ctx.temperature
            # Recompute this chunk's log-softmax from the saved log-sum-exp; the
            # ops below are in place so only two [C, V] buffers (logp, p) live.
            logp_CV = _scaled_logits(hidden_NH[start:end], w_VH, ctx.temperature,
                                     cdtype).sub_(lse_N[start:end].unsqueeze(-1))
            p_CV = logp_CV.exp()
            if grad_logprobs_N is not None:
                labels_C = labels_N[start:end]
                valid_C = labels_C != ctx.ignore_index
                safe_C = torch.where(valid_C, labels_C, torch.zeros_like(labels_C))
                g_lp_C = torch.where(valid_C, grad_logprobs_N[start:end], torch.zeros_like(lse_N[start:end]))
            # dz = -p * coef (+ g_lp at the label), coef = g_lp + g_H * (log p + H).
            if grad_entropy_N is not None:
                # The logp buffer becomes coef in place.
                logp_CV.add_(entropy_N[start:end].unsqueeze(-1)).mul_(grad_entropy_N[start:end].unsqueeze(-1))
                if grad_logprobs_N is not None:
                    logp_CV.add_(g_lp_C.unsqueeze(-1))
                g_z_CV = p_CV.mul_(logp_CV).neg_()
            else:
                g_z_CV = p_CV.mul_(-g_lp_C.unsqueeze(-1))
            if grad_logprobs_N is not None:
                g_z_CV.scatter_add_(-1, safe_C.unsqueeze(-1), g_lp_C.unsqueeze(-1))
            # z = (h / T) @ W.T, so dW += dz.T @ (h / T) and dh = (dz @ W) / T.
            g_z_CV = g_z_CV.to(mm_dtype)
            if need_h:
                grad_h_NH[start:end] = (g_z_CV @ w_VH).to(cdtype) / ctx.temperature
            if need_w:
                if mm_dtype == cdtype:
                    grad_w_VH.addmm_(g_z_CV.T, h_CH)
                else:  # accumulate the chunks in fp32
                    grad_w_VH.add_(g_z_CV.T @ h_CH)
            del logp_CV, p_CV, g_z_CV  # free before the next chunk allocates
        return grad_h_NH, grad_w_VH


def gather_logprobs_entropy(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    compute_entropy: bool = True,
    ignore_index: int = -100,
    matmul_dtype: torch.dtype | None = None,
    kernel: str = "auto",
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``(logprobs, entropy)`` without materialising ``N x V`` logits.

    Returns tensors shaped like ``labels_BT`` in fp32 (fp64 for fp64 inputs);
    entropy is ``None`` when ``compute_entropy=False``. Gradients flow to
    ``hidden_BTH`` and ``lm_head_weight_VH`` through both outputs. The LM-head
    matmuls run in ``matmul_dtype`` (default: the autocast dtype when called under
    ``torch.autocast`` on the hidden states' device, else fp32); the softmax math is
    always fp32. ``kernel``: ``torch``
    (the chunked PyTorch ops), ``triton`` (:mod:`tapioca.algorithms.logprobs_triton`:
    the same math in one pass over the logits, CUDA or ``TRITON_INTERPRET=1``), or
    ``auto`` (triton on CUDA when Triton is installed and the inputs are not fp64).
    ``keep_logits`` (Triton path): keep each chunk's logits (``N x V`` in the matmul
    dtype in all) from forward to backward instead of recomputing them there.
    """
    if not temperature > 0:
        raise AlgorithmInputError(f"gather_logprobs_entropy: temperature={temperature!r} must be > 0.")
    if chunk_tokens < 1:
        raise AlgorithmInputError(f"gather_logprobs_entropy: chunk_tokens={chunk_tokens!r} must be >= 1.")
    hidden_size = lm_head_weight_VH.shape[-1]
    if (
        lm_head_weight_VH.dim() != 2
        or hidden_BTH.shape[:-1] != labels_BT.shape
        or hidden_BTH.shape[-1] != hidden_size
    ):
        raise AlgorithmInputError(
            "gather_logprobs_entropy: need hidden [..., H], weight [V, H], labels [...]; got "
            f"{tuple(hidden_BTH.shape)}, {tuple(lm_head_weight_VH.shape)}, {tuple(labels_BT.shape)}."
        )
    if matmul_dtype is None:
        device_type = hidden_BTH.device.type
        if torch.is_autocast_enabled(device_type):
            matmul_dtype = torch.get_autocast_dtype(device_type)
    logprobs_N, entropy_N = _ChunkedLogprobEntropy.apply(
        hidden_BTH.reshape(-1, hidden_size),
        lm_head_weight_VH,
        labels_BT.reshape(-1).long(),
        float(temperature),
        int(chunk_tokens),
        bool(compute_entropy),
        int(ignore_index),
        matmul_dtype,
        _use_triton(kernel, hidden_BTH),
        bool(keep_logits),
    )
    logprobs_BT = logprobs_N.view(labels_BT.shape)
    return logprobs_BT, (entropy_N.view(labels_BT.shape) if compute_entropy else None)


KERNELS = ("auto", "torch", "triton")


def triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _use_triton(kernel: str, hidden: torch.Tensor) -> bool:
    if kernel not in KERNELS:
        raise AlgorithmInputError(f"gather_logprobs_entropy: kernel={kernel!r}; use one of {', '.join(KERNELS)}.")
    if kernel == "auto":
        return hidden.is_cuda and hidden.dtype != torch.float64 and triton_available()
    if kernel == "triton" and not triton_available():
        raise AlgorithmInputError("gather_logprobs_entropy: kernel=triton needs the triton package "
                                  "(it comes with CUDA builds of PyTorch); use kernel=torch.")
    return kernel == "triton"


def logprobs_from_logits(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    temperature: float = 1.0,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Reference / small-case logprobs from full logits (upcast to fp32, / temperature)."""
    if not temperature > 0:
        raise AlgorithmInputError(f"logprobs_from_logits: temperature={temperature!r} must be > 0.")
    logp_BTV = torch.log_softmax(logits_BTV.to(_compute_dtype(logits_BTV)) / temperature, dim=-1)
    labels = labels_BT.long()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lp_BT = logp_BTV.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lp_BT, torch.zeros_like(lp_BT))


def entropy_from_logits(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Reference / small-case entropy of ``softmax(logits / temperature)`` per position."""
    if not temperature > 0:
        raise AlgorithmInputError(f"entropy_from_logits: temperature={temperature!r} must be > 0.")
    logp_BTV = torch.log_softmax(logits_BTV.to(_compute_dtype(logits_BTV)) / temperature, dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(-1)
