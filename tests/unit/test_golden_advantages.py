"""Golden numbers for every advantage estimator, normalisation level and reward shaping.

Every expected value is written out and derived by hand in a comment from the formula
(module docstrings of tapioca.algorithms.advantages and .reward_shaping); none is
copied from running the code. Tolerances are 1e-7 on 7-decimal hand values.
"""

from __future__ import annotations

import math

import pytest

from tapioca.algorithms.advantages import (
    ESTIMATOR_NORMS,
    ESTIMATORS,
    GROUP_BASELINE_ESTIMATORS,
    check_reward_norm,
    estimator_norm,
    group_advantages,
    normalize_batch,
    normalize_group,
    normalize_rewards,
)
from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.reward_shaping import overlong_penalty, weighted_reward

A = dict(abs=1e-7)

# The running example: r = [3, 1, 0, 0], n = 4, sum 4, mean 1,
# centred c = [2, 0, -1, -1], sum c^2 = 4 + 0 + 1 + 1 = 6,
# population var 6/4 = 1.5 -> std sqrt(1.5) = 1.2247449,
# Bessel var 6/3 = 2 -> std sqrt(2) = 1.4142136.
R = [3.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------ estimators


def test_estimator_presets_are_the_documented_levels():
    # The table of docs/algorithms.md, written out: (mean_level, std_level, leave1out).
    table = {
        "grpo": ("group", "group", False),
        "dr_grpo": ("group", "none", False),
        "lite_ppo": ("group", "batch", False),
        "rloo": ("group", "none", True),
        "reinforce_pp": ("batch", "batch", False),
        "reinforce_pp_baseline": ("group", "batch", False),
        "gae": ("batch", "batch", False),
    }
    assert set(ESTIMATORS) == set(table)
    for name, (mean, std, loo) in table.items():
        n = ESTIMATOR_NORMS[name]
        assert (n["mean_level"], n["std_level"], n["mean_leave1out"]) == (mean, std, loo)


def test_grpo_population_std():
    # c / (sqrt(1.5) + 0): 2/1.2247449 = 1.6329932 ; -1/1.2247449 = -0.8164966.
    adv = group_advantages(R, estimator="grpo", eps=0.0)
    assert adv == pytest.approx([1.6329932, 0.0, -0.8164966, -0.8164966], **A)


def test_grpo_default_eps_is_added_to_the_std():
    # 2 / (1.22474487 + 1e-6) = 1.63299316 * (1 - 1e-6/1.22474487) = 1.63299316 - 0.00000133
    # = 1.63299183 ; -1 / 1.22474587 = -0.81649658 + 0.00000067 = -0.81649591.
    adv = group_advantages(R, estimator="grpo")
    assert adv == pytest.approx([1.6329918, 0.0, -0.8164959, -0.8164959], abs=1e-7)


def test_grpo_bessel_std():
    # c / sqrt(2): 2/1.4142136 = 1.4142136 ; -1/1.4142136 = -0.7071068.
    adv = group_advantages(R, estimator="grpo", eps=0.0, std_unbiased=True)
    assert adv == pytest.approx([1.4142136, 0.0, -0.7071068, -0.7071068], **A)


@pytest.mark.parametrize("estimator", ["dr_grpo", "lite_ppo", "reinforce_pp_baseline"])
def test_group_mean_only_estimators_are_centred_rewards(estimator):
    # r - mean = [3-1, 1-1, 0-1, 0-1]; lite_ppo / reinforce_pp_baseline divide by the
    # batch std later, in the trainer (see test_batch_std_after_group_mean).
    assert group_advantages(R, estimator=estimator) == pytest.approx([2.0, 0.0, -1.0, -1.0], **A)


def test_rloo_leave_one_out_mean():
    # r=3: others (1+0+0)/3 = 1/3 -> 8/3 = 2.6666667 ; r=1: others (3+0+0)/3 = 1 -> 0 ;
    # r=0: others (3+1+0)/3 = 4/3 -> -4/3 = -1.3333333.
    adv = group_advantages(R, estimator="rloo")
    assert adv == pytest.approx([2.6666667, 0.0, -1.3333333, -1.3333333], **A)


def test_reinforce_pp_has_no_group_baseline():
    # mean_level batch, std_level batch: nothing happens at group level.
    assert group_advantages(R, estimator="reinforce_pp") == [3.0, 1.0, 0.0, 0.0]


def test_gae_leaves_advantages_to_the_trainer():
    assert group_advantages(R, estimator="gae") == [0.0, 0.0, 0.0, 0.0]


# --------------------------------------------------------- group-level levels


def test_std_without_mean_is_the_root_mean_square():
    # mean_level none: the std is taken around 0 (AReaL's convention):
    # sum r^2 = 9 + 1 = 10, /4 = 2.5, sqrt 1.5811388 ; 3/1.5811388 = 1.8973666,
    # 1/1.5811388 = 0.6324555.
    adv = normalize_group(R, mean_level="none", std_level="group", eps=0.0)
    assert adv == pytest.approx([1.8973666, 0.6324555, 0.0, 0.0], **A)


def test_leave_one_out_mean_with_group_std_equals_grpo():
    # Leave-one-out centring is n/(n-1) times the plain one: c' = 4/3 c =
    # [8/3, 0, -4/3, -4/3]; sum c'^2 = 64/9 + 16/9 + 16/9 = 32/3, /4 = 8/3, std 1.6329932;
    # (8/3)/1.6329932 = 1.6329932, (-4/3)/1.6329932 = -0.8164966: the GRPO numbers
    # (the std scales with the centring), with eps = 0.
    adv = normalize_group(R, mean_level="group", mean_leave1out=True, std_level="group",
                          eps=0.0)
    assert adv == pytest.approx([1.6329932, 0.0, -0.8164966, -0.8164966], **A)


def test_batch_levels_do_nothing_at_group_level():
    assert normalize_group(R, mean_level="batch", std_level="batch") == R
    assert normalize_group(R, mean_level="none", std_level="none") == R
    # group mean, batch std: only the centring: [2, 0, -1, -1].
    assert normalize_group(R, mean_level="group", std_level="batch") == [2.0, 0.0, -1.0, -1.0]


def test_two_samples_with_and_without_bessel():
    # r = [1, 3]: mean 2, c = [-1, 1], sum c^2 = 2.
    # population: var 2/2 = 1, std 1 -> [-1, 1] ; Bessel: var 2/1 = 2, std 1.4142136
    # -> [-0.7071068, 0.7071068].
    assert normalize_group([1.0, 3.0], eps=0.0) == pytest.approx([-1.0, 1.0], **A)
    assert normalize_group([1.0, 3.0], eps=0.0, std_unbiased=True) == pytest.approx(
        [-0.7071068, 0.7071068], **A)
    # eps 1e-6 added to std 1: -1/1.000001 = -0.999999000001.
    assert normalize_group([1.0, 3.0]) == pytest.approx([-0.999999000001, 0.999999000001],
                                                        abs=1e-12)


# ----------------------------------------------------------------- edge cases


@pytest.mark.parametrize("estimator", GROUP_BASELINE_ESTIMATORS)
@pytest.mark.parametrize("unbiased", [False, True])
def test_singleton_with_a_group_mean_is_zero(estimator, unbiased):
    assert group_advantages([5.0], estimator=estimator, std_unbiased=unbiased) == [0.0]


def test_singleton_without_a_group_mean():
    # reinforce_pp: the raw reward passes (the batch gives it a baseline); gae: 0.
    assert group_advantages([5.0], estimator="reinforce_pp") == [5.0]
    assert group_advantages([5.0], estimator="gae") == [0.0]
    # A group std of one sample is undefined: skipped, population or Bessel.
    for unbiased in (False, True):
        assert normalize_group([5.0], mean_level="none", std_level="group",
                               std_unbiased=unbiased) == [5.0]


@pytest.mark.parametrize("estimator", GROUP_BASELINE_ESTIMATORS)
def test_all_equal_rewards_are_exact_zeros(estimator):
    # 0.1 is not exact in binary; the mean of three may round. Still exact zeros.
    assert group_advantages([0.1, 0.1, 0.1], estimator=estimator) == [0.0, 0.0, 0.0]
    assert normalize_group([0.3] * 4, mean_leave1out=True, std_unbiased=True) == [0.0] * 4


def test_all_equal_rewards_without_a_group_mean():
    # reinforce_pp: untouched. std only (RMS of [2, 2] = 2): 2/2 = 1 each, eps 0.
    assert group_advantages([0.7, 0.7], estimator="reinforce_pp") == [0.7, 0.7]
    assert normalize_group([2.0, 2.0], mean_level="none", std_level="group",
                           eps=0.0) == pytest.approx([1.0, 1.0], **A)
    # All zeros: RMS 0, nothing to scale, no 0/0 even with eps 0.
    assert normalize_group([0.0, 0.0], mean_level="none", std_level="group",
                           eps=0.0) == [0.0, 0.0]


def test_extreme_values_do_not_overflow_the_std():
    # [1e300, -1e300]: mean 0, c = +-1e300; squares would overflow to inf, so the std is
    # computed on c / 1e300 = +-1: population std = 1e300 * sqrt(2/2) = 1e300 ->
    # +-1e300 / (1e300 + 1e-6) = +-1.0 ; Bessel std = 1e300 * sqrt(2) -> +-0.7071068.
    assert normalize_group([1e300, -1e300]) == pytest.approx([1.0, -1.0], **A)
    assert normalize_group([1e300, -1e300], std_unbiased=True) == pytest.approx(
        [0.7071068, -0.7071068], **A)
    # Tiny: [1e-300, -1e-300] with eps 0 -> +-1 ; with eps 1e-6 the eps dominates:
    # 1e-300 / (1e-300 + 1e-6) = 1e-294 (relative).
    assert normalize_group([1e-300, -1e-300], eps=0.0) == pytest.approx([1.0, -1.0], **A)
    assert normalize_group([1e-300, -1e-300])[0] == pytest.approx(1e-294, rel=1e-9)
    # A wide but finite spread: [1e6, 0] -> mean 5e5, c = +-5e5, std 5e5 ->
    # 5e5 / (5e5 + 1e-6) = 1 - 2e-12.
    assert normalize_group([1e6, 0.0]) == pytest.approx([1 - 2e-12, -(1 - 2e-12)], abs=1e-15)


def test_bad_normalisations_are_rejected_with_the_fix():
    with pytest.raises(AlgorithmInputError, match="batch mean"):
        normalize_group(R, mean_level="batch", std_level="group")
    with pytest.raises(AlgorithmInputError, match="group, batch, none"):
        normalize_group(R, mean_level="token", std_level="group")
    with pytest.raises(AlgorithmInputError, match="mean_leave1out"):
        normalize_group(R, mean_level="none", std_level="none", mean_leave1out=True)
    with pytest.raises(AlgorithmInputError, match="eps"):
        normalize_group(R, eps=-1.0)
    with pytest.raises(AlgorithmInputError, match="non-finite"):
        normalize_group([1.0, math.inf])
    with pytest.raises(AlgorithmInputError, match="empty"):
        normalize_group([])


# ------------------------------------------------ batch levels (trainer reference)


def test_batch_std_after_group_mean():
    # lite_ppo over two groups: [1, 0] -> c [0.5, -0.5] ; [2, 0] -> c [1, -1].
    # Batch std around the subtracted group means (batch mean of c is 0):
    # sum c^2 = 0.25 + 0.25 + 1 + 1 = 2.5, /4 = 0.625, std 0.7905694 ;
    # 0.5/0.7905694 = 0.6324555, 1/0.7905694 = 1.2649111 (eps 0).
    norm = estimator_norm("lite_ppo", eps=0.0)
    c = normalize_group([1.0, 0.0], **norm) + normalize_group([2.0, 0.0], **norm)
    assert c == [0.5, -0.5, 1.0, -1.0]
    adv = normalize_batch(c, **norm)
    assert adv == pytest.approx([0.6324555, -0.6324555, 1.2649111, -1.2649111], **A)
    # Bessel over the batch: 2.5/3 = 0.8333333, std 0.9128709 ; 0.5/0.9128709 = 0.5477226,
    # 1/0.9128709 = 1.0954451.
    adv = normalize_batch(c, **estimator_norm("lite_ppo", eps=0.0, std_unbiased=True))
    assert adv == pytest.approx([0.5477226, -0.5477226, 1.0954451, -1.0954451], **A)


def test_reinforce_pp_batch_mean_and_std():
    # The batch [3, 1, 0, 0] as one batch: the GRPO numbers of the running example.
    adv = normalize_batch(R, **estimator_norm("reinforce_pp", eps=0.0))
    assert adv == pytest.approx([1.6329932, 0.0, -0.8164966, -0.8164966], **A)
    # Leave-one-out batch mean, no std: 4/3 * c = [8/3, 0, -4/3, -4/3].
    adv = normalize_batch(R, mean_level="batch", mean_leave1out=True, std_level="none")
    assert adv == pytest.approx([2.6666667, 0.0, -1.3333333, -1.3333333], **A)


def test_group_levels_do_nothing_at_batch_level():
    assert normalize_batch(R, **estimator_norm("dr_grpo")) == R
    assert normalize_batch(R, **estimator_norm("grpo")) == R


# ----------------------------------------------------------- overlong penalty


@pytest.mark.parametrize("length, expected", [
    (10, 0.0),   # under max_new - overlong = 20 - 4 = 16: no penalty
    (16, 0.0),   # exactly at the threshold: exceed 0 -> 0
    (17, -0.25),  # exceed 1: -1/4 * 1.0
    (18, -0.5),   # -2/4
    (20, -1.0),   # at max_new_tokens: -4/4 = -factor
    (22, -1.5),   # past the limit it keeps falling (not floored), as in AReaL
])
def test_overlong_penalty_linear_tail(length, expected):
    got = overlong_penalty(length, max_new_tokens=20, overlong_tokens=4,
                           overlong_penalty_factor=1.0)
    assert got == pytest.approx(expected, **A)


def test_overlong_penalty_factor_and_bad_arguments():
    # factor 0.5, L = 19: exceed 3 -> -3/4 * 0.5 = -0.375.
    assert overlong_penalty(19, max_new_tokens=20, overlong_tokens=4,
                            overlong_penalty_factor=0.5) == pytest.approx(-0.375, **A)
    # factor 0: never a penalty (and not -0.0).
    assert math.copysign(1.0, overlong_penalty(20, max_new_tokens=20, overlong_tokens=4,
                                               overlong_penalty_factor=0.0)) == 1.0
    with pytest.raises(AlgorithmInputError, match="overlong_tokens"):
        overlong_penalty(5, max_new_tokens=4, overlong_tokens=8, overlong_penalty_factor=1.0)
    with pytest.raises(AlgorithmInputError, match="overlong_penalty_factor"):
        overlong_penalty(5, max_new_tokens=8, overlong_tokens=4, overlong_penalty_factor=-1.0)


# -------------------------------------------------------------- reward weights


def test_weighted_reward_sums_weighted_sources_only():
    # 1.0 * 1.0 + (-0.5) * 0.4 = 1.0 - 0.2 = 0.8 ; "extra" has no weight: not summed.
    got = weighted_reward({"acc": 1.0, "len": 0.4, "extra": 9.0}, {"acc": 1.0, "len": -0.5})
    assert got == pytest.approx(0.8, **A)
    # 0.25 * 2 + 2 * 0.1 = 0.5 + 0.2 = 0.7.
    assert weighted_reward({"a": 2.0, "b": 0.1}, {"a": 0.25, "b": 2.0}) == pytest.approx(0.7, **A)


def test_weighted_reward_needs_every_weighted_source():
    with pytest.raises(AlgorithmInputError, match="judge"):
        weighted_reward({"acc": 1.0}, {"acc": 1.0, "judge": 0.5})


def test_whole_shaping_pipeline_in_the_processor_order():
    # weights acc 1, judge 0.5 ; max_new 10, overlong_tokens 4 (penalty from L > 6),
    # factor 1 ; bias -0.5, scale 2 ; then GRPO with eps 0.
    # t0: 1 + 0.5*0.4 = 1.2, L 5 -> +0          -> (1.2 - 0.5)*2 =  1.4
    # t1: 1 + 0.5*1.0 = 1.5, L 8 -> -(8-6)/4    -> (1.0 - 0.5)*2 =  1.0
    # t2: 0 + 0.5*0.2 = 0.1, L 10 -> -(10-6)/4  -> (-0.9 - 0.5)*2 = -2.8
    # mean -0.4/3 = -0.1333333 ; c = [1.5333333, 1.1333333, -2.6666667] ;
    # sum c^2 = 2.3511111 + 1.2844444 + 7.1111111 = 10.7466667, /3 = 3.5822222,
    # std 1.8926759 ; A = [0.8101404, 0.5987995, -1.4089399].
    from tapioca.algorithms.advantages import shape_reward

    weights = {"acc": 1.0, "judge": 0.5}
    scores = [({"acc": 1.0, "judge": 0.4}, 5), ({"acc": 1.0, "judge": 1.0}, 8),
              ({"acc": 0.0, "judge": 0.2}, 10)]
    shaped = [shape_reward(weighted_reward(s, weights)
                           + overlong_penalty(n, max_new_tokens=10, overlong_tokens=4,
                                              overlong_penalty_factor=1.0),
                           bias=-0.5, scale=2.0) for s, n in scores]
    assert shaped == pytest.approx([1.4, 1.0, -2.8], **A)
    adv = normalize_group(shaped, eps=0.0)
    assert adv == pytest.approx([0.8101404, 0.5987995, -1.4089399], **A)


# ------------------------------------------------------------------ reward_norm
# AReaL's reward_norm: the same formula as the advantage normalisation, applied to the
# shaped rewards of one group before the estimator; the estimator then sees r'.


def test_reward_norm_group_mean_and_std_then_grpo_eps_zero():
    # r' = c / s = [2, 0, -1, -1] / 1.2247449 = [1.6329932, 0, -0.8164966, -0.8164966].
    # GRPO on r': mean(r') = (1.6329932 - 2*0.8164966)/4 = 0, and its population std is
    # s/s = 1, so A = r' / (1 + 0) = r' (GRPO on group-normalised rewards changes nothing).
    rn = normalize_rewards(R, mean_level="group", std_level="group", eps=0.0)
    assert rn == pytest.approx([1.6329932, 0.0, -0.8164966, -0.8164966], **A)
    adv = group_advantages(rn, estimator="grpo", eps=0.0)
    assert adv == pytest.approx([1.6329932, 0.0, -0.8164966, -0.8164966], **A)


def test_reward_norm_then_grpo_with_default_eps_applies_eps_twice():
    # r'_0 = 2 / (1.22474487 + 1e-6) = 1.63299183 (test_grpo_default_eps_is_added_to_the_std).
    # std(r') = s/(s + eps) = 1 - 1e-6/1.22474587 = 1 - 8.1649592e-7 ;
    # GRPO divides by std(r') + eps = 1 + 1e-6 - 8.1649592e-7 = 1 + 1.8350408e-7:
    # A_0 = 1.63299183 * (1 - 1.8350408e-7) = 1.63299183 - 0.00000030 = 1.63299153 ;
    # A_2 = -0.81649591 * (1 - 1.8350408e-7) = -0.81649591 + 0.00000015 = -0.81649576.
    rn = normalize_rewards(R)
    assert rn == pytest.approx([1.6329918, 0.0, -0.8164959, -0.8164959], **A)
    adv = group_advantages(rn, estimator="grpo")
    assert adv == pytest.approx([1.6329915, 0.0, -0.8164958, -0.8164958], **A)


def test_reward_norm_std_only_then_dr_grpo():
    # mean_level none: scaled by the group RMS, sqrt((9 + 1 + 0 + 0)/4) = sqrt(2.5) =
    # 1.5811388 ; r' = [3, 1, 0, 0]/1.5811388 = [1.8973666, 0.6324555, 0, 0].
    # Dr. GRPO subtracts mean(r') = 2.5298221/4 = 0.6324555:
    # A = [1.2649111, 0, -0.6324555, -0.6324555] (= [2, 0, -1, -1] / 1.5811388).
    rn = normalize_rewards(R, mean_level="none", std_level="group", eps=0.0)
    assert rn == pytest.approx([1.8973666, 0.6324555, 0.0, 0.0], **A)
    adv = group_advantages(rn, estimator="dr_grpo")
    assert adv == pytest.approx([1.2649111, 0.0, -0.6324555, -0.6324555], **A)


def test_reward_norm_leave_one_out_then_reinforce_pp():
    # Leave-one-out mean, no std: r_i - (sum - r_i)/(n - 1) with sum 4, n 4:
    # 3 - 1/3 = 2.6666667 ; 1 - 3/3 = 0 ; 0 - 4/3 = -1.3333333 (twice).
    # REINFORCE++ has no group level: the advantage it passes on is r' itself.
    rn = normalize_rewards(R, mean_level="group", mean_leave1out=True, std_level="none")
    assert rn == pytest.approx([2.6666667, 0.0, -1.3333333, -1.3333333], **A)
    assert group_advantages(rn, estimator="reinforce_pp") == pytest.approx(rn, **A)


def test_reward_norm_leave_one_out_with_bessel_std():
    # centred 4/3 * [2, 0, -1, -1] = [8/3, 0, -4/3, -4/3] ; sum of squares
    # 64/9 + 16/9 + 16/9 = 96/9 = 10.6666667, /(n-1) = 3.5555556, std 1.8856181 ;
    # r' = [2.6666667/1.8856181, 0, -1.3333333/1.8856181] = [1.4142136, 0, -0.7071068]
    # (= the plain Bessel GRPO numbers: leave-one-out only rescales the centring).
    rn = normalize_rewards(R, mean_level="group", mean_leave1out=True, std_level="group",
                           std_unbiased=True, eps=0.0)
    assert rn == pytest.approx([1.4142136, 0.0, -0.7071068, -0.7071068], **A)


@pytest.mark.parametrize("loo", [False, True])
def test_reward_norm_all_equal_and_singleton_groups_are_exact_zeros(loo):
    # A group mean is subtracted: no relative signal, exactly 0 (never round-off).
    kw = dict(mean_level="group", std_level="group", mean_leave1out=loo)
    assert normalize_rewards([0.7, 0.7, 0.7], **kw) == [0.0, 0.0, 0.0]
    assert normalize_rewards([5.0], **kw) == [0.0]


def test_reward_norm_without_a_group_mean_on_all_equal_and_singleton_groups():
    # std only: all-equal [0.7] * 3 has RMS 0.7, so r' = 0.7/0.7 = 1 each (eps 0);
    # a singleton has no std: left as is, 5.
    kw = dict(mean_level="none", std_level="group", eps=0.0)
    assert normalize_rewards([0.7, 0.7, 0.7], **kw) == pytest.approx([1.0, 1.0, 1.0], **A)
    assert normalize_rewards([5.0], **kw) == [5.0]
    # Both levels none: the rewards unchanged.
    assert normalize_rewards(R, mean_level="none", std_level="none") == R


@pytest.mark.parametrize("levels", [("batch", "batch"), ("group", "batch"), ("batch", "none"),
                                    ("none", "batch")])
def test_reward_norm_batch_levels_are_refused_with_the_alternative(levels):
    mean, std = levels
    with pytest.raises(AlgorithmInputError, match="not supported for reward_norm.*one group at "
                       "a time.*advantage.adv_norm batch levels"):
        check_reward_norm(mean_level=mean, std_level=std)
    with pytest.raises(AlgorithmInputError, match="adv_norm batch levels"):
        normalize_rewards(R, mean_level=mean, std_level=std)


def test_reward_norm_bad_values_are_rejected():
    with pytest.raises(AlgorithmInputError, match="use one of group, batch, none"):
        check_reward_norm(mean_level="prompt", std_level="group")
    with pytest.raises(AlgorithmInputError, match="mean_leave1out needs"):
        check_reward_norm(mean_level="none", std_level="group", mean_leave1out=True)
    with pytest.raises(AlgorithmInputError, match="non-finite"):
        normalize_rewards([1.0, float("nan")])
    with pytest.raises(AlgorithmInputError, match="empty"):
        normalize_rewards([])


# --- adv_norm.group_unit token: AReaL's token-weighted group levels ---------------------
# Issue 41's case: rewards 1 (1 trained token) and 0 (3 trained tokens). As tokens the
# group is [1, 0, 0, 0]: N = 4, mean 1/4.

def test_token_unit_group_mean_weighs_each_sample_by_its_trained_tokens():
    # Mean only: 1 - 1/4 = 0.75, 0 - 1/4 = -0.25 (AReaL's); per sequence 0.5 / -0.5.
    kw = dict(mean_level="group", std_level="none")
    assert normalize_group([1.0, 0.0], **kw, group_unit="token", token_counts=[1, 3]) == \
        pytest.approx([0.75, -0.25], **A)
    assert normalize_group([1.0, 0.0], **kw) == pytest.approx([0.5, -0.5], **A)


def test_token_unit_group_std_is_over_tokens_too():
    # Centred tokens 0.75, -0.25 x3: sum of squares 0.5625 + 3 * 0.0625 = 0.75.
    # Population (/4): std sqrt(0.1875) = sqrt(3)/4 -> 0.75 / (sqrt(3)/4) = sqrt(3),
    # -0.25 / (sqrt(3)/4) = -1/sqrt(3). Unbiased (/3): std 0.5 -> 1.5, -0.5.
    kw = dict(mean_level="group", std_level="group", eps=0.0, group_unit="token", token_counts=[1, 3])
    assert normalize_group([1.0, 0.0], **kw) == pytest.approx([math.sqrt(3), -1 / math.sqrt(3)], **A)
    assert normalize_group([1.0, 0.0], **kw, std_unbiased=True) == pytest.approx([1.5, -0.5], **A)


def test_token_unit_leave_one_out_leaves_out_one_token():
    # Token of sample 0: 1 - (1 - 1)/3 = 1; tokens of sample 1: 0 - (1 - 0)/3 = -1/3.
    out = normalize_group([1.0, 0.0], mean_level="group", std_level="none", mean_leave1out=True,
                          group_unit="token", token_counts=[1, 3])
    assert out == pytest.approx([1.0, -1 / 3], **A)


def test_token_unit_edge_cases():
    kw = dict(mean_level="group", std_level="group", group_unit="token")
    # A sample without trained tokens counts in nothing and gets 0: the others as before.
    assert normalize_group([1.0, 0.0, 5.0], mean_level="group", std_level="none", group_unit="token",
                           token_counts=[1, 3, 0]) == pytest.approx([0.75, -0.25, 0.0], **A)
    # One sample (many tokens), all trained samples equal, one token, no token: exact zeros.
    assert normalize_group([0.3], **kw, token_counts=[7]) == [0.0]
    assert normalize_group([0.3, 0.3, 9.0], **kw, token_counts=[2, 5, 0]) == [0.0, 0.0, 0.0]
    assert normalize_group([1.0, 0.0], **kw, token_counts=[1, 0]) == [0.0, 0.0]
    assert normalize_group([1.0, 0.0], **kw, token_counts=[0, 0]) == [0.0, 0.0]
    # Equal token counts: the per-sequence numbers (each sample weighs the same).
    assert normalize_group(R, **kw, token_counts=[4] * len(R)) == pytest.approx(
        normalize_group(R, mean_level="group", std_level="group"), **A)
    with pytest.raises(AlgorithmInputError, match="one token count per reward"):
        normalize_group([1.0, 0.0], **kw)
    with pytest.raises(AlgorithmInputError, match="group_unit='tokens'"):
        normalize_group([1.0, 0.0], mean_level="group", std_level="group", group_unit="tokens")
    with pytest.raises(AlgorithmInputError, match="not supported for reward_norm"):
        check_reward_norm(mean_level="group", std_level="group", group_unit="token")
