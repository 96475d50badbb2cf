"""One RL step end to end for a tiny random model of every family of docs/models.md.

Per family: the feeder, rollout, reward, advantage processor and trainer, each a
RoleRunner thread built as the launcher builds it, on the module's embedded broker; one
training step, its weights published (file transport) and loaded back by the rollout
worker. The engine the rollout worker built and the trainer's forward (packed or padded)
must be the ones docs/models.md's table names, so the table is what runs. Families
neither in-process engine runs must fail at start-up naming the family and what to use.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.models.families import ARCHS
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint, resolve_run
from tapioca.schemas.errors import ConfigError
from tapioca.trainers.batching import SeqItem
from tapioca.trainers.trainer import read_metrics

pytestmark = pytest.mark.e2e

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
SIZES = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def doc_table() -> dict[str, tuple[str, str]]:
    """arch -> (rollout engine, trainer forward) from docs/models.md's family table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| [^|]+ \| ([^|]+) \| (\w+) \|", line)
        if m:
            rows[m[1]] = (m[2].strip(), m[3])
    return rows


def test_the_table_names_every_family():
    assert sorted(doc_table()) == sorted(ARCHS)


def config(arch: str, broker, bus_cfg, tmp_path, fast_join=()) -> TrainConfig:
    ckpt = create_tiny_checkpoint(tmp_path / "model", "synthetic", arch=arch, **SIZES)
    return load_config(TrainConfig, None, [
        f"run_dir={tmp_path}", "trial_name=t0", f"model.path={ckpt}", "total_train_steps=1",
        "train_dataset.prompts_per_step=2", "gconfig.n_samples=2", "gconfig.max_new_tokens=3",
        "rollout.max_head_offpolicyness=0", "actor.mb_max_tokens=256",
        f"bus.bootstrap_servers={broker.bootstrap}", f"bus.topic_prefix={bus_cfg.topic_prefix}", *fast_join,
    ])


@pytest.mark.parametrize("arch", [a for a, (engine, _) in doc_table().items() if not engine.startswith("none")])
def test_one_rl_step_end_to_end(arch, broker, bus_cfg, fast_join, tmp_path, start_runner, wait_until):
    engine_name, forward = doc_table()[arch]
    cfg = config(arch, broker, bus_cfg, tmp_path, fast_join)
    roles = {name: build_role(name, cfg) for name in ("feeder", "rollout", "reward", "advantage", "trainer")}
    assert type(roles["rollout"].engine).__name__ == engine_name
    assert (roles["trainer"].actor.packed is not None) == (forward == "packed")
    runners = {name: start_runner(role, cfg.bus, max_seconds=240) for name, role in roles.items()}
    trainer = runners["trainer"]
    deadline = time.monotonic() + 240
    while trainer.thread.is_alive() and time.monotonic() < deadline:
        for name, rt in runners.items():
            assert rt.error is None, f"{arch}: {name} failed: {rt.error!r}"
        time.sleep(0.2)
    # The step's weights went back to the engine (expert tensors included).
    wait_until(lambda: runners["rollout"].state.loaded_version >= 1, timeout_s=120,
               what=f"{arch}: the rollout worker loading version 1")
    for rt in runners.values():
        rt.finish()
    rows = read_metrics(cfg.run_path)
    assert [r["step"] for r in rows] == [1], f"{arch}: {rows}"
    assert rows[0]["actor/trained_tokens"] > 0 and math.isfinite(rows[0]["actor/loss"])
    if arch == "qwen3_moe":  # the packed MoE forward's router statistics reach the metrics
        assert rows[0]["actor/moe_dropped_tokens"] == 0.0 and rows[0]["actor/moe_load_entropy"] > 0


@pytest.mark.parametrize("arch", [a for a, (engine, _) in doc_table().items() if engine.startswith("none")])
def test_families_no_in_process_engine_runs_fail_at_start_up(arch, broker, bus_cfg, tmp_path):
    cfg = config(arch, broker, bus_cfg, tmp_path)
    with pytest.raises(ConfigError, match=rf"model family '{arch}'.*rollout.engine=vllm or rollout.engine=sglang"):
        resolve_run(cfg, prepare=True)
    with pytest.raises(ConfigError, match=rf"model family '{arch}'"):
        build_role("rollout", cfg)
    # Its trainer trains (the padded HF forward): rollouts would come from a server.
    actor = build_role("trainer", cfg).actor
    assert actor.packed is None
    items = [SeqItem(group_id="g", input_ids=[3, 4, 5, 6, 7, 8][: 4 + i], prompt_len=2, behav_logprobs=[-3.0] * (2 + i),
                     versions=[0] * (2 + i), loss_mask=[1] * (2 + i), advantage=1.0 - 2 * i, reward=0.0)
             for i in range(2)]
    assert math.isfinite(actor.train_step(items, policy_version=0).metrics["actor/loss"])
