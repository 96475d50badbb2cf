"""The agent proxy with a server engine: `tapioca proxy`'s service built with
``rollout.engine=vllm`` against the session's REAL vLLM server (tests/conftest.py's
``vllm_server``), the official openai SDK in front and the embedded broker behind. A
chat call is answered by vLLM, and the session's trajectory carries vLLM's token ids,
behaviour logprobs and versions."""

from __future__ import annotations

import openai
import pytest

from tapioca.bus.reader import read_events
from tapioca.config.servers import InferenceServerConfig
from tapioca.schemas.events import TrajectoryEvent

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ADMIN = "test-admin-key"


def test_proxy_chat_through_vllm_publishes_the_trajectory(start_proxy, vllm_server, wait_until):
    import json
    import urllib.request

    server, bus = start_proxy(
        vllm_server.model_dir, api_key=ADMIN, rollout__engine="vllm",
        rollout__server=InferenceServerConfig(urls=[vllm_server.url]),
        gconfig__n_samples=1, gconfig__max_new_tokens=6, train_dataset__prompts_per_step=1000)

    def post(path: str, body: dict, key: str) -> dict:
        req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json",
                                                             "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    session = post("/sessions", {"group_size": 1}, ADMIN)
    client = openai.OpenAI(base_url=server.base_url, api_key=session["api_key"], max_retries=0)
    out = client.chat.completions.create(model="tapioca", max_tokens=6, temperature=1.0,
                                         messages=[{"role": "user", "content": "Hello!"}])
    assert 1 <= out.usage.completion_tokens <= 6
    post(f"/sessions/{session['session_id']}/end", {}, session["api_key"])

    found: list[TrajectoryEvent] = []

    def published() -> bool:
        found[:] = [e for e in read_events(bus, "trajectories", idle_s=0.3)
                    if isinstance(e, TrajectoryEvent)]
        return bool(found)

    wait_until(published, timeout_s=60, what="the session's trajectory")
    traj = found[0]
    model_tokens = sum(traj.loss_mask) if traj.loss_mask else len(traj.output_ids)
    assert model_tokens == out.usage.completion_tokens
    assert len(traj.output_logprobs) == len(traj.output_ids) == len(traj.output_versions)
    assert all(v == 0 for v in traj.output_versions)
