"""The agent proxy in online mode over loopback (issue 22): the official `openai` SDK and
plain HTTP against real proxy servers (uvicorn, the tiny model in the in-process engine,
the real embedded broker). Sessions ended without a reward wait on the log; rewards after
the end over HTTP and through `tapioca reward` (a signed control command, the CLI run as
a subprocess), also after the proxy restarted; the bad inputs and their codes; admission
past the staleness bound (429 + Retry-After, or served untrained); a fixed key across
episodes; a group that cannot be published dead-lettered with its slot freed.

Two parts use an engine that is not the real one (:class:`HeldEngine`, which answers with
fixed ids when the test lets it): "a call is generating" must last until the test has
sent its second request, and a trajectory over ``bus.max_message_bytes`` needs more
tokens than the tiny model's context. Everything else there is the real thing.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tapioca.bus.fleet import read_fleet
from tapioca.bus.producer import EventProducer
from tapioca.bus.reader import read_events
from tapioca.bus.signing import create_key_file
from tapioca.config.schema import AdvantageConfig, ModelConfig, NormConfig, ProxyConfig, TrainConfig
from tapioca.engines.base import GenRequest, GenResult, InferenceEngine
from tapioca.models.tokenizer import load_tokenizer
from tapioca.producers.proxy import ProxyServer, ProxyService
from tapioca.runtime.builders import build_proxy_service
from tapioca.runtime.run import create_tiny_checkpoint, resolve_run
from tapioca.schemas.events import DlqRecord, RewardEvent, TrajectoryEvent

pytestmark = pytest.mark.integration

ADMIN = "test-admin-key"
OFF = NormConfig(mean_level="none", std_level="none")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("online") / "model", task="gsm8k",
                                      max_position_embeddings=512))


def online_cfg(make_cfg, model_dir, tmp_path, **values) -> TrainConfig:
    """A run in online mode (n_samples 1, normalisation off) on a fresh topic prefix,
    signed with its own key."""
    key = tmp_path / "bus.key"
    create_key_file(key)
    bus = make_cfg(run_id="online.t0", signing_key_path=str(key))
    cfg = TrainConfig(experiment_name="online", trial_name="t0", model=ModelConfig(path=model_dir),
                      bus=bus, run_dir=str(tmp_path))
    base = {"proxy.api_key": ADMIN, "proxy.port": 0, "agent.mode": "online",
            "gconfig.n_samples": 1, "gconfig.max_new_tokens": 4, "advantage": AdvantageConfig(
                adv_norm=OFF, reward_timeout_s=600.0, group_timeout_s=900.0),
            "rollout.max_head_offpolicyness": 8, "train_dataset.prompts_per_step": 1}
    base.update({k.replace("__", "."): v for k, v in values.items()})
    return resolve_run(cfg, values=base)


def ready(server: ProxyServer) -> ProxyServer:
    """Started, and its head gate knows the latest weights (else a start is a 503)."""
    assert server.svc.gate.ready.wait(60), "the proxy's weights follower did not recover"
    return server


@pytest.fixture
def serve(make_cfg, model_dir, tmp_path, one_torch_thread):
    """``serve(cfg=None, **values) -> (server, cfg)``; every server is stopped after the test."""
    servers: list[ProxyServer] = []

    def start(cfg: TrainConfig | None = None, **values):
        cfg = cfg or online_cfg(make_cfg, model_dir, tmp_path, **values)
        server = ProxyServer(build_proxy_service(cfg), "127.0.0.1", 0).start()
        servers.append(server)
        return ready(server), cfg

    yield start
    for server in servers:
        server.stop()


def post(server, path: str, body=None, key: str | None = ADMIN, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body or {}).encode()
    req = urllib.request.Request(server.base_url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def code_of(answer) -> tuple[int, str | None]:
    status, body, _ = answer
    return status, (body.get("error") or {}).get("code")


def chat(server, session, turns: int = 2) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=session["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "2+2="}]
    for _ in range(turns):
        out = client.chat.completions.create(model="tapioca", messages=messages, max_tokens=3)
        messages += [{"role": "assistant", "content": out.choices[0].message.content},
                     {"role": "user", "content": "again"}]


def session(server, **body) -> dict:
    status, out, _ = post(server, "/sessions", body)
    assert status == 200, out
    return out


def end(server, s, **body) -> dict:
    status, out, _ = post(server, f"/sessions/{s['session_id']}/end", body, s["api_key"])
    assert status == 200, out
    return out


def events(cfg, topic: str, cls, **match) -> list:
    return [e for e in read_events(cfg.bus, topic, idle_s=0.3) if isinstance(e, cls)
            and all(getattr(e, k) == v for k, v in match.items())]


def test_an_ended_session_waits_on_the_log_for_its_reward(serve, wait_until):
    server, cfg = serve()
    s = session(server)
    chat(server, s)
    ended = end(server, s)
    assert ended["published"] and ended["reward_pending"] and ended["rewards"] == [None]
    (traj,) = events(cfg, "trajectories", TrajectoryEvent, group_id=s["group_id"])
    assert traj.session_id == s["session_id"] and len(traj.turn_boundaries) == 2
    assert events(cfg, "rewards", RewardEvent, group_id=s["group_id"]) == []
    path = f"/sessions/{s['session_id']}/reward"
    # Bad values: 400, and nothing else changes.
    assert code_of(post(server, path, raw=b'{"reward": NaN}')) == (400, "invalid_json")
    assert code_of(post(server, path, {"reward": 1e10})) == (400, "invalid_reward")
    assert code_of(post(server, path, {"reward": "good"})) == (400, "invalid_reward")
    assert code_of(post(server, "/sessions/sess-nope/reward", {"reward": 1.0})) == (
        404, "session_not_found")
    # The session's own key still rewards it after the end (this proxy served it).
    status, out, _ = post(server, path, {"reward": 0.75}, s["api_key"])
    assert status == 200 and out["published"] and out["traj_ids"] == [traj.traj_id], out
    (r,) = events(cfg, "rewards", RewardEvent, group_id=s["group_id"])
    assert (r.traj_id, r.reward, r.scorer) == (traj.traj_id, 0.75, "session")
    assert r.details["delayed"] and r.details["session_id"] == s["session_id"]
    assert code_of(post(server, path, {"reward": 1.0})) == (409, "already_rewarded")
    # Rewarded before its end: its reward went out with it; a later one is a second one.
    t = session(server)
    chat(server, t, turns=1)
    assert post(server, f"/sessions/{t['session_id']}/reward", {"reward": 1.0}, t["api_key"])[0] == 200
    assert not end(server, t)["reward_pending"]
    assert code_of(post(server, f"/sessions/{t['session_id']}/reward", {"reward": 1.0})) == (
        409, "already_rewarded")
    # A group of two: a reward after the first one's end goes out with the group.
    a = session(server, group_size=2)
    b = session(server, group_id=a["group_id"], group_size=2)
    chat(server, a, turns=1)
    chat(server, b, turns=1)
    assert not end(server, a)["published"]
    status, out, _ = post(server, f"/sessions/{a['session_id']}/reward", {"reward": 0.5})
    assert status == 200 and not out["published"]
    assert end(server, b)["reward_pending"]  # b has none yet; a's goes out with the group
    (ra,) = events(cfg, "rewards", RewardEvent, group_id=a["group_id"])
    assert ra.reward == 0.5 and ra.traj_id == out["traj_ids"][0]
    counts = server.svc.session_counts()
    assert counts["served"] == 4 and counts["rewards_pending"] == 1 and counts["rewarded"] == 3
    # A reward from another service (a RewardEvent on rewards.v1) counts too: a second
    # one through the proxy is refused.
    (tb,) = [e for e in events(cfg, "trajectories", TrajectoryEvent, group_id=a["group_id"])
             if e.session_id == b["session_id"]]
    with EventProducer(cfg.bus, "thumbs-service") as producer:
        producer.publish(RewardEvent(traj_id=tb.traj_id, group_id=tb.group_id, reward=1.0,
                                     scorer="thumbs", run_id=tb.run_id))
    wait_until(lambda: server.svc.session_counts()["rewards_pending"] == 0,
               what="the proxy to read the service's reward")
    assert code_of(post(server, f"/sessions/{b['session_id']}/reward", {"reward": 1.0})) == (
        409, "already_rewarded")


def test_the_reward_window_closes_with_410(serve):
    # The processor waits reward_timeout_s = 2 s: the proxy takes rewards for 1.8 s.
    server, _ = serve(advantage=AdvantageConfig(adv_norm=OFF, reward_timeout_s=2.0,
                                                group_timeout_s=4.0))
    s = session(server)
    chat(server, s, turns=1)
    end(server, s)
    time.sleep(2.0)
    status, body, _ = post(server, f"/sessions/{s['session_id']}/reward", {"reward": 1.0})
    assert (status, body["error"]["code"]) == (410, "reward_window_closed")
    assert "past the reward window of 2 s" in body["error"]["message"]


def tapioca(cfg, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TAPIOCA_BOOTSTRAP": cfg.bus.bootstrap_servers}
    return subprocess.run([sys.executable, "-m", "tapioca.ops.cli", "--prefix", cfg.bus.topic_prefix,
                           "--key-file", cfg.bus.signing_key_path, *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_rewards_after_a_proxy_restart_over_http_and_tapioca_reward(serve, wait_until):
    """The ended sessions are on the log: a new proxy of the run rebuilds its index from
    it and takes their rewards; `tapioca reward` sends the signed command."""
    first, cfg = serve()
    ended = []
    for _ in range(3):
        s = session(first)
        chat(first, s, turns=1)
        end(first, s)
        ended.append(s)
    first.stop()
    second, _ = serve(cfg)
    path = f"/sessions/{ended[0]['session_id']}/reward"
    # The old key is unknown to the new proxy (keys never go on the log): admin only.
    assert code_of(post(second, path, {"reward": 1.0}, ended[0]["api_key"]))[0] == 403
    status, out, _ = post(second, path, {"reward": 1.0})
    assert status == 200 and out["published"], out
    # tapioca reward, once the new proxy's member shows in the fleet (a heartbeat or two).
    sid = ended[1]["session_id"]
    wait_until(lambda: any(m.live and m.event.role == "proxy-sessions"
                           and m.event.member_id.startswith(second.svc.member_id)
                           for m in read_fleet(cfg.bus)), timeout_s=60, interval_s=0.5,
               what="the restarted proxy in the fleet")
    done = tapioca(cfg, "reward", sid, "-0.5", "--timeout", "30")
    assert done.returncode == 0, done.stderr
    again = tapioca(cfg, "reward", sid, "1")
    assert again.returncode != 0 and "409 already_rewarded" in again.stderr, again.stderr
    unknown = tapioca(cfg, "reward", "sess-unknown", "1")
    assert unknown.returncode != 0 and "404 session_not_found" in unknown.stderr
    bad = tapioca(cfg, "reward", ended[2]["session_id"], "nan")
    assert bad.returncode != 0 and "finite" in bad.stderr
    rewards = {e.traj_id: e.reward for e in events(cfg, "rewards", RewardEvent)}
    trajs = {e.session_id: e.traj_id for e in events(cfg, "trajectories", TrajectoryEvent)}
    assert rewards == {trajs[ended[0]["session_id"]]: 1.0, trajs[sid]: -0.5}


def test_past_the_staleness_bound_429_or_served_untrained(serve):
    # eta 0, B 1: one group may be admitted before the trainer's first step.
    gate = dict(rollout__max_head_offpolicyness=0)
    server, _ = serve(**gate)
    session(server)
    status, body, headers = post(server, "/sessions", {})
    assert (status, body["error"]["code"], headers.get("retry-after")) == (429, "staleness_bound", "5")
    assert body["error"]["type"] == "rate_limit_error"
    assert server.svc.session_counts()["refused"] == 1
    # The 429 is counted for the status row (`tapioca_proxy_rate_limited_total`).
    assert server.svc.session_counts()["rate_limited"] == 1
    untrained, cfg = serve(proxy=ProxyConfig(api_key=ADMIN, port=0, admission="serve_untrained"),
                           **gate)
    session(untrained)
    u = session(untrained)
    assert u["for_training"] is False and untrained.svc.gate.admitted == 1
    chat(untrained, u, turns=1)
    ended = end(untrained, u)
    assert not ended["published"] and ended["reason"].startswith("not for training: served past")
    assert code_of(post(untrained, f"/sessions/{u['session_id']}/reward", {"reward": 1.0})) == (
        409, "not_for_training")
    assert events(cfg, "trajectories", TrajectoryEvent, group_id=u["group_id"]) == []
    assert untrained.svc.gate.capacity() == 0  # its session took no slot, nor gave one back


class HeldEngine(InferenceEngine):
    """Answers every request with ``output_ids`` (logprob -0.25, version 0) once the
    test sets ``go``."""

    def __init__(self, output_ids: list[int]) -> None:
        self.output_ids = output_ids
        self.go = threading.Event()
        self.go.set()

    def submit(self, request: GenRequest) -> concurrent.futures.Future[GenResult]:
        future: concurrent.futures.Future[GenResult] = concurrent.futures.Future()
        n = len(self.output_ids)

        def answer() -> None:
            self.go.wait(60)
            future.set_result(GenResult(request.request_id, list(request.prompt_ids),
                                        list(self.output_ids), [-0.25] * n, [0] * n, "stop",
                                        {"generate_s": 0.0}))

        threading.Thread(target=answer, daemon=True).start()
        return future

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, weights, version: int) -> None: ...

    @property
    def version(self) -> int:
        return 0

    def shutdown(self) -> None: ...


def held_proxy(cfg, engine: HeldEngine) -> ProxyServer:
    from tapioca.config.sections import proxy_section

    tokenizer = load_tokenizer(cfg.model.path)
    svc = ProxyService(proxy_section(cfg), engine=engine, tokenizer=tokenizer, bus=cfg.bus,
                       load_weights=lambda e: None)
    return ready(ProxyServer(svc).start())


def test_a_fixed_key_ends_and_exports_its_previous_episode(make_cfg, model_dir, tmp_path,
                                                            wait_until):
    cfg = online_cfg(make_cfg, model_dir, tmp_path)
    engine = HeldEngine([40, 41, 42])
    server = held_proxy(cfg, engine)
    try:
        key = "user-alice-0123456789"
        one = session(server, api_key=key)
        assert one["api_key"] == key and one["previous"] is None
        chat(server, one, turns=1)
        two = session(server, api_key=key)
        prev = two["previous"]
        assert prev["session_id"] == one["session_id"] and prev["published"]
        assert prev["reward_pending"]
        (traj,) = events(cfg, "trajectories", TrajectoryEvent, group_id=one["group_id"])
        assert traj.session_id == one["session_id"]
        chat(server, two, turns=1)  # the key now drives the second episode
        assert server.svc.store.sessions[two["session_id"]].calls == 1
        # Two clients on one key at once: a call is generating when the next start comes.
        engine.go.clear()
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        pending = concurrent.futures.ThreadPoolExecutor(1).submit(
            client.chat.completions.create, model="tapioca",
            messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        wait_until(lambda: server.svc.session_counts()["generating"] == 1, what="a call in flight")
        assert code_of(post(server, "/sessions", {"api_key": key})) == (409, "key_in_use")
        engine.go.set()
        assert pending.result(timeout=60).choices  # the held call is answered, not lost
        three = session(server, api_key=key)
        assert three["previous"]["session_id"] == two["session_id"]
        # Bad keys: 400.
        for bad in ("short", "tpk-" + "x" * 20, "has space " * 3, 12345678901234567):
            assert code_of(post(server, "/sessions", {"api_key": bad}))[0] == 400, bad
        # The first episode's reward, by session id, after the key moved on.
        status, out, _ = post(server, f"/sessions/{one['session_id']}/reward", {"reward": 1.0})
        assert status == 200 and out["traj_ids"] == [traj.traj_id]
    finally:
        engine.go.set()
        server.stop()


def test_a_group_that_cannot_be_published_is_dead_lettered_and_frees_its_slot(
        make_cfg, model_dir, tmp_path):
    # A trajectory over bus.max_message_bytes: no retry can publish it.
    cfg = online_cfg(make_cfg, model_dir, tmp_path, bus__max_message_bytes=4096,
                     rollout__max_head_offpolicyness=0)
    engine = HeldEngine([40] * 600)
    server = held_proxy(cfg, engine)
    try:
        s = session(server)
        assert server.svc.gate.capacity() == 0
        chat(server, s, turns=1)
        ended = end(server, s)
        assert not ended["published"] and "over the limit of 4,096" in ended["reason"], ended
        assert server.svc.gate.capacity() == 1  # its slot is free again
        letters = [e for e in read_events(cfg.bus, "dlq", idle_s=0.3) if isinstance(e, DlqRecord)]
        assert len(letters) == 1 and letters[0].source_topic.endswith(".trajectories.v1")
        assert f"group {s['group_id']} cannot be published" in letters[0].error
        assert events(cfg, "trajectories", TrajectoryEvent) == []
        assert code_of(post(server, f"/sessions/{s['session_id']}/reward", {"reward": 1.0})) == (
            409, "nothing_to_reward")
    finally:
        server.stop()


def test_the_terminal_chat_example_runs_episodes_under_one_key(serve):
    """examples/online/chat.py against a real online proxy, fed lines on stdin as a
    person would type them: two episodes, the first rated in the chat, the second left
    for `tapioca reward`; the first start of the second ends and exports the first."""
    server, cfg = serve()
    example = Path(__file__).resolve().parents[2] / "examples" / "online" / "chat.py"
    done = subprocess.run(
        [sys.executable, str(example), "--proxy", server.base_url, "--admin-key", ADMIN,
         "--key", "user-example-0123456789", "--max-tokens", "3"],
        input="hello\n/rate 1\n/new\nhi again\n/quit\n", capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    first, second = [line.split()[1] for line in out.splitlines() if line.startswith("episode ")]
    assert f"[{first}: rewarded]" in out and f"[episode {first} ended: rewarded]" in out
    assert f"[episode {second} ended: waits for its reward]" in out
    assert f"reward {second} 1" in out
    trajs = {t.session_id for t in events(cfg, "trajectories", TrajectoryEvent)}
    assert trajs == {first, second}
