"""Block-diagonal causal attention over packed sequences (no padding in the token stream).

Consumes ``q_NHD`` / ``k_NKD`` / ``v_NKD`` (``N`` packed tokens, ``H`` query heads,
``K`` key/value heads, ``D`` head dim) and a :class:`PackedSeqs` (where each sequence
starts); emits ``out_NHD``: every token attends causally to the tokens of its own
sequence only. Keyed by nothing: pure functions plus a one-time backend probe.

Backends (``attention_backend``):

* ``varlen``: flash-attention's variable-length kernel as PyTorch ships it
  (:func:`torch.nn.attention.varlen.varlen_attn`, PyTorch >= 2.10; CUDA, bf16 / fp16,
  grouped-query attention without repeating K/V). No padding anywhere; cost is
  sum(L_i^2), not S * max(L)^2.
* ``sdpa``: the reference that runs everywhere (CPU CI, fp32 / fp64): the packed
  tokens are scattered into a right-padded ``[S, H, max_len, D]`` view only for the
  attention call, ``scaled_dot_product_attention(is_causal=True)`` runs on it, and the
  real rows are gathered back. Right padding cannot leak into a causal row of real
  tokens, so the result is exact; padded rows are computed and dropped (their gradient
  is zero).
* ``fa4``: FlashAttention-4's CuTe kernels (``pip install flash-attn-4``; Hopper /
  Blackwell, bf16 / fp16; :mod:`tapioca.models.attention_fa4`), behind an import guard.
* ``auto``: ``fa4`` when it imports and its probe passes, else ``varlen`` on CUDA in
  bf16 / fp16 when :func:`probe_varlen` passes, else ``sdpa``.

A :class:`~tapioca.models.prefix_attention.TreeSeqs` (prefix-shared packing) brings its
own segments: :func:`attention` hands it the resolved backend.

Why not flex_attention: its block mask is rebuilt per micro-batch and it must be
compiled (tens of seconds per shape) to be fast; flash varlen needs neither.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..schemas.errors import ConfigError
from .attention_fa4 import fa4_available, fa4_import_error, fa4_varlen

log = logging.getLogger(__name__)

BACKENDS = ("auto", "varlen", "sdpa", "fa4")


@dataclass
class PackedSeqs:
    """Where the packed sequences start. ``cu_seqlens_S1``: ``[S+1]`` int32 offsets on the
    device; ``max_len``: the longest sequence (a host int, as the kernels take it);
    ``pad_index_N``: packed token -> row ``s * max_len + t`` of the padded view (sdpa)."""

    cu_seqlens_S1: torch.Tensor
    max_len: int
    lengths: tuple[int, ...]
    pad_index_N: torch.Tensor

    @property
    def n_seqs(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)


def packed_seqs(lengths: Sequence[int], device: torch.device | str) -> PackedSeqs:
    """:class:`PackedSeqs` of sequences of ``lengths`` (host ints, each >= 1), in order."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"packed_seqs: need at least one sequence, each of length >= 1; got {lengths}")
    max_len = max(lengths)
    lengths_S = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths_S, 0)
    seq_of_token_N = torch.repeat_interleave(torch.arange(len(lengths)), lengths_S)
    pos_N = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1].long(), lengths_S)
    pad_index_N = seq_of_token_N * max_len + pos_N
    return PackedSeqs(cu.to(device), max_len, lengths, pad_index_N.to(device))


def position_ids(lengths: Sequence[int]) -> torch.Tensor:
    """Position ids of packed sequences: ``0..L_i-1`` for each, concatenated (host)."""
    lengths_S = torch.tensor([int(n) for n in lengths])
    starts_S = torch.cumsum(lengths_S, 0) - lengths_S
    return torch.arange(int(lengths_S.sum())) - torch.repeat_interleave(starts_S, lengths_S)


# ------------------------------------------------------------------------- backends

def sdpa_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
                   seqs: PackedSeqs, scale: float) -> torch.Tensor:
    """Reference: padded only inside attention (see the module docstring)."""
    n_tokens, n_heads, head_dim = q_NHD.shape
    n_kv = k_NKD.shape[1]
    S, L = seqs.n_seqs, seqs.max_len
    idx = seqs.pad_index_N

    def padded(x_NXD: torch.Tensor) -> torch.Tensor:  # [S, X, L, D]
        x = x_NXD.new_zeros(S * L, x_NXD.shape[1], head_dim).index_copy(0, idx, x_NXD)
        return x.view(S, L, x_NXD.shape[1], head_dim).transpose(1, 2)

    q, k, v = padded(q_NHD), padded(k_NKD), padded(v_NKD)
    if n_kv != n_heads:  # enable_gqa is not in every SDPA backend: repeat K/V (reference path)
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
    out_SHLD = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out_SHLD.transpose(1, 2).reshape(S * L, n_heads, head_dim).index_select(0, idx)


