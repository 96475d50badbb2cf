"""Golden numeric tests for tapioca.algorithms.ppo_loss.decoupled_ppo_loss.

Expected values are derived by hand in comments from
  r = exp(logp - prox), pg = max(-A r, -A clip(r, 1-eps, 1+eps_high)),
  dual clip pg = min(pg, -A c_clip) for A < 0, w = exp(prox - behav), loss_t = w pg.
"""

from __future__ import annotations

import math

import pytest
import torch

from tapioca.algorithms.ppo_loss import decoupled_ppo_loss

LN2 = math.log(2.0)


def _t(values, requires_grad=False):
    return torch.tensor([values], dtype=torch.float64, requires_grad=requires_grad)


def _on_policy(ratios, advantages, mask=None):
    """prox = behav = 0 (so w = 1) and logp = log(ratio)."""
    logp = _t([math.log(r) for r in ratios], requires_grad=True)
    zeros = _t([0.0] * len(ratios))
    adv = _t(advantages)
    mask = torch.ones_like(zeros, dtype=torch.bool) if mask is None else mask
    return logp, zeros, zeros.clone(), adv, mask


def test_clip_positive_and_negative_advantages():
    # eps 0.2, w = 1:
    #  A=+1 r=1.5: max(-1.5, -1.2) = -1.2  clipped
    #  A=+1 r=0.5: max(-0.5, -0.8) = -0.5  not clipped (A>0 never clips below)
    #  A=-1 r=0.5: max( 0.5,  0.8) =  0.8  clipped
    #  A=-1 r=1.5: max( 1.5,  1.2) =  1.5  not clipped (A<0 never clips above)
    # token-mean = (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.6 / 4 = 0.15
    logp, prox, behav, adv, mask = _on_policy([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(0.15, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(0.5)
    assert stats["dual_clip_ratio"] == 0.0
    # ratio mean (1.5+0.5+0.5+1.5)/4 = 1 ; approx_kl = (2 ln1.5 + 2 ln0.5)/4 = ln(0.75)/2 = -0.1438410
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["approx_kl"] == pytest.approx(-0.1438410, abs=1e-7)
    assert stats["importance_weight_mean"] == pytest.approx(1.0)
    assert stats["importance_weight_max"] == pytest.approx(1.0)
    # Gradient wrt logp: clipped tokens 0; unclipped d(-A r)/dlogp = -A r, / 4 tokens:
    #   token 2: -(1)(0.5)/4 = -0.125 ; token 4: -(-1)(1.5)/4 = 0.375
    loss.backward()
    assert torch.allclose(logp.grad, _t([0.0, -0.125, 0.0, 0.375]))


def test_clip_higher():
    # A=+1, r in {1.25, 1.5}.
    #  eps_high=None (=0.2): both clipped at 1.2 -> [-1.2, -1.2], mean -1.2, clip_ratio 1
    #  eps_high=0.28: r=1.25 < 1.28 unclipped -> -1.25 ; r=1.5 -> -1.28
    #                 mean (-1.25 - 1.28)/2 = -1.265, clip_ratio 0.5
    logp, prox, behav, adv, mask = _on_policy([1.25, 1.5], [1.0, 1.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(1.0)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, eps_clip_higher=0.28)
    assert loss.item() == pytest.approx(-1.265, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(0.5)


def test_dual_clip():
    # eps 0.2, c_clip 3:
    #  A=-1 r=5  : max(5, 1.2) = 5 ; dual min(5, 3) = 3   dual-clipped (not "clipped")
    #  A=-1 r=2  : max(2, 1.2) = 2 ; min(2, 3) = 2         untouched
    #  A=+1 r=5  : max(-5, -1.2) = -1.2 ; A>0: no dual     clipped
    #  A=-2 r=0.5: max(1, 1.6) = 1.6 ; min(1.6, 6) = 1.6   clipped
    # with c_clip: (3 + 2 - 1.2 + 1.6)/4 = 5.4/4 = 1.35
    # without    : (5 + 2 - 1.2 + 1.6)/4 = 7.4/4 = 1.85
    logp, prox, behav, adv, mask = _on_policy([5.0, 2.0, 5.0, 0.5], [-1.0, -1.0, 1.0, -2.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, c_clip=3.0)
    assert loss.item() == pytest.approx(1.35, abs=1e-12)
    assert stats["dual_clip_ratio"] == pytest.approx(0.25)
    assert stats["clip_ratio"] == pytest.approx(0.5)
    # Only token 2 has a gradient: -A r / 4 = 2/4 = 0.5 ; the dual-clipped constant has none.
    loss.backward()
    assert torch.allclose(logp.grad, _t([0.0, 0.5, 0.0, 0.0]))

    loss, stats = decoupled_ppo_loss(logp.detach(), prox, behav, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(1.85, abs=1e-12)
    assert stats["dual_clip_ratio"] == 0.0


def _behav_inputs():
    # logp = prox = 0 -> r = 1, no clipping; pg = -A = [-1, -1, 1, -2].
    # behav = [-ln2, ln2, -ln4, 0] -> log w = prox - behav = [ln2, -ln2, ln4, 0], w = [2, 0.5, 4, 1]
    logp = _t([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    prox = _t([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    behav = _t([-LN2, LN2, -2 * LN2, 0.0], requires_grad=True)
    adv = _t([1.0, 1.0, -1.0, 2.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    return logp, prox, behav, adv, mask


def test_behaviour_weight_multiplies_loss():
    # loss_t = w * pg = [-2, -0.5, 4, -2] ; mean = -0.5/4 = -0.125
    logp, prox, behav, adv, mask = _behav_inputs()
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx(-0.125, abs=1e-12)
    # w stats: mean (2 + 0.5 + 4 + 1)/4 = 1.875, max 4 ; nothing capped.
    assert stats["importance_weight_mean"] == pytest.approx(1.875)
    assert stats["importance_weight_max"] == pytest.approx(4.0)
    assert stats["behav_capped_ratio"] == 0.0
    # grad = w * (-A r) / 4 = [2*-1, 0.5*-1, 4*1, 1*-2]/4 = [-0.5, -0.125, 1, -0.5]
    loss.backward()
    assert torch.allclose(logp.grad, _t([-0.5, -0.125, 1.0, -0.5]))
    # w is detached: no gradient reaches prox or behav.
    assert prox.grad is None and behav.grad is None


def test_behaviour_weight_cap():
    # cap 3 drops token 3 (w = 4 > 3): losses [-2, -0.5, 0, -2], sum -4.5;
    # the denominator stays 4 (AReaL's choice): -4.5/4 = -1.125
    logp, prox, behav, adv, mask = _behav_inputs()
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=3.0)
    assert loss.item() == pytest.approx(-1.125, abs=1e-12)
    assert stats["behav_capped_ratio"] == pytest.approx(0.25)
    # Stats describe w before the cap.
    assert stats["importance_weight_max"] == pytest.approx(4.0)
    loss.backward()
    assert torch.allclose(logp.grad, _t([-0.5, -0.125, 0.0, -0.5]))
    # w == cap is kept (strictly greater is dropped): cap 4 keeps everything -> -0.125.
    loss, _ = decoupled_ppo_loss(logp.detach(), prox, behav, adv, mask, behav_imp_weight_cap=4.0)
    assert loss.item() == pytest.approx(-0.125, abs=1e-12)


def test_masked_garbage_does_not_leak():
    # Row 0 is the clip test (loss 0.15); row 1 is fully masked garbage.
    logp, prox, behav, adv, _ = _on_policy([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    garbage = torch.tensor([[math.nan, math.inf, -math.inf, 1e30]], dtype=torch.float64)
    logp2 = torch.cat([logp.detach(), garbage]).requires_grad_(True)
    prox2 = torch.cat([prox, garbage.flip(-1)])
    behav2 = torch.cat([behav, -garbage])
    adv2 = torch.cat([adv, garbage])
    mask2 = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    for mode in ("token-mean", "seq-mean-token-mean"):
        # seq-mean-token-mean: row 0 mean 0.15, row 1 excluded -> 0.15 too.
        loss, stats = decoupled_ppo_loss(logp2, prox2, behav2, adv2, mask2, agg_mode=mode)
        assert loss.item() == pytest.approx(0.15, abs=1e-12)
        assert all(math.isfinite(v) for v in stats.values())
        assert stats["clip_ratio"] == pytest.approx(0.5)
        logp2.grad = None
        loss.backward()
        assert torch.isfinite(logp2.grad).all()
        assert (logp2.grad[1] == 0).all()


def test_extreme_log_ratios_are_finite():
    # |logp - prox| = 1000 and |prox - behav| = 1000, fp32: exp would overflow
    # without the [-20, 20] clamp.
    logp = torch.tensor([[1000.0, -1000.0, 1000.0, -1000.0, 0.0]], requires_grad=True)
    prox = torch.zeros(1, 5)
    behav = torch.tensor([[0.0, 0.0, -1000.0, 1000.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    for kwargs in ({}, {"c_clip": 3.0}, {"behav_imp_weight_cap": 5.0}):
        loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, **kwargs)
        assert torch.isfinite(loss), kwargs
        assert all(math.isfinite(v) for v in stats.values()), (kwargs, stats)
        logp.grad = None
        loss.backward()
        assert torch.isfinite(logp.grad).all(), kwargs
    # With the cap, token 3 (log w = 1000) is dropped: 1 of 5.
    assert stats["behav_capped_ratio"] == pytest.approx(0.2)


def test_seq_mode_passthrough_and_no_tokens():
    # Two rows: [A=+1 r=1.5 -> -1.2, A=+1 r=0.5 -> -0.5] and [A=-1 r=0.5 -> 0.8, masked].
    # seq-mean-token-sum: row sums [-1.7, 0.8] -> mean -0.45
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(0.5), 0.0]], dtype=torch.float64)
    zeros = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0], [-1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, _ = decoupled_ppo_loss(logp, zeros, zeros, adv, mask, agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-0.45, abs=1e-12)
    # No unmasked token at all: loss 0, all stats 0.
    loss, stats = decoupled_ppo_loss(logp, zeros, zeros, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0
    assert all(v == 0.0 for v in stats.values())


def test_bad_arguments():
    logp, prox, behav, adv, mask = _on_policy([1.0, 1.0], [1.0, -1.0])
    with pytest.raises(ValueError):
        decoupled_ppo_loss(logp, prox, behav, adv, mask, c_clip=1.0)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.0)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=0.0)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(logp, prox, behav[:, :1], adv, mask)
