"""Golden numeric tests for the policy losses, filters and aggregation modes.

Every expected value is written here and derived by hand in the comment above it
from the formula in the module docstrings (tapioca.algorithms.policy_losses,
rejection_sampling, prox_logp, aggregation); the decimals come from evaluating
those formulas by hand/calculator, never from running the code under test.

Common set-up unless stated: prox = 0 and logp = log r, so r = pi_theta/pi_prox is
chosen directly; behav = prox gives w = 1; float64; one row = one sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from tapioca.algorithms.aggregation import agg_units, aggregate_loss
from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.policy_losses import policy_loss
from tapioca.algorithms.prox_logp import loglinear_alpha, loglinear_prox_logprobs
from tapioca.algorithms.rejection_sampling import (
    RejectionSampling,
    behaviour_weight,
    binary_kl,
    m2po_keep_flat,
)

LN2 = math.log(2.0)
LN4 = math.log(4.0)
D = torch.float64


def t(rows, requires_grad=False, dtype=D):
    return torch.tensor(rows, dtype=dtype, requires_grad=requires_grad)


def ones_mask(rows):
    return torch.ones(len(rows), len(rows[0]), dtype=torch.bool)


# ----------------------------------------------------------------------------------
# Aggregation modes
# ----------------------------------------------------------------------------------

AGG_LOSS = [[1.0, 2.0, 3.0, math.nan], [5.0, 6.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]]
AGG_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("mode, expected, units", [
    # unmasked: row0 1,2,3 (NaN masked), row1 5,6; row2 fully masked.
    # token-mean: (1+2+3+5+6)/5 = 17/5
    ("token-mean", 3.4, 5),
    # row sums 6 and 11; 2 non-empty rows: (6+11)/2
    ("seq-mean-token-sum", 8.5, 2),
    # row means 2 and 5.5: (2+5.5)/2
    ("seq-mean-token-mean", 3.75, 2),
    # row sums / max_tokens=4: 1.5 and 2.75: (1.5+2.75)/2
    ("seq-mean-token-sum-norm", 2.125, 2),
])
def test_aggregation_modes(mode, expected, units):
    loss = t(AGG_LOSS, requires_grad=True)
    mask = t(AGG_MASK).bool()
    out = aggregate_loss(loss, mask, mode, max_tokens=4)
    assert out.item() == pytest.approx(expected, abs=1e-12)
    assert agg_units(mask, mode) == units
    out.backward()
    # d/d loss: token-mean 1/5 each; seq-mean-token-sum 1/2; seq-mean-token-mean
    # 1/(2*3) on row0, 1/(2*2) on row1; -norm 1/(2*4); masked positions 0 (no NaN).
    per_row = {"token-mean": (0.2, 0.2), "seq-mean-token-sum": (0.5, 0.5),
               "seq-mean-token-mean": (1 / 6, 0.25), "seq-mean-token-sum-norm": (0.125, 0.125)}[mode]
    row_scale = torch.tensor([[per_row[0]], [per_row[1]], [0.0]], dtype=D)
    expected_grad = torch.tensor(AGG_MASK, dtype=D) * row_scale
    assert torch.allclose(loss.grad, expected_grad)


def test_aggregation_empty_mask_is_zero():
    loss = t([[1.0, 2.0]], requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = aggregate_loss(loss, torch.zeros(1, 2, dtype=torch.bool), mode, max_tokens=3)
        assert out.item() == 0.0
        assert agg_units(torch.zeros(1, 2, dtype=torch.bool), mode) == 0


# ----------------------------------------------------------------------------------
# Decoupled PPO: clip-higher asymmetry (dual clip: tests/unit/test_algorithms_ppo.py)
# ----------------------------------------------------------------------------------

def test_clip_higher_is_asymmetric():
    # eps_clip 0.2, eps_clip_higher 0.28: band [0.8, 1.28].
    #  A=-1 r=0.7 : max(0.7, 0.8) = 0.8  (lower bound unchanged by clip-higher) clipped
    #  A=+1 r=1.25: max(-1.25, -1.25) = -1.25  unclipped (symmetric 0.2 would give -1.2)
    # token-mean (0.8 - 1.25)/2 = -0.225; grad: token 1 clipped -> 0, token 2 -A r /2 = -0.625
    logp = t([[math.log(0.7), math.log(1.25)]], requires_grad=True)
    zeros = torch.zeros_like(logp)
    adv = t([[-1.0, 1.0]])
    loss, stats = policy_loss(logp, zeros, zeros, adv, ones_mask([[0, 0]]), eps_clip=0.2,
                              eps_clip_higher=0.28)
    assert loss.item() == pytest.approx(-0.225, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(logp.grad, t([[0.0, -0.625]]))


# ----------------------------------------------------------------------------------
# GSPO (importance_sampling_level = sequence)
# ----------------------------------------------------------------------------------

def _gspo_inputs():
    # row0: log r = [ln2, 0], A = [1, 1]       -> s0 = exp(ln2/2) = sqrt2 = 1.41421356, A0 = 1
    # row1: log r = [ln0.25, 0, 0, (masked)], A = [3, 0, 0, x]
    #                                          -> s1 = 0.25^(1/3) = 0.62996052, A1 = 1
    logp = t([[LN2, 0.0, 0.0, 0.0], [math.log(0.25), 0.0, 0.0, 123.0]], requires_grad=True)
    zeros = torch.zeros(2, 4, dtype=D)
    adv = t([[1.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, -50.0]])
    mask = t([[1, 1, 0, 0], [1, 1, 1, 0]]).bool()
    return logp, zeros, adv, mask


def test_gspo_sequence_ratio_matches_paper_with_seq_mean():
    # eps 0.2 / eps_high 0.5: band [0.8, 1.5]; both s unclipped (A > 0, s0 < 1.5; s1 < 1
    # only clips for A < 0). pg per token = -A_i s_i.
    # seq-mean-token-mean = (-s0 - s1)/2 = -(1.41421356 + 0.62996052)/2 = -1.02208704
    logp, zeros, adv, mask = _gspo_inputs()
    loss, stats = policy_loss(logp, zeros, zeros, adv, mask, eps_clip=0.2, eps_clip_higher=0.5,
                              importance_sampling_level="sequence", agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.0220870437, abs=1e-9)
    assert stats["clip_ratio"] == 0.0
    # ratio_mean over the 5 tokens: (2 s0 + 3 s1)/5 = (2.82842712 + 1.88988157)/5 = 0.94366174
    assert stats["ratio_mean"] == pytest.approx(0.9436617399, abs=1e-9)
    loss.backward()
    # d/dlogp_t of -s_i/2 with ds_i/dlogp_t = s_i/|y_i|: row0 -s0/4 = -0.35355339,
    # row1 -s1/6 = -0.10499342; masked tokens 0.
    expected = t([[-0.3535533906, -0.3535533906, 0.0, 0.0],
                  [-0.1049934208, -0.1049934208, -0.1049934208, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-9)


def test_gspo_token_mean_weights_by_length():
    # token-mean of the broadcast per-token losses: (2*(-s0) + 3*(-s1))/5 = -0.94366174
    logp, zeros, adv, mask = _gspo_inputs()
    loss, _ = policy_loss(logp, zeros, zeros, adv, mask, eps_clip=0.2, eps_clip_higher=0.5,
                          importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-0.9436617399, abs=1e-9)


def test_gspo_clips_per_sequence_and_dual_clip():
    # row0: log r = [ln4, ln4] -> s = 4, A = [-1, -1] -> max(4, 1.2) = 4, dual c_clip 3 -> 3
    # row1: log r = [ln4, 0]   -> s = 2, A = [1, 1]   -> max(-2, -1.2) = -1.2 (clipped)
    # token-mean (3 + 3 - 1.2 - 1.2)/4 = 0.9; dual_clip_ratio 2/4, clip_ratio 2/4
    logp = t([[LN4, LN4], [LN4, 0.0]], requires_grad=True)
    zeros = torch.zeros(2, 2, dtype=D)
    adv = t([[-1.0, -1.0], [1.0, 1.0]])
    loss, stats = policy_loss(logp, zeros, zeros, adv, ones_mask([[0, 0], [0, 0]]), c_clip=3.0,
                              importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(0.9, abs=1e-12)
    assert stats["dual_clip_ratio"] == pytest.approx(0.5)
    assert stats["clip_ratio"] == pytest.approx(0.5)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))  # every term is a constant


# ----------------------------------------------------------------------------------
# SAPO
# ----------------------------------------------------------------------------------

def test_sapo_soft_gate():
    # pg = -A (4/tau) sigmoid(tau (r-1)), tau = 1 if A > 0 else 1.05:
    #  A=+1 r=1  : 4 * 0.5 = 2                       -> -2
    #  A=-1 r=1  : (4/1.05) * 0.5 = 1.9047619        -> +1.9047619
    #  A=+1 r=2  : 4 * sigmoid(1) = 2.9242343        -> -2.9242343
    #  A=-2 r=0.5: (4/1.05) sigmoid(-0.525) = 1.4159383 -> +2.8318767
    # token-mean: (-2 + 1.9047619 - 2.9242343 + 2.8318767)/4 = -0.04689894
    logp = t([[0.0, 0.0, LN2, math.log(0.5)]], requires_grad=True)
    zeros = torch.zeros_like(logp)
    adv = t([[1.0, -1.0, 1.0, -2.0]])
    loss, stats = policy_loss(logp, zeros, zeros, adv, ones_mask([[0] * 4]), use_sapo_loss=True)
    assert loss.item() == pytest.approx(-0.0468989373, abs=1e-9)
    # gate mean (2 + 1.9047619 + 2.9242343 + 1.4159383)/4 = 2.0612336
    assert stats["sapo_gate_mean"] == pytest.approx(2.0612336374, abs=1e-9)
    assert stats["clip_ratio"] == 0.0
    loss.backward()
    # d pg/d logp = -A * 4 s (1-s) * r (tau cancels), /4 tokens:
    #  -1*4*0.25*1/4 = -0.25 ; +0.25 ; -4*0.7310586*0.2689414*2/4 = -0.39322387 ;
    #  2*4*sigmoid(-0.525)(1-sigmoid(-0.525))*0.5/4 = 0.23353496
    assert torch.allclose(logp.grad, t([[-0.25, 0.25, -0.3932238665, 0.2335349558]]), atol=1e-9)


def test_sapo_applies_behaviour_weight():
    # One token, r = 1, A = 1, behav = prox - ln2 -> w = 2: loss = 2 * (-2) = -4
    logp = t([[0.0]], requires_grad=True)
    loss, _ = policy_loss(logp, t([[0.0]]), t([[-LN2]]), t([[1.0]]), ones_mask([[0]]),
                          use_sapo_loss=True)
    assert loss.item() == pytest.approx(-4.0, abs=1e-12)


# ----------------------------------------------------------------------------------
# CISPO
# ----------------------------------------------------------------------------------

def test_cispo_clips_weight_keeps_gradient():
    # band [1-0.2, 1+0.28] = [0.8, 1.28]; value -clip(r) A, gradient -clip(r) A grad(logp):
    #  A=1  r=2  : clip 1.28 -> -1.28 (out of band)
    #  A=-1 r=0.5: clip 0.8  -> +0.8  (out of band)
    #  A=1  r=1.1: 1.1       -> -1.1
    #  A=2  r=1  : 1         -> -2
    # token-mean (-1.28 + 0.8 - 1.1 - 2)/4 = -0.895 ; grads /4: [-0.32, 0.2, -0.275, -0.5]
    logp = t([[LN2, math.log(0.5), math.log(1.1), 0.0]], requires_grad=True)
    zeros = torch.zeros_like(logp)
    adv = t([[1.0, -1.0, 1.0, 2.0]])
    loss, stats = policy_loss(logp, zeros, zeros, adv, ones_mask([[0] * 4]), use_cispo_loss=True,
                              eps_clip=0.2, eps_clip_higher=0.28)
    assert loss.item() == pytest.approx(-0.895, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(logp.grad, t([[-0.32, 0.2, -0.275, -0.5]]))


def test_cispo_eps_clip_one_has_no_lower_bound():
    # eps_clip 1.0 -> lower bound max(0, 0) = 0: A=-1 r=0.5 -> weight 0.5, loss +0.5
    logp = t([[math.log(0.5)]], requires_grad=True)
    loss, stats = policy_loss(logp, t([[0.0]]), t([[0.0]]), t([[-1.0]]), ones_mask([[0]]),
                              use_cispo_loss=True, eps_clip=1.0, eps_clip_higher=4.0)
    assert loss.item() == pytest.approx(0.5, abs=1e-12)
    assert stats["clip_ratio"] == 0.0
    # PPO refuses eps_clip = 1
    with pytest.raises(AlgorithmInputError):
        policy_loss(logp, t([[0.0]]), t([[0.0]]), t([[-1.0]]), ones_mask([[0]]), eps_clip=1.0)


def test_behaviour_weight_applies_to_gspo_and_cispo():
    # behav = prox - log w with w = [2, 0.5] (prox = 0, behav = [-ln2, ln2]).
    # GSPO: log r = [ln2, 0] -> s = sqrt2, A = 1, band [0.8, 1.5]: pg = -sqrt2 per token;
    #   loss_t = w pg = [-2 sqrt2, -sqrt2/2]; token-mean = -1.25 sqrt2 = -1.76776695
    logp = t([[LN2, 0.0]], requires_grad=True)
    prox = torch.zeros(1, 2, dtype=D)
    behav = t([[-LN2, LN2]])
    adv = t([[1.0, 1.0]])
    loss, stats = policy_loss(logp, prox, behav, adv, ones_mask([[0, 0]]), eps_clip_higher=0.5,
                              importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-1.7677669530, abs=1e-9)
    assert stats["importance_weight_mean"] == pytest.approx(1.25)
    # CISPO, band [0.8, 1.28]: r = [2, 1] -> clip [1.28, 1]; loss_t = -w clip(r) A
    #   = [-2.56, -0.5]; token-mean -1.53
    loss, _ = policy_loss(logp, prox, behav, adv, ones_mask([[0, 0]]), use_cispo_loss=True,
                          eps_clip_higher=0.28)
    assert loss.item() == pytest.approx(-1.53, abs=1e-12)


# ----------------------------------------------------------------------------------
# M2PO
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold, keep", [
    # values [0.09, 0.01, 0.25, 0.0, 0.04]; sorted desc [0.25, 0.09, 0.04, 0.01, 0]
    # suffix means: 0.39/5=0.078, 0.14/4=0.035, 0.05/3=0.0167, 0.01/2=0.005, 0/1=0
    (0.04, [True, True, False, True, True]),   # 0.035 < 0.04: drop 1 (the 0.25)
    (0.03, [False, True, False, True, True]),  # first < 0.03 is 0.0167: drop 2
    (1e-9, [False, False, False, True, False]),  # only the last suffix (0) is below: drop 4
])
def test_m2po_rule(threshold, keep):
    m2 = t([0.09, 0.01, 0.25, 0.0, 0.04])
    assert m2po_keep_flat(m2, threshold).tolist() == keep


def test_m2po_fallback_and_strictness():
    # No suffix mean below 0.5 ([1, 1]: means 1, 1): drop all but one (stable: the later one).
    assert m2po_keep_flat(t([1.0, 1.0]), 0.5).tolist() == [False, True]
    # Mean exactly at the threshold is not below it; all-but-one of one token = keep it.
    assert m2po_keep_flat(t([0.04]), 0.04).tolist() == [True]
    assert m2po_keep_flat(t([]), 0.04).tolist() == []


def test_m2po_in_loss_keeps_denominator():
    # log w = prox - behav = [0.3, 0.1, 0.5, 0, 0.2] -> m2 = [0.09, 0.01, 0.25, 0, 0.04]
    # threshold 0.04 drops token 3. r = 1, A = 1: loss_t = -w for kept tokens;
    # denominator stays 5: -(e^0.3 + e^0.1 + 1 + e^0.2)/5 = -4.67643248/5 = -0.93528650
    prox = t([[0.3, 0.1, 0.5, 0.0, 0.2]])
    logp = prox.clone().requires_grad_(True)
    behav = torch.zeros_like(prox)
    loss, stats = policy_loss(logp, prox, behav, torch.ones_like(prox), ones_mask([[0] * 5]),
                              m2_threshold=0.04)
    assert loss.item() == pytest.approx(-0.9352864968, abs=1e-9)
    assert stats["m2po_masked_ratio"] == pytest.approx(0.2)
    loss.backward()
    assert logp.grad[0, 2] == 0.0


# ----------------------------------------------------------------------------------
# Rejection sampling (behaviour weight pi_prox / pi_behav)
# ----------------------------------------------------------------------------------

# prox = logp = 0 (r = 1), A = 1 -> pg = -1, loss_t = -w for kept tokens.
# behav = [ln4, ln2, 0, -ln2, -ln4] -> log w = -behav, w = [0.25, 0.5, 1, 2, 4].
RS_BEHAV = [[LN4, LN2, 0.0, -LN2, -LN4]]


def _rs_loss(rs, behav=RS_BEHAV):
    behav = t(behav)
    logp = torch.zeros_like(behav, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros_like(behav), behav, torch.ones_like(behav),
                              torch.ones_like(behav, dtype=torch.bool), rejection_sampling=rs)
    return loss, stats, logp


@pytest.mark.parametrize("rs, expected, rejected", [
    # IcePop, bounds [0.4, 2.5]: keep w = 0.5, 1, 2 -> -(3.5)/5 = -0.7 ; 2 of 5 dropped
    (RejectionSampling(lower=0.4, upper=2.5), -0.7, 0.4),
    # clamp to [0.4, 2.5]: w -> [0.4, 0.5, 1, 2, 2.5] -> -6.4/5 = -1.28 ; 2 clamped
    (RejectionSampling(action="clamp", lower=0.4, upper=2.5), -1.28, 0.4),
    # clamp, lower null (= 0): w -> [0.25, 0.5, 1, 2, 2.5] -> -6.25/5 = -1.25 ; 1 clamped
    (RejectionSampling(action="clamp", upper=2.5), -1.25, 0.2),
    # upper bound inclusive: upper 4 keeps w = 4 -> -(7.75)/5 = -1.55 ; nothing dropped
    (RejectionSampling(upper=4.0), -1.55, 0.0),
    # kl_k1 = log w = [-1.386, -0.693, 0, 0.693, 1.386]; <= 1 keeps 4 -> -3.75/5 = -0.75
    (RejectionSampling(metric="kl_k1", upper=1.0), -0.75, 0.2),
    # ... and >= -1 drops the first too -> -3.5/5 = -0.7
    (RejectionSampling(metric="kl_k1", lower=-1.0, upper=1.0), -0.7, 0.4),
    # kl_k2 = (log w)^2/2 = [0.961, 0.240, 0, 0.240, 0.961]; <= 0.5 keeps 0.5, 1, 2 -> -0.7
    (RejectionSampling(metric="kl_k2", upper=0.5), -0.7, 0.4),
    # kl_k3 = 1/w - 1 + log w = [1.614, 0.307, 0, 0.193, 0.636]; <= 0.25 keeps w = 1, 2
    # -> -(1 + 2)/5 = -0.6 (asymmetric: w = 2 kept, w = 0.5 dropped)
    (RejectionSampling(metric="kl_k3", upper=0.25), -0.6, 0.6),
])
def test_rejection_sampling_token_level(rs, expected, rejected):
    loss, stats, logp = _rs_loss(rs)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["rejection_ratio"] == pytest.approx(rejected)
    # Statistics describe w before any clamp: (0.25 + 0.5 + 1 + 2 + 4)/5 = 1.55, max 4
    assert stats["importance_weight_mean"] == pytest.approx(1.55)
    assert stats["importance_weight_max"] == pytest.approx(4.0)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_binary_kl_values_and_kpop():
    # Bernoulli KL(a||b) = a ln(a/b) + (1-a) ln((1-a)/(1-b)); metric = max of both directions:
    #  p=q=0.5: 0
    #  p=0.9 q=0.5: KL(p||q) = 0.9 ln1.8 + 0.1 ln0.2 = 0.36806421; KL(q||p) = 0.5 ln(5/9) + 0.5 ln5
    #               = 0.51082562 -> 0.51082562 (and the same for p=0.5 q=0.9)
    #  p=0.6 q=0.5: 0.6 ln1.2 + 0.4 ln0.8 = 0.02013551; 0.5 ln(5/6) + 0.5 ln1.25 = 0.02041100
    p = t([[0.5, 0.9, 0.5, 0.6]]).log()
    q = t([[0.5, 0.5, 0.9, 0.5]]).log()
    assert torch.allclose(binary_kl(p, q), t([[0.0, 0.3680642072, 0.5108256238, 0.0201355136]]),
                          atol=1e-9)
    # KPop, upper 0.1: keep tokens 1 and 4; r = 1, A = 1, w = p/q = [1, 1.8, 0.5556, 1.2]
    # -> -(1 + 1.2)/4 = -0.55 ; 2 of 4 rejected
    logp = p.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, p, q, torch.ones_like(p), torch.ones_like(p, dtype=torch.bool),
                              rejection_sampling=RejectionSampling(metric="binary_kl", upper=0.1))
    assert loss.item() == pytest.approx(-0.55, abs=1e-12)
    assert stats["rejection_ratio"] == pytest.approx(0.5)


def test_binary_kl_probability_one_is_finite_in_float32():
    # p = q = 1 (logprob 0): both clamp to 1 - 1e-8 (in float64) -> KL exactly 0, not NaN.
    zero = torch.zeros(1, 1, dtype=torch.float32)
    assert binary_kl(zero, zero).item() == 0.0


# Sequence level. Rows (A = 1, r = 1):
#  row0 w = [0.5, 2]  -> log mean 0    -> geometric mean 1
#  row1 w = [4, 4]    -> geometric mean 4
#  row2 w = [0.25, 1] -> log mean -ln2 -> geometric mean 0.5
SEQ_BEHAV = [[LN2, -LN2], [-LN4, -LN4], [LN4, 0.0]]


@pytest.mark.parametrize("rs, expected, rejected", [
    # mean, [0.4, 2.5]: rows 0 (1) and 2 (0.5) in, row1 (4) out; the weight is the
    # geometric mean: -(1 + 1 + 0.5 + 0.5)/6 = -0.5 ; 2 of 6 tokens dropped
    (RejectionSampling(level="sequence", lower=0.4, upper=2.5), -0.5, 2 / 6),
    # sum (exp of summed logs): row0 1 in, row1 16 out, row2 0.25 < 0.4 out -> -2/6
    (RejectionSampling(level="sequence", agg="sum", lower=0.4, upper=2.5), -2 / 6, 4 / 6),
    # max (exp of max log w), upper 1.5: row0 2 out, row1 4 out, row2 1 in -> -(0.5+0.5)/6
    (RejectionSampling(level="sequence", agg="max", upper=1.5), -1 / 6, 4 / 6),
    # clamp, [0.4, 2.5]: row1's weight 4 -> 2.5: -(1 + 1 + 2.5 + 2.5 + 0.5 + 0.5)/6 = -8/6
    (RejectionSampling(level="sequence", action="clamp", lower=0.4, upper=2.5), -8 / 6, 2 / 6),
    # kl_k2 mean, upper 0.3: row0 (0.2402) in, row1 (0.9609) out, row2 (0.4805) out; for KL
    # metrics the weight stays per token: -(0.5 + 2)/6 = -0.41666667
    (RejectionSampling(level="sequence", metric="kl_k2", upper=0.3), -2.5 / 6, 4 / 6),
])
def test_rejection_sampling_sequence_level(rs, expected, rejected):
    loss, stats, logp = _rs_loss(rs, SEQ_BEHAV)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["rejection_ratio"] == pytest.approx(rejected)


def test_all_tokens_rejected():
    # kl_k2 mean, upper 0.1: every row is out -> loss 0 (denominator still 6), zero grads.
    loss, stats, logp = _rs_loss(RejectionSampling(level="sequence", metric="kl_k2", upper=0.1),
                                 SEQ_BEHAV)
    assert loss.item() == 0.0
    assert stats["rejection_ratio"] == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_cap_and_rejection_exclude_each_other():
    with pytest.raises(AlgorithmInputError):
        behaviour_weight(t([[0.0]]), t([[0.0]]), ones_mask([[0]]), behav_imp_weight_cap=2.0,
                         rejection_sampling=RejectionSampling())
    with pytest.raises(AlgorithmInputError):
        RejectionSampling(action="clamp", metric="kl_k3")
    with pytest.raises(AlgorithmInputError):
        RejectionSampling(upper=1.0)  # ratio needs upper > 1


# ----------------------------------------------------------------------------------
# prox_logp_method = loglinear
# ----------------------------------------------------------------------------------

def test_loglinear_interpolation():
    # policy_version v = 3 (pi_prox), v_theta = 4: alpha = (3 - v_b)/(4 - v_b)
    #  v_b=3: 0 ; v_b=2: 1/2 ; v_b=0: 3/4 ; v_b=-1 (not an output token): 0 ; v_b=5 (> v): 0
    versions = torch.tensor([[3, 2, 0, -1, 5]])
    assert loglinear_alpha(versions, 3).tolist() == [[0.0, 0.5, 0.75, 0.0, 0.0]]
    # prox = behav + alpha (logp - behav):
    #  -1 + 0 = -1 ; -2 + 0.5*1 = -1.5 ; -3 + 0.75*2 = -1.5 ; 0 ; -1
    behav = t([[-1.0, -2.0, -3.0, 0.0, -1.0]])
    logp = t([[-0.5, -1.0, -1.0, 0.0, -0.2]], requires_grad=True)
    prox = loglinear_prox_logprobs(behav, logp, versions, 3)
    assert prox.tolist() == [[-1.0, -1.5, -1.5, 0.0, -1.0]]
    assert not prox.requires_grad
    with pytest.raises(AlgorithmInputError):
        loglinear_prox_logprobs(behav, logp, versions, None)


# ----------------------------------------------------------------------------------
# Entropy bonus
# ----------------------------------------------------------------------------------

def test_entropy_bonus():
    # A = 0 so pg = 0; entropy [1, 2, (3 masked)], coeff 0.1, token-mean H = 1.5:
    # loss = 0 - 0.1 * 1.5 = -0.15 ; dL/dH = -0.1/2 on unmasked tokens.
    logp = t([[0.0, 0.0, 0.0]], requires_grad=True)
    ent = t([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = t([[1, 1, 0]]).bool()
    zeros = torch.zeros(1, 3, dtype=D)
    loss, stats = policy_loss(logp, zeros, zeros, zeros, mask, entropy_BT=ent, entropy_coeff=0.1)
    assert loss.item() == pytest.approx(-0.15, abs=1e-12)
    assert stats["policy_entropy"] == pytest.approx(1.5)
    loss.backward()
    assert torch.allclose(ent.grad, t([[-0.05, -0.05, 0.0]]))
    # seq-mean-token-sum on two rows [1, 2] and [4]: (3 + 4)/2 = 3.5 -> loss -0.35
    ent2 = t([[1.0, 2.0], [4.0, 9.0]])
    mask2 = t([[1, 1], [1, 0]]).bool()
    z2 = torch.zeros(2, 2, dtype=D)
    loss2, _ = policy_loss(z2.clone().requires_grad_(True), z2, z2, z2, mask2, entropy_BT=ent2,
                           entropy_coeff=0.1, agg_mode="seq-mean-token-sum")
    assert loss2.item() == pytest.approx(-0.35, abs=1e-12)


# ----------------------------------------------------------------------------------
# Edge cases for every surrogate: fully masked rows, extreme log-ratios
# ----------------------------------------------------------------------------------

SURROGATES = [
    {},
    {"importance_sampling_level": "sequence"},
    {"use_sapo_loss": True},
    {"use_sapo_loss": True, "importance_sampling_level": "sequence"},
    {"use_cispo_loss": True, "eps_clip_higher": 4.0},
    {"c_clip": 3.0, "rejection_sampling": RejectionSampling(lower=0.5, upper=2.0)},
    {"m2_threshold": 0.04},
]


@pytest.mark.parametrize("kwargs", SURROGATES)
def test_fully_masked_row_does_not_leak(kwargs):
    # Row 0 real, row 1 fully masked NaN/inf garbage: the loss equals row 0 alone and
    # row 1 gets exactly zero gradient. seq-mean-token-mean also must not count row 1.
    logp0 = t([[math.log(1.5), math.log(0.5), 0.1]])
    prox0 = t([[0.0, 0.0, 0.05]])
    behav0 = t([[0.0, -0.1, 0.0]])
    adv0 = t([[1.0, -1.0, 0.5]])
    garbage = t([[math.nan, math.inf, -math.inf]])
    for mode in ("token-mean", "seq-mean-token-mean"):
        ref, _ = policy_loss(logp0, prox0, behav0, adv0, ones_mask([[0] * 3]), agg_mode=mode, **kwargs)
        logp = torch.cat([logp0, garbage]).requires_grad_(True)
        mask = t([[1, 1, 1], [0, 0, 0]]).bool()
        loss, stats = policy_loss(logp, torch.cat([prox0, garbage.flip(-1)]),
                                  torch.cat([behav0, -garbage]), torch.cat([adv0, garbage]), mask,
                                  agg_mode=mode, **kwargs)
        assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
        assert all(math.isfinite(v) for v in stats.values())
        loss.backward()
        assert torch.isfinite(logp.grad).all() and (logp.grad[1] == 0).all()


@pytest.mark.parametrize("kwargs", SURROGATES)
def test_extreme_log_ratios_finite(kwargs):
    # |logp - prox| and |prox - behav| of 1000 in float32: exp would overflow without
    # the [-20, 20] clamp.
    logp = torch.tensor([[1000.0, -1000.0, 1000.0, -1000.0, 0.0]], requires_grad=True)
    prox = torch.zeros(1, 5)
    behav = torch.tensor([[0.0, 0.0, -1000.0, 1000.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    loss, stats = policy_loss(logp, prox, behav, adv, mask, **kwargs)
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in stats.values()), stats
    loss.backward()
    assert torch.isfinite(logp.grad).all()
