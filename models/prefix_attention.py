"""Attention over a prefix tree of packed sequences (tree training / prefix sharing).

Consumes ``q_NHD`` / ``k_NKD`` / ``v_NKD`` over the ``N`` tokens of a packed prefix
tree and a :class:`TreeSeqs`; emits ``out_NHD``. Keyed by nothing: pure functions plus
a one-time kernel check. The tree itself (which tokens are shared) is built by
:mod:`tapioca.trainers.prefix_packing`.

A tree's tokens are cut into **segments** (the tree's nodes: a run of tokens that the
same set of sequences shares, e.g. a GRPO group's prompt, then each sample's answer).
A segment's queries attend to the tokens of its ancestors and to its own tokens
causally: its keys are the ancestors' tokens followed by its own, ``lk = depth at the
segment's end`` keys for ``lq`` queries, and query ``i`` (at depth ``lk - lq + i``) sees
keys ``0 .. lk - lq + i``. That is a causal mask aligned to the bottom-right corner of
the ``[lq, lk]`` block, which is what flash-attention's varlen kernels compute for
``seqlen_q != seqlen_k`` (FA2's documented convention, FA3/FA4 keep it). So every
segment is one entry of ONE varlen call: ``cu_seqlens_q`` over the segments' own
tokens, ``cu_seqlens_k`` over their key lists, and the key / value stream is the K/V of
the packed tokens gathered by ``kv_index_K`` (ancestors' rows, then the segment's own).
The gather's backward sums the gradient of a shared token's K/V over every segment
that reads it, which is exactly the unshared gradient.

Why this and not the alternatives (``docs/trainer-performance.md``):

* FlexAttention block masks express any tree, run on CPU too, but need
  ``torch.compile`` per shape (tens of seconds, dynamic shapes every micro-batch) and a
  block mask rebuilt per micro-batch; the flash varlen kernels (FA2 in PyTorch, FA4)
  need neither.
* "prefix + suffixes, two passes, LSE merge" keeps the kernels too, but needs two
  calls per layer, the LSE (FA2 in PyTorch returns it, its gradient is not supported),
  and one level of sharing only. The gather formulation is one call, any depth.
* Cost of the gather: ``sum over segments of lk`` K/V rows copied per layer (a GRPO
  group of 8 x (1024 + 512): 13.3k rows, ~14 MB per layer at Qwen2.5-1.5B's 2 K/V
  heads in bf16), against attention and GEMM work that drops ~2.4x.

Backends: ``sdpa`` (the reference: segments padded to ``[S, max_q]`` queries and
``[S, max_k]`` keys with the bottom-right causal mask; any device and dtype, the CPU
path), ``varlen`` / ``varlen-expand`` (``torch.nn.attention.varlen``), ``fa4``
(``flash_attn.cute``). :func:`check_tree_backend` runs the chosen kernel once against
``sdpa`` on a small tree (forward and backward) and refuses one that aligns the mask
differently.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..schemas.errors import ConfigError
from .attention import PackedSeqs, kernel_error, packed_seqs, varlen_call
from .attention_fa4 import fa4_varlen


@dataclass
class TreeSeqs(PackedSeqs):
    """A packed prefix tree. The :class:`PackedSeqs` fields describe the query side: one
    "sequence" per segment (``lengths``: its own tokens, ``cu_seqlens_S1``, ``max_len``,
    ``pad_index_N``). The key side: ``lengths_k`` (ancestors' tokens + own, per segment),
    ``cu_seqlens_k_S1``, ``max_len_k``, ``kv_index_K`` (the packed row of every key, in
    segment order) and ``pad_index_K`` (key -> row ``s * max_len_k + j`` of the padded
    view, sdpa). ``n_flat_tokens``: the tokens the same sequences have unshared."""

    cu_seqlens_k_S1: torch.Tensor
    max_len_k: int
    lengths_k: tuple[int, ...]
    kv_index_K: torch.Tensor
    pad_index_K: torch.Tensor
    n_flat_tokens: int

    def attend(self, backend: str, q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``out_NHD`` with a resolved backend (``models/attention.resolve_backend``)."""
        if backend == "sdpa":
            return tree_sdpa_attention(q_NHD, k_NKD, v_NKD, self, scale)
        # The keys of every segment, ancestors first (a copy; its backward sums over readers).
        k_KKD, v_KKD = k_NKD.index_select(0, self.kv_index_K), v_NKD.index_select(0, self.kv_index_K)
        if backend == "fa4":
            return fa4_varlen(q_NHD, k_KKD, v_KKD, self.cu_seqlens_S1, self.cu_seqlens_k_S1,
                              self.max_len, self.max_len_k, scale)
        return _tree_varlen(q_NHD, k_KKD, v_KKD, self, scale, expand_kv=backend == "varlen-expand")


def tree_seqs(q_lengths: Sequence[int], k_lengths: Sequence[int], kv_index_K: torch.Tensor,
              device: torch.device | str, *, n_flat_tokens: int) -> TreeSeqs:
    """:class:`TreeSeqs` of segments with ``q_lengths`` own tokens and ``k_lengths`` keys
    (host ints, ``k >= q >= 1``), keys at packed rows ``kv_index_K`` (host, in order)."""
    k_lengths = tuple(int(n) for n in k_lengths)
    q = packed_seqs(q_lengths, device)
    if len(k_lengths) != q.n_seqs or any(k < n for k, n in zip(k_lengths, q.lengths)):
        raise ValueError(f"tree_seqs: need one key count >= the query count per segment; got "
                         f"{q.lengths} queries and {k_lengths} keys")
    if int(kv_index_K.numel()) != sum(k_lengths):
        raise ValueError(f"tree_seqs: kv_index_K has {kv_index_K.numel()} rows, the segments "
                         f"{sum(k_lengths)} keys")
    k = packed_seqs(k_lengths, device)
    return TreeSeqs(q.cu_seqlens_S1, q.max_len, q.lengths, q.pad_index_N, k.cu_seqlens_S1, k.max_len,
                    k.lengths, kv_index_K.to(device), k.pad_index_N, int(n_flat_tokens))


def tree_sdpa_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
                        seqs: TreeSeqs, scale: float) -> torch.Tensor:
    """Reference: each segment padded to ``max_len`` queries and ``max_len_k`` keys, the
    bottom-right causal mask ``j <= i + lk - lq`` (and ``j < lk``). A padded query row
    (``i >= lq``) sees every real key, so no row is empty (no NaN); it is dropped."""
    n_heads, head_dim = q_NHD.shape[1], q_NHD.shape[2]
    n_kv = k_NKD.shape[1]
    S, Lq, Lk = seqs.n_seqs, seqs.max_len, seqs.max_len_k

    def padded(x_RXD: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:  # [S, X, L, D]
        x = x_RXD.new_zeros(S * length, x_RXD.shape[1], head_dim).index_copy(0, index, x_RXD)
        return x.view(S, length, x_RXD.shape[1], head_dim).transpose(1, 2)

    q = padded(q_NHD, seqs.pad_index_N, Lq)
    k = padded(k_NKD.index_select(0, seqs.kv_index_K), seqs.pad_index_K, Lk)
    v = padded(v_NKD.index_select(0, seqs.kv_index_K), seqs.pad_index_K, Lk)
    if n_kv != n_heads:
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    device = q_NHD.device
    lq_S = torch.tensor(seqs.lengths, device=device)
    lk_S = torch.tensor(seqs.lengths_k, device=device)
    i_Q, j_K = torch.arange(Lq, device=device), torch.arange(Lk, device=device)
    allowed_SQK = ((j_K[None, None, :] <= i_Q[None, :, None] + (lk_S - lq_S)[:, None, None])
                   & (j_K[None, None, :] < lk_S[:, None, None]))
    out_SHQD = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_SQK[:, None], scale=scale)
    return out_SHQD.transpose(1, 2).reshape(S * Lq, n_heads, head_dim).index_select(0, seqs.pad_index_N)


