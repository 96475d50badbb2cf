"""Golden numbers for tapioca.algorithms.gae: GAE (token and turn level), discounted
returns, the clipped value loss, masked batch normalisation and the KL penalty in the
reward. Every expected value is derived by hand in the comment next to it (inputs are
chosen so the arithmetic is exact in binary where possible)."""

from __future__ import annotations

import math

import pytest
import torch

from tapioca.algorithms.advantages import normalize_batch
from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.gae import (
    clipped_value_loss,
    discounted_returns,
    explained_variance,
    gae_advantages,
    kl_penalty_rewards,
    masked_batch_normalize,
    terminal_rewards,
    turn_gae_advantages,
)
from tapioca.trainers.batching import SeqItem
from tapioca.trainers.token_advantages import turn_ids

T_ = torch.tensor


def B(*rows):  # bool mask
    return torch.tensor(rows, dtype=torch.bool)


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32),
                          torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0)


# ---------------------------------------------------------------- token-level GAE

def test_gae_token_level_gamma_lambda_half():
    # r = [0, 0, 1], V = [0.5, 0.25, 0.5], gamma = lambda = 0.5, V after the end = 0.
    # t=2: delta = 1 + 0.5*0 - 0.5 = 0.5;          A = 0.5;                     R = 1.0
    # t=1: delta = 0 + 0.5*0.5 - 0.25 = 0;         A = 0 + 0.25*0.5 = 0.125;    R = 0.375
    # t=0: delta = 0 + 0.5*0.25 - 0.5 = -0.375;    A = -0.375 + 0.25*0.125
    #                                                = -0.34375;                R = 0.15625
    adv, ret = gae_advantages(T_([[0., 0., 1.]]), T_([[0.5, 0.25, 0.5]]), B([1, 1, 1]),
                              discount=0.5, gae_lambda=0.5)
    assert close(adv, [[-0.34375, 0.125, 0.5]])
    assert close(ret, [[0.15625, 0.375, 1.0]])


def test_gae_lambda_zero_is_one_step_td():
    # lambda = 0: A_t = delta_t = r_t + gamma*V_{t+1} - V_t, gamma = 1.
    # t=2: 1 + 0 - 0.5 = 0.5; t=1: 0 + 0.5 - 0.25 = 0.25; t=0: 0 + 0.25 - 0.5 = -0.25.
    # R = A + V = [0.25, 0.5, 1.0] (the one-step targets r + V_next).
    adv, ret = gae_advantages(T_([[0., 0., 1.]]), T_([[0.5, 0.25, 0.5]]), B([1, 1, 1]),
                              discount=1.0, gae_lambda=0.0)
    assert close(adv, [[-0.25, 0.25, 0.5]])
    assert close(ret, [[0.25, 0.5, 1.0]])


def test_gae_lambda_one_gamma_one_is_monte_carlo_minus_value():
    # lambda = gamma = 1: A_t = (sum_{j>=t} r_j) - V_t; the future sums are [1, 1, 1].
    # A = [1-0.5, 1-0.25, 1-0.5] = [0.5, 0.75, 0.5]; R = [1, 1, 1].
    adv, ret = gae_advantages(T_([[0., 0., 1.]]), T_([[0.5, 0.25, 0.5]]), B([1, 1, 1]),
                              discount=1.0, gae_lambda=1.0)
    assert close(adv, [[0.5, 0.75, 0.5]])
    assert close(ret, [[1.0, 1.0, 1.0]])


def test_gae_skips_masked_positions_and_masked_rows():
    # Row 0, mask [1, 0, 1]: the middle position is not a step, its reward 5 and value
    # 9 are ignored. gamma = lambda = 1. t=2: delta = 1 - 0.5 = 0.5, A = 0.5;
    # t=0: delta = 0 + 1*0.5 (V of the next *step*, t=2) - 0.5 = 0, A = 0 + 0.5 = 0.5.
    # Outputs off the mask are 0. Row 1 is fully masked: all 0.
    rewards = T_([[0., 5., 1.], [3., 3., 3.]])
    values = T_([[0.5, 9., 0.5], [1., 1., 1.]])
    adv, ret = gae_advantages(rewards, values, B([1, 0, 1], [0, 0, 0]), discount=1.0, gae_lambda=1.0)
    assert close(adv, [[0.5, 0.0, 0.5], [0., 0., 0.]])
    assert close(ret, [[1.0, 0.0, 1.0], [0., 0., 0.]])


