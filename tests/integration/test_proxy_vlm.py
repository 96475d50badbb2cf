"""Images through the agent proxy (docs/vlm.md): a program using only the official
``openai`` SDK (examples/vlm/openai_vision_agent.py, run as its own process) sends
``image_url`` data-URL parts to a real proxy (uvicorn on 127.0.0.1, a tiny random
Qwen2.5-VL in the paged engine, the real embedded broker); its sessions' trajectories
carry the images by sha256 (stored in the run's image store), and they train: the
advantage processor and the trainer role, fed the events read back from the topics,
take a step whose vision tower moves. Bad images get a 400 that says why, and nothing
else of the session is lost; a refused request leaves nothing in the image store; six
concurrent requests never decode more pixels at once than ``vlm.max_decoding_pixels``
(the budget's high-water mark), and with the budget full a request gets 503 with
``Retry-After``."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tapioca.bus.reader import read_events
from tapioca.bus.role import Source
from tapioca.config.schema import TrainConfig
from tapioca.media.store import FileImageStore
from tapioca.models.vision import vision_spec
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint, resolve_run
from tapioca.schemas.events import RewardEvent, TrajectoryEvent
from tapioca.tasks.visual import draw
from tapioca.trainers.offline import OFFLINE_ETA, OfflineTrainer, samples_from_log

pytestmark = pytest.mark.integration

ADMIN = "vlm-admin-key"
AGENT = Path(__file__).resolve().parents[2] / "examples" / "vlm" / "openai_vision_agent.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("proxy-vlm") / "model", task="visual",
                                      arch="qwen2_5_vl", vision={"depth": 1, "hidden_size": 32}))


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("proxy-vlm-images")


@pytest.fixture(scope="module")
def proxy(start_proxy, model_dir, images_dir):
    return start_proxy(model_dir, api_key=ADMIN, run_id="vlmproxy.t0", gconfig__n_samples=2,
                       gconfig__max_new_tokens=2, train_dataset__prompts_per_step=1000,
                       vlm__image_store=str(images_dir), vlm__max_image_pixels=200 * 200,
                       vlm__max_decoding_pixels=2 * 200 * 200)


def _post(base_url: str, path: str, body, key: str):
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _agent(server, key: str, question: str, paths: list[Path]) -> str:
    env = {**os.environ, "OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": key, "AGENT_MAX_TOKENS": "2"}
    out = subprocess.run([sys.executable, str(AGENT), question, *map(str, paths)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def _png(size: int, colour=(9, 9, 9)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_an_openai_sdk_program_sends_images_and_its_sessions_train(proxy, model_dir, images_dir, tmp_path,
                                                                    wait_until):
    server, bus = proxy
    pngs = []
    for k in range(3):
        data, _ = draw("color", k)
        pngs.append(tmp_path / f"{k}.png")
        pngs[-1].write_bytes(data)
    # One group of 2 sessions: the first sends one image, the second two in one message.
    sessions = [_post(server.base_url, "/sessions", {"group_id": "vg", "task": "visual",
                                                      "task_data": {"answer": "1"}}, ADMIN)[1] for _ in range(2)]
    for i, s in enumerate(sessions):
        _agent(server, s["api_key"], "color?", pngs[:1 + i])
        # Unequal rewards, so the group's advantages (and the step's gradient) are not 0.
        status, _ = _post(server.base_url, f"/sessions/{s['session_id']}/reward",
                          {"reward": float(i == 0)}, s["api_key"])
        assert status == 200
        status, ended = _post(server.base_url, f"/sessions/{s['session_id']}/end", {}, s["api_key"])
        assert status == 200, ended
    def trajectories():
        return [e for e in read_events(bus, "trajectories", idle_s=0.5) if isinstance(e, TrajectoryEvent)]

    wait_until(lambda: len(trajectories()) == 2, timeout_s=60, what="the group's 2 trajectories")
    trajs = trajectories()
    store = FileImageStore(images_dir)
    from transformers import AutoConfig

    spec = vision_spec(AutoConfig.from_pretrained(model_dir))
    by_index = {t.sample_index: t for t in trajs}
    for i, t in by_index.items():
        assert [r.sha256 for r in t.images] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in pngs[:1 + i]]
        for ref, path in zip(t.images, pngs):
            assert store.get(ref.sha256) == path.read_bytes() and (ref.width, ref.height) == (56, 56)
        # 56 x 56 -> 4 placeholder tokens per image, all in the prompt.
        assert (t.prompt_ids + t.output_ids).count(spec.image_token_id) >= 4 * (1 + i)
    # The sessions train: the log's trajectories + rewards -> advantage processor -> trainer.
    cfg = resolve_run(TrainConfig(experiment_name="vlmproxy", trial_name="train", run_dir=str(tmp_path / "runs"),
                                  total_train_steps=1), values={
        "model.path": model_dir, "train_dataset.prompts_per_step": 1, "gconfig.n_samples": 2,
        "vlm.image_store": str(images_dir), "rollout.max_head_offpolicyness": OFFLINE_ETA,
        "actor.optimizer.lr": 1e-2}, prepare=True)
    events = [(Source("log", 0, i), e) for i, e in enumerate(
        trajs + [e for e in read_events(bus, "rewards", idle_s=0.5) if isinstance(e, RewardEvent)])]
    trainer = build_role("trainer", cfg)
    tower = {k: v.clone() for k, v in trainer.actor.model.model.visual.state_dict().items()}
    result = OfflineTrainer(trainer).run(samples_from_log(iter(events), build_role("advantage", cfg)))
    assert result.steps == 1 and result.final_version == 1
    # The step went through the images: the vision tower's weights moved.
    assert any(not (tower[k] == v).all() for k, v in trainer.actor.model.model.visual.state_dict().items())


def test_bad_images_get_a_400_that_says_why(proxy):
    server, _ = proxy
    s = _post(server.base_url, "/sessions", {"task": "visual"}, ADMIN)[1]

    def chat(content):
        return _post(server.base_url, "/chat/completions", {
            "model": "tapioca", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}, s["api_key"])

    def url_part(url):
        return {"type": "image_url", "image_url": {"url": url}}

    status, body = chat([url_part("https://example.com/cat.png"), {"type": "text", "text": "color?"}])
    assert status == 400 and "not fetched: a run must not depend on a third party" in body["error"]["message"]
    assert body["error"]["code"] == "invalid_image"
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot an image").decode()
    status, body = chat([url_part(corrupt)])
    assert status == 400 and "cannot be decoded" in body["error"]["message"]
    big = "data:image/png;base64," + base64.b64encode(_png(300)).decode()
    status, body = chat([url_part(big)])
    assert status == 400 and "over vlm.max_image_pixels=40,000" in body["error"]["message"]
    status, body = chat([{"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>color?"}])
    assert status == 400 and "placeholder" in body["error"]["message"]
    ok = "data:image/png;base64," + base64.b64encode(draw("color", 1)[0]).decode()
    status, body = chat([url_part(ok), url_part(ok), {"type": "text", "text": "color?"}])
    assert status == 200, body  # the session is unharmed by its bad calls


def test_an_image_for_a_text_only_model_is_a_400(start_proxy, tmp_path):
    model_dir = str(create_tiny_checkpoint(tmp_path / "text", task="visual"))
    server, _ = start_proxy(model_dir, api_key=ADMIN, run_id="vlmproxy.text", train_dataset__prompts_per_step=1000)
    s = _post(server.base_url, "/sessions", {}, ADMIN)[1]
    ok = "data:image/png;base64," + base64.b64encode(draw("color", 1)[0]).decode()
    status, body = _post(server.base_url, "/chat/completions", {
        "model": "tapioca", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": ok}}, {"type": "text", "text": "color?"}]}]}, s["api_key"])
    assert status == 400 and body["error"]["code"] == "unsupported_content", body
    server.stop()


def _url(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _stored(images_dir: Path) -> set[str]:
    return {p.name for p in Path(images_dir).rglob("*") if p.is_file()}


def test_a_refused_request_stores_nothing(proxy, images_dir):
    server, _ = proxy
    s = _post(server.base_url, "/sessions", {"task": "visual"}, ADMIN)[1]
    fresh = [_png(20 + k, (k, 200, 100)) for k in range(3)]  # never sent before
    before = _stored(images_dir)

    def chat(content):
        return _post(server.base_url, "/chat/completions", {
            "model": "tapioca", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}, s["api_key"])

    # Three good images, then one over the pixel limit: refused whole.
    status, body = chat([_url(d) for d in fresh] + [_url(_png(300))])
    assert status == 400 and "image 4 of 4" in body["error"]["message"]
    # Good images, refused after they were checked (a literal placeholder in the text).
    status, body = chat([_url(fresh[0]), {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}])
    assert status == 400 and "placeholder" in body["error"]["message"]
    assert _stored(images_dir) == before
    status, body = chat([_url(fresh[0]), {"type": "text", "text": "color?"}])
    assert status == 200, body  # accepted: now it is stored
    assert _stored(images_dir) == before | {hashlib.sha256(fresh[0]).hexdigest()}


def test_concurrent_images_stay_within_the_decoding_budget(proxy, monkeypatch):
    import threading

    from PIL import ImageFile

    server, _ = proxy
    budget = server.svc.vision.budget
    assert budget.capacity == 2 * 200 * 200
    load = ImageFile.ImageFile.load

    def slow_load(self):  # decodes that overlap: the budget, not luck, keeps them apart
        import time

        time.sleep(0.1)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", slow_load)
    sessions = [_post(server.base_url, "/sessions", {"task": "visual"}, ADMIN)[1] for _ in range(6)]
    statuses: list[int] = []

    def call(k: int) -> None:
        status, _ = _post(server.base_url, "/chat/completions", {
            "model": "tapioca", "max_tokens": 2, "messages": [{"role": "user", "content": [
                _url(_png(200, (k, 7, 7))), {"type": "text", "text": "color?"}]}]}, sessions[k]["api_key"])
        statuses.append(status)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert statuses == [200] * 6
    # Six images at the pixel limit, each decoded twice (checked, then processed): never
    # more than two at once. Counted in the budget, not in RSS.
    assert 200 * 200 <= budget.high_water <= budget.capacity and budget.in_use == 0


def test_a_full_decoding_budget_answers_503_with_retry_after(proxy):
    server, _ = proxy
    budget = server.svc.vision.budget
    s = _post(server.base_url, "/sessions", {"task": "visual"}, ADMIN)[1]
    body = {"model": "tapioca", "max_tokens": 2, "messages": [{"role": "user", "content": [
        _url(_png(50, (1, 2, 3))), {"type": "text", "text": "color?"}]}]}
    req = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {s['api_key']}"})
    wait_s, budget.wait_s = budget.wait_s, 0.0
    try:
        with budget.hold(budget.capacity):  # other requests' images fill the budget
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=60)
    finally:
        budget.wait_s = wait_s
    assert err.value.code == 503 and err.value.headers["Retry-After"] == "5"
    assert json.loads(err.value.read())["error"]["code"] == "images_busy"
    assert _post(server.base_url, "/chat/completions", body, s["api_key"])[0] == 200  # room again
