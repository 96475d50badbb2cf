"""Tests for tapioca.algorithms.logprobs: golden values, and the chunked custom
autograd function against the naive full-logits computation (values and grads)."""

from __future__ import annotations

import math

import pytest
import torch

from tapioca.algorithms.logprobs import (
    entropy_from_logits,
    gather_logprobs_entropy,
    logprobs_from_logits,
)

LN2 = math.log(2.0)


def test_logprobs_from_logits_golden():
    # logits [0, 0, ln2] -> exp [1, 1, 2], sum 4 -> p = [0.25, 0.25, 0.5]
    #   logprob(2) = ln 0.5 = -0.6931472 ; logprob(0) = ln 0.25 = -1.3862944
    #   entropy = -(2 * 0.25 ln 0.25 + 0.5 ln 0.5) = 0.6931472 + 0.3465736 = 1.0397208
    logits = torch.tensor([[[0.0, 0.0, LN2], [0.0, 0.0, LN2]]])
    labels = torch.tensor([[2, 0]])
    lp = logprobs_from_logits(logits, labels)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, torch.tensor([[-0.6931472, -1.3862944]]), atol=1e-6)
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([[1.0397208, 1.0397208]]), atol=1e-6)
    # temperature 2: logits/2 = [0, 0, ln2/2] -> exp [1, 1, sqrt2]; p(2) = sqrt2/(2+sqrt2) = sqrt2 - 1
    #   ln(sqrt2 - 1) = ln(0.4142136) = -0.8813736
    lp_t = logprobs_from_logits(logits, labels, temperature=2.0)
    assert lp_t[0, 0].item() == pytest.approx(-0.8813736, abs=1e-6)


def test_chunked_golden_and_ignore_index():
    # W = I_3 so logits = hidden = [0, 0, ln2]: same golden numbers as above.
    hidden = torch.tensor([[[0.0, 0.0, LN2]] * 3])
    labels = torch.tensor([[2, 0, -100]])
    lp, ent = gather_logprobs_entropy(hidden, torch.eye(3), labels, chunk_tokens=2)
    # ignore_index -> logprob exactly 0, entropy still the distribution's.
    assert torch.allclose(lp, torch.tensor([[-0.6931472, -1.3862944, 0.0]]), atol=1e-6)
    assert torch.allclose(ent, torch.full((1, 3), 1.0397208), atol=1e-6)


def _naive(hidden, weight, labels, temperature):
    logits = hidden.to(torch.promote_types(hidden.dtype, torch.float32)) @ weight.to(
        torch.promote_types(weight.dtype, torch.float32)
    ).T
    return logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)


def _inputs(B, T, H, V, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_(True)
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, V, (B, T), generator=g)
    c_lp = torch.randn(B, T, generator=g, dtype=dtype)
    c_ent = torch.randn(B, T, generator=g, dtype=dtype)
    return hidden, weight, labels, c_lp, c_ent


def _grads(fn, hidden, weight, labels, c_lp, c_ent, temperature, use_lp=True, use_ent=True):
    hidden.grad = weight.grad = None
    lp, ent = fn(hidden, weight, labels, temperature)
    obj = 0.0
    if use_lp:
        obj = obj + (lp * c_lp).sum()
    if use_ent:
        obj = obj + (ent * c_ent).sum()
    obj.backward()
    return lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk_tokens", [1, 3, 4, 7, 1024])  # N = 2*5 = 10: 3, 4, 7 do not divide it
