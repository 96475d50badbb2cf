"""Every algorithm of docs/algorithms.md runs a few steps of the real loop: feeder,
rollout, reward, advantage processor and trainer, each a RoleRunner thread built as
the launcher builds it, on the module's embedded broker (one broker, a topic prefix
per algorithm). Each run must reach its step count with finite losses, and rows with a
switch-specific metric (critic, KL, KD, rejection, M2PO, SAPO, entropy, batch levels)
must report it; the examples/algorithms/*.yaml file of each row is loaded, so the
documented example configs are the ones exercised. Model paths an example names (a KD
teacher) point at the test's tiny checkpoint."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import yaml

from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.trainers.trainer import read_metrics

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "algorithms"
STEPS = 3
# Small enough that three steps take seconds on one core; the example files carry the
# real sizes, these overrides only shrink them.
SHRINK = ["total_train_steps=3", "train_dataset.prompts_per_step=4", "gconfig.n_samples=4",
          "gconfig.max_new_tokens=3", "rollout.max_head_offpolicyness=1",
          "actor.mb_max_tokens=256"]
# Metrics that exist only when an example's defining switch took effect in the trainer,
# so a row cannot pass by silently running plain GRPO.
SWITCH_METRICS = {
    "ppo": ["critic/value_loss", "critic/value_mean"],
    "ppo_turn": ["critic/value_loss", "critic/value_mean"],
    "reinforce_pp": ["actor/kl_ref", "adv/token_std"],
    "reinforce_pp_baseline": ["adv/token_std"],
    "lite_ppo": ["adv/token_std"],
    "grpo_reward_norm": ["adv/token_std"],  # its adv_norm batch levels; reward_norm: unit tests
    "kl_ref": ["actor/kl_ref"],
    "kd_rl": ["distill/reverse_kl"],
    "kd_pure": ["distill/reverse_kl"],
    "icepop": ["actor/rejection_ratio"],
    "kpop": ["actor/rejection_ratio"],
    "m2po": ["actor/m2po_masked_ratio"],
    "sapo": ["actor/sapo_gate_mean"],
    "entropy_bonus": ["actor/policy_entropy"],
    "stale_tokens": ["actor/stale_masked_ratio", "actor/stale_empty_minibatch_fraction"],
}


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def path_overrides(example: Path, tiny_ckpt: str) -> list[str]:
    """Model paths an example names (a teacher, a reference) point at the tiny checkpoint:
    the test has no trained teacher, and any directory with the policy's vocabulary works."""
    raw = yaml.safe_load(example.read_text()) or {}
    out = []
    if (raw.get("distill") or {}).get("teacher_path"):
        out.append(f"distill.teacher_path={tiny_ckpt}")
    if (raw.get("ref") or {}).get("path"):
        out.append(f"ref.path={tiny_ckpt}")
    # SHRINK cuts the generation budget to 3 tokens; an overlong window must fit in it.
    if (raw.get("advantage") or {}).get("overlong_tokens", 0) > 2:
        out.append("advantage.overlong_tokens=2")
    return out


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model"))


def run_loop(cfg: TrainConfig, start_runner, timeout_s: float = 120.0) -> list[dict]:
    roles = ("feeder", "rollout", "reward", "advantage", "trainer")
    runners = {name: start_runner(build_role(name, cfg), cfg.bus, max_seconds=timeout_s)
               for name in roles}
    deadline = time.monotonic() + timeout_s
    trainer = runners["trainer"]
    while trainer.thread.is_alive() and time.monotonic() < deadline:
        for name, rt in runners.items():
            assert rt.error is None, f"{name} failed: {rt.error!r}"
        time.sleep(0.2)
    for rt in runners.values():
        rt.finish()
    return read_metrics(cfg.run_path)


@pytest.mark.parametrize("example", example_files(), ids=lambda p: p.stem)
def test_algorithm_runs_in_the_loop(example, broker, bus_cfg, fast_join, tiny_ckpt, tmp_path, start_runner):
    cfg = load_config(TrainConfig, str(example), SHRINK + path_overrides(example, tiny_ckpt) + [
        f"run_dir={tmp_path}", f"model.path={tiny_ckpt}", "trial_name=t0",
        f"bus.bootstrap_servers={broker.bootstrap}", f"bus.topic_prefix={bus_cfg.topic_prefix}", *fast_join,
    ])
    rows = run_loop(cfg, start_runner)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), f"{example.name}: {rows}"
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{example.name} step {r['step']}: non-finite metrics {bad}"
        assert r["actor/trained_tokens"] > 0
        missing = [k for k in SWITCH_METRICS.get(example.stem, []) if k not in r]
        assert not missing, f"{example.name} step {r['step']}: no {missing}; the switch did not act"
