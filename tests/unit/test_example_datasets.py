"""The examples' datasets are in the repository (issue 37): GSM8K ships in
examples/data/gsm8k (MIT, with its LICENSE), the GSM8K examples name it by a path
relative to the repository root, and that path reads the same rows from the root of a
clone and from any other working directory, as a fresh clone would (nothing outside the
repository, no ../shared)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.tasks.datasets import dataset_rows

ROOT = Path(__file__).resolve().parents[2]
GSM8K_EXAMPLES = ("examples/gsm8k_grpo.yaml", "examples/lora/gsm8k_grpo_lora.yaml",
                  "examples/agents/tir_agent_gsm8k.yaml")
SHIPPED = ("examples/data/gsm8k/train.jsonl", "examples/data/gsm8k/test.jsonl",
           "examples/data/gsm8k/LICENSE")


@pytest.mark.parametrize("example", GSM8K_EXAMPLES)
def test_the_gsm8k_examples_read_the_shipped_data_from_any_directory(example, tmp_path, monkeypatch):
    ds = load_config(TrainConfig, str(ROOT / example), []).train_dataset
    assert ds.type == "gsm8k" and ds.path == "examples/data/gsm8k/train.jsonl"
    for cwd in (ROOT, tmp_path):  # the root of the clone, and elsewhere
        monkeypatch.chdir(cwd)
        task, rows = dataset_rows(ds, seed=None)
        first = next(iter(rows))
        assert task == "gsm8k" and first["prompt_id"] == "gsm8k-train-0" and first["answer"] == "72"
        assert first["messages"][0]["content"].startswith("Natalia sold clips")


def test_gsm8k_ships_whole_with_its_license_and_is_tracked():
    train, test, license_ = (ROOT / p for p in SHIPPED)
    assert sum(1 for _ in train.open()) == 7473 and sum(1 for _ in test.open()) == 1319
    text = license_.read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in text
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: a fresh clone holds what git tracks")
    tracked = subprocess.run([git, "ls-files", "--", *SHIPPED], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert sorted(tracked) == sorted(SHIPPED)


def test_no_example_or_doc_points_outside_the_repository_for_data():
    texts = [p for p in ROOT.glob("examples/**/*.yaml")] + [p for p in ROOT.glob("docs/*.md")] \
        + [ROOT / "README.md"]
    assert not [str(p.relative_to(ROOT)) for p in texts if "../shared" in p.read_text()]