def test_gae_single_token_and_right_padding():
    # One trained token, then padding (mask 0): A = r - V = 2 - 0.5 = 1.5, R = 2,
    # whatever gamma and lambda are (no next step).
    adv, ret = gae_advantages(T_([[2., 0., 0.]]), T_([[0.5, 7., 7.]]), B([1, 0, 0]),
                              discount=0.3, gae_lambda=0.7)
    assert close(adv, [[1.5, 0., 0.]])
    assert close(ret, [[2.0, 0., 0.]])


def test_gae_rejects_bad_arguments():
    m = B([1, 1])
    with pytest.raises(AlgorithmInputError, match="discount"):
        gae_advantages(T_([[0., 1.]]), T_([[0., 0.]]), m, discount=1.5, gae_lambda=1.0)
    with pytest.raises(AlgorithmInputError, match="shapes differ"):
        gae_advantages(T_([[0., 1., 2.]]), T_([[0., 0.]]), m, discount=1.0, gae_lambda=1.0)


# ---------------------------------------------------------------- discounted returns

def test_discounted_returns():
    # r = [1, 0, 2], gamma = 0.5: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5.
    assert close(discounted_returns(T_([[1., 0., 2.]]), B([1, 1, 1]), discount=0.5), [[1.5, 1.0, 2.0]])
    # gamma = 1: suffix sums [3, 2, 2].
    assert close(discounted_returns(T_([[1., 0., 2.]]), B([1, 1, 1]), discount=1.0), [[3., 2., 2.]])
    # The last position masked: its reward 2 is not a step's reward. G1 = 0, G0 = 1.
    assert close(discounted_returns(T_([[1., 0., 2.]]), B([1, 1, 0]), discount=0.5), [[1., 0., 0.]])


def test_terminal_reward_goes_to_the_last_trained_token():
    # Row 0: last trained position is 1 (position 2 is masked); row 1 has none: all 0.
    out = terminal_rewards(T_([2., 3.]), B([1, 1, 0], [0, 0, 0]))
    assert close(out, [[0., 2., 0.], [0., 0., 0.]])


# ---------------------------------------------------------------- turn-level GAE

def test_gae_turn_level():
    # Turns [0, 0, 1, 1, 1]; r = [0.5, 0, 0, 0, 1]; the value of a turn is V at its
    # first token: V0 = 0.25, V1 = 0.5 (the 9s are never read). gamma = 0.5, lambda = 1.
    # Turn rewards: R0 = 0.5 + 0 = 0.5, R1 = 0 + 0 + 1 = 1.
    # k=1: delta = 1 + 0.5*0 - 0.5 = 0.5, A1 = 0.5, return 0.5 + 0.5 = 1.0
    # k=0: delta = 0.5 + 0.5*0.5 - 0.25 = 0.5, A0 = 0.5 + 0.5*1*0.5 = 0.75, return 1.0
    rewards = T_([[0.5, 0., 0., 0., 1.]])
    values = T_([[0.25, 9., 0.5, 9., 9.]])
    ids = T_([[0, 0, 1, 1, 1]])
    adv, ret = turn_gae_advantages(rewards, values, B([1, 1, 1, 1, 1]), ids,
                                   discount=0.5, gae_lambda=1.0)
    assert close(adv, [[0.75, 0.75, 0.5, 0.5, 0.5]])
    assert close(ret, [[1.0, 1.0, 1.0, 1.0, 1.0]])


