"""tasks/: the registry, the synthetic task, GSM8K loading, math rewards, dataset readers."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest

from tapioca.models.tokenizer import build_char_tokenizer
from tapioca.schemas.errors import ConfigError, TapiocaError
from tapioca.tasks.base import Task, get_task, reference_of, task_names
from tapioca.tasks.datasets import read_records
from tapioca.tasks.gsm8k import GSM8KTask, gsm8k_reference
from tapioca.tasks.math_reward import last_number, math_reward
from tapioca.tasks.synthetic import SyntheticTask

# The copy the repository ships (examples/data/gsm8k, MIT licensed).
GSM8K_TEST = Path(__file__).resolve().parents[2] / "examples" / "data" / "gsm8k" / "test.jsonl"


# --- registry -------------------------------------------------------------------


def test_registry_knows_the_builtins():
    assert {"synthetic", "gsm8k"} <= set(task_names())
    assert isinstance(get_task("synthetic"), Task)
    assert get_task("synthetic", op="min").op == "min"
    with pytest.raises(ConfigError, match="known tasks"):
        get_task("nope")
    assert reference_of({"answer": 7}) == "7" and reference_of("7") == "7"


# --- synthetic ------------------------------------------------------------------


def test_synthetic_records():
    task = get_task("synthetic")
    records = list(task.iter_records("train", seed=0))
    assert len(records) == 100
    assert len({r["prompt_id"] for r in records}) == 100
    by_id = {r["prompt_id"]: r for r in records}
    r = by_id["synthetic-max-37"]
    assert r["prompt"] == "max(3,7)=" and r["answer"] == "7"
    assert r["messages"] == [{"role": "user", "content": "max(3,7)="}]
    assert r["task"] == "synthetic"
    # Seed changes the order, never the ids; the test split is in order.
    again = [x["prompt_id"] for x in task.iter_records("train", seed=0)]
    other = [x["prompt_id"] for x in task.iter_records("train", seed=1)]
    assert again == [x["prompt_id"] for x in records] and other != again and set(other) == set(again)
    assert [x["prompt_id"] for x in task.iter_records("test")][:2] == ["synthetic-max-00", "synthetic-max-01"]


def test_synthetic_prompts_fit_the_char_tokenizer():
    task = get_task("synthetic")
    tok = build_char_tokenizer(task.alphabet)
    assert len(tok) <= 32
    for r in task.iter_records("test"):
        ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert tok.unk_token_id not in ids
        assert tok.unk_token_id not in tok(r["answer"]).input_ids


def test_synthetic_reward():
    task = get_task("synthetic")
    rec = {"prompt": "max(3,7)=", "answer": "7"}
    assert task.reward("7", rec) == 1.0
    assert task.reward("7<eos>", rec) == 1.0
    assert task.reward(" 7 ", "7") == 1.0
    assert task.reward("7<eos>garbage", rec) == 1.0
    for wrong in ["3", "77", "", "7+", "x7", "<eos>7"]:
        assert task.reward(wrong, rec) == 0.0, wrong
    shaped = SyntheticTask(format_credit=0.1)
    assert shaped.reward("3", rec) == 0.1 and shaped.reward("7", rec) == 1.0 and shaped.reward("+", rec) == 0.0


def test_random_text_gets_low_synthetic_reward():
    task = get_task("synthetic")
    alphabet = list(task.alphabet) + ["<eos>"]
    rng = random.Random(0)
    records = list(task.iter_records("test"))
    scores = []
    for i in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        scores.append(task.reward(text, records[i % len(records)]))
    assert sum(scores) / len(scores) < 0.05


def test_synthetic_rejects_bad_config():
    with pytest.raises(ConfigError):
        SyntheticTask(op="mul")
    with pytest.raises(ConfigError):
        SyntheticTask(max_digit=12)


# --- GSM8K ----------------------------------------------------------------------


def test_gsm8k_reference():
    assert gsm8k_reference("so 9 * 2 = 18\n#### 18") == "18"
    assert gsm8k_reference("#### 1,000") == "1000"
    with pytest.raises(TapiocaError):
        gsm8k_reference("no marker")


def test_gsm8k_loader_on_the_shipped_data():
    task = get_task("gsm8k", path=str(GSM8K_TEST))
    first = next(iter(task.iter_records("test", seed=None)))
    assert first["prompt_id"] == "gsm8k-test-0"
    assert first["answer"] == "18"
    assert first["messages"][0]["role"] == "user"
    assert first["messages"][0]["content"].startswith("Janet")
    assert "\\boxed{}" in first["prompt"]
    # The id follows the row, not the shuffle.
    shuffled = {r["prompt_id"]: r["answer"] for _, r in zip(range(200), task.iter_records("test", seed=3))}
    assert len(shuffled) == 200
    assert shuffled.get("gsm8k-test-0", "18") == "18"
    assert task.reward("She makes 9 * 2 = $18 every day. \\boxed{18}", first) == 1.0
    assert task.reward("\\boxed{17}", first) == 0.0


def test_gsm8k_default_data_dir_and_folder_path(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    task = GSM8KTask(path=str(tmp_path), instruction="")
    (rec,) = list(task.iter_records("train"))
    assert rec == {
        "prompt_id": "gsm8k-train-0",
        "task": "gsm8k",
        "messages": [{"role": "user", "content": "1+1?"}],
        "prompt": "1+1?",
        "answer": "2",
    }


# --- math_reward ----------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("so the answer is \\boxed{42}", "42", 1.0),
        ("\\boxed{42}", "41", 0.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("The answer is 1,234.", "1,234", 1.0),
        ("$18", "18", 1.0),
        ("18 dollars", "18", 1.0),
        ("0.5", "1/2", 1.0),
        ("1/2", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("x = 3.50", "3.5", 1.0),
        ("-3", "-3", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("She makes 9 * 2 = $18 every day.", "18", 1.0),
        ("The answer is 41", "42", 0.0),
        ("I got 42 then 43", "42", 0.0),  # the last answer counts, never either of two
        ("\\boxed{18} dollars, not 20", "18", 1.0),  # a boxed answer wins over later numbers
        ("", "42", 0.0),
        ("no idea", "42", 0.0),
    ],
)
def test_math_reward(completion, reference, expected):
    assert math_reward(completion, reference) == expected


def test_math_reward_off_the_main_thread():
    # math-verify's default signal timeouts raise ValueError off the main thread.
    results: list[float] = []
    errors: list[BaseException] = []

    def work():
        try:
            results.extend([math_reward("\\boxed{42}", "42"), math_reward("0.5", "1/2"), math_reward("7", "8")])
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    assert not errors and results == [1.0, 1.0, 0.0]


def test_last_number():
    assert last_number("$1,234.5 total") == "1234.5"
    assert last_number("3/4 of 8 is 6") == "6"
    assert last_number("ratio 3/4") == "3/4"
    assert last_number("none") is None


# --- dataset readers ------------------------------------------------------------


def test_read_records_jsonl_json_parquet(tmp_path):
    rows = [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "#### 2"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ["d.jsonl", "d.json", "d.parquet"]:
        assert list(read_records(tmp_path / name)) == rows, name


def test_read_records_errors(tmp_path):
    with pytest.raises(TapiocaError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TapiocaError, match="unknown format"):
        read_records(tmp_path / "x.csv")
    with pytest.raises(TapiocaError, match="save_to_disk"):
        read_records(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(TapiocaError, match="bad.jsonl:2"):
        list(read_records(tmp_path / "bad.jsonl"))


def test_read_records_hf_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": "a", "answer": "#### 1"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert list(read_records(tmp_path / "ds")) == rows


def test_read_records_hf_directory_without_datasets(tmp_path, monkeypatch):
    import builtins

    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text("{}")
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(TapiocaError, match="pip install datasets"):
        list(read_records(tmp_path / "ds"))
