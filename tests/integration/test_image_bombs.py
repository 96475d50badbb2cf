"""An image bomb on the log (docs/vlm.md, docs/security.md), on the real embedded broker: a
prompt event carrying an inline ~20 KB PNG (its sha256 right) that decodes to 13000 x
13000 reaches a rollout worker built as `tapioca train` builds it (a tiny random
Qwen2.5-VL). The worker dead-letters it on ``dlq.v1`` with the reason (the pixel limit,
read from the PNG's header) before any of its pixels is decoded, and serves the good
prompt published after it."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_image_admission import bomb_png, spy_decodes  # noqa: E402

from tapioca.bus import EventProducer  # noqa: E402
from tapioca.bus.reader import read_events  # noqa: E402
from tapioca.config.schema import GenerationConfig, ModelConfig, TrainConfig, VlmConfig  # noqa: E402
from tapioca.media.store import FileImageStore, sha256_hex  # noqa: E402
from tapioca.models.tokenizer import load_tokenizer  # noqa: E402
from tapioca.models.vision import VisionPrompts  # noqa: E402
from tapioca.runtime.builders import build_role  # noqa: E402
from tapioca.runtime.run import create_tiny_checkpoint  # noqa: E402
from tapioca.schemas.events import DlqRecord, ImageRef, PromptEvent, TrajectoryEvent  # noqa: E402
from tapioca.tasks.visual import draw  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_bomb_on_the_log_is_dead_lettered_with_its_reason_and_the_worker_goes_on(
        make_cfg, start_runner, wait_until, tmp_path, one_torch_thread, monkeypatch):
    decodes = spy_decodes(monkeypatch)
    model = str(create_tiny_checkpoint(tmp_path / "model", task="visual", arch="qwen2_5_vl"))
    bus = make_cfg(run_id="bombs.run")
    cfg = TrainConfig(experiment_name="bombs", trial_name="run", run_dir=str(tmp_path / "runs"), bus=bus,
                      model=ModelConfig(path=model, arch="qwen2_5_vl"),
                      gconfig=GenerationConfig(n_samples=2, max_new_tokens=2),
                      vlm=VlmConfig(image_store=str(tmp_path / "images"), inline_image_max_bytes=0))
    vp = VisionPrompts(model, load_tokenizer(model), FileImageStore(cfg.vlm.image_store),
                       max_pixels=cfg.vlm.max_image_pixels, inline_max_bytes=0)
    ids, _, refs = vp.encode({"messages": [{"role": "user", "content": [{"type": "image"},
                                                                          {"type": "text", "text": "color?"}]}],
                              "images": [draw("color", 1)[0]]})
    bomb = bomb_png()
    bomb_ref = ImageRef(sha256=sha256_hex(bomb), mime="image/png", width=13000, height=13000,
                        data_b64=base64.b64encode(bomb).decode())

    def prompt(gid: str, images) -> PromptEvent:
        return PromptEvent(group_id=gid, prompt_id=gid, group_index=0, n_samples=2, prompt_ids=list(ids),
                           task="visual", task_data={"answer": "1"}, images=list(images))

    producer = EventProducer(bus, "bomb-feeder")
    try:
        producer.publish(prompt("bomb", [bomb_ref]))  # first: the good one waits behind it
        producer.publish(prompt("good", refs))
        producer.flush()
    finally:
        producer.close()
    start_runner(build_role("rollout", cfg), bus, max_seconds=120, member_id="rollout-0")

    def dead() -> list[DlqRecord]:
        return [e for e in read_events(bus, "dlq", idle_s=0.3) if isinstance(e, DlqRecord)]

    def trajectories() -> list[TrajectoryEvent]:
        return [e for e in read_events(bus, "trajectories", idle_s=0.3) if isinstance(e, TrajectoryEvent)]

    wait_until(lambda: len(trajectories()) == 2, timeout_s=90, what="the good prompt's 2 trajectories")
    (record,) = dead()
    assert record.source_topic.endswith("prompts.v1") and record.error_type == "BadEventError"
    assert ("prompt bomb cannot be generated: the image is 13000 x 13000 = 169,000,000 pixels, over "
            "vlm.max_image_pixels=16,777,216") in record.error
    assert {t.group_id for t in trajectories()} == {"good"}
    assert (13000, 13000) not in decodes  # refused from the header: no pixel of it decoded
