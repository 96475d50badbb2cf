"""Golden numbers of the evaluation metrics (algorithms/eval_metrics.py), each derived by
hand in the comment beside it."""

from __future__ import annotations

import math

import pytest

from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.eval_metrics import (
    PromptSamples,
    Sample,
    avg_at_k,
    default_pass_ks,
    maj_at_k,
    majority_answer,
    pass_at_k,
    prompts_from_rows,
    summarize,
)


def _s(correct: bool, answer: str | None = None, reward: float | None = None) -> Sample:
    return Sample(float(correct) if reward is None else reward, correct, answer)


@pytest.mark.parametrize("n,c,k,want", [
    # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 2, 0.7),
    # 1 - C(4,3)/C(6,3) = 1 - 4/20
    (6, 2, 3, 0.8),
    # k = 1 is c / n: 3 / 10
    (10, 3, 1, 0.3),
    # k = n: 1 if any sample is correct ...
    (4, 1, 4, 1.0),
    (4, 4, 4, 1.0),
    # ... else 0 (C(4,4)/C(4,4) = 1)
    (4, 0, 4, 0.0),
    # n - c < k: every draw of k holds a correct one
    (5, 4, 2, 1.0),
    # 1 - C(7,3)/C(8,3) = 1 - 35/56 = 3/8 (= k/n: one correct of n)
    (8, 1, 3, 0.375),
])
def test_pass_at_k_is_chen_et_al_unbiased_estimator(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)
    # the closed form it stands for
    assert pass_at_k(n, c, k) == pytest.approx(
        1 - (math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 0.0), abs=1e-12)


def test_k_larger_than_the_samples_is_an_error_naming_what_to_do():
    with pytest.raises(AlgorithmInputError, match=r"needs 5 sampled completions.*has 4.*eval.k >= 5"):
        pass_at_k(4, 1, 5)
    prompts = [PromptSamples("p0", [_s(True), _s(False)])]
    with pytest.raises(AlgorithmInputError, match=r"prompt 'p0' has 2.*k <= 2"):
        summarize(prompts, k=4)
    with pytest.raises(AlgorithmInputError, match="pass@8"):
        summarize([PromptSamples("p0", [_s(True)] * 4)], k=4, pass_ks=[1, 8])


def test_an_empty_dataset_is_an_error_naming_what_to_do():
    with pytest.raises(AlgorithmInputError, match="dataset is empty.*valid_dataset / --data"):
        summarize([], k=4)


def test_avg_at_k_is_the_mean_reward_of_the_first_k():
    samples = [_s(True), _s(False, reward=0.3), _s(False), _s(True)]
    # (1 + 0.3 + 0 + 1) / 4
    assert avg_at_k(samples, 4) == pytest.approx(0.575)
    # (1 + 0.3) / 2
    assert avg_at_k(samples, 2) == pytest.approx(0.65)


def test_majority_vote_and_its_tie_rule():
    # 5 has two votes, 7 one; unanswered samples do not vote
    assert majority_answer([_s(False, "7"), _s(False, None), _s(True, "5"), _s(True, "5")]) == "5"
    # tie 3:2 / 5:2 -> the answer voted first (sample 0) wins, though "5" is the right one
    tied = [_s(False, "3"), _s(True, "5"), _s(True, "5"), _s(False, "3")]
    assert majority_answer(tied) == "3"
    assert maj_at_k(tied, 4) == 0.0
    # the same votes in the other order: "5" votes first and wins
    assert maj_at_k([tied[1], tied[0], tied[3], tied[2]], 4) == 1.0
    # maj@2 sees only the first two: one vote each, the first ("3") wins
    assert maj_at_k(tied, 2) == 0.0
    # nobody answered: 0
    assert majority_answer([_s(False), _s(False)]) is None
    assert maj_at_k([_s(False), _s(False)], 2) == 0.0
    # k = n with the majority right although most samples are wrong: a:2 (right),
    # b:1, c:1, unanswered:1 -> 1
    assert maj_at_k([_s(True, "a"), _s(False, "b"), _s(True, "a"), _s(False, "c"), _s(False)], 5) == 1.0


def test_default_pass_ks():
    assert default_pass_ks(1) == [1]
    assert default_pass_ks(4) == [1, 2, 4]
    assert default_pass_ks(6) == [1, 2, 4, 6]
    assert default_pass_ks(8) == [1, 2, 4, 8]


