"""tasks/longchain.py: the long, long-tailed workload of benchmarks/learn_async.py (issue 42)."""

from __future__ import annotations

import random
import statistics

import pytest

from tapioca.config.schema import DatasetConfig
from tapioca.models.tokenizer import build_char_tokenizer
from tapioca.schemas.errors import ConfigError
from tapioca.tasks.arith import chain_lengths
from tapioca.tasks.base import get_task, task_answer, task_reward
from tapioca.tasks.datasets import dataset_rows
from tapioca.tasks.longchain import LONGCHAIN_ALPHABET, LongChainTask, solve


def test_solutions_are_correct_numbered_down_and_rewarded():
    task = get_task("longchain", train_size=200, test_size=20, min_steps=3, max_steps=40)
    for r in task.iter_records("train", seed=0):
        start, rest = r["prompt"].rstrip("=").split("+")
        addend, n = (int(v) for v in rest.split("x"))
        lines = r["solution"].split("\n")
        assert n == r["steps"] and len(lines) == n + 1 and lines[-1] == f"answer {r['answer']}"
        value = int(start)
        for k, line in enumerate(lines[:-1]):
            number, work = line.split(": ")
            parts = work.split("=")  # "x+b", the sum ("s-100" when it wraps), the new value
            total = int(parts[1].removesuffix("-100"))
            assert int(number) == n - k and parts[0] == f"{value}+{addend}" and total == value + addend
            value = (value + addend) % 100
            assert int(parts[-1]) == value and (len(parts) == 3) == (total >= 100)
        assert int(r["answer"]) == (int(start) + n * addend) % 100 == value
        assert task.reward(r["solution"], r) == 1.0
        assert task.reward(r["solution"] + "<eos>answer 1000", r) == 1.0  # after the end of turn: ignored
    assert solve(97, 9, 2) == ("2: 97+9=106-100=6\n1: 6+9=15\nanswer 15", 15)  # lines count down
    assert task_reward("longchain")("1: 2+3=5\nanswer 5", {"answer": "5"}) == 1.0
    assert task_reward("longchain")("answer 6", "5") == 0.0
    assert task_answer("longchain")("...\nanswer 42<|im_end|>") == "42"


def test_lengths_meet_the_issue_in_tokens_of_the_char_tokenizer():
    """Issue 42: correct solutions of median >= 512 new tokens and p99 >= 4,096. With the
    char tokenizer a solution is len(text) tokens + <eos>."""
    task = LongChainTask(train_size=4000, test_size=10)
    tokens = sorted(len(r["solution"]) + 1 for r in task.iter_records("train", seed=0))
    assert 512 <= statistics.median(tokens) <= 700
    assert tokens[int(0.99 * (len(tokens) - 1))] >= 4096
    # The longest possible solution: 300 lines of at most 22 characters ("300: 99+99=198-100=98\n"),
    # 2 fewer for the lines labelled 1-9 and 1 fewer for 10-99, then "answer 99", then <eos>: 6,502 tokens,
    # under the benchmark's max_new_tokens (6,600).
    assert tokens[-1] <= 300 * 22 - 9 * 2 - 90 + len("answer 99") + 1 == 6502
    tok = build_char_tokenizer(LONGCHAIN_ALPHABET)
    r = next(task.iter_records("test", seed=0))
    for text in (r["prompt"], r["solution"]):
        assert tok.decode(tok(text)["input_ids"]) == text  # every character is in the alphabet


def test_chain_lengths_have_the_pareto_tail():
    # n = floor(24 * U ** (-1/1.9)) capped at 300: P(n >= k) = (24/k) ** 1.9 for k >= 24, so
    # P(n >= 34) = 0.516, P(n >= 35) = 0.488 -> median 34; P(n = 300) = (24/300) ** 1.9 = 0.0082.
    rng = random.Random(0)
    ns = sorted(chain_lengths(rng, min_steps=24, max_steps=300, alpha=1.9) for _ in range(20000))
    assert statistics.median(ns) == 34 and ns[0] == 24 and ns[-1] == 300
    assert abs(ns.count(300) / len(ns) - 0.0082) < 0.002


def test_splits_are_disjoint_deterministic_and_shuffled_by_seed():
    task = LongChainTask(train_size=1000, test_size=50, max_steps=60)
    train, test = list(task.iter_records("train", seed=0)), list(task.iter_records("test"))
    assert len(train) == 1000 and len(test) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    again = LongChainTask(train_size=1000, test_size=50, max_steps=60)
    assert [r["prompt"] for r in again.iter_records("valid", seed=3)] == [r["prompt"] for r in test]
    assert [r["prompt_id"] for r in task.iter_records("train", seed=1)] != [r["prompt_id"] for r in train]


def test_dataset_config_and_bad_options():
    name, rows = dataset_rows(DatasetConfig(type="longchain", split="test",
                                            task_options={"test_size": 4, "train_size": 10}), None)
    assert name == "longchain" and [r["task"] for r in rows] == ["longchain"] * 4
    with pytest.raises(ConfigError, match="min_steps"):
        LongChainTask(min_steps=10, max_steps=5)
    with pytest.raises(ConfigError, match="max_addend"):
        LongChainTask(max_addend=100)
    with pytest.raises(ConfigError, match="splits"):
        list(LongChainTask(train_size=1, test_size=1).iter_records("dev"))
