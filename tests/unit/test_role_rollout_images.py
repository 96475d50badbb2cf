"""RolloutWorker with image prompts, on the paged engine and a tiny random Qwen2.5-VL (no
broker): the images are fetched from the store and processed as the builder wires it
(runtime/builders.py ``request_images``), the trajectories carry the prompt's references,
and a prompt whose images cannot be used is dead-lettered at once (BadEventError), the
worker going on: a blob missing from the store, placeholders that do not match the
images, any image for a worker whose model reads none, and an image bomb (a small
inline PNG that decodes to 13000 x 13000), refused from its header before a pixel of it
is decoded."""

from __future__ import annotations

import base64
import time

import pytest
from test_image_admission import bomb_png, spy_decodes

from tapioca.bus.role import Source
from tapioca.config.policy import policy_of_dir
from tapioca.config.schema import GenerationConfig, VlmConfig
from tapioca.config.sections import RolloutSection
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.torch_engine import TorchEngine
from tapioca.media.store import FileImageStore, sha256_hex
from tapioca.models.factory import load_model_and_tokenizer, save_tiny_checkpoint
from tapioca.models.vision import VisionPrompts
from tapioca.producers.rollout import RolloutWorker
from tapioca.runtime.builders import request_images
from tapioca.schemas.errors import BadEventError
from tapioca.schemas.events import ImageRef, PromptEvent, TrajectoryEvent
from tapioca.tasks.visual import VISUAL_ALPHABET, draw


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-vl")
    path = save_tiny_checkpoint(root / "m", arch="qwen2_5_vl", alphabet=VISUAL_ALPHABET)
    model, tokenizer = load_model_and_tokenizer(path)
    vlm = VlmConfig(image_store=str(root / "images"), inline_image_max_bytes=0)
    vp = VisionPrompts(path, tokenizer, FileImageStore(vlm.image_store), max_pixels=10**6, inline_max_bytes=0)
    return path, model, tokenizer, vlm, vp


def worker(engine, images):
    section = RolloutSection(gconfig=GenerationConfig(temperature=1.0, max_new_tokens=3), seed=0)
    return RolloutWorker(section, engine=engine, load_weights=lambda e: None,
                         decode=lambda ids: str(ids), images=images)


def prompt(gid: str, ids, refs, n: int = 2) -> PromptEvent:
    return PromptEvent(group_id=gid, prompt_id=gid, group_index=0, n_samples=n, prompt_ids=list(ids),
                       task="visual", task_data={"answer": "1"}, images=list(refs))


def test_image_prompts_become_trajectories_with_their_references(setup):
    path, model, tokenizer, vlm, vp = setup
    ids, _, refs = vp.encode(next(iter_rows()))
    role = worker(PagedEngine(model, seed=0, kv_cache_tokens=2048),
                  request_images(policy_of_dir(str(path)), vlm, pixels=True))
    state = role.init_state()
    try:
        role.handle(prompt("g0", ids, refs), state, Source("p", 0, 0))
        out: list[TrajectoryEvent] = []
        deadline = time.monotonic() + 60
        while len(out) < 2:
            assert time.monotonic() < deadline
            out += [e for e in role.on_tick(state, time.time()) if isinstance(e, TrajectoryEvent)]
            time.sleep(0.01)
    finally:
        role.on_stop(state)
    assert [t.images for t in out] == [refs, refs] and all(len(t.output_ids) >= 1 for t in out)


def iter_rows():
    from tapioca.tasks.base import get_task

    return get_task("visual", n_images=2).iter_records("train", 0)


def test_unusable_images_are_dead_lettered_and_the_worker_goes_on(setup, tmp_path):
    path, model, tokenizer, vlm, vp = setup
    ids, _, refs = vp.encode(next(iter_rows()))
    role = worker(TorchEngine(model, seed=0), request_images(policy_of_dir(str(path)), vlm, pixels=True))
    state = role.init_state()
    try:
        missing = ImageRef(sha256="0" * 64, mime="image/png", width=56, height=56)
        with pytest.raises(BadEventError, match="not in the image store"):
            role.handle(prompt("g1", ids, [missing]), state, Source("p", 0, 1))
        two = vp.refs([draw("color", 5)[0]])
        with pytest.raises(BadEventError, match="placeholder"):
            role.handle(prompt("g2", ids, refs + two), state, Source("p", 0, 2))
        role.handle(prompt("g3", ids, refs), state, Source("p", 0, 3))  # a good one still goes
        assert "g3" in state.inflight
    finally:
        role.on_stop(state)
    text_dir = save_tiny_checkpoint(tmp_path / "text", alphabet=VISUAL_ALPHABET)
    text = worker(TorchEngine(load_model_and_tokenizer(text_dir)[0]),
                  request_images(policy_of_dir(str(text_dir)), vlm, pixels=True))
    state = text.init_state()
    try:
        with pytest.raises(BadEventError, match="reads no images"):
            text.handle(prompt("g4", [1, 2, 3], refs), state, Source("p", 0, 4))
    finally:
        text.on_stop(state)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_an_image_bomb_is_dead_lettered_before_it_is_decoded(setup, monkeypatch):
    decodes = spy_decodes(monkeypatch)
    path, model, tokenizer, vlm, vp = setup
    ids, _, refs = vp.encode(next(iter_rows()))
    bomb = bomb_png()  # ~20 KB inline, its sha256 right: 13000 x 13000 = 507 MB as RGB
    ref = ImageRef(sha256=sha256_hex(bomb), mime="image/png", width=13000, height=13000,
                   data_b64=base64.b64encode(bomb).decode())
    role = worker(TorchEngine(model, seed=0), request_images(policy_of_dir(str(path)), vlm, pixels=True))
    state = role.init_state()
    try:
        with pytest.raises(BadEventError, match=r"prompt gb cannot be generated: the image is 13000 x 13000 "
                                                r"= 169,000,000 pixels, over vlm.max_image_pixels"):
            role.handle(prompt("gb", ids, [ref]), state, Source("p", 0, 5))
        assert (13000, 13000) not in decodes and "gb" not in state.inflight
        role.handle(prompt("g6", ids, refs), state, Source("p", 0, 6))  # the next good one is served
        assert "g6" in state.inflight and (56, 56) in decodes  # (the spy sees decodes)
    finally:
        role.on_stop(state)