def test_gae_turn_level_with_tool_tokens_lambda_zero():
    # Turn 0 = positions 0-1, a tool token at 2 (mask 0, reward 7 ignored), turn 1 =
    # positions 3-4. r = [0, 0, 7, 0, 1], V(turn0) = 0.5, V(turn1) = 0.25, gamma = 1,
    # lambda = 0: A1 = 1 - 0.25 = 0.75; A0 = delta0 = 0 + 1*0.25 - 0.5 = -0.25.
    # Returns: turn0 -0.25 + 0.5 = 0.25, turn1 0.75 + 0.25 = 1.0. Position 2: 0.
    rewards = T_([[0., 0., 7., 0., 1.]])
    values = T_([[0.5, 3., 3., 0.25, 3.]])
    ids = T_([[0, 0, -1, 1, 1]])
    adv, ret = turn_gae_advantages(rewards, values, B([1, 1, 0, 1, 1]), ids,
                                   discount=1.0, gae_lambda=0.0)
    assert close(adv, [[-0.25, -0.25, 0., 0.75, 0.75]])
    assert close(ret, [[0.25, 0.25, 0., 1.0, 1.0]])


def test_gae_turn_level_one_turn_and_empty_row():
    # One turn of 3 tokens, r = [0, 0, 1], V = 0.25 at its first token:
    # A = 1 - 0.25 = 0.75 on every token, return 1. The fully masked row stays 0.
    adv, ret = turn_gae_advantages(T_([[0., 0., 1.], [1., 1., 1.]]), T_([[0.25, 5., 5.], [1., 1., 1.]]),
                                   B([1, 1, 1], [0, 0, 0]), T_([[0, 0, 0], [0, 0, 0]]),
                                   discount=0.9, gae_lambda=0.9)
    assert close(adv, [[0.75, 0.75, 0.75], [0., 0., 0.]])
    assert close(ret, [[1., 1., 1.], [0., 0., 0.]])


def test_turn_ids_from_boundaries_or_loss_mask_runs():
    def item(mask, bounds=()):
        n = len(mask)
        return SeqItem("g", [0] * (n + 1), 1, [0.0] * n, [0] * n, list(mask), 0.0, 0.0,
                       turn_boundaries=list(bounds))
    # Boundaries [0, 2] on 5 tokens: turns start at 0 and 2.
    assert turn_ids(item([1] * 5, [0, 2])) == [0, 0, 1, 1, 1]
    # Without 0: a boundary at 3 still makes tokens 0-2 turn 0 and 3-4 turn 1.
    assert turn_ids(item([1] * 5, [3])) == [0, 0, 0, 1, 1]
    # No boundaries: each run of trained tokens is a turn (tool tokens between).
    assert turn_ids(item([1, 1, 0, 0, 1, 1])) == [0, 0, 0, 0, 1, 1]
    assert turn_ids(item([0, 1, 1, 0, 1])) == [0, 0, 0, 0, 1]


# ---------------------------------------------------------------- clipped value loss

def test_clipped_value_loss_both_tokens_clipped():
    # eps = 0.25. Token 0: V = 1, V_old = 0.5, R = 2. Unclipped 0.5*(1-2)^2 = 0.5;
    # V_clip = 0.5 + clamp(0.5, +-0.25) = 0.75, 0.5*(0.75-2)^2 = 0.5*1.5625 = 0.78125.
    # Max 0.78125 (clipped). Token 1: V = 0, V_old = 0.5, R = 0. Unclipped 0;
    # V_clip = 0.5 - 0.25 = 0.25, 0.5*0.0625 = 0.03125 (clipped).
    # Token 2 is masked (V = 100 must not count). Loss = (0.78125 + 0.03125)/2 = 0.40625.
    values = T_([[1.0, 0.0, 100.0]], requires_grad=True)
    loss, stats = clipped_value_loss(values, T_([[0.5, 0.5, 0.5]]), T_([[2.0, 0.0, 0.0]]),
                                     B([1, 1, 0]), eps_clip=0.25)
    assert loss.item() == pytest.approx(0.40625)
    assert stats["value_clip_frac"] == pytest.approx(1.0)
    loss.backward()
    # Both maxima are the clipped branch, constant in V (V - V_old is outside the clip):
    # zero gradient everywhere.
    assert torch.equal(values.grad, torch.zeros_like(values))


def test_clipped_value_loss_inside_the_clip():
    # V = 0.6, V_old = 0.5 (|0.1| < eps 0.25): V_clip = V, loss = 0.5*0.6^2 = 0.18,
    # not counted as clipped; gradient d/dV 0.5*(V-R)^2 = V - R = 0.6.
    values = T_([[0.6]], requires_grad=True)
    loss, stats = clipped_value_loss(values, T_([[0.5]]), T_([[0.0]]), B([1]), eps_clip=0.25)
    assert loss.item() == pytest.approx(0.18)
    assert stats["value_clip_frac"] == 0.0
    loss.backward()
    assert values.grad.item() == pytest.approx(0.6)


