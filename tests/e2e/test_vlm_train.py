"""End to end, vision-language: `tapioca train`'s launcher on ``examples/vlm/color_cpu.yaml``
(feeder, rollout on the paged engine, reward, advantage, trainer and archiver, each its
own OS process, a real embedded broker, a tiny random Qwen2.5-VL created for the run),
a few steps only: CI checks the plumbing; the learning curve of the full example is
measured in docs/vlm.md (0.03 -> 0.86, first 20 -> last 20 steps, 282 s here).

Checked from the log: every prompt, trajectory and sample names its image by sha256,
every such image is in the run's image store (and in the archive's copy), the
trajectories' prompts hold the expanded placeholders, and the trainer trained groups
with images (weights events name them)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.media.store import FileImageStore
from tapioca.ops.launcher import Launcher
from tapioca.schemas import ProgressEvent, PromptEvent, SampleEvent, TrajectoryEvent

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm" / "color_cpu.yaml"
STEPS = 6


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory, fast_join):
    cfg = load_config(TrainConfig, str(EXAMPLE), [
        f"run_dir={tmp_path_factory.mktemp('runs')}", "experiment_name=vlm-e2e", "trial_name=t0",
        f"total_train_steps={STEPS}", f"bus.bootstrap_servers={broker.bootstrap}", *fast_join,
        f"bus.topic_prefix=vlm{uuid.uuid4().hex[:8]}", "train_dataset.prompts_per_step=4",
        "archive.enabled=true", "archive.roll_interval_s=1",
    ])
    launcher = Launcher(cfg)
    started = time.monotonic()
    try:
        launcher.start()
        summary = launcher.wait(timeout_s=600)
    except BaseException:
        for child in launcher.children:
            print(f"--- {child.label} ---\n{child.log_tail(40)}")
        raise
    finally:
        launcher.stop()
    return launcher.cfg, summary, time.monotonic() - started


def test_images_flow_by_reference_from_the_dataset_to_the_trainer(run):
    cfg, _, _ = run
    store = FileImageStore(cfg.vlm.image_store)
    assert Path(cfg.vlm.image_store) == Path(cfg.run_path) / "images"
    prompts = [e for e in read_events(cfg.bus, "prompts") if isinstance(e, PromptEvent)]
    trajs = [e for e in read_events(cfg.bus, "trajectories") if isinstance(e, TrajectoryEvent)]
    samples = [e for e in read_events(cfg.bus, "samples") if isinstance(e, SampleEvent)]
    assert prompts and trajs and samples
    by_group = {p.group_id: p for p in prompts}
    for p in prompts:
        (ref,) = p.images
        assert store.has(ref.sha256) and (ref.width, ref.height) == (56, 56)
        assert ref.data_b64  # the tiny PNGs also travel inline (vlm.inline_image_max_bytes)
    for t in trajs:
        assert t.images == by_group[t.group_id].images and t.prompt_ids == by_group[t.group_id].prompt_ids
    for s in samples:
        assert all(q.images == by_group[s.group_id].images for q in s.sequences)
    trained = {g for e in read_events(cfg.bus, "progress") if isinstance(e, ProgressEvent) for g in e.group_ids}
    assert len(trained) >= STEPS * cfg.train_dataset.prompts_per_step
    assert trained <= set(by_group)
    archived = FileImageStore(Path(cfg.run_path) / "archive" / "images")
    assert all(archived.has(p.images[0].sha256) for p in prompts if p.group_id in trained)
