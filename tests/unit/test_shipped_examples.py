"""What the repository ships around the examples (issue 38): no example sets a key the
config loader reads only as a deprecated name, an example is named for what it trains,
and what `tapioca eval` writes in the working directory (``./eval/``) is ignored by git."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tapioca.config.loader import RENAMED_KEYS, load_config
from tapioca.config.schema import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("**/*.yaml"))


def dotted_keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.add(name)
        if isinstance(value, dict):
            out |= dotted_keys(value, f"{name}.")
    return out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_example_sets_a_deprecated_key(example):
    raw = yaml.safe_load(example.read_text()) or {}
    deprecated = sorted(dotted_keys(raw) & set(RENAMED_KEYS)) if isinstance(raw, dict) else []
    assert not deprecated, f"{example.name} sets {deprecated}: use {[RENAMED_KEYS[k] for k in deprecated]}"


def test_the_moe_example_loads_with_its_learning_rate():
    cfg = load_config(TrainConfig, str(ROOT / "examples" / "moe" / "qwen3_moe_cpu.yaml"))
    assert cfg.actor.optimizer.lr == 1.0e-3


def test_a_vlm_example_is_named_for_the_visual_task_it_trains():
    """examples/vlm/count_cpu.yaml trained the colour task (docs/vlm.md: counting did not
    learn in 200 steps; colour is the measured example): an example named OP_cpu.yaml
    trains op OP."""
    named = [p for p in (ROOT / "examples" / "vlm").glob("*_cpu.yaml")]
    assert named
    for path in named:
        ds = load_config(TrainConfig, str(path)).train_dataset
        assert ds.type == "visual" and ds.task_options.get("op", "color") == path.stem.split("_")[0], path


def test_what_tapioca_eval_writes_in_the_working_directory_is_ignored():
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run([git, "check-ignore", "-q", "eval/tiny/summary.json"], cwd=ROOT)
    assert ignored.returncode == 0