@pytest.mark.parametrize("use_lp,use_ent", [(True, True), (True, False), (False, True)])
def test_chunked_matches_naive_fp64(chunk_tokens, use_lp, use_ent):
    hidden, weight, labels, c_lp, c_ent = _inputs(2, 5, 4, 11)
    labels[1, 3] = -100  # one padding label

    def chunked(h, w, y, t):
        return gather_logprobs_entropy(h, w, y, temperature=t, chunk_tokens=chunk_tokens)

    ref = _grads(_naive, hidden, weight, labels, c_lp, c_ent, 0.7, use_lp, use_ent)
    got = _grads(chunked, hidden, weight, labels, c_lp, c_ent, 0.7, use_lp, use_ent)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float64
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_chunked_matches_naive_fp32():
    hidden, weight, labels, c_lp, c_ent = _inputs(3, 7, 16, 50, dtype=torch.float32, seed=1)

    def chunked(h, w, y, t):
        return gather_logprobs_entropy(h, w, y, temperature=t, chunk_tokens=5)

    ref = _grads(_naive, hidden, weight, labels, c_lp, c_ent, 1.3)
    got = _grads(chunked, hidden, weight, labels, c_lp, c_ent, 1.3)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_gradcheck_fp64():
    hidden, weight, labels, _, _ = _inputs(1, 3, 3, 5, seed=2)

    def fn(h, w):
        lp, ent = gather_logprobs_entropy(h, w, labels, temperature=0.9, chunk_tokens=2)
        return lp, ent

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_compute_entropy_false_and_frozen_weight():
    hidden, weight, labels, c_lp, _ = _inputs(2, 3, 4, 6)
    weight.requires_grad_(False)
    lp, ent = gather_logprobs_entropy(hidden, weight, labels, compute_entropy=False, chunk_tokens=4)
    assert ent is None
    (lp * c_lp).sum().backward()
    ref_lp, _ = _naive(hidden.detach().requires_grad_(True), weight, labels, 1.0)
    assert torch.allclose(lp.detach(), ref_lp.detach())
    assert hidden.grad is not None and weight.grad is None


def test_bf16_inputs_compute_in_fp32():
    hidden, weight, labels, c_lp, c_ent = _inputs(2, 4, 8, 32, dtype=torch.float32, seed=3)
    h16 = hidden.detach().bfloat16().requires_grad_(True)
    w16 = weight.detach().bfloat16().requires_grad_(True)
    lp, ent = gather_logprobs_entropy(h16, w16, labels, chunk_tokens=3)
    # Outputs are fp32; grads come back in the parameters' dtype.
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
    assert h16.grad.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    # Same numbers as the naive fp32 computation on the upcast bf16 values.
    ref_lp, ref_ent = _naive(h16.detach().float(), w16.detach().float(), labels, 1.0)
    assert torch.allclose(lp.detach(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.detach(), ref_ent, atol=1e-5)


def test_under_autocast_matmul_in_bf16_softmax_in_fp32():
    """Under autocast the LM-head matmuls run in bf16 (as an autocast model's head and
    the engine do), but the log-softmax stays fp32: equal to the full-logits reference
    on bf16-rounded logits, with matching gradients. (An ambient autocast used to run
    the forward's exp and sums in bf16 too: ~0.17 nats off.)"""
    hidden, weight, labels, c_lp, c_ent = _inputs(2, 6, 16, 64, dtype=torch.float32, seed=5)
    hidden.data.mul_(3.0)  # logits of a few units, like a trained LM head's
    t = 0.7

    def rounded_logits_ref(h, w, y, temperature):
        z = ((h.bfloat16() / temperature) @ w.bfloat16().T).float()
        return logprobs_from_logits(z, y), entropy_from_logits(z)

    def chunked_autocast(h, w, y, temperature):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gather_logprobs_entropy(h, w, y, temperature=temperature, chunk_tokens=5)

    lp, ent = chunked_autocast(hidden, weight, labels, t)
    ref_lp, ref_ent = rounded_logits_ref(hidden, weight, labels, t)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    # Not the fp32-logits answer: the matmul really ran in bf16.
    fp32_lp, _ = _naive(hidden.detach(), weight.detach(), labels, t)
    assert (lp.detach() - fp32_lp).abs().max() > 1e-3
    got = _grads(chunked_autocast, hidden, weight, labels, c_lp, c_ent, t)
    want = _grads(rounded_logits_ref, hidden, weight, labels, c_lp, c_ent, t)
    for g, w in zip(got, want):  # bf16 products in the backward matmuls: ~1e-2 relative
        assert torch.allclose(g, w, rtol=3e-2, atol=3e-2 * w.abs().max().item())
    # An explicit matmul_dtype outside autocast gives the same numbers.
    lp2, _ = gather_logprobs_entropy(hidden, weight, labels, temperature=t, chunk_tokens=5,
                                     matmul_dtype=torch.bfloat16)
    assert torch.equal(lp2, lp)


def test_no_grad_inference_and_bad_args():
    hidden, weight, labels, _, _ = _inputs(1, 4, 3, 5)
    with torch.no_grad():
        lp, ent = gather_logprobs_entropy(hidden, weight, labels, chunk_tokens=3)
    assert not lp.requires_grad and lp.shape == (1, 4) and ent.shape == (1, 4)
    with pytest.raises(ValueError):
        gather_logprobs_entropy(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError):
        gather_logprobs_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError):
        gather_logprobs_entropy(hidden, weight[:, :2], labels)
