"""Each role, built as the launcher builds it, running in a RoleRunner thread against the
real embedded broker: events in on its input topics, and its output events checked on
its output topics (never its memory). One broker for the module; each test has its own
topic prefix, so its topics and consumer groups are its own."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest

from tapioca.bus import BusConfig, EventProducer, TopicReader, consumer_lag, read_events
from tapioca.config.schema import (
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from tapioca.config.sections import RewardSection
from tapioca.consumers.reward_scorer import RewardScorer
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import (
    DlqRecord,
    MetricsEvent,
    ProgressEvent,
    PromptEvent,
    RewardEvent,
    SampleEvent,
    SampleSequence,
    TrajectoryEvent,
    topic,
)
from tapioca.schemas.envelope import decode_event
from tapioca.weights.files import sha256_file

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    """The tiny synthetic-task model + char tokenizer, written once for the module."""
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt, local_files_only=True)


def train_cfg(bus: BusConfig, model_path: str, run_dir: Path, *, prompts_per_step: int = 4,
              eta: int = 1, n_samples: int = 2, max_new_tokens: int = 3) -> TrainConfig:
    return TrainConfig(
        run_dir=str(run_dir), bus=bus, model=ModelConfig(path=model_path),
        train_dataset=DatasetConfig(prompts_per_step=prompts_per_step),
        gconfig=GenerationConfig(n_samples=n_samples, max_new_tokens=max_new_tokens),
        rollout=RolloutConfig(max_head_offpolicyness=eta),
    )


def publish(cfg: BusConfig, *events) -> None:
    with EventProducer(cfg, "test") as producer:
        for e in events:
            producer.publish(e)


class Tail:
    """A group-less reader kept open for a test: ``poll()`` adds whatever arrived since
    the last call, so waiting for N events does not re-read the topic each time."""

    def __init__(self, cfg: BusConfig, name: str) -> None:
        self.reader = TopicReader(cfg, name)
        self.records = []

    @property
    def events(self) -> list:
        return [r.event for r in self.records]

    def poll(self, idle_s: float = 0.1) -> list:
        self.records += [r for r in self.reader.records(idle_s=idle_s, timeout_s=5)
                         if r.event is not None]
        return self.events


@pytest.fixture
def tail(wait_until):
    opened: list[Tail] = []

    def open_(cfg: BusConfig, name: str) -> Tail:
        t = Tail(cfg, name)
        opened.append(t)
        return t

    yield open_
    for t in opened:
        t.reader.close()


def wait_for(t: Tail, n: int, wait_until, what: str, timeout_s: float = 20.0) -> list:
    wait_until(lambda: len(t.poll()) >= n, timeout_s=timeout_s,
               what=f"{n} {what} (have {len(t.events)})")
    return t.events


def traj(gid: str, i: int, *, text: str = "", answer: str = "5", size: int = 2,
         ids: list[int] | None = None) -> TrajectoryEvent:
    out = ids or [3, 4, 5]
    return TrajectoryEvent(traj_id=f"{gid}:{i}", group_id=gid, prompt_id=f"p-{gid}",
                           sample_index=i, group_size=size, prompt_ids=[6, 7, 8],
                           output_ids=out, output_logprobs=[-1.0] * len(out),
                           output_versions=[0] * len(out), output_text=text,
                           task="synthetic", task_data={"answer": answer})


# ---------------------------------------------------------------------------- feeder


def test_feeder_head_gate_and_restart(bus_cfg, tiny_ckpt, tmp_path, start_runner, tail,
                                      wait_until):
    # B = 4, eta = 1: group k is admitted while k < (eta + v + 1) * B, i.e. k < 8 at
    # v = 0, k < 12 at v = 1, k < 16 at v = 2.
    cfg = train_cfg(bus_cfg, tiny_ckpt, tmp_path, prompts_per_step=4, eta=1)
    prompts = tail(bus_cfg, "prompts")

    def indices() -> list[int]:
        return sorted(e.group_index for e in prompts.events)

    first = start_runner(build_role("feeder", cfg), bus_cfg)
    wait_for(prompts, 8, wait_until, "prompts at v=0")
    time.sleep(1.0)
    prompts.poll()
    assert indices() == list(range(8))
    assert all(e.n_samples == 2 and e.admitted_at_version == 0 for e in prompts.events)

    publish(bus_cfg, ProgressEvent(version=1))  # the trainer's version, on progress.v1
    wait_for(prompts, 12, wait_until, "prompts at v=1")
    time.sleep(1.0)
    prompts.poll()
    assert indices() == list(range(12))
    first.finish()

    # A new feeder recovers k = 12 (and the dataset position) from the prompts topic
    # and v = 1 from the progress topic: the gate stays shut until v = 2.
    second = start_runner(build_role("feeder", cfg), bus_cfg)
    wait_until(lambda: second.runner.producer is not None, timeout_s=20,
               what="the restarted feeder to finish recovery")
    time.sleep(1.0)
    prompts.poll()
    assert indices() == list(range(12)), "the restarted feeder republished or ran ahead"

    publish(bus_cfg, ProgressEvent(version=2))
    wait_for(prompts, 16, wait_until, "prompts at v=2")
    time.sleep(0.5)
    prompts.poll()
    assert indices() == list(range(16))
    before = [e for e in prompts.events if e.group_index < 12]
    after = sorted((e for e in prompts.events if e.group_index >= 12),
                   key=lambda e: e.group_index)
    # Same run tag, dataset continues where it stopped: no prompt repeated or skipped.
    assert [e.dataset_position for e in after] == [12, 13, 14, 15]
    assert {e.prompt_id for e in after}.isdisjoint(e.prompt_id for e in before)
    assert all(e.admitted_at_version == 2 for e in after)
    assert len({e.group_id for e in prompts.events}) == 16
    second.finish()


# ---------------------------------------------------------------------------- rollout


def test_rollout_generates_a_group_per_prompt(bus_cfg, tiny_ckpt, tokenizer, tmp_path,
                                              start_runner, tail, wait_until):
    cfg = train_cfg(bus_cfg, tiny_ckpt, tmp_path, n_samples=2, max_new_tokens=3)
    trajs = tail(bus_cfg, "trajectories")
    runner = start_runner(build_role("rollout", cfg), bus_cfg)

    texts = {"ga": "max(3,5)=", "gb": "max(7,2)="}
    prompt_ids = {g: tokenizer(t, add_special_tokens=False)["input_ids"] for g, t in texts.items()}
    assert all(prompt_ids.values())
    publish(bus_cfg, *[
        PromptEvent(group_id=g, prompt_id=f"p-{g}", group_index=i, n_samples=2,
                    prompt_ids=prompt_ids[g], prompt_text=texts[g], task="synthetic",
                    task_data={"answer": "5"})
        for i, g in enumerate(texts)])

    wait_for(trajs, 4, wait_until, "trajectories", timeout_s=30)
    time.sleep(0.5)
    events = trajs.poll()
    assert sorted(e.traj_id for e in events) == ["ga:0", "ga:1", "gb:0", "gb:1"]
    for e in events:
        assert isinstance(e, TrajectoryEvent)
        assert e.group_size == 2 and e.prompt_ids == prompt_ids[e.group_id]
        assert 1 <= len(e.output_ids) <= 3
        assert len(e.output_ids) == len(e.output_logprobs) == len(e.output_versions)
        assert e.output_versions == [0] * len(e.output_ids)
        assert all(lp <= 0.0 for lp in e.output_logprobs)
        assert e.task == "synthetic" and e.task_data == {"answer": "5"}
    runner.finish()


# ---------------------------------------------------------------------------- reward


def test_reward_scorer_scores_right_and_wrong(bus_cfg, tiny_ckpt, tmp_path, start_runner,
                                              tail, wait_until):
    cfg = train_cfg(bus_cfg, tiny_ckpt, tmp_path)
    rewards = tail(bus_cfg, "rewards")
    runner = start_runner(build_role("reward", cfg), bus_cfg)
    publish(bus_cfg, traj("g", 0, text="5", answer="5"), traj("g", 1, text="3", answer="5"))
    wait_for(rewards, 2, wait_until, "rewards")
    time.sleep(0.5)
    events = rewards.poll()
    assert {e.traj_id: e.reward for e in events} == {"g:0": 1.0, "g:1": 0.0}
    assert all(isinstance(e, RewardEvent) and e.group_id == "g" for e in events)
    assert len(events) == 2
    assert read_events(bus_cfg, "dlq", idle_s=0.3) == []
    runner.finish()


def test_reward_failure_is_dead_lettered_and_the_rest_scored(make_cfg, start_runner, tail,
                                                             wait_until):
    cfg = make_cfg(handler_max_attempts=2, handler_backoff_s=0.05)
    calls: dict[str, int] = {}

    def reward_fn(event: TrajectoryEvent) -> float:
        calls[event.traj_id] = calls.get(event.traj_id, 0) + 1
        if event.traj_id == "g:1":
            raise ValueError("unparseable completion")
        return 1.0 if event.output_text == "5" else 0.0

    rewards = tail(cfg, "rewards")
    dlq = tail(cfg, "dlq")
    runner = start_runner(RewardScorer(RewardSection(reward=RewardConfig(scorer="test")), reward_fn=reward_fn), cfg)
    publish(cfg, traj("g", 0, text="5"), traj("g", 1, text="5"), traj("g", 2, text="4", size=3))

    wait_for(rewards, 2, wait_until, "rewards")
    wait_for(dlq, 1, wait_until, "dead letters")
    time.sleep(0.5)
    assert {e.traj_id: e.reward for e in rewards.poll()} == {"g:0": 1.0, "g:2": 0.0}
    (dead,) = dlq.poll()
    assert isinstance(dead, DlqRecord)
    assert dead.source_topic == cfg.topic(topic("trajectories"))
    assert dead.error_type == "RewardError" and "unparseable completion" in dead.error
    assert dead.attempts == 2 and dead.consumer_group == f"{cfg.topic_prefix}.reward"
    original = decode_event(base64.b64decode(dead.payload_b64))
    assert isinstance(original, TrajectoryEvent) and original.traj_id == "g:1"
    runner.finish()
    assert calls["g:1"] == 2


# ---------------------------------------------------------------------------- advantage


def test_advantage_joins_groups_in_any_order(bus_cfg, tiny_ckpt, tmp_path, start_runner, tail,
                                             wait_until):
    cfg = train_cfg(bus_cfg, tiny_ckpt, tmp_path)
    samples = tail(bus_cfg, "samples")
    runner = start_runner(build_role("advantage", cfg), bus_cfg)

    def reward(gid: str, i: int, r: float) -> RewardEvent:
        return RewardEvent(traj_id=f"{gid}:{i}", group_id=gid, reward=r)

    # ga: rewards (1, 0); gb: rewards (0, 1); published interleaved, rewards first.
    publish(bus_cfg, reward("ga", 1, 0.0), traj("gb", 0), reward("gb", 1, 1.0),
            traj("ga", 0), reward("ga", 0, 1.0))
    time.sleep(0.3)
    publish(bus_cfg, traj("gb", 1), reward("gb", 0, 0.0), traj("ga", 1))

    wait_for(samples, 2, wait_until, "samples")
    time.sleep(1.0)
    events = samples.poll()
    assert len(events) == 2
    by_group = {e.group_id: e for e in events}
    assert set(by_group) == {"ga", "gb"}
    # GRPO on a group (1, 0): mean 0.5, population std 0.5, so advantages
    # (1 - 0.5) / (0.5 + 1e-6) = +0.999998 and -0.999998 — the +1 / -1 pattern.
    expected = {"ga": ([1.0, 0.0], [1.0, -1.0]), "gb": ([0.0, 1.0], [-1.0, 1.0])}
    for gid, (rs, advs) in expected.items():
        s = by_group[gid]
        assert isinstance(s, SampleEvent) and not s.dropped_reason
        assert [q.traj_id for q in s.sequences] == [f"{gid}:0", f"{gid}:1"]
        assert [q.reward for q in s.sequences] == rs
        assert [q.advantage for q in s.sequences] == pytest.approx(advs, abs=1e-5)
        assert s.min_version == 0 and s.max_version == 0 and s.estimator == "grpo"
    runner.finish()


# ---------------------------------------------------------------------------- trainer


def test_trainer_step_weights_metrics_and_commit(bus_cfg, tiny_ckpt, tokenizer, tmp_path,
                                                 start_runner, tail, wait_until):
    cfg = train_cfg(bus_cfg, tiny_ckpt, tmp_path, prompts_per_step=2)
    weights = tail(bus_cfg, "weights")
    progress = tail(bus_cfg, "progress")
    metrics = tail(bus_cfg, "metrics")
    runner = start_runner(build_role("trainer", cfg), bus_cfg)

    prompt = tokenizer("max(3,5)=", add_special_tokens=False)["input_ids"]
    out = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def sample(gid: str) -> SampleEvent:
        seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=out, behav_logprobs=[-3.0] * len(out),
                               output_versions=[0] * len(out), reward=float(i == 0),
                               advantage=1.0 if i == 0 else -1.0) for i in range(2)]
        return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=prompt,
                           sequences=seqs)

    publish(bus_cfg, sample("ga"), sample("gb"))

    wait_until(lambda: any(e.version == 1 for e in weights.poll()), timeout_s=30,
               what="weights version 1")
    (v1,) = [e for e in weights.events if e.version == 1]
    assert Path(v1.path).is_file() and sha256_file(v1.path) == v1.sha256
    # The version-0 announcement at start comes first; nothing past version 1.
    assert [e.version for e in weights.events] == [0, 1]
    wait_until(lambda: any(e.version == 1 for e in progress.poll()), timeout_s=30,
               what="progress of version 1")
    (p1,) = [e for e in progress.events if e.version == 1]
    assert sorted(p1.group_ids) == ["ga", "gb"] and [e.version for e in progress.events] == [0, 1]

    # The runner's own status events (step = events handled) share the topic: pick the
    # trainer's step metrics by their content.
    def step_metrics():
        return [e for e in metrics.events
                if isinstance(e, MetricsEvent) and e.step == 1 and "reward/mean" in e.metrics]

    wait_until(lambda: metrics.poll() is not None and bool(step_metrics()), what="trainer metrics")
    (m1,) = step_metrics()
    assert m1.policy_version == 1 and m1.metrics["reward/mean"] == pytest.approx(0.5)

    # Both samples' offsets are committed, and no further than the checkpoint covers.
    positions = {}
    with TopicReader(bus_cfg, "samples") as reader:
        for r in reader.records(idle_s=0.3, timeout_s=10):
            positions[r.event.group_id] = (r.source.partition, r.source.offset)
    assert set(positions) == {"ga", "gb"}
    samples_topic = bus_cfg.topic(topic("samples"))
    group = f"{bus_cfg.topic_prefix}.trainer"

    def committed() -> dict[int, int]:
        return {row.partition: row.committed for row in consumer_lag(bus_cfg, [group])
                if row.topic == samples_topic and row.committed is not None}

    # Next offset to read per partition holding a sample: one past its last sample.
    ends: dict[int, int] = {}
    for p, off in positions.values():
        ends[p] = max(ends.get(p, 0), off + 1)
    wait_until(lambda: all(committed().get(p, -1) >= end for p, end in ends.items()),
               what="the trainer's commit of both samples")
    from tapioca.trainers.checkpoint import read_progress

    progress = read_progress(Path(cfg.run_path) / "checkpoints" / "trainer.safetensors")
    assert progress.version == 1 and sorted(progress.trained_groups) == ["ga", "gb"]
    now = committed()
    for p, end in ends.items():
        assert progress.offsets[f"{samples_topic}:{p}"] == end == now[p]
    runner.finish()
