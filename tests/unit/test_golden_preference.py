"""Golden numeric tests for tapioca.algorithms.preference and tapioca.algorithms.supervised.

Expected values are derived by hand in the comments from the formulas (TRL's):
  DPO   logits = (pi_c - pi_r) - (ref_c - ref_r)
        sigmoid: loss = -(1-ls) log σ(β logits) - ls log σ(-β logits)
        ipo:     loss = (logits - 1/(2β))²
        rewards  r_c = β (pi_c - ref_c), r_r = β (pi_r - ref_r)
  BT    loss = -log σ(r_c - r_r) [+ coef (r_c + r_r)²]
  SFT   nll = -Σ mask·logp / Σ mask   (0 when nothing is masked in)
  KD    KL(p‖q) = Σ p (log p - log q), p = softmax(z_t/τ), q = softmax(z_s/τ)
with log σ(x) = -log(1 + e^-x). Constants used below:
  log(1 + e^-1) = 0.3132616875,  log(1 + e) = 1 + log(1 + e^-1) = 1.3132616875
  log(1 + e^-2) = 0.1269280110,  σ(-1) = 0.2689414214,  σ(-2) = 0.1192029220
  log 2 = 0.6931471806, log 1.5 = 0.4054651081
"""

from __future__ import annotations

import math

import pytest
import torch

from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.preference import bradley_terry_loss, dpo_loss
from tapioca.algorithms.supervised import (
    forward_kl_from_hidden,
    forward_kl_from_logits,
    masked_nll,
    sequence_logprobs,
)

LN2 = 0.6931471806


def _t(values, requires_grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)


def _close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, _t(expected), atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- DPO


def test_dpo_sigmoid_value_rewards_and_gradient():
    # pi_c=-1, pi_r=-3, ref_c=ref_r=-2, β=0.5:
    #   logits = (-1 + 3) - (-2 + 2) = 2;  β·logits = 1
    #   loss = -log σ(1) = log(1 + e^-1) = 0.3132616875
    #   r_c = 0.5 (-1 + 2) = 0.5;  r_r = 0.5 (-3 + 2) = -0.5
    #   d loss / d pi_c = -β σ(-β logits) = -0.5 · 0.2689414214 = -0.1344707107; d/d pi_r = +0.1344707107
    pc, pr = _t([-1.0], True), _t([-3.0], True)
    loss, rc, rr = dpo_loss(pc, pr, _t([-2.0]), _t([-2.0]), beta=0.5)
    assert loss.item() == pytest.approx(0.3132616875, abs=1e-9)
    assert rc.item() == pytest.approx(0.5) and rr.item() == pytest.approx(-0.5)
    loss.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.1344707107, abs=1e-9)
    assert pr.grad.item() == pytest.approx(0.1344707107, abs=1e-9)


def test_dpo_sigmoid_label_smoothing():
    # Same pair, ls = 0.1: loss = 0.9 log(1 + e^-1) + 0.1 log(1 + e)
    #   = 0.9 · 0.3132616875 + 0.1 · 1.3132616875 = 0.2819355188 + 0.1313261688 = 0.4132616875
    loss, _, _ = dpo_loss(_t([-1.0]), _t([-3.0]), _t([-2.0]), _t([-2.0]), beta=0.5, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.4132616875, abs=1e-9)


def test_dpo_chosen_equals_rejected_is_log2_for_sigmoid_and_target_squared_for_ipo():
    # chosen == rejected: logits = 0.
    #   sigmoid: -log σ(0) = log 2 = 0.6931471806, rewards 0 (policy == reference)
    #   ipo, β = 0.5: (0 - 1/(2·0.5))² = 1;  β = 0.1: (0 - 5)² = 25
    same = _t([-2.0, -7.0])
    loss, rc, rr = dpo_loss(same, same, same, same, beta=0.5)
    assert loss.tolist() == pytest.approx([LN2, LN2], abs=1e-9)
    assert rc.tolist() == [0.0, 0.0] and rr.tolist() == [0.0, 0.0]
    ipo, _, _ = dpo_loss(same, same, same, same, beta=0.5, loss_type="ipo")
    assert ipo.tolist() == pytest.approx([1.0, 1.0])
    ipo01, _, _ = dpo_loss(same, same, same, same, beta=0.1, loss_type="ipo")
    assert ipo01.tolist() == pytest.approx([25.0, 25.0])