def test_clipped_value_loss_empty_mask_is_zero():
    loss, stats = clipped_value_loss(T_([[1.0]]), T_([[0.0]]), T_([[5.0]]), B([0]), eps_clip=0.2)
    assert loss.item() == 0.0 and stats["value_clip_frac"] == 0.0


def test_explained_variance():
    # V = [0, 1], R = [0, 2]: Var(R) = ((0-1)^2 + (2-1)^2)/2 = 1; R - V = [0, 1] has
    # Var 0.25; EV = 1 - 0.25/1 = 0.75. The masked third token is ignored.
    assert explained_variance(T_([[0., 1., 9.]]), T_([[0., 2., -9.]]), B([1, 1, 0])) == pytest.approx(0.75)
    assert math.isnan(explained_variance(T_([[1., 1.]]), T_([[2., 2.]]), B([1, 1])))
    # Returns equal up to rounding (Var ~1e-18): undefined, not a huge negative number.
    assert math.isnan(explained_variance(T_([[0.5, 0.0]]), T_([[1e-9, -1e-9]]), B([1, 1])))


# ---------------------------------------------------------------- batch normalisation

def test_masked_batch_normalize_mean_and_std():
    # Trained tokens [1, 2, 3] over two rows (the 9s are masked). Mean 2, c = [-1, 0, 1].
    # Population std sqrt(2/3): c / sqrt(2/3) = c * sqrt(1.5) = [-1.2247449, 0, 1.2247449].
    # Unbiased std sqrt(2/2) = 1: [-1, 0, 1].
    x = T_([[1., 2., 9.], [3., 9., 9.]])
    m = B([1, 1, 0], [1, 0, 0])
    s = math.sqrt(1.5)
    assert close(masked_batch_normalize(x, m, eps=0.0), [[-s, 0., 0.], [s, 0., 0.]])
    assert close(masked_batch_normalize(x, m, eps=0.0, unbiased=True), [[-1., 0., 0.], [1., 0., 0.]])
    # eps is added to the std: c / (1 + 1) with eps = 1 (unbiased).
    assert close(masked_batch_normalize(x, m, eps=1.0, unbiased=True), [[-0.5, 0., 0.], [0.5, 0., 0.]])


def test_masked_batch_normalize_std_only_and_mean_only():
    # LitePPO's batch std of group-centred values: no centring, std around 0 =
    # sqrt((4+4+4+4)/4) = 2, so [2, -2, 2, -2] -> [1, -1, 1, -1] (eps 0).
    x = T_([[2., -2.], [2., -2.]])
    m = B([1, 1], [1, 1])
    assert close(masked_batch_normalize(x, m, center=False, eps=0.0), [[1., -1.], [1., -1.]])
    # Mean only: [1, 2, 3] - 2 = [-1, 0, 1]; leave-one-out: 3/2 * that = [-1.5, 0, 1.5].
    y, my = T_([[1., 2., 3.]]), B([1, 1, 1])
    assert close(masked_batch_normalize(y, my, scale=False), [[-1., 0., 1.]])
    assert close(masked_batch_normalize(y, my, scale=False, leave1out=True), [[-1.5, 0., 1.5]])


def test_masked_batch_normalize_edge_cases():
    # All equal -> exact zeros; one token -> zero when centred; empty mask -> zeros;
    # std step with no spread (std only, all zeros) leaves the values as they are.
    assert torch.equal(masked_batch_normalize(T_([[0.7, 0.7, 0.7]]), B([1, 1, 1])), torch.zeros(1, 3))
    assert torch.equal(masked_batch_normalize(T_([[5.0, 1.0]]), B([1, 0])), torch.zeros(1, 2))
    assert torch.equal(masked_batch_normalize(T_([[5.0, 1.0]]), B([0, 0])), torch.zeros(1, 2))
    assert torch.equal(masked_batch_normalize(T_([[0.0, 0.0]]), B([1, 1]), center=False),
                       torch.zeros(1, 2))
    # One token, std only, unbiased: d = 0, no std step, value kept: 5.
    assert close(masked_batch_normalize(T_([[5.0]]), B([1]), center=False, unbiased=True), [[5.0]])


