"""Vocabulary-parallel log-probabilities and entropy: the LM head split by vocabulary
over the tensor-parallel ranks, the ``[tokens, vocab]`` logits never gathered.

Consumes, on each tp rank, the same hidden states ``hidden_MH`` (whole, replicated over
tp), this rank's rows of the LM head ``weight_VlH`` (vocabulary ``[vocab_start,
vocab_start + Vl)``), the labels (global token ids) and the tp process group; emits
``(logprobs_M, entropy_M)`` of the whole vocabulary, equal on every tp rank.

Per chunk of ``chunk_tokens`` rows, each rank computes its ``[C, Vl]`` logits ``z`` and
then, with ``m`` the global max (one all-reduce MAX):

- ``s = sum_k exp(z_k - m)``, the label's logit (0 on the ranks that do not hold it),
  and ``sum_k exp(z_k - m) (z_k - m)`` (entropy): one all-reduce SUM of ``[3, C]``;
- ``lse = m + log s``, ``logprob = z_y - lse``, ``entropy = log s - sum_k p_k (z_k - m)``
  (``-sum p log p``, written so a peaked distribution loses no digits to cancellation).

Backward needs no communication: ``d logp_y / dz_k = [k = y] - p_k`` and ``d H / dz_k =
-p_k (log p_k + H)`` use the global ``lse`` and ``H`` saved by the forward, so every
rank gets its own slice of ``dz``; the weight's gradient is then this rank's rows, and
the hidden states' gradient is a partial sum over tp (the caller marks it so and the
reduce-scatter of the sequence-parallel stream sums it; models/parallel.py).
Precision as :mod:`tapioca.algorithms.logprobs`: the matmuls in ``matmul_dtype`` (the
weight's, bf16 under FSDP mixed precision), the softmax math in fp32 (fp64 stays fp64).
Memory per rank: two ``[C, Vl]`` fp32 buffers, i.e. 1/tp of the unsplit head's.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..algorithms.errors import AlgorithmInputError
from ..algorithms.logprobs import _compute_dtype, _scaled_logits


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_MH, weight_VH, labels_M, vocab_start, group, temperature, chunk_tokens,
                compute_entropy, ignore_index, matmul_dtype):
        import torch.distributed as dist

        ctx.set_materialize_grads(False)
        cdtype = _compute_dtype(hidden_MH, weight_VH)
        mm_dtype = matmul_dtype or cdtype
        w_VH = weight_VH.to(mm_dtype)
        n, n_vocab = hidden_MH.shape[0], weight_VH.shape[0]
        logprobs_M = hidden_MH.new_empty(n, dtype=cdtype)
        lse_M = hidden_MH.new_empty(n, dtype=cdtype)
        entropy_M = hidden_MH.new_zeros(n, dtype=cdtype)
        local_M = labels_M - vocab_start
        mine_M = (labels_M != ignore_index) & (local_M >= 0) & (local_M < n_vocab)
        safe_M = torch.where(mine_M, local_M, torch.zeros_like(local_M))
        with torch.autocast(hidden_MH.device.type, enabled=False):
            for start in range(0, n, chunk_tokens):
                end = min(start + chunk_tokens, n)
                z_CV = _scaled_logits(hidden_MH[start:end], w_VH, temperature, cdtype)
                max_C = z_CV.amax(dim=-1)
                dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=group)
                z_CV.sub_(max_C.unsqueeze(-1))  # z - m in place
                label_C = torch.where(mine_M[start:end], z_CV.gather(-1, safe_M[start:end, None])[:, 0],
                                      torch.zeros_like(max_C))
                p_CV = z_CV.exp()
                stats = [p_CV.sum(-1), label_C]
                if compute_entropy:
                    stats.append(p_CV.mul_(z_CV).sum(-1))
                del p_CV, z_CV
                stats_XC = torch.stack(stats)
                dist.all_reduce(stats_XC, group=group)
                log_s_C = stats_XC[0].log()
                lse_M[start:end] = max_C + log_s_C
                logprobs_M[start:end] = stats_XC[1] - log_s_C  # (z_y - m) - log s
                if compute_entropy:
                    entropy_M[start:end] = log_s_C - stats_XC[2] / stats_XC[0]
        valid_M = labels_M != ignore_index
        logprobs_M = torch.where(valid_M, logprobs_M, torch.zeros_like(logprobs_M))
        ctx.save_for_backward(hidden_MH, weight_VH, valid_M, mine_M, safe_M, lse_M, entropy_M)
        ctx.temperature, ctx.chunk_tokens, ctx.mm_dtype = temperature, chunk_tokens, mm_dtype
        ctx.compute_entropy = compute_entropy
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy_M)
        return logprobs_M, entropy_M

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp_M, grad_ent_M):
        hidden_MH, weight_VH, valid_M, mine_M, safe_M, lse_M, entropy_M = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.compute_entropy:
            grad_ent_M = None
        none = (None,) * 8
        if (grad_lp_M is None and grad_ent_M is None) or not (need_h or need_w):
            return (None, None, *none)
        cdtype, mm_dtype, temp = lse_M.dtype, ctx.mm_dtype, ctx.temperature
        w_VH = weight_VH.to(mm_dtype)
        grad_h = torch.empty_like(hidden_MH, dtype=cdtype) if need_h else None
        grad_w = torch.zeros_like(weight_VH, dtype=cdtype) if need_w else None
        with torch.autocast(hidden_MH.device.type, enabled=False):
            for start in range(0, hidden_MH.shape[0], ctx.chunk_tokens):
                end = min(start + ctx.chunk_tokens, hidden_MH.shape[0])
                h_CH = hidden_MH[start:end].to(mm_dtype) / temp
                logp_CV = _scaled_logits(hidden_MH[start:end], w_VH, temp, cdtype).sub_(lse_M[start:end, None])
                p_CV = logp_CV.exp()
                g_lp_C = None
                if grad_lp_M is not None:
                    g_lp_C = torch.where(valid_M[start:end], grad_lp_M[start:end], torch.zeros_like(lse_M[start:end]))
                # dz = -p * coef (+ g_lp at the label, on its rank), coef = g_lp + g_H (log p + H)
                if grad_ent_M is not None:
                    coef = logp_CV.add_(entropy_M[start:end, None]).mul_(grad_ent_M[start:end, None])
                    if g_lp_C is not None:
                        coef.add_(g_lp_C[:, None])
                    g_z_CV = p_CV.mul_(coef).neg_()
                else:
                    g_z_CV = p_CV.mul_(-g_lp_C[:, None])
                if g_lp_C is not None:
                    at_label = torch.where(mine_M[start:end], g_lp_C, torch.zeros_like(g_lp_C))
                    g_z_CV.scatter_add_(-1, safe_M[start:end, None], at_label[:, None])
                g_z_CV = g_z_CV.to(mm_dtype)
                # z = (h / T) @ W.T: dW += dz.T @ (h / T), dh = (dz @ W) / T (partial over tp).
                if need_h:
                    grad_h[start:end] = (g_z_CV @ w_VH).to(cdtype) / temp
                if need_w:
                    grad_w.add_((g_z_CV.T @ h_CH).to(cdtype))
                del logp_CV, p_CV, g_z_CV
        return (grad_h.to(hidden_MH.dtype) if need_h else None,
                grad_w.to(weight_VH.dtype) if need_w else None, *none)


def vocab_parallel_logprobs_entropy(
    hidden_MH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_M: torch.Tensor,
    *,
    vocab_start: int,
    group,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    compute_entropy: bool = True,
    ignore_index: int = -100,
    matmul_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs_M, entropy_M)`` over the whole vocabulary from this rank's slice of the
    LM head (see the module docstring). Collective over ``group``: every rank calls it
    with the same hidden states and labels. ``entropy_M`` is None unless asked for."""
    if not temperature > 0 or chunk_tokens < 1:
        raise AlgorithmInputError(f"vocab_parallel_logprobs_entropy: temperature={temperature!r} must be > 0 "
                                  f"and chunk_tokens={chunk_tokens!r} >= 1")
    if hidden_MH.dim() != 2 or weight_VH.dim() != 2 or hidden_MH.shape[1] != weight_VH.shape[1] \
            or labels_M.shape != hidden_MH.shape[:1]:
        raise AlgorithmInputError(
            "vocab_parallel_logprobs_entropy: need hidden [M, H], weight [Vl, H], labels [M]; got "
            f"{tuple(hidden_MH.shape)}, {tuple(weight_VH.shape)}, {tuple(labels_M.shape)}")
    if matmul_dtype is None and torch.is_autocast_enabled(hidden_MH.device.type):
        matmul_dtype = torch.get_autocast_dtype(hidden_MH.device.type)
    lp, ent = _VocabParallel.apply(hidden_MH, weight_VH, labels_M.long(), int(vocab_start), group,
                                   float(temperature), int(chunk_tokens), bool(compute_entropy),
                                   int(ignore_index), matmul_dtype)
    return lp, (ent if compute_entropy else None)