def test_dpo_ipo_value_and_gradient():
    # pi_c=-1, pi_r=-3, refs 0 -> logits = 2.
    #   β = 0.5: target 1/(2β) = 1, loss = (2 - 1)² = 1, d/d pi_c = 2 (2 - 1) = 2, d/d pi_r = -2
    #   β = 0.1: target 5, loss = (2 - 5)² = 9
    pc, pr = _t([-1.0], True), _t([-3.0], True)
    loss, _, _ = dpo_loss(pc, pr, _t([0.0]), _t([0.0]), beta=0.5, loss_type="ipo")
    assert loss.item() == pytest.approx(1.0)
    loss.sum().backward()
    assert pc.grad.item() == pytest.approx(2.0) and pr.grad.item() == pytest.approx(-2.0)
    loss9, _, _ = dpo_loss(_t([-1.0]), _t([-3.0]), _t([0.0]), _t([0.0]), beta=0.1, loss_type="ipo")
    assert loss9.item() == pytest.approx(9.0)


def test_dpo_extreme_margins_stay_finite():
    # β = 1, refs 0.
    #   pi_c=-1000, pi_r=0: logits = -1000, loss = -log σ(-1000) = 1000 + log(1 + e^-1000) = 1000
    #   pi_c=0, pi_r=-1000: logits = +1000, loss = log(1 + e^-1000) = 0 (e^-1000 underflows)
    #   gradient of the first: -β σ(1000) = -1 for pi_c (not NaN)
    pc = _t([-1000.0, 0.0], True)
    loss, _, _ = dpo_loss(pc, _t([0.0, -1000.0]), _t([0.0, 0.0]), _t([0.0, 0.0]), beta=1.0)
    assert loss.tolist() == pytest.approx([1000.0, 0.0], abs=1e-9)
    loss.sum().backward()
    assert torch.isfinite(pc.grad).all()
    assert pc.grad[0].item() == pytest.approx(-1.0)
    # IPO, β = 0.5, logits = 1000: (1000 - 1)² = 998001
    ipo, _, _ = dpo_loss(_t([0.0]), _t([-1000.0]), _t([0.0]), _t([0.0]), beta=0.5, loss_type="ipo")
    assert ipo.item() == pytest.approx(998001.0)