# Resolved at import (not per call) so torch.compile sees a plain function.
try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # PyTorch < 2.10
    _varlen_attn = None
_VARLEN_TAKES_GQA = _varlen_attn is not None and "enable_gqa" in inspect.signature(_varlen_attn).parameters


def varlen_attention(q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
                     seqs: PackedSeqs, scale: float, *, expand_kv: bool = False) -> torch.Tensor:
    """Flash-attention varlen (CUDA, bf16 / fp16). ``expand_kv`` repeats K/V heads for a
    kernel build without grouped-query support (the probe decides)."""
    cu = seqs.cu_seqlens_S1
    return varlen_call(q_NHD, k_NKD, v_NKD, cu, cu, seqs.max_len, seqs.max_len, scale, expand_kv=expand_kv)


def varlen_call(q_NHD: torch.Tensor, k_KKD: torch.Tensor, v_KKD: torch.Tensor, cu_q_S1: torch.Tensor,
                cu_k_S1: torch.Tensor, max_q: int, max_k: int, scale: float, *,
                expand_kv: bool = False) -> torch.Tensor:
    """One causal ``varlen_attn`` call; queries and keys may have their own offsets (the
    kernel aligns the causal mask bottom-right where a sequence has more keys)."""
    if _varlen_attn is None:
        raise ConfigError("attention_backend=varlen needs torch.nn.attention.varlen "
                          "(PyTorch >= 2.10); use attention_backend=sdpa")
    n_heads, n_kv = q_NHD.shape[1], k_KKD.shape[1]
    if expand_kv and n_kv != n_heads:
        k_KKD = k_KKD.repeat_interleave(n_heads // n_kv, dim=1)
        v_KKD = v_KKD.repeat_interleave(n_heads // n_kv, dim=1)
    # window (-1, 0) is causal in every version of the API (2.10 has no is_causal flag);
    # 2.12+ asks for enable_gqa when K/V have fewer heads, 2.10-2.11 take GQA as it is.
    if _VARLEN_TAKES_GQA and k_KKD.shape[1] != n_heads:
        return _varlen_attn(q_NHD.contiguous(), k_KKD.contiguous(), v_KKD.contiguous(), cu_q_S1, cu_k_S1,
                            max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=True)
    return _varlen_attn(q_NHD.contiguous(), k_KKD.contiguous(), v_KKD.contiguous(), cu_q_S1, cu_k_S1,
                        max_q, max_k, scale=scale, window_size=(-1, 0))


def kernel_error(kernel, reference, n_tokens: int, device: str, dtype: torch.dtype, n_heads: int,
                 n_kv: int, head_dim: int) -> float:
    """Max relative error of ``kernel(q, k, v, scale)`` (forward and the three input
    gradients) against ``reference`` run in fp32, on seeded random inputs of
    ``n_tokens`` packed tokens. Raises what the kernel raises."""
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(n_tokens, n, head_dim) for n in (n_heads, n_kv, n_kv)]
    q, k, v = (torch.randn(s, device=device, dtype=dtype, generator=gen).requires_grad_() for s in shapes)
    g = torch.randn(n_tokens, n_heads, head_dim, device=device, dtype=dtype, generator=gen)
    scale = head_dim ** -0.5
    ref = reference(q.float(), k.float(), v.float(), scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.float())
    out = kernel(q, k, v, scale)
    grads = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    return max(float((a.detach().float() - b.detach()).abs().max() / (b.detach().abs().max() + 1e-6))
               for a, b in zip((out, *grads), (ref, *ref_grads)))


@functools.lru_cache(maxsize=None)
def probe_varlen(device: str, dtype: torch.dtype, n_heads: int, n_kv: int, head_dim: int) -> str:
    """Which varlen variant works here: ``"gqa"`` (native grouped-query), ``"expand"``
    (K/V repeated), or ``""`` (none: use sdpa). Runs forward + backward once on a
    small packed batch against :func:`sdpa_attention` (a few ms, once per shape)."""
    if not str(device).startswith("cuda") or dtype not in (torch.bfloat16, torch.float16):
        return ""
    if _varlen_attn is None:
        return ""
    seqs = packed_seqs([37, 5, 64], device)
    for variant in ("gqa", "expand") if n_kv != n_heads else ("gqa",):
        try:
            err = kernel_error(
                lambda q, k, v, scale: varlen_attention(q, k, v, seqs, scale, expand_kv=variant == "expand"),
                lambda q, k, v, scale: sdpa_attention(q, k, v, seqs, scale),
                seqs.n_tokens, device, dtype, n_heads, n_kv, head_dim)
        except (RuntimeError, ValueError, TypeError):
            continue
        if err < 0.05:  # bf16 rounding is ~1e-2 at most here
            return variant
    return ""


@functools.lru_cache(maxsize=None)
def probe_fa4(device: str, dtype: torch.dtype, n_heads: int, n_kv: int, head_dim: int) -> bool:
    """FA4 runs forward + backward on a small packed batch and agrees with sdpa (once per
    shape; the first call compiles the kernels, seconds). Here, not in attention_fa4.py:
    the probe is this module's (kernel_error, packed_seqs, sdpa_attention), and FA4's
    module imports nothing of this one."""
    if not fa4_available(device, dtype):
        return False
    seqs = packed_seqs([37, 5, 64], device)
    cu = seqs.cu_seqlens_S1
    try:
        err = kernel_error(lambda q, k, v, scale: fa4_varlen(q, k, v, cu, cu, seqs.max_len, seqs.max_len, scale),
                           lambda q, k, v, scale: sdpa_attention(q, k, v, seqs, scale),
                           seqs.n_tokens, device, dtype, n_heads, n_kv, head_dim)
    except Exception as exc:  # a kernel the DSL cannot build for this shape / GPU
        log.warning("attention_backend fa4 does not run at %d/%d heads x %d: %s", n_heads, n_kv, head_dim, exc)
        return False
    return err < 0.05


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype, n_heads: int,
                    n_kv: int, head_dim: int) -> str:
    """The backend that will run: ``fa4`` / ``varlen`` / ``varlen-expand`` / ``sdpa``. ``dtype`` is
    the dtype attention runs in (the autocast dtype, or the parameters')."""
    if name not in BACKENDS:
        raise ConfigError(f"attention_backend={name!r}: use one of {', '.join(BACKENDS)}")
    if name == "sdpa":
        return "sdpa"
    if name in ("auto", "fa4"):
        if probe_fa4(str(torch.device(device)), dtype, n_heads, n_kv, head_dim):
            return "fa4"
        if name == "fa4":
            why = fa4_import_error() or "it needs CUDA (Hopper / Blackwell) and bf16 / fp16, and its probe failed"
            raise ConfigError(f"attention_backend=fa4 does not run here (device {device}, {dtype}): {why}; "
                              "pip install flash-attn-4, or use attention_backend=auto / varlen / sdpa")
    variant = probe_varlen(str(torch.device(device)), dtype, n_heads, n_kv, head_dim)
    if variant:
        return "varlen" if variant == "gqa" else "varlen-expand"
    if name == "varlen":
        raise ConfigError(
            f"attention_backend=varlen does not run here (device {device}, {dtype}, PyTorch "
            f"{torch.__version__}): it needs CUDA, bf16 / fp16 (set autocast_dtype or "
            "param_dtype bfloat16) and torch.nn.attention.varlen; or use attention_backend=sdpa")
    return "sdpa"


def attention(backend: str, q_NHD: torch.Tensor, k_NKD: torch.Tensor, v_NKD: torch.Tensor,
              seqs: PackedSeqs, scale: float) -> torch.Tensor:
    """Dispatch to a resolved backend (:func:`resolve_backend`)."""
    attend = getattr(seqs, "attend", None)
    if attend is not None:  # a prefix tree (models/prefix_attention.py): its own segments
        return attend(backend, q_NHD, k_NKD, v_NKD, scale)
    if backend == "fa4":
        cu = seqs.cu_seqlens_S1
        return fa4_varlen(q_NHD, k_NKD, v_NKD, cu, cu, seqs.max_len, seqs.max_len, scale)
    if backend == "sdpa":
        return sdpa_attention(q_NHD, k_NKD, v_NKD, seqs, scale)
    return varlen_attention(q_NHD, k_NKD, v_NKD, seqs, scale, expand_kv=backend == "varlen-expand")
