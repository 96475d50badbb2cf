"""Vectorised next-token sampling for a batch of rows with per-row parameters.

Consumes the last-position logits ``logits_BV`` of a batch and per-row sampling
parameters; emits the sampled tokens ``tok_B`` and their behaviour logprobs ``logp_B``
under the convention of :mod:`tapioca.engines.base` (full-vocabulary
``log_softmax(logits / T)`` in fp32, T = 1 for greedy rows). No Python loop over rows
and no host sync: the engine syncs once per step, elsewhere.

The draws come from a ``torch.Generator`` (TorchEngine), or, given per-row keys
(``seed_B``, ``counter_B``: the paged engine's request seed and token position), from a
counter-based hash of each row's own key (:func:`tapioca.engines.kernels.reference.row_uniform`),
so a row's draw does not depend on the batch (docs/provenance.md). :func:`request_seed`
derives a request's seed from stable names (the run's seed and a trajectory id).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from .base import SamplingParams
from .kernels.reference import row_uniform

#: Request seeds are 63-bit non-negative integers (they fit an int64 tensor and JSON).
SEED_BITS = 63


def request_seed(*parts: object) -> int:
    """A request's sampling seed from stable names (e.g. the run's seed and the
    trajectory id): the same names give the same seed on any machine and in any process
    (blake2b, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


@dataclass
class RowParams:
    """Per-row sampling parameters as device tensors (one entry per batch row)."""

    temperature_B: torch.Tensor  # float32; 0 = greedy
    top_p_B: torch.Tensor  # float32; 1 = off
    top_k_B: torch.Tensor  # int64; 0 = off
    all_greedy: bool  # host-side summaries, so the common cases skip work
    any_filter: bool

    @classmethod
    def build(cls, temperatures: list[float], top_ps: list[float], top_ks: list[int], device) -> "RowParams":
        return cls(
            temperature_B=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_p_B=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_k_B=torch.tensor(top_ks, dtype=torch.int64, device=device),
            all_greedy=all(t == 0 for t in temperatures),
            any_filter=any(
                t > 0 and (p < 1 or k > 0) for t, p, k in zip(temperatures, top_ps, top_ks)
            ),
        )

    @classmethod
    def from_sampling(cls, sampling: Sequence[SamplingParams], device) -> "RowParams":
        temperatures = [s.temperature for s in sampling]
        return cls.build(temperatures, [s.top_p for s in sampling], [s.top_k for s in sampling], device)


def sample_next(
    logits_BV: torch.Tensor, params: RowParams, generator: torch.Generator | None = None, *,
    seed_B: torch.Tensor | None = None, counter_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ``(tok_B int64, logp_B float32)``. With
    ``seed_B`` and ``counter_B`` (int64 ``[B]``), each row's uniform comes from its own
    key (no generator): a row draws the same whatever else is in the batch."""
    u_B1 = None
    if seed_B is not None:
        u_B1 = row_uniform(seed_B, counter_B).unsqueeze(-1)
    logits_BV = logits_BV.float()
    greedy_B = params.temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(params.temperature_B), params.temperature_B)
    scaled_BV = logits_BV / temp_B.unsqueeze(-1)
    logp_BV = torch.log_softmax(scaled_BV, dim=-1)

    argmax_B = logits_BV.argmax(dim=-1)
    if params.all_greedy:
        tok_B = argmax_B
    else:
        if params.any_filter:
            tok_B = _sample_filtered(scaled_BV, params, generator, u_B1)
        else:
            tok_B = _inverse_cdf(logp_BV.exp(), generator, u_B1)
        tok_B = torch.where(greedy_B, argmax_B, tok_B)
    logp_B = logp_BV.gather(-1, tok_B.unsqueeze(-1)).squeeze(-1)
    return tok_B, logp_B


def _inverse_cdf(probs_BV: torch.Tensor, generator: torch.Generator | None,
                 u_B1: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row from (unnormalised) ``probs_BV`` by inverse CDF.

    Not the exponential-race / Gumbel trick: with fp32 uniforms an Exp(1) draw is exactly
    0 with probability ~2^-24 per entry, i.e. ~1% per step over a 150k vocabulary, and
    that entry wins whatever its probability. One uniform per row has no such tail. The
    cumsum is fp64 so that mass is not shifted between tokens by rounding; zero-prob
    entries have empty intervals and are never drawn.
    """
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    if u_B1 is None:
        u_B1 = torch.rand(probs_BV.shape[0], 1, device=probs_BV.device, dtype=torch.float64, generator=generator)
    u_B1 = u_B1.to(cdf_BV.device) * cdf_BV[:, -1:]
    pick_B = torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(-1)
    return pick_B.clamp_(max=probs_BV.shape[-1] - 1)


def _sample_filtered(
    scaled_BV: torch.Tensor, params: RowParams, generator: torch.Generator | None,
    u_B1: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k then top-p (on the renormalised top-k distribution), sampled in sorted order."""
    vocab = scaled_BV.shape[-1]
    sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=scaled_BV.device)
    top_k_B = params.top_k_B
    drop_BV = (top_k_B > 0).unsqueeze(-1) & (rank_V.unsqueeze(0) >= top_k_B.unsqueeze(-1))
    sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    # Keep a token while the mass strictly before it is < top_p: the top token always stays.
    mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV
    drop_BV = mass_before_BV >= params.top_p_B.unsqueeze(-1)
    probs_BV = probs_BV.masked_fill(drop_BV, 0.0)
    pick_B = _inverse_cdf(probs_BV, generator, u_B1)
    return order_BV.gather(-1, pick_B.unsqueeze(-1)).squeeze(-1)
