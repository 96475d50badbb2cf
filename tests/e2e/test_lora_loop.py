"""End to end, a LoRA run (the CPU LoRA demo's config, examples/lora/demo_cpu_lora.yaml, a
few steps): every role its own process on the real embedded broker, the adapter over the
ipc transport (a shared-memory buffer on the CPU) with its durable PEFT directories. From
the log and the run directory: every weights event names its version's adapter and carries
its tensors only (nothing of the base, whose identity it names); the rollout worker
generated with later versions; the weights directory holds adapter directories only;
``final/`` is a PEFT adapter; the base model's files were never written."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE
from tapioca.ops.launcher import Launcher
from tapioca.schemas import TrajectoryEvent, WeightsEvent
from tapioca.weights.adapter_files import adapter_sha256
from tapioca.weights.base_id import base_identity

pytestmark = pytest.mark.e2e

STEPS = 6
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora" / "demo_cpu_lora.yaml"


def test_a_lora_run_publishes_and_serves_adapters_only(broker, tmp_path, fast_join):
    cfg = load_config(TrainConfig, EXAMPLE, [
        f"run_dir={tmp_path}", "trial_name=t0", f"total_train_steps={STEPS}",
        f"bus.bootstrap_servers={broker.bootstrap}", *fast_join, f"bus.topic_prefix=lora{uuid.uuid4().hex[:8]}",
        "train_dataset.prompts_per_step=8", "gconfig.n_samples=4", "rollout.max_head_offpolicyness=1",
        "weights.transport=ipc", "rollout.max_batch_size=64",
    ])
    launcher = Launcher(cfg)
    launcher.start()
    cfg = launcher.cfg  # resolved: the tiny model's path, the bus run id
    model_file = Path(cfg.model.path) / "model.safetensors"
    before = (model_file.stat().st_mtime_ns, model_file.stat().st_size)
    try:
        summary = launcher.wait(timeout_s=400)
    finally:
        launcher.stop()
    assert summary.steps == STEPS

    events = [e for e in read_events(cfg.bus, "weights") if isinstance(e, WeightsEvent)]
    assert {e.version for e in events} == set(range(STEPS + 1))
    base_id = base_identity(cfg.model.path)
    for e in events:
        a = e.adapter
        assert a is not None and a.name == f"demo-lora-v{e.version}" and a.base_id == base_id
        assert (a.rank, a.alpha) == (8, 16.0)
        assert e.transport == "ipc" or e.path  # a repeat names the durable directory
        if e.tensors:  # the ipc buffer: LoRA tensors only
            names = [t.name for t in e.tensors]
            assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
            assert len(names) == 2 * 7 * cfg.model.num_layers
    files = {f.version: f for e in events for f in e.files}
    assert STEPS in files  # the final version's durable directory
    final_dir = Path(files[STEPS].path)
    assert final_dir.name == f"demo-lora-v{STEPS}" and adapter_sha256(final_dir) == files[STEPS].sha256

    weights_dir = Path(cfg.run_path) / "weights"
    assert not list(weights_dir.glob("v*.safetensors"))  # no whole-weights file, ever
    assert all(p.name.startswith("demo-lora-v") for p in weights_dir.iterdir() if p.is_dir())
    final = Path(cfg.run_path) / "final"
    assert sorted(p.name for p in final.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE]
    assert (model_file.stat().st_mtime_ns, model_file.stat().st_size) == before

    trajs = [t for t in read_events(cfg.bus, "trajectories") if isinstance(t, TrajectoryEvent)]
    assert max(v for t in trajs for v in t.output_versions) >= STEPS - 1  # adapters were served
