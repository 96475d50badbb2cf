"""The ``nccl`` weight transport with the gloo backend on CPU, end to end on the real
broker: the trainer role (in a thread) publishes versions over it, two rollout worker
processes (the real rollout role, tests/integration/weights_follower.py) join after the
trainer's first version, pull each later version over their process group, and the
weights in their engines are compared bit for bit with the trainer's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tapioca.bus import EventProducer, read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import SampleEvent, SampleSequence, WeightsEvent

pytestmark = pytest.mark.integration

FOLLOWER = str(Path(__file__).with_name("weights_follower.py"))


def sample(gid: str, version: int) -> SampleEvent:
    seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=[5, 6], behav_logprobs=[-3.0, -3.0],
                           output_versions=[version] * 2, reward=float(i),
                           advantage=2.0 * i - 1.0) for i in range(2)]
    return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=[3, 4, 5], sequences=seqs,
                       min_version=version, max_version=version)


def publish(cfg, *events) -> None:
    with EventProducer(cfg, "test") as producer:
        for e in events:
            producer.publish(e)


def test_nccl_gloo_two_rollout_processes_get_each_version_bit_for_bit(
        bus_cfg, tmp_path, start_runner, wait_until, one_torch_thread):
    ckpt = create_tiny_checkpoint(tmp_path / "model")
    overrides = [f"bus.bootstrap_servers={bus_cfg.bootstrap_servers}",
                 f"bus.topic_prefix={bus_cfg.topic_prefix}", f"model.path={ckpt}",
                 f"run_dir={tmp_path / 'run'}", "experiment_name=wt", "trial_name=t",
                 "weights.transport=nccl", "weights.transfer_timeout_s=30",
                 "weights.bucket_bytes=8192", "train_dataset.prompts_per_step=1",
                 "gconfig.n_samples=2", "gconfig.max_new_tokens=3",
                 # TorchEngine: the follower compares its model's state dict (the paged
                 # engine keeps no model object).
                 "rollout.paged=false"]
    cfg = load_config(TrainConfig, None, overrides)
    trainer = build_role("trainer", cfg)
    start_runner(trainer, bus_cfg, member_id="trainer-0", max_seconds=400)

    def weights() -> dict[int, WeightsEvent]:
        return {e.version: e for e in read_events(bus_cfg, "weights", idle_s=0.2)}

    def trainer_weights() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}

    # Two workers, started with the trainer: they join its process group after it has
    # published version 0 (they take longer to start), pulling the current version.
    out = tmp_path / "follower"
    logs = [open(tmp_path / f"follower{m}.log", "w") for m in (0, 1)]  # a pipe could fill up
    procs = [subprocess.Popen([sys.executable, FOLLOWER, f"{out}{m}", str(m), "1,2", *overrides],
                              stdout=logs[m], stderr=subprocess.STDOUT) for m in (0, 1)]
    publish(bus_cfg, sample("ga", 0))
    try:
        wait_until(lambda: 1 in weights(), timeout_s=60, what="version 1")
        assert weights()[1].transport == "nccl" and weights()[1].bucket_checksums
        at_v1 = trainer_weights()  # the trainer waits for its next sample meanwhile
        dumps = [Path(f"{out}{m}.v1.pt") for m in (0, 1)]
        wait_until(lambda: all(p.exists() for p in dumps) or any(
            p.poll() is not None for p in procs), timeout_s=180, what="both workers on version 1")
        publish(bus_cfg, sample("gb", 1))
        wait_until(lambda: 2 in weights(), timeout_s=60, what="version 2")
        at_v2 = trainer_weights()
        for m, p in enumerate(procs):
            p.wait(timeout=120)
            assert p.returncode == 0, (tmp_path / f"follower{m}.log").read_text()[-3000:]
    finally:
        for p, log in zip(procs, logs):
            if p.poll() is None:
                p.kill()
                p.wait(10)
            log.close()

    for m in (0, 1):
        for version, expected in ((1, at_v1), (2, at_v2)):
            dump = torch.load(f"{out}{m}.v{version}.pt")
            assert dump["version"] == version
            assert dump["weights"].keys() == expected.keys()
            for name, t in expected.items():  # float32 model: the bytes the trainer holds
                assert torch.equal(dump["weights"][name], t), (m, version, name)
        # Every version came over the process group; none from a file.
        assert dump["fast_loads"] == 2 and dump["file_loads"] == 0, dump
    assert any(not torch.equal(at_v1[k], at_v2[k]) for k in at_v1)  # two distinct versions
