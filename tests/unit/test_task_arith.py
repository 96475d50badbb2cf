"""tasks/arith.py: the chain-arithmetic task of benchmarks/learn_async.py (issue 27)."""

from __future__ import annotations

import random
import statistics

import pytest

from tapioca.config.schema import DatasetConfig
from tapioca.models.tokenizer import build_char_tokenizer
from tapioca.schemas.errors import ConfigError
from tapioca.tasks.arith import ARITH_ALPHABET, ArithChainTask, chain_lengths, final_answer
from tapioca.tasks.base import get_task, task_answer, task_reward
from tapioca.tasks.datasets import dataset_rows


def test_solutions_are_correct_and_rewarded():
    task = get_task("arith", train_size=300, test_size=30)
    for r in task.iter_records("train", seed=0):
        lines = r["solution"].split("\n")
        assert len(lines) == r["steps"] + 1 and lines[-1] == f"answer {r['answer']}"
        value = None
        for line in lines[:-1]:  # each line is one step, and its result starts the next
            lhs, result = line.split("=")
            assert eval(lhs) == int(result) and 0 <= int(result) <= 99  # noqa: S307 (digits, + and -)
            assert value is None or lhs.startswith(str(value))
            value = int(result)
        assert str(value) == r["answer"] and eval(r["prompt"].rstrip("=")) == value  # noqa: S307
        assert task.reward(r["solution"], r) == 1.0


def test_reward_reads_the_last_answer_before_the_end_of_turn():
    task = ArithChainTask(train_size=1, test_size=1)
    assert task.reward("1+2=3\nanswer 3<|im_end|>\nanswer 4", "3") == 1.0
    assert task.reward("answer 4\nanswer 3<eos>", "3") == 1.0
    assert task.reward("answer 4", "3") == 0.0
    assert task.reward("3", "3") == 0.0  # no "answer": no credit
    assert final_answer("1+2=3") is None
    # the scorer's and maj@k's dispatch by task name
    assert task_reward("arith")("answer 12", {"answer": "12"}) == 1.0
    assert task_answer("arith")("x\nanswer 12<eos>") == "12"


def test_splits_are_disjoint_deterministic_and_shuffled_by_seed():
    task = ArithChainTask(train_size=2000, test_size=100)
    train = list(task.iter_records("train", seed=0))
    test = list(task.iter_records("test", seed=0))
    assert len(train) == 2000 and len(test) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert [r["prompt"] for r in test] == [r["prompt"] for r in ArithChainTask(train_size=2000, test_size=100)
                                           .iter_records("valid", seed=5)]
    other = list(task.iter_records("train", seed=1))
    assert [r["prompt_id"] for r in other] != [r["prompt_id"] for r in train]
    assert {r["prompt_id"]: r["prompt"] for r in other} == {r["prompt_id"]: r["prompt"] for r in train}
    assert len({r["prompt_id"] for r in train}) == 2000


def test_chain_lengths_have_the_pareto_tail():
    # n = floor(2 * U ** (-1/1.5)) capped at 24, so P(n >= k) = (2/k) ** 1.5 for k >= 2:
    # P(n >= 3) = 0.544, P(n >= 4) = 0.354 -> median 3; P(n >= 9) = 0.105,
    # P(n >= 10) = 0.089 -> p90 9; P(n = 24) = P(n >= 24) = (1/12) ** 1.5 = 0.024.
    rng = random.Random(0)
    ns = sorted(chain_lengths(rng, min_steps=2, max_steps=24, alpha=1.5) for _ in range(20000))
    assert statistics.median(ns) == 3 and ns[int(0.9 * len(ns))] == 9
    assert ns[0] == 2 and ns[-1] == 24
    assert abs(ns.count(24) / len(ns) - 0.024) < 0.005


def test_dataset_config_and_char_tokenizer():
    name, rows = dataset_rows(DatasetConfig(type="arith", split="test", task_options={"test_size": 5}), None)
    assert name == "arith" and len(list(rows)) == 5
    tok = build_char_tokenizer(ARITH_ALPHABET)
    text = next(ArithChainTask(train_size=1, test_size=1).iter_records())["solution"]
    assert tok.decode(tok(text)["input_ids"]) == text  # every character is in the alphabet
    with pytest.raises(ConfigError, match="min_steps"):
        ArithChainTask(min_steps=5, max_steps=2)
    with pytest.raises(ConfigError, match="splits"):
        list(ArithChainTask(train_size=1, test_size=1).iter_records("dev"))
