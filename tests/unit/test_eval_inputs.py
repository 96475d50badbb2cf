"""What evaluation reads: the synthetic task's held-out split, the tasks' answer
extraction (maj@k's votes), a file's subset column, and the eval / eval_gconfig /
evaluator / valid_dataset config (defaults, validation, and who launches the evaluator)."""

from __future__ import annotations

import json

import pytest

from tapioca.config.loader import load_config
from tapioca.config.schema import DatasetConfig, TrainConfig
from tapioca.config.sections import eval_section
from tapioca.ops.run_setup import role_counts
from tapioca.schemas.errors import ConfigError
from tapioca.tasks.base import get_task, task_answer
from tapioca.tasks.datasets import dataset_rows
from tapioca.tasks.math_reward import math_answer, math_reward


def _ids(task, split, seed=None):
    return [r["prompt_id"] for r in task.iter_records(split, seed)]


def test_synthetic_holdout_split_is_disjoint_fixed_and_independent_of_the_seed():
    task = get_task("synthetic", holdout_pairs=16)
    test = _ids(task, "test")
    assert len(test) == 16 and _ids(task, "valid") == test
    for seed in (0, 1, 7):
        train = _ids(task, "train", seed)
        assert len(train) == 84 and not set(train) & set(test)
        assert set(train) | set(test) == set(_ids(get_task("synthetic"), "train", 0))
    assert _ids(get_task("synthetic", holdout_pairs=16), "test") == test  # the same every run
    # no holdout: test is the whole table (the old behaviour)
    assert len(_ids(get_task("synthetic"), "test")) == 100
    with pytest.raises(ConfigError, match="hold out 0..99"):
        get_task("synthetic", holdout_pairs=100)


def test_answer_extraction_is_what_the_reward_compares():
    synthetic = task_answer("synthetic")
    assert synthetic(" 7<eos>junk") == "7" and synthetic("") is None
    # math: boxed, ####, prose, commas and trailing zeros give one spelling
    assert math_answer("so \\boxed{18}") == "18"
    assert math_answer("... #### 1,000") == "1000"
    assert math_answer("The answer is 18 dollars.") == "18"
    assert math_answer("#### 7.0") == "7" and math_answer("$0.50") == "0.5"
    assert math_answer("no digits here") is None
    assert task_answer("gsm8k")("#### 42") == task_answer("math")("\\boxed{42}") == "42"
    # answers that vote together are scored alike
    for text in ("\\boxed{18}", "#### 18.0", "The answer is 18."):
        assert math_answer(text) == "18" and math_reward(text, "18") == 1.0


def test_a_files_subset_column_reaches_the_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"question": "1+1?", "answer": "2", "subset": "easy"},
        {"question": "2+2?", "answer": "4"},
        {"question": "3*3?", "answer": "9", "level": "hard"}]))
    _, rows = dataset_rows(DatasetConfig(type="jsonl", path=str(path)), None)
    assert [r.get("subset") for r in rows] == ["easy", None, None]
    _, rows = dataset_rows(DatasetConfig(type="jsonl", path=str(path), subset_key="level"), None)
    assert [r.get("subset") for r in rows] == [None, None, "hard"]


def test_a_missing_prompt_column_names_the_section_to_set(tmp_path):
    """The error names the key of the section read: valid_dataset for evaluation."""
    from tapioca.producers.eval_run import load_eval_task

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    ds = DatasetConfig(type="jsonl", path=str(path))
    with pytest.raises(ConfigError, match=r"set valid_dataset\.prompt_key .*problem"):
        load_eval_task(ds, lambda row: ([1], row["prompt"]))
    with pytest.raises(ConfigError, match=r"set train_dataset\.prompt_key"):
        list(dataset_rows(ds, None)[1])


def test_eval_gconfig_fields_default_to_gconfig():
    cfg = load_config(TrainConfig, None, ["gconfig.temperature=0.7", "gconfig.max_new_tokens=9",
                                          "eval_gconfig.top_p=0.95", "eval.k=6",
                                          "valid_dataset.type=synthetic"])
    s = eval_section(cfg).sampling
    assert (s.n_samples, s.temperature, s.top_p, s.max_new_tokens) == (6, 0.7, 0.95, 9)
    cfg = load_config(TrainConfig, None, ["eval_gconfig.temperature=1.2", "eval_gconfig.max_new_tokens=64",
                                          "valid_dataset.type=synthetic"])
    s = eval_section(cfg).sampling
    assert (s.temperature, s.max_new_tokens) == (1.2, 64)
    with pytest.raises(ConfigError, match="eval_gconfig.temperature must be > 0"):
        load_config(TrainConfig, None, ["eval_gconfig.temperature=0"])
    with pytest.raises(ConfigError, match="eval.k must be >= 1"):
        load_config(TrainConfig, None, ["eval.k=0"])


def test_the_evaluator_runs_when_a_trigger_is_set_and_needs_a_valid_dataset():
    base = ["valid_dataset.type=synthetic"]
    assert "evaluator" not in dict(role_counts(load_config(TrainConfig, None, base)))
    for trigger in ("evaluator.freq_steps=10", "evaluator.freq_epochs=1",
                    "evaluator.freq_secs=30", "evaluator.eval_before_train=true"):
        cfg = load_config(TrainConfig, None, base + [trigger])
        assert dict(role_counts(cfg))["evaluator"] == 1, trigger
        with pytest.raises(ConfigError, match="valid_dataset is not"):
            load_config(TrainConfig, None, [trigger])
    with pytest.raises(ConfigError, match="evaluator.freq_steps must be >= 1"):
        load_config(TrainConfig, None, base + ["evaluator.freq_steps=0"])
    with pytest.raises(ConfigError, match="no evaluation dataset"):
        eval_section(load_config(TrainConfig, None, []))


def test_the_demo_config_evaluates_a_held_out_split():
    from tapioca.ops.commands import DEMO_CONFIG, EXAMPLES

    cfg = load_config(TrainConfig, str(EXAMPLES / DEMO_CONFIG), [])
    assert cfg.evaluator.enabled and cfg.valid_dataset.split == "test"
    held = {r["prompt_id"] for r in dataset_rows(cfg.valid_dataset, None)[1]}
    train = {r["prompt_id"] for r in dataset_rows(cfg.train_dataset, cfg.seed)[1]}
    assert len(held) == 16 and not held & train


def test_the_evaluator_refuses_the_rollout_workers_servers():
    from tapioca.runtime.builders import build_evaluator

    cfg = load_config(TrainConfig, None, ["valid_dataset.type=synthetic", "evaluator.freq_steps=5",
                                          "rollout.engine=vllm", "model.path=/nonexistent",
                                          "rollout.server.urls=[http://127.0.0.1:1]"])
    with pytest.raises(ConfigError, match="would change the weights they generate with"):
        build_evaluator(cfg, renice=False)