def test_masked_batch_normalize_agrees_with_the_processor_reference():
    # The pure-Python normalize_batch on the trained tokens as a flat list gives the
    # same numbers (both sides hand-checked above; this pins the shared conventions).
    x = T_([[0.5, -1.0, 9.0], [2.0, 0.25, 9.0]])
    m = B([1, 1, 0], [1, 1, 0])
    flat = [0.5, -1.0, 2.0, 0.25]
    for kw in ({"mean_level": "batch", "std_level": "batch"},
               {"mean_level": "none", "std_level": "batch", "std_unbiased": True},
               {"mean_level": "batch", "std_level": "none", "mean_leave1out": True}):
        ref = normalize_batch(flat, eps=1e-6, **kw)
        got = masked_batch_normalize(x, m, center=kw["mean_level"] == "batch",
                                     scale=kw["std_level"] == "batch",
                                     leave1out=kw.get("mean_leave1out", False), eps=1e-6,
                                     unbiased=kw.get("std_unbiased", False))
        assert close(got[m], ref, tol=1e-6)


# ---------------------------------------------------------------- KL in the reward

def test_kl_penalty_rewards_k1_k2_k3():
    # logp = [-1, -2], ref = [-2, -1], kl_ctl = 0.5.
    # k1 = logp - ref = [1, -1]                       -> r = [-0.5, 0.5]
    # k2 = 0.5*(ref - logp)^2 = [0.5, 0.5]            -> r = [-0.25, -0.25]
    # k3 = exp(lr) - lr - 1, lr = ref - logp = [-1, 1] = [e^-1, e - 2]
    #    = [0.3678794, 0.7182818]                      -> r = [-0.1839397, -0.3591409]
    logp, ref, m = T_([[-1., -2.]]), T_([[-2., -1.]]), B([1, 1])
    r1, kl1 = kl_penalty_rewards(logp, ref, m, kl_ctl=0.5, kind="k1")
    assert close(r1, [[-0.5, 0.5]]) and close(kl1, [[1., -1.]])
    r2, _ = kl_penalty_rewards(logp, ref, m, kl_ctl=0.5, kind="k2")
    assert close(r2, [[-0.25, -0.25]])
    r3, _ = kl_penalty_rewards(logp, ref, m, kl_ctl=0.5, kind="k3")
    assert close(r3, [[-0.1839397, -0.3591409]])


def test_kl_penalty_is_clamped_and_masked():
    # k1 = 0 - (-50) = 50, clamped to 10 (AReaL): r = -0.1*10 = -1. The masked token
    # (k1 = -50 there) contributes 0.
    r, kl = kl_penalty_rewards(T_([[0., -50.]]), T_([[-50., 0.]]), B([1, 0]), kl_ctl=0.1, kind="k1")
    assert close(r, [[-1.0, 0.0]]) and close(kl, [[10.0, 0.0]])


def test_kl_in_reward_then_returns_gives_group_advantage_plus_future_penalty():
    # Group advantage 1 at the last token, k1 = [1, -1], kl_ctl = 0.5:
    # r = [-0.5, 0.5 + 1] = [-0.5, 1.5]; returns (gamma 1) = [1.0, 1.5]
    # = 1 + (future KL penalties: -0.5 + 0.5 = 0, then 0.5).
    m = B([1, 1])
    kl_r, _ = kl_penalty_rewards(T_([[-1., -2.]]), T_([[-2., -1.]]), m, kl_ctl=0.5, kind="k1")
    r = terminal_rewards(T_([1.0]), m) + kl_r
    assert close(r, [[-0.5, 1.5]])
    assert close(discounted_returns(r, m, discount=1.0), [[1.0, 1.5]])
    # With a critic (V = [0.5, 0.5], gamma = lambda = 1): A = G - V = [0.5, 1.0].
    adv, _ = gae_advantages(r, T_([[0.5, 0.5]]), m, discount=1.0, gae_lambda=1.0)
    assert close(adv, [[0.5, 1.0]])