def test_dpo_rejects_bad_arguments():
    x = _t([0.0])
    with pytest.raises(AlgorithmInputError, match="loss_type"):
        dpo_loss(x, x, x, x, loss_type="hinge")
    with pytest.raises(AlgorithmInputError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(AlgorithmInputError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(AlgorithmInputError, match="shape"):
        dpo_loss(_t([0.0, 1.0]), x, x, x)


# ----------------------------------------------------------------------------- Bradley-Terry


def test_bradley_terry_value_accuracy_and_gradient():
    # r_c = 2, r_r = 0: loss = -log σ(2) = log(1 + e^-2) = 0.1269280110, correct
    #   d/d r_c = -σ(-2) = -0.1192029220, d/d r_r = +0.1192029220
    # r_c = r_r = 0.7 (tie): log 2, counted wrong
    # r_c = -50, r_r = 50: margin -100, loss = 100 + log(1 + e^-100) = 100, wrong
    rc, rr = _t([2.0, 0.7, -50.0], True), _t([0.0, 0.7, 50.0], True)
    loss, correct = bradley_terry_loss(rc, rr)
    assert loss.tolist() == pytest.approx([0.1269280110, LN2, 100.0], abs=1e-9)
    assert correct.tolist() == [True, False, False]
    loss.sum().backward()
    assert rc.grad[0].item() == pytest.approx(-0.1192029220, abs=1e-9)
    assert rr.grad[0].item() == pytest.approx(0.1192029220, abs=1e-9)
    assert torch.isfinite(rc.grad).all()


def test_bradley_terry_center_rewards():
    # coef 0.01, r_c = 2, r_r = 0: 0.1269280110 + 0.01 · (2 + 0)² = 0.1669280110
    loss, _ = bradley_terry_loss(_t([2.0]), _t([0.0]), center_rewards_coefficient=0.01)
    assert loss.item() == pytest.approx(0.1669280110, abs=1e-9)


# ----------------------------------------------------------------------------- SFT NLL


def test_masked_nll_trains_only_masked_tokens():
    # logprobs [[-inf, -2, -3], [-4, -5, NaN]], mask [[0,1,1],[1,0,0]]:
    #   trained -2, -3, -4 -> nll = (2 + 3 + 4) / 3 = 3.0
    #   d nll / d logp = -1/3 at trained positions, 0 elsewhere (the -inf / NaN never leak)
    lp = _t([[-math.inf, -2.0, -3.0], [-4.0, -5.0, math.nan]], True)
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    loss = masked_nll(lp, mask)
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    third = -1.0 / 3.0
    _close(lp.grad, [[0.0, third, third], [third, 0.0, 0.0]])


def test_masked_nll_fully_masked_is_zero_with_zero_grad():
    lp = _t([[-1.0, -2.0]], True)
    loss = masked_nll(lp, torch.zeros(1, 2, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]


def test_sequence_logprobs_sum_and_average():
    # rows [-1,-2,-3] mask [0,1,1] -> sum -5, mean -2.5; [-4,-5,-6] mask [1,0,0] -> -4, -4;
    # an all-masked row -> 0 either way
    lp = _t([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert sequence_logprobs(lp, mask).tolist() == pytest.approx([-5.0, -4.0, 0.0])
    assert sequence_logprobs(lp, mask, average=True).tolist() == pytest.approx([-2.5, -4.0, 0.0])


# ----------------------------------------------------------------------------- forward KL


def test_forward_kl_from_logits_by_hand():
    # token 0: teacher z = [log 3, 0] -> p = [3/4, 1/4]; student z = [0, 0] -> q = [1/2, 1/2]
    #   KL = 3/4 log(1.5) + 1/4 log(0.5) = 0.75·0.4054651081 - 0.25·0.6931471806 = 0.1308120361
    # token 1: identical logits -> 0
    # d KL / d z_s = q - p = [-0.25, 0.25] (τ = 1), and 0 for token 1
    zs = _t([[0.0, 0.0], [1.0, 2.0]], True)
    zt = _t([[math.log(3.0), 0.0], [1.0, 2.0]])
    kl = forward_kl_from_logits(zs, zt)
    assert kl.tolist() == pytest.approx([0.1308120361, 0.0], abs=1e-9)
    kl.sum().backward()
    _close(zs.grad, [[-0.25, 0.25], [0.0, 0.0]])
    # τ = 2 with both logits doubled gives the same distributions, so the same KL
    kl2 = forward_kl_from_logits(2 * zs.detach(), 2 * zt, temperature=2.0)
    assert kl2[0].item() == pytest.approx(0.1308120361, abs=1e-9)


def test_forward_kl_from_hidden_by_hand():
    # Identity heads: logits = hidden. Student h = [1, 1] (uniform q), teacher h = [log 3, 0].
    #   KL = 0.1308120361 as above; d KL / d h_s = (q - p) W = [-0.25, 0.25]
    #   d KL / d W_s = (q - p)ᵀ h_s = [[-0.25, -0.25], [0.25, 0.25]]
    hs = _t([[1.0, 1.0]], True)
    ws = torch.eye(2, dtype=torch.float64, requires_grad=True)
    kl = forward_kl_from_hidden(hs, ws, _t([[math.log(3.0), 0.0]]), torch.eye(2, dtype=torch.float64))
    assert kl.item() == pytest.approx(0.1308120361, abs=1e-9)
    kl.sum().backward()
    _close(hs.grad, [[-0.25, 0.25]])
    _close(ws.grad, [[-0.25, -0.25], [0.25, 0.25]])


def test_forward_kl_extreme_logits_finite():
    # teacher z = [1000, 0] -> p = [1, e^-1000 = 0]; student z = [0, 1000] -> log q_0 = -1000
    #   KL = 1 · (0 - (-1000)) = 1000; gradient q - p = [0 - 1, 1 - 0] = [-1, 1]
    hs = _t([[0.0, 1000.0]], True)
    kl = forward_kl_from_hidden(hs, torch.eye(2, dtype=torch.float64), _t([[1000.0, 0.0]]),
                                torch.eye(2, dtype=torch.float64))
    assert kl.item() == pytest.approx(1000.0)
    kl.sum().backward()
    _close(hs.grad, [[-1.0, 1.0]])


def test_forward_kl_chunked_matches_reference_and_gradcheck():
    # Not golden: the chunked autograd function against the plain-autograd reference
    # (values for any chunk size, and gradcheck of the hand-written backward).
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    ws = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    ht = torch.randn(7, 3, dtype=torch.float64, generator=g)
    wt = torch.randn(11, 3, dtype=torch.float64, generator=g)
    ref = forward_kl_from_logits(hs @ ws.T / 1.5, ht @ wt.T / 1.5)
    for chunk in (1, 3, 100):
        got = forward_kl_from_hidden(hs, ws, ht, wt, temperature=1.5, chunk_tokens=chunk)
        torch.testing.assert_close(got, ref)
    assert torch.autograd.gradcheck(
        lambda h, w: forward_kl_from_hidden(h, w, ht, wt, temperature=1.5, chunk_tokens=3), (hs, ws))
    with pytest.raises(AlgorithmInputError, match="vocabulary|head"):
        forward_kl_from_hidden(hs, ws, ht, wt[:5])