def test_summary_totals_and_subsets_by_hand():
    # Three prompts of k = 4 samples (+ a greedy one each); A and B in subset "easy", C in "hard".
    a = PromptSamples("A", [_s(True, "1"), _s(True, "1"), _s(False, "2"), _s(True, "1")],
                      greedy=_s(True, "1"), subset="easy")
    b = PromptSamples("B", [_s(False, "9"), _s(False, "8"), _s(False, "8"), _s(True, "4")],
                      greedy=_s(False, "8"), subset="easy")
    c = PromptSamples("C", [_s(False, None), _s(False, None), _s(False, "0"), _s(False, "0")],
                      greedy=_s(True, "3"), subset="hard")
    out = summarize([a, b, c], k=4)
    total = out["total"]
    # pass@1 = c/n per prompt: (3/4 + 1/4 + 0) / 3 = 1/3
    assert total["pass@1"] == pytest.approx(1 / 3)
    # pass@2: A 1 - C(1,2)/C(4,2) = 1 (n-c=1<2); B 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; C 0
    assert total["pass@2"] == pytest.approx((1 + 0.5 + 0) / 3)
    # pass@4 (k = n): A 1, B 1, C 0
    assert total["pass@4"] == pytest.approx(2 / 3)
    # avg@4 = mean reward: (3/4 + 1/4 + 0) / 3
    assert total["avg@4"] == pytest.approx(1 / 3)
    # maj@4: A "1" (3 votes, right) 1; B "8" (2 votes, wrong) 0; C "0" (2 votes, wrong) 0
    assert total["maj@4"] == pytest.approx(1 / 3)
    # greedy: A right, B wrong, C right
    assert total["greedy"] == pytest.approx(2 / 3)
    assert (total["prompts"], total["samples"], total["greedy_prompts"]) == (3, 12, 3)
    # standard errors (sample sd with n - 1, over sqrt(n)): pass@1 per prompt 9/12, 3/12, 0,
    # deviations from 4/12: 5/12, -1/12, -4/12 -> var = (25 + 1 + 16) / 144 / 2 = 7/48,
    # SE = sqrt(7/48 / 3) = sqrt(7) / 12; greedy 1, 0, 1: var = (1 + 4 + 1) / 9 / 2 = 1/3,
    # SE = sqrt(1/9) = 1/3
    assert total["pass@1_stderr"] == pytest.approx(math.sqrt(7) / 12)
    assert total["greedy_stderr"] == pytest.approx(1 / 3)
    assert "pass@1_stderr" not in summarize([PromptSamples("A", a.samples)], k=4)["total"]  # one prompt
    easy, hard = out["subsets"]["easy"], out["subsets"]["hard"]
    assert easy["pass@1"] == pytest.approx(0.5)     # (3/4 + 1/4) / 2
    assert easy["pass@4"] == 1.0
    assert easy["maj@4"] == 0.5                     # (1 + 0) / 2
    assert easy["greedy"] == 0.5
    assert hard["pass@4"] == 0.0 and hard["greedy"] == 1.0 and hard["prompts"] == 1
    # no subset column: no per-subset table
    assert summarize([PromptSamples("A", a.samples)], k=4)["subsets"] == {}


def test_rows_regroup_into_the_same_numbers():
    rows = [  # out of order on purpose, greedy as sample_index -1
        {"prompt_id": "A", "sample_index": 1, "reward": 0.0, "correct": False, "extracted_answer": "2"},
        {"prompt_id": "A", "sample_index": -1, "reward": 1.0, "correct": True, "extracted_answer": "1"},
        {"prompt_id": "A", "sample_index": 0, "reward": 1.0, "correct": True, "extracted_answer": "1"},
        {"prompt_id": "B", "sample_index": 0, "reward": 0.0, "correct": False, "extracted_answer": None},
        {"prompt_id": "B", "sample_index": 1, "reward": 1.0, "correct": True, "extracted_answer": "5"},
    ]
    prompts = prompts_from_rows(rows)
    assert [p.prompt_id for p in prompts] == ["A", "B"]
    assert [s.answer for s in prompts[0].samples] == ["1", "2"]
    assert prompts[0].greedy == Sample(1.0, True, "1") and prompts[1].greedy is None
    total = summarize(prompts, k=2)["total"]
    assert total["pass@1"] == pytest.approx(0.5)   # (1/2 + 1/2) / 2
    assert total["maj@2"] == 1.0                   # A: tie "1"/"2" -> "1" (first), right; B: "5" alone, right
    assert total["greedy"] == 1.0 and total["greedy_prompts"] == 1
