"""Golden numeric tests for tapioca.algorithms: advantages, KL estimators, aggregation.

Every expected value is derived by hand in a comment from the formula; none is
copied from running the code.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tapioca.algorithms.advantages import (
    ESTIMATORS,
    GROUP_BASELINE_ESTIMATORS,
    group_advantages,
    shape_reward,
)
from tapioca.algorithms.aggregation import aggregate_loss
from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.kl import kl_estimate
from tapioca.schemas.errors import TapiocaError

LN2 = math.log(2.0)


# ----------------------------------------------------------------- shape_reward


def test_shape_reward_bias_then_scale():
    # (1 + (-0.5)) * 2 = 1.0 ; bias applies before scale.
    assert shape_reward(1.0, bias=-0.5, scale=2.0) == pytest.approx(1.0)
    # Defaults are the identity.
    assert shape_reward(0.25) == 0.25


def test_shape_reward_clip_both_sides():
    # (3 + 0) * 2 = 6 -> clipped to 5 ; (-3) * 2 = -6 -> clipped to -5.
    assert shape_reward(3.0, scale=2.0, clip=5.0) == 5.0
    assert shape_reward(-3.0, scale=2.0, clip=5.0) == -5.0
    # Inside the band: (0.5 + 1) * 2 = 3, untouched.
    assert shape_reward(0.5, bias=1.0, scale=2.0, clip=5.0) == pytest.approx(3.0)
    # No clip: 6 stays 6.
    assert shape_reward(3.0, scale=2.0) == 6.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_shape_reward_rejects_non_finite(bad):
    with pytest.raises(ValueError):
        shape_reward(bad)
    with pytest.raises(ValueError):
        shape_reward(1.0, scale=bad)


# ------------------------------------------------------------- group_advantages


def test_grpo_population_std_default():
    # rewards [1,0,0,1]: mean 0.5, centred [.5,-.5,-.5,.5],
    # population var = 4 * 0.25 / 4 = 0.25, std 0.5 -> +-0.5 / (0.5 + 1e-6).
    x = 0.5 / (0.5 + 1e-6)
    assert group_advantages([1, 0, 0, 1]) == pytest.approx([x, -x, -x, x], rel=1e-12)


def test_grpo_three_values_eps_zero():
    # rewards [0,1,2]: mean 1, centred [-1,0,1], population var 2/3,
    # std sqrt(2/3) -> advantages +-1/sqrt(2/3) = +-sqrt(1.5) = +-1.2247449.
    adv = group_advantages([0.0, 1.0, 2.0], eps=0.0)
    assert adv == pytest.approx([-1.2247449, 0.0, 1.2247449], abs=1e-7)


def test_grpo_bessel_std():
    # rewards [1,0,0,1], std_unbiased: var = 1.0 / 3, std = 0.5773503,
    # with eps 0: 0.5 / 0.5773503 = sqrt(3)/2 = 0.8660254.
    adv = group_advantages([1, 0, 0, 1], eps=0.0, std_unbiased=True)
    assert adv == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], abs=1e-7)


def test_grpo_eps_is_added_to_std():
    # rewards [0,2]: mean 1, centred [-1,1], population std 1;
    # eps 1.0 added (not max, not under sqrt): -1/(1+1) = -0.5.
    assert group_advantages([0.0, 2.0], eps=1.0) == pytest.approx([-0.5, 0.5])


def test_dr_grpo_is_centred_reward():
    # [1,0,0,1] -> r - 0.5 ; [0,1,2] -> r - 1 ; no std division.
    assert group_advantages([1, 0, 0, 1], estimator="dr_grpo") == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert group_advantages([0, 1, 2], estimator="dr_grpo") == pytest.approx([-1.0, 0.0, 1.0])


def test_rloo_leave_one_out_baseline():
    # [1,0,0,1]: r=1 -> others mean (0+0+1)/3 = 1/3 -> 2/3 ;
    #            r=0 -> others mean (1+0+1)/3 = 2/3 -> -2/3.
    t = 2.0 / 3.0
    assert group_advantages([1, 0, 0, 1], estimator="rloo") == pytest.approx([t, -t, -t, t])
    # [0,1,2]: r=0 -> others mean 1.5 -> -1.5 ; r=1 -> others mean 1 -> 0 ;
    #          r=2 -> others mean 0.5 -> 1.5.
    assert group_advantages([0, 1, 2], estimator="rloo") == pytest.approx([-1.5, 0.0, 1.5])


@pytest.mark.parametrize("estimator", GROUP_BASELINE_ESTIMATORS)
@pytest.mark.parametrize("unbiased", [False, True])
def test_singleton_group_is_zero(estimator, unbiased):
    # Documented choice: no baseline for n == 1 -> advantage 0.0 (for every estimator
    # that subtracts a group mean; reinforce_pp and gae: tests/unit/test_golden_advantages.py).
    assert group_advantages([5.0], estimator=estimator, std_unbiased=unbiased) == [0.0]


@pytest.mark.parametrize("estimator", GROUP_BASELINE_ESTIMATORS)
def test_all_equal_rewards_exact_zeros(estimator):
    # 0.1 is not exactly representable; the mean of [0.1]*3 may round, but the
    # documented behaviour is exact zeros.
    assert group_advantages([0.1, 0.1, 0.1], estimator=estimator) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7] * 5, estimator=estimator, std_unbiased=True) == [0.0] * 5


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as info:
        group_advantages([1.0, 0.0], estimator="ppo")
    for name in ESTIMATORS:
        assert name in str(info.value)
    assert isinstance(info.value, TapiocaError)


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError):
        group_advantages([])
    with pytest.raises(ValueError):
        group_advantages([1.0, math.nan])
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0], eps=-1.0)


def test_advantages_module_does_not_import_torch():
    code = (
        "import sys; import tapioca.algorithms.advantages; "
        "sys.exit(1 if 'torch' in sys.modules or 'numpy' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ------------------------------------------------------------------------ KL


def _kl_inputs():
    # d = logp - ref = [ln2, 0, -ln2]
    logp = torch.tensor([[0.0, -1.0, -LN2]], dtype=torch.float64)
    ref = torch.tensor([[-LN2, -1.0, 0.0]], dtype=torch.float64)
    return logp, ref


def test_kl_k1():
    # k1 = logp - ref = [ln2, 0, -ln2] = [0.6931472, 0, -0.6931472]
    logp, ref = _kl_inputs()
    expected = torch.tensor([[0.6931472, 0.0, -0.6931472]], dtype=torch.float64)
    assert torch.allclose(kl_estimate(logp, ref, "k1"), expected, atol=1e-7)


def test_kl_k2():
    # k2 = 0.5 * d^2 = [0.5*ln2^2, 0, 0.5*ln2^2] = [0.2402265, 0, 0.2402265]
    logp, ref = _kl_inputs()
    expected = torch.tensor([[0.2402265, 0.0, 0.2402265]], dtype=torch.float64)
    assert torch.allclose(kl_estimate(logp, ref, "k2"), expected, atol=1e-7)


def test_kl_k3():
    # log_r = ref - logp = [-ln2, 0, ln2];  k3 = exp(log_r) - log_r - 1:
    #   0.5 + ln2 - 1 = 0.1931472 ; 1 - 0 - 1 = 0 ; 2 - ln2 - 1 = 0.3068528
    logp, ref = _kl_inputs()
    expected = torch.tensor([[0.1931472, 0.0, 0.3068528]], dtype=torch.float64)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), expected, atol=1e-7)


def test_kl_gradient_flows_and_bad_args():
    logp, ref = _kl_inputs()
    logp.requires_grad_(True)
    # d k1 / d logp = 1 everywhere.
    kl_estimate(logp, ref, "k1").sum().backward()
    assert torch.equal(logp.grad, torch.ones_like(logp))
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")
    with pytest.raises(ValueError):
        kl_estimate(logp, ref[:, :2], "k1")


# ---------------------------------------------------------------- aggregation


def _agg_inputs():
    loss = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    return loss, mask


# Row 0 keeps {1,2}, row 1 keeps {5,6,7}, row 2 is fully masked (padding).
AGG_GOLDEN = {
    # (1+2+5+6+7) / 5 tokens = 21/5
    "token-mean": 4.2,
    # seq sums [3, 18]; mean over the 2 non-empty sequences = 21/2
    "seq-mean-token-sum": 10.5,
    # seq means [1.5, 6]; mean over 2 = 7.5/2
    "seq-mean-token-mean": 3.75,
    # seq sums / max_tokens=4: [0.75, 4.5]; mean over 2 = 5.25/2
    "seq-mean-token-sum-norm": 2.625,
}


@pytest.mark.parametrize("mode", sorted(AGG_GOLDEN))
def test_aggregation_modes(mode):
    loss, mask = _agg_inputs()
    got = aggregate_loss(loss, mask, mode, max_tokens=4)
    assert got.item() == pytest.approx(AGG_GOLDEN[mode], abs=1e-12)


@pytest.mark.parametrize("mode", sorted(AGG_GOLDEN))
def test_aggregation_ignores_nan_in_masked_positions(mode):
    loss, mask = _agg_inputs()
    loss[2, 0] = math.nan
    loss[0, 3] = math.inf
    loss.requires_grad_(True)
    got = aggregate_loss(loss, mask, mode, max_tokens=4)
    assert got.item() == pytest.approx(AGG_GOLDEN[mode], abs=1e-12)
    got.backward()
    assert torch.isfinite(loss.grad).all()
    assert (loss.grad[~mask] == 0).all()


def test_token_mean_gradient():
    # d/dloss of sum/5 = 1/5 = 0.2 on each of the 5 kept tokens.
    loss, mask = _agg_inputs()
    loss.requires_grad_(True)
    aggregate_loss(loss, mask, "token-mean").backward()
    assert torch.allclose(loss.grad, 0.2 * mask.double())


def test_seq_mean_token_mean_gradient():
    # row 0: 1/(2 tokens * 2 seqs) = 0.25 ; row 1: 1/(3 * 2) = 1/6 ; row 2: 0.
    loss, mask = _agg_inputs()
    loss.requires_grad_(True)
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    expected = torch.tensor([[0.25, 0.25, 0, 0], [1 / 6, 1 / 6, 1 / 6, 0], [0, 0, 0, 0]], dtype=torch.float64)
    assert torch.allclose(loss.grad, expected)


@pytest.mark.parametrize("mode", sorted(AGG_GOLDEN))
def test_fully_masked_batch_is_zero_not_nan(mode):
    loss = torch.randn(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    got = aggregate_loss(loss, mask, mode, max_tokens=3)
    assert got.item() == 0.0
    got.backward()
    assert torch.equal(loss.grad, torch.zeros_like(loss))


def test_aggregation_float_mask_and_bad_args():
    loss, mask = _agg_inputs()
    # A 0/1 float mask means the same as the bool mask.
    assert aggregate_loss(loss, mask.double()).item() == pytest.approx(4.2)
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")  # needs max_tokens
    with pytest.raises(ValueError) as info:
        aggregate_loss(loss, mask, "token-sum")
    assert "token-mean" in str(info.value)
    with pytest.raises(AlgorithmInputError):
        aggregate_loss(loss, mask[:, :2])
