"""Per-token KL estimators between the policy and a reference policy.

Consumes per-token log-probabilities of the sampled tokens under the policy
(``logp_BT``) and under the reference (``ref_logp_BT``), same shape; emits a
per-token estimate of ``KL(pi || pi_ref)`` of that shape (Schulman's k1/k2/k3,
http://joschu.net/blog/kl-approx.html). Masking and aggregation are the caller's
job (see ``tapioca.algorithms.aggregation``).

With ``log_r = ref_logp - logp`` (the log of ``pi_ref / pi`` at the sampled token):

* ``k1 = -log_r = logp - ref_logp``: unbiased, high variance, can be negative.
* ``k2 = 0.5 * log_r**2``: biased, low variance, always >= 0.
* ``k3 = exp(log_r) - log_r - 1``: unbiased, always >= 0.

No clamping: ``k3`` overflows to ``inf`` for ``log_r`` above ~88 in fp32. Callers
that want verl-style safety clamp the log-ratio before calling.
"""

from __future__ import annotations

import torch

from .errors import AlgorithmInputError

#: Valid values of ``kl_estimate(kind=...)``.
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate of kind ``"k1"``, ``"k2"`` or ``"k3"``; differentiable in both inputs."""
    if kind not in KL_KINDS:
        raise AlgorithmInputError(f"kl_estimate: unknown kind {kind!r}; use one of {', '.join(KL_KINDS)}.")
    if logp_BT.shape != ref_logp_BT.shape:
        raise AlgorithmInputError(
            f"kl_estimate: shapes differ, logp {tuple(logp_BT.shape)} vs ref {tuple(ref_logp_BT.shape)}."
        )
    if kind == "k1":
        return logp_BT - ref_logp_BT
    log_r = ref_logp_BT - logp_BT
    if kind == "k2":
        return 0.5 * log_r.square()
    # expm1 keeps k3 accurate when log_r is tiny (exp(x) - 1 - x cancels badly).
    return torch.expm1(log_r) - log_r
