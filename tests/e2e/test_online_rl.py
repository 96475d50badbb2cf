"""End to end, online mode (issue 22's "done when"): live users' sessions are the data,
their rewards come later, and every rewarded trajectory trains exactly once.

``tapioca train``'s launcher with ``examples/online/online_cpu.yaml`` (``agent.mode:
online``, ``gconfig.n_samples: 1``, normalisation off) on a real embedded broker: the
proxy, the advantage processor and the trainer, each its own OS process; nothing feeds
prompts. Three scripted users chat at once with the official ``openai`` SDK, two
multi-turn episodes each under a fixed key (the second start ends and exports the
first). Their rewards come later, and each group of them after a different event:
10 s after the episode ended (HTTP), after the advantage processor was killed (kill -9)
while they were pending, and after the proxy was killed and restarted (`tapioca
reward`, the signed CLI command; the ended sessions are only on the log then). One
user's last episode and a fourth user's episodes are never rewarded. The bad inputs get
their codes: NaN and out-of-bounds rewards 400, an unknown session 404, a second reward
409, a key two clients use at once 409. Then, read from the topics: every rewarded
group is trained in exactly one version, no unrewarded one is, and every trained
group's staleness is within rollout.max_head_offpolicyness.

Budget (the shared 2-core box): ~20-40 s to start the three processes, the 10 s wait,
~10-20 s for each restart, and five training steps of one short sequence.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from tapioca.bus import read_events
from tapioca.bus.fleet import read_fleet
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher, role_counts
from tapioca.schemas import RewardEvent, SampleEvent, TrajectoryEvent

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "online" / "online_cpu.yaml"
ETA = 16
HTTP_TIMEOUT_S = 120


class Proxy:
    """The run's proxy over plain HTTP (the admin key), and the SDK for chats."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.base = f"http://{cfg.proxy.host}:{cfg.proxy.port}/v1"
        self.admin = cfg.proxy.admin_key()

    def post(self, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
        data = raw if raw is not None else json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base + path, data=data, method="POST", headers={
            "Authorization": f"Bearer {self.admin}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(self.base.removesuffix("/v1") + "/health", timeout=10) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return {}

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.health().get("ready"):
            assert time.monotonic() < deadline, f"the proxy at {self.base} did not become ready"
            time.sleep(0.5)

    def start(self, key: str) -> dict:
        """A session under a fixed key; a 429 / 503 is retried as Retry-After says."""
        for _ in range(60):
            status, body = self.post("/sessions", {"api_key": key})
            if status == 200:
                return body
            assert status in (429, 503), body
            time.sleep(1.0)
        raise AssertionError("the proxy kept refusing a session start")

    def chat(self, key: str, turns: int, **kw) -> None:
        client = openai.OpenAI(base_url=self.base, api_key=key, max_retries=0,
                               timeout=HTTP_TIMEOUT_S)
        messages = [{"role": "user", "content": "hello there"}]
        for _ in range(turns):
            out = client.chat.completions.create(model="tapioca", messages=messages,
                                                 max_tokens=kw.get("max_tokens", 4),
                                                 n=kw.get("n", 1))
            messages += [{"role": "assistant", "content": out.choices[0].message.content},
                         {"role": "user", "content": "tell me more"}]

    def reward(self, session_id: str, value) -> tuple[int, dict]:
        return self.post(f"/sessions/{session_id}/reward", {"reward": value})


def user(proxy: Proxy, key: str, out: dict) -> None:
    """Two episodes of two turns; starting the second ends (and exports) the first."""
    try:
        a = proxy.start(key)
        proxy.chat(key, 2)
        b = proxy.start(key)
        out["a"], out["a_end"], out["a_ended_at"] = a, b["previous"], time.monotonic()
        proxy.chat(key, 2)
        status, out["b_end"] = proxy.post(f"/sessions/{b['session_id']}/end")
        assert status == 200, out["b_end"]
        out["b"] = b
    except BaseException as exc:  # surfaced by the test
        out["error"] = exc


def two_clients_on_one_key(proxy: Proxy) -> None:
    """A long call (16 choices x 64 tokens) is generating when a second client starts a
    session with the same key: 409 key_in_use. If the call ended first (then the start
    is a legal next episode), again, with the new episode."""
    key = f"user-dana-{uuid.uuid4().hex}"
    proxy.start(key)
    for _ in range(5):
        call = threading.Thread(target=proxy.chat, args=(key, 1), kwargs={"n": 16, "max_tokens": 64})
        call.start()
        deadline = time.monotonic() + 60
        while proxy.health().get("sessions", {}).get("generating", 0) < 1:
            assert call.is_alive() or time.monotonic() < deadline, "the long call never showed"
            if not call.is_alive():
                break
            time.sleep(0.005)
        status, body = proxy.post("/sessions", {"api_key": key})
        call.join(HTTP_TIMEOUT_S)
        if status == 409:
            assert body["error"]["code"] == "key_in_use", body
            return
        assert status == 200, body  # the call had finished: the next episode started
    raise AssertionError("never caught the long call in flight")


def trained_by_version(cfg: TrainConfig) -> dict[int, list[str]]:
    """Version -> the groups trained to make it, from the trainer's verdicts on the log:
    progress.v1 where the tree has it (issue 21), else weights.v1."""
    from tapioca.schemas import events

    cls = getattr(events, "ProgressEvent", None) or events.WeightsEvent
    topic = "progress" if cls.__name__ == "ProgressEvent" else "weights"
    versions: dict[int, list[str]] = {}
    for e in read_events(cfg.bus, topic):
        if isinstance(e, cls) and e.run_id == cfg.bus.run_id:
            versions.setdefault(e.version, list(e.group_ids))
    return versions


def tapioca(cfg: TrainConfig, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tapioca.ops.cli", "--run-dir", cfg.run_path,
                           *args], capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory):
    cfg = load_config(TrainConfig, str(EXAMPLE), [
        f"run_dir={tmp_path_factory.mktemp('runs')}", "experiment_name=online-e2e",
        "trial_name=t0", "total_train_steps=5", f"bus.bootstrap_servers={broker.bootstrap}",
        f"bus.topic_prefix=online{uuid.uuid4().hex[:8]}", "gconfig.max_new_tokens=4",
        f"rollout.max_head_offpolicyness={ETA}", "advantage.reward_timeout_s=600",
        "advantage.group_timeout_s=900",
    ])
    assert [r for r, _ in role_counts(cfg)] == ["trainer", "advantage", "proxy"]
    launcher = Launcher(cfg)
    facts: dict = {}
    try:
        launcher.start()
        cfg = launcher.cfg
        proxy = Proxy(cfg)
        proxy.wait_ready()
        # Three users at once.
        users = [{} for _ in range(3)]
        threads = [threading.Thread(target=user, args=(proxy, f"user-{i}-{uuid.uuid4().hex}", u))
                   for i, u in enumerate(users)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        for u in users:
            assert "error" not in u, u.get("error")
        two_clients_on_one_key(proxy)
        a = [u["a"]["session_id"] for u in users]
        b = [u["b"]["session_id"] for u in users]
        # Bad inputs: a clear 4xx, and nothing else changes.
        facts["bad"] = [proxy.post(f"/sessions/{a[0]}/reward", raw=b'{"reward": NaN}')[0],
                        proxy.reward(a[0], 1e12)[0], proxy.reward("sess-nobody", 1.0)[0]]
        # Rewards 10 s after the end.
        time.sleep(max(0.0, max(u["a_ended_at"] for u in users[:2]) + 10.0 - time.monotonic()))
        assert [proxy.reward(sid, 1.0)[0] for sid in a[:2]] == [200, 200]
        facts["second"] = proxy.reward(a[0], 0.0)
        # The advantage processor killed while rewards are pending; they come after.
        launcher.restart("advantage")
        assert [proxy.reward(a[2], 0.5)[0], proxy.reward(b[0], -1.0)[0]] == [200, 200]
        # The proxy killed and restarted: the ended sessions are only on the log now.
        old = {m.event.member_id for m in read_fleet(cfg.bus) if m.event.role == "proxy-sessions"}
        launcher.restart("proxy")
        proxy.wait_ready()
        deadline = time.monotonic() + 120
        while not any(m.live and m.event.role == "proxy-sessions" and m.event.member_id not in old
                      for m in read_fleet(cfg.bus)):
            assert time.monotonic() < deadline, "the restarted proxy never heartbeat"
            time.sleep(0.5)
        done = tapioca(cfg, "reward", b[1], "0.25", "--timeout", "60")
        assert done.returncode == 0, done.stderr
        facts["cli_again"] = tapioca(cfg, "reward", b[1], "1")
        summary = launcher.wait(timeout_s=600)
    except BaseException:
        for child in launcher.children:
            print(f"--- {child.label} ---\n{child.log_tail(40)}")
        raise
    finally:
        launcher.stop()
    facts.update(users=users, rewarded={a[0]: 1.0, a[1]: 1.0, a[2]: 0.5, b[0]: -1.0, b[1]: 0.25},
                 unrewarded=[b[2]])
    return cfg, summary, facts


def test_bad_inputs_get_their_codes(run):
    _, _, facts = run
    assert facts["bad"] == [400, 400, 404]
    status, body = facts["second"]
    assert (status, body["error"]["code"]) == (409, "already_rewarded")
    again = facts["cli_again"]
    assert again.returncode != 0 and "409 already_rewarded" in again.stderr


def test_every_rewarded_trajectory_trained_exactly_once_within_the_bound(run):
    cfg, summary, facts = run
    assert summary.steps == 5
    ours = lambda e: e.run_id == cfg.bus.run_id  # noqa: E731
    trajs = [e for e in read_events(cfg.bus, "trajectories") if isinstance(e, TrajectoryEvent)
             and ours(e)]
    group_of = {t.session_id: t.group_id for t in trajs}
    rewarded = {group_of[sid] for sid in facts["rewarded"]}
    unrewarded = {group_of[sid] for sid in facts["unrewarded"]}
    # Every session of a user became a multi-turn trajectory of its own group.
    for u in facts["users"]:
        assert u["a_end"]["published"] and u["a_end"]["reward_pending"]
        assert u["b_end"]["published"] and u["b_end"]["reward_pending"]
    assert all(len(t.turn_boundaries) == 2 and t.group_size == 1 for t in trajs
               if t.session_id in facts["rewarded"])
    # The rewards on the log: one per rewarded session, with the value it was given.
    rewards = [e for e in read_events(cfg.bus, "rewards") if isinstance(e, RewardEvent) and ours(e)]
    by_group = {}
    for r in rewards:
        by_group.setdefault(r.group_id, set()).add(r.reward)
    assert by_group == {group_of[s]: {v} for s, v in facts["rewarded"].items()}
    # Trained: each version's groups (the first event of a version; re-announcements
    # repeat them), every rewarded group in exactly one version, nothing else.
    versions = trained_by_version(cfg)
    trained = [g for v in sorted(versions) for g in versions[v]]
    assert sorted(trained) == sorted(rewarded), (trained, rewarded)
    assert not unrewarded & set(trained)
    # The staleness bound: a group trained by the step to version v was trained at v - 1.
    samples = {s.group_id: s for s in read_events(cfg.bus, "samples") if isinstance(s, SampleEvent)
               and not s.dropped_reason}
    for v, groups in versions.items():
        for g in groups:
            assert (v - 1) - samples[g].min_version <= ETA
    # The 10 s rewards came at least 10 s after their trajectories.
    late = [samples[group_of[sid]].reward_delay_s for sid in list(facts["rewarded"])[:2]]
    assert min(late) >= 9.0, late


def test_live_traffic_is_scored_per_version_with_the_version_proof(run):
    cfg, _, facts = run
    done = tapioca(cfg, "eval", "--online", "-o", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # By hand from the log: each rewarded session's trajectory counts for the version all
    # its loss-bearing tokens carry (the five rewards the users gave).
    trajs = {t.session_id: t for t in read_events(cfg.bus, "trajectories")
             if isinstance(t, TrajectoryEvent) and t.run_id == cfg.bus.run_id}
    expected: dict[str, list[float]] = {}
    dropped = 0
    for sid, value in facts["rewarded"].items():
        t = trajs[sid]
        scored = {v for v, m in zip(t.output_versions, t.loss_mask or [1] * len(t.output_versions)) if m}
        if len(scored) == 1:
            expected.setdefault(str(scored.pop()), []).append(value)
        else:
            dropped += 1
    assert report["rewarded_trajectories"] == len(facts["rewarded"]) == 5
    assert report["mixed_version_dropped"] == dropped
    assert {v: (s["trajectories"], round(s["mean_reward"], 9)) for v, s in report["versions"].items()} == \
        {v: (len(r), round(sum(r) / len(r), 9)) for v, r in expected.items()}