def _tree_varlen(q_NHD: torch.Tensor, k_KKD: torch.Tensor, v_KKD: torch.Tensor, seqs: TreeSeqs,
                 scale: float, *, expand_kv: bool) -> torch.Tensor:
    """One flash varlen call: queries per segment, keys per segment, causal (-1, 0), which
    the kernel aligns bottom-right when a segment has more keys than queries."""
    return varlen_call(q_NHD, k_KKD, v_KKD, seqs.cu_seqlens_S1, seqs.cu_seqlens_k_S1, seqs.max_len,
                       seqs.max_len_k, scale, expand_kv=expand_kv)


def probe_tree(device: str) -> TreeSeqs:
    """A small two-level tree: a 23-token root shared by three sequences, one of which
    shares 6 more tokens with a fourth (segments: root 23; 9; 1; 6 -> 17 and 4)."""
    # Segment rows in the packed stream: root 0..22, a 23..31, b 32, c 33..38, c1 39..55, c2 56..59.
    root, a, b, c = list(range(23)), list(range(23, 32)), [32], list(range(33, 39))
    c1, c2 = list(range(39, 56)), list(range(56, 60))
    kv = root + (root + a) + (root + b) + (root + c) + (root + c + c1) + (root + c + c2)
    return tree_seqs([23, 9, 1, 6, 17, 4], [23, 32, 24, 29, 46, 33], torch.tensor(kv), device,
                     n_flat_tokens=32 + 24 + 46 + 33)


@functools.lru_cache(maxsize=None)
def _tree_kernel_error(backend: str, device: str, dtype: torch.dtype, n_heads: int, n_kv: int,
                       head_dim: int) -> float:
    seqs = probe_tree(device)
    return kernel_error(lambda q, k, v, scale: seqs.attend(backend, q, k, v, scale),
                        lambda q, k, v, scale: tree_sdpa_attention(q, k, v, seqs, scale),
                        seqs.n_tokens, device, dtype, n_heads, n_kv, head_dim)


def check_tree_backend(backend: str, device: torch.device | str, dtype: torch.dtype, n_heads: int,
                       n_kv: int, head_dim: int) -> None:
    """Refuse a kernel that computes the tree mask differently from :func:`tree_sdpa_attention`
    (forward + backward on :func:`probe_tree`, once per shape; sdpa is the reference)."""
    if backend == "sdpa":
        return
    try:
        err = _tree_kernel_error(backend, str(torch.device(device)), dtype, n_heads, n_kv, head_dim)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConfigError(f"actor.enable_tree_training: the {backend} attention kernel fails on a "
                          f"prefix tree ({exc}); set actor.attention_backend=sdpa or "
                          "actor.enable_tree_training=false") from exc
    if err >= 0.05:  # bf16 rounding is ~1e-2 here; a misaligned mask is O(1)
        raise ConfigError(f"actor.enable_tree_training: the {backend} attention kernel differs from the "
                          f"reference on a prefix tree (relative error {err:.3f}: it does not align the "
                          "causal mask bottom-right); set actor.attention_backend=sdpa or "
                          "actor.enable_tree_training=false")
