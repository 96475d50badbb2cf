"""A training run under a fuzzer (issue 10, "Done when"): the real CPU loop (feeder,
rollout, reward, advantage and trainer as processes, started by tapioca's Launcher on an
embedded broker) while a fuzzer thread publishes well-formed bad events of every kind
issue 10 lists, plus garbage bytes, onto the topics.

Then, from the log itself: which bad events are on ``dlq.v1`` (per kind), whether any
genuine event was dead-lettered, the reward's first and last windows, and the trainer's
bookkeeping (versions contiguous, no group trained twice or lost, staleness within eta,
no fuzz group trained, the head gate not opened by fake rejections).

Kinds, and where each is caught (its "edge"):

* prompts (rollout worker): token ids outside the vocabulary, ``n_samples`` 0, a prompt
  longer than the model's context;
* trajectories and rewards (advantage processor, then trainer): a trajectory with an
  out-of-vocabulary token (scored by the run's scorer, refused by the trainer as a
  sample), a reward of 1.5e308, rewards keyed to groups nobody admitted (expected:
  dropped at ``advantage.group_timeout_s``, rejected by the trainer, *ignored* by the
  feeder's head gate: not dead-lettered);
* samples (trainer): out-of-vocabulary ids, another estimator, behaviour logprobs of
  -1e30, an advantage of 1e20, versions from the future (negative staleness), and fake
  "dropped" samples (expected: rejected, ignored by the feeder);
* weights (every follower): an old record re-published byte for byte (its signature
  still verifies; versions only go forward); the next version unsigned, and signed with
  another run's key (the signature check); the next version with a missing file, or
  with a wrong sha256 (alternately), signed with the run's key as a key holder's broken
  event would be (the rollout worker's load checks);
* progress (the feeder's and the proxy's head gate): the next version unsigned, and
  signed with another run's key (the signature check);
* control (every role): an unsigned command pausing every role;
* garbage bytes on prompts, trajectories, rewards, samples, weights and progress.

The fuzzer is a client of the bus without the run's key (``outsider_bus``), but for the
two key-holder kinds. Its rounds are paced by the trainer's versions and end by half the
run (``plan_rounds``), so every bad event is consumed before the run ends on a fast box
as on a slow one.

Run it alone (prints a table; JSON to ``$OUT/fuzz_loop.json`` when ``$OUT`` is set)::

    .venv/bin/python benchmarks/fuzz_loop.py [--steps 60] [--rounds 8]

tests/e2e/test_fuzz_loop.py runs the same function and asserts on its figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import orjson

# Where each kind is expected to end: "dlq" (dead-lettered) or "ignored" (well-formed and
# harmless by design: rejected upstream, and the feeder's head gate does not count it).
KINDS: dict[str, str] = {
    "prompt_oov": "dlq",
    "prompt_no_samples": "dlq",
    "prompt_too_long": "dlq",
    "trajectory_oov": "dlq",
    "reward_overflow": "dlq",
    "reward_wrong_key": "ignored",
    "sample_oov": "dlq",
    "sample_other_estimator": "dlq",
    "sample_logprob_-1e30": "dlq",
    "sample_advantage_1e20": "dlq",
    "sample_future_version": "dlq",
    "sample_fake_dropped": "ignored",
    "weights_replayed_old": "dlq",
    "weights_next_unsigned": "dlq",
    "weights_next_other_key": "dlq",
    "weights_next_missing_file": "dlq",
    "weights_next_bad_sha256": "dlq",
    "progress_next_unsigned": "dlq",
    "progress_next_other_key": "dlq",
    "control_unsigned_pause": "dlq",
    "garbage": "dlq",
}
GARBAGE_TOPICS = ("prompts", "trajectories", "rewards", "samples", "weights", "progress")
FUZZ = "poison"  # every fuzz group id (and the fuzzer's producer id) starts with this


@dataclass
class Sent:
    kind: str
    # How its dead letter is recognised: ("event_id", id), ("group_id", gid) for a bad
    # trajectory refused downstream as its group's sample, or ("raw", bytes) for garbage
    # and a byte-for-byte replay.
    match: tuple[str, object]
    # A replay's original record (topic, partition, offset): a dead letter of *that* one
    # would be a genuine event's.
    original: tuple[str, int, int] | None = None


@dataclass
class FuzzResult:
    steps: int = 0
    wall_s: float = 0.0
    rounds: int = 0  # rounds planned
    round_versions: list[int] = field(default_factory=list)  # trainer version at each sent
    reward_first: float = 0.0
    reward_last: float = 0.0
    window: int = 0
    sent: dict[str, int] = field(default_factory=dict)
    dead_lettered: dict[str, int] = field(default_factory=dict)
    missed: dict[str, list[str]] = field(default_factory=dict)  # dlq kinds not on the DLQ
    genuine_dead_lettered: list[str] = field(default_factory=list)
    dlq_records: int = 0
    trained_groups: int = 0
    rejected_groups: int = 0
    fuzz_groups_trained: list[str] = field(default_factory=list)
    versions_contiguous: bool = False
    trained_twice: int = 0
    lost_groups: int = 0
    staleness_max: int = -1
    staleness_min: int = -1
    admitted_groups: int = 0
    gate_bound: int = 0  # (eta + trained steps + 1) * B + admitted groups rejected
    feeder_ignored_rejections: float = 0.0
    trainer_dead_lettered: float = 0.0
    trainer_skipped_steps: float = 0.0
    read_s: float = 0.0  # reading the figures back from the log

    def table(self) -> str:
        rows = [f"{'kind':<28}{'expected':>10}{'sent':>6}{'on dlq':>8}"]
        for kind, expected in KINDS.items():
            rows.append(f"{kind:<28}{expected:>10}{self.sent.get(kind, 0):>6}"
                        f"{self.dead_lettered.get(kind, 0):>8}")
        rows += [
            f"fuzz rounds sent {len(self.round_versions)}/{self.rounds}, at trainer versions "
            f"{self.round_versions}",
            f"dead letters on dlq.v1: {self.dlq_records} (genuine events among them: "
            f"{len(self.genuine_dead_lettered)})",
            f"reward: first {self.window} steps {self.reward_first:.3f} -> last {self.window} "
            f"steps {self.reward_last:.3f} ({self.steps} steps, {self.wall_s:.0f} s; figures "
            f"read back in {self.read_s:.0f} s)",
            f"trained {self.trained_groups} groups ({self.trained_twice} twice, "
            f"{len(self.fuzz_groups_trained)} fuzz), rejected {self.rejected_groups}, lost "
            f"{self.lost_groups}; staleness {self.staleness_min}..{self.staleness_max}",
            f"head gate: {self.admitted_groups} groups admitted <= bound {self.gate_bound}; "
            f"feeder ignored {self.feeder_ignored_rejections:.0f} rejections of groups it "
            f"never admitted; trainer dead-lettered {self.trainer_dead_lettered:.0f} samples, "
            f"skipped {self.trainer_skipped_steps:.0f} steps",
        ]
        return "\n".join(rows)


# ----------------------------------------------------------------------------- fuzzer


def plan_rounds(steps: int, rounds: int, eta: int, last_round_fraction: float = 0.5) -> list[int]:
    """The trainer version at which each round is sent, spread from ``eta + 2`` to
    ``last_round_fraction`` of the run. Paced by versions, not seconds: the figures need
    every round consumed before the run ends, whatever the speed of the box (a 60-step
    run takes 25 s to 2:30 here). From ``eta + 2``: round r re-publishes version r, which
    every rollout worker has passed by then (a trainer at version V has trained tokens of
    version >= V - 1 - eta)."""
    first, last = eta + 2, int(steps * last_round_fraction)
    if rounds < 1 or last - first < rounds - 1:
        raise ValueError(f"{rounds} fuzz rounds do not fit between versions {first} and {last} "
                         f"({last_round_fraction:.0%} of {steps} steps): run more steps or "
                         "fewer rounds")
    spacing = (last - first) // max(1, rounds - 1)
    return [first + r * spacing for r in range(rounds)]


def outsider_bus(run_bus):
    """The run's bus settings without its key: what any other client of the bus has
    (issue 10: "any producer on the bus"). The Launcher writes the run's key path into
    the config it is given, which the fuzzer shares; publishing with that config signed
    every forgery with the run's key, so a forged next version moved the feeder's head
    gate."""
    bus = dataclasses.replace(run_bus)
    # No key at all, also when $TAPIOCA_SIGNING_KEY_FILE is set (BusConfig's __post_init__
    # fills an empty path from it, so the frozen field is cleared after construction).
    object.__setattr__(bus, "signing_key_path", "")
    return bus


@dataclass
class Outgoing:
    """One record the fuzzer publishes, as bytes (so a test can check its signature)."""

    kind: str
    topic: str  # full topic name
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] | None
    match: tuple[str, object]
    original: tuple[str, int, int] | None = None


class Fuzzer(threading.Thread):
    """Publishes ``len(schedule)`` rounds of bad events of every kind, round r once the
    trainer has published version ``schedule[r]`` (:func:`plan_rounds`).

    It publishes as an outsider, without the run's key (:func:`outsider_bus`): forged
    control commands and weights events must fail the signature check. Two weights kinds
    stand for a key holder's broken event (a trainer whose file was lost) and are signed
    with the run's key, so that the rollout worker's own checks are what stop them: the
    next version with a missing file or a wrong sha256. The feeder trusts a signed
    version: it admits up to one batch early until the trainer reaches that version,
    which the schedule leaves it ample time to do."""

    def __init__(self, bus, *, vocab_size: int, max_positions: int, schedule: list[int],
                 seed: int = 0) -> None:
        from tapioca.bus.signing import SigningKey

        super().__init__(daemon=True, name="fuzzer")
        self.run_bus = bus  # reads (and verifies) the trainer's genuine weights events
        self.run_key = bus.signing_key()
        if self.run_key is None:
            raise ValueError("the fuzz loop needs a run with a signing key (the Launcher "
                             "creates one): forged weights and commands are to fail it")
        self.bus = outsider_bus(bus)
        self.other_key = SigningKey(random.Random(seed + 1).randbytes(32), "another run")
        self.vocab = vocab_size
        self.max_positions = max_positions
        self.schedule = list(schedule)
        self.rng = random.Random(seed)
        self.sent: list[Sent] = []
        self.round_versions: list[int] = []  # the trainer's version when each round went out
        self.error: BaseException | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the caller
            self.error = exc

    def is_genuine(self, rec) -> bool:
        """A weights record of the trainer's that verifies under the run's key."""
        from tapioca.schemas import WeightsEvent

        ev = rec.event
        return (isinstance(ev, WeightsEvent) and ev.producer_id.startswith("trainer")
                and not ev.producer_id.startswith(FUZZ))

    def _run(self) -> None:
        from tapioca.bus import EventProducer, TopicReader

        genuine = []
        with TopicReader(self.run_bus, "weights") as reader, \
                EventProducer(self.bus, producer_id=f"{FUZZ}-producer") as producer:
            # One reader follows the topic (re-reading it per round lagged the trainer
            # by tens of versions); every round due at the version seen goes out at once.
            while len(self.round_versions) < len(self.schedule) and not self.stop_event.is_set():
                genuine += [rec for rec in reader.records(follow=True, timeout_s=0.3)
                            if self.is_genuine(rec)]
                v = max((rec.event.version for rec in genuine), default=-1)
                while (len(self.round_versions) < len(self.schedule)
                       and self.schedule[len(self.round_versions)] <= v):
                    out = self.build_round(len(self.round_versions), genuine)
                    for o in out:
                        producer.publish_raw(o.topic, o.key, o.value, o.headers)
                    producer.flush()
                    self.sent += [Sent(o.kind, o.match, o.original) for o in out]
                    self.round_versions.append(v)

    def _gid(self, kind: str) -> str:
        return f"{FUZZ}-{kind}-{uuid.uuid4().hex[:8]}"

    def _out(self, kind: str, event, *, key=None, match=None) -> Outgoing:
        """``event`` encoded as the fuzzer's, signed with ``key`` if given."""
        from tapioca.bus.signing import SIGNATURE_HEADER
        from tapioca.schemas import encode_event, topic_for
        from tapioca.schemas.envelope import names_a_run

        if not event.producer_id:
            event.producer_id = f"{FUZZ}-producer"
        if not names_a_run(event.run_id):
            event.run_id = self.bus.run_id  # attributed: read by the run's roles
        spec = topic_for(event)
        value = encode_event(event, max_bytes=self.bus.max_message_bytes)
        headers = [(SIGNATURE_HEADER, key.sign(value))] if key is not None else None
        return Outgoing(kind, self.bus.topic(spec), spec.key_of(event).encode(), value, headers,
                        match or ("event_id", event.event_id))

    def build_round(self, r: int, genuine: list) -> list[Outgoing]:
        """Round ``r``'s records, given the genuine weights records read so far."""
        from tapioca.schemas import (
            ControlEvent,
            ProgressEvent,
            PromptEvent,
            RewardEvent,
            SampleEvent,
            SampleSequence,
            TrajectoryEvent,
            topic,
        )

        V = self.vocab
        out: list[Outgoing] = []
        latest = max((rec.event for rec in genuine), key=lambda e: (e.version, e.produced_at))
        v = latest.version

        def prompt(kind: str, **kw) -> PromptEvent:
            gid = self._gid(kind)
            args = dict(group_id=gid, prompt_id=gid, group_index=0, n_samples=2,
                        prompt_ids=[1, 2, 3], task="synthetic", task_data={"answer": "1"},
                        admitted_at_version=0)
            args.update(kw)
            return PromptEvent(**args)

        out.append(self._out("prompt_oov", prompt("prompt_oov", prompt_ids=[1, V + 7, 2])))
        out.append(self._out("prompt_no_samples", prompt("prompt_no_samples", n_samples=0)))
        out.append(self._out("prompt_too_long",
                             prompt("prompt_too_long", prompt_ids=[1] * self.max_positions)))

        gid = self._gid("trajectory_oov")  # the run's scorer scores it; the trainer refuses it
        out.append(self._out("trajectory_oov", TrajectoryEvent(
            traj_id=f"{gid}:0", group_id=gid, prompt_id=gid, sample_index=0, group_size=1,
            prompt_ids=[1, 2], output_ids=[V + 3], output_logprobs=[-1.0],
            output_versions=[v], task="synthetic", task_data={"answer": "1"}),
            match=("group_id", gid)))
        gid = self._gid("reward_overflow")
        out.append(self._out("reward_overflow",
                             RewardEvent(traj_id=f"{gid}:0", group_id=gid, reward=1.5e308)))
        gid = self._gid("reward_wrong_key")
        out.append(self._out("reward_wrong_key",
                             RewardEvent(traj_id=f"{gid}:0", group_id=gid, reward=1.0)))

        def sample(kind: str, *, toks=(3, 4), lp=-1.0, adv=1.0, version=v, **kw) -> SampleEvent:
            gid = self._gid(kind)
            seq = SampleSequence(traj_id=f"{gid}:0", output_ids=list(toks),
                                 behav_logprobs=[lp] * len(toks),
                                 output_versions=[version] * len(toks), reward=1.0,
                                 advantage=adv)
            args = dict(group_id=gid, prompt_id=gid, prompt_ids=[1, 2], sequences=[seq],
                        min_version=version, max_version=version)
            args.update(kw)
            return SampleEvent(**args)

        out.append(self._out("sample_oov", sample("sample_oov", toks=(3, V + 1))))
        out.append(self._out("sample_other_estimator",
                             sample("sample_other_estimator", estimator="rloo")))
        out.append(self._out("sample_logprob_-1e30", sample("sample_logprob_-1e30", lp=-1e30)))
        out.append(self._out("sample_advantage_1e20", sample("sample_advantage_1e20", adv=1e20)))
        out.append(self._out("sample_future_version",
                             sample("sample_future_version", version=10**9)))
        gid = self._gid("sample_fake_dropped")
        out.append(self._out("sample_fake_dropped", SampleEvent(
            group_id=gid, prompt_id=gid, prompt_ids=[], sequences=[], dropped_reason="fuzz")))

        # An old weights record re-published byte for byte: its signature still verifies
        # (an outsider can copy it); versions only go forward. Version r: a distinct record
        # per round, older than what every worker has loaded (plan_rounds).
        old = max((rec for rec in genuine if rec.event.version <= r),
                  key=lambda rec: (rec.event.version, -rec.source.offset))
        out.append(Outgoing("weights_replayed_old", old.source.topic,
                            old.source.key.encode() if old.source.key is not None else None,
                            old.raw, list(old.headers), ("raw", old.raw),
                            (old.source.topic, old.source.partition, old.source.offset)))

        def forged_next(**kw):
            return dataclasses.replace(
                latest, event_id=uuid.uuid4().hex, produced_at=time.time(), version=v + 1,
                step=v + 1, producer_id=f"{FUZZ}-producer", **kw)

        # The next version, naming the latest genuine file (loadable: a worker that took
        # it would label its tokens one version ahead): unsigned, and signed with another
        # run's key. Both fail the signature check at every follower.
        out.append(self._out("weights_next_unsigned", forged_next()))
        out.append(self._out("weights_next_other_key", forged_next(), key=self.other_key))
        # A key holder's broken event (signed with the run's key): the rollout worker
        # cannot load it, retries, dead-letters it and keeps its version.
        if r % 2 == 0:
            kind, broken = "weights_next_missing_file", forged_next(
                path=f"/nonexistent/{FUZZ}/v{v + 1:06d}.safetensors")
        else:
            kind, broken = "weights_next_bad_sha256", forged_next(sha256="0" * 64)
        out.append(self._out(kind, broken, key=self.run_key))

        # The trainer's progress one version ahead, which would open the head gates a
        # batch: unsigned, and signed with another run's key. Both fail the signature check.
        def forged_progress():
            return ProgressEvent(version=v + 1, producer_id=f"{FUZZ}-producer")

        out.append(self._out("progress_next_unsigned", forged_progress()))
        out.append(self._out("progress_next_other_key", forged_progress(), key=self.other_key))

        # An unsigned command pausing every role: dead-lettered by each, obeyed by none.
        out.append(self._out("control_unsigned_pause", ControlEvent(
            command_id=uuid.uuid4().hex, command="pause", target="all")))

        for name in GARBAGE_TOPICS:
            raw = b"\xff\x00" + self.rng.randbytes(24) + f"{FUZZ}{r}{name}".encode()
            out.append(Outgoing("garbage", self.bus.topic(topic(name)),
                                f"{FUZZ}-garbage".encode(), raw, None, ("raw", raw)))
        return out


# ----------------------------------------------------------------------------- the run


def build_config(run_dir: str, steps: int, *, bootstrap: str = "", prefix: str = "",
                 overrides: list[str] | None = None):
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig

    args = [
        f"run_dir={run_dir}", "experiment_name=fuzz", "trial_name=t0",
        f"total_train_steps={steps}",
        # Copy the first operand: the synthetic op a tiny model learns fastest.
        "train_dataset.task_options.op=copy", "train_dataset.prompts_per_step=32",
        "gconfig.n_samples=8", "gconfig.max_new_tokens=3", "rollout.max_head_offpolicyness=1",
        "actor.optimizer.lr=3e-3", "actor.checkpoint_every_steps=1",
        # Fast retries; fake reward fragments dropped within the run.
        "bus.handler_backoff_s=0.05", "advantage.group_timeout_s=15",
    ]
    if bootstrap:
        args.append(f"bus.bootstrap_servers={bootstrap}")
    if prefix:
        args.append(f"bus.topic_prefix={prefix}")
    return load_config(TrainConfig, None, args + list(overrides or []))


def run_fuzz_loop(run_dir: str, *, steps: int = 60, rounds: int = 8,
                  last_round_fraction: float = 0.5, bootstrap: str = "", prefix: str = "",
                  timeout_s: float = 420.0, overrides: list[str] | None = None) -> FuzzResult:
    """Run the loop under the fuzzer and read the figures back from the log. The rounds
    go out by the trainer's versions, the last one by ``last_round_fraction`` of the
    steps (:func:`plan_rounds`). Without ``bootstrap`` an embedded broker is started for
    the run (and stopped after the figures are read: the launcher's own broker would go
    down with the roles)."""
    from tapioca.bus import EmbeddedBroker

    broker = None
    if not bootstrap:
        broker = EmbeddedBroker()
        broker.start()
        bootstrap = broker.bootstrap
    try:
        return _run(run_dir, steps, rounds, last_round_fraction, bootstrap, prefix, timeout_s,
                    overrides)
    finally:
        if broker is not None:
            broker.stop(timeout_s=1.0)


def _run(run_dir, steps, rounds, last_round_fraction, bootstrap, prefix, timeout_s, overrides):
    from transformers import AutoConfig

    from tapioca.ops.launcher import Launcher

    prefix = prefix or f"fuzz{uuid.uuid4().hex[:8]}"
    cfg = build_config(run_dir, steps, bootstrap=bootstrap, prefix=prefix, overrides=overrides)
    schedule = plan_rounds(steps, rounds, cfg.rollout.max_head_offpolicyness, last_round_fraction)
    launcher = Launcher(cfg)
    launcher.start()
    # The launcher's resolved config: the model it created, the run's bus run id and key
    # path (runtime/run.py resolve_run; the loaded config itself is frozen).
    cfg = launcher.cfg
    fuzzer = None
    try:
        model_cfg = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        # cfg.bus holds the run's key path: the fuzzer reads with it and publishes
        # without it (outsider_bus).
        fuzzer = Fuzzer(cfg.bus, vocab_size=model_cfg.vocab_size,
                        max_positions=model_cfg.max_position_embeddings, schedule=schedule)
        fuzzer.start()
        summary = launcher.wait(timeout_s=timeout_s)
    finally:
        if fuzzer is not None:
            fuzzer.stop_event.set()
            fuzzer.join(30)
        launcher.stop()  # the roles flush their last dead letters and commits
    if fuzzer.error is not None:
        raise fuzzer.error
    res = read_figures(cfg, fuzzer.sent, summary)
    res.rounds, res.round_versions = len(schedule), list(fuzzer.round_versions)
    return res


def read_figures(cfg, sent: list[Sent], summary) -> FuzzResult:
    from tapioca.bus import TopicReader, consumer_lag, read_events
    from tapioca.bus.dlq import original_payload
    from tapioca.schemas import ProgressEvent, SampleEvent
    from tapioca.schemas import topic as topic_spec
    from tapioca.trainers.trainer import read_metrics

    t0 = time.monotonic()
    res = FuzzResult(steps=summary.steps, wall_s=summary.wall_s)
    by_step = {r["step"]: r for r in read_metrics(cfg.run_path)}
    res.steps = max(by_step, default=0)
    rewards = [by_step[s]["reward/mean"] for s in sorted(by_step)]
    w = max(1, min(10, len(rewards) // 2))
    res.reward_first, res.reward_last, res.window = (sum(rewards[:w]) / w,
                                                     sum(rewards[-w:]) / w, w)
    if by_step:
        final = by_step[max(by_step)]
        res.trainer_dead_lettered = final.get("trainer/dead_lettered", 0.0)
        res.trainer_skipped_steps = final.get("trainer/skipped_steps", 0.0)

    # Dead letters, matched to what the fuzzer sent.
    res.sent = dict(Counter(s.kind for s in sent))
    wanted = {s.match: s for s in sent}
    originals = {s.original for s in sent if s.original is not None}
    found: set[tuple[str, object]] = set()
    with TopicReader(cfg.bus, "dlq") as reader:
        for rec in reader.records(idle_s=1.0, timeout_s=60):
            if rec.event is None:
                continue
            res.dlq_records += 1
            raw = original_payload(rec.event)
            keys = [("raw", raw)]
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = None
            if isinstance(body, dict):
                keys += [("event_id", body.get("event_id")), ("group_id", body.get("group_id"))]
            at = (rec.event.source_topic, rec.event.source_partition, rec.event.source_offset)
            hit = [k for k in keys if k in wanted] if at not in originals else []
            if hit:
                found.update(hit)
            else:
                res.genuine_dead_lettered.append(
                    f"{rec.event.source_topic}@{rec.event.source_offset}: {rec.event.error[:160]}")
    per_kind: dict[str, int] = defaultdict(int)
    for match, s in wanted.items():
        if match in found:
            per_kind[s.kind] += 1
        elif KINDS[s.kind] == "dlq":
            res.missed.setdefault(s.kind, []).append(str(match[1])[:60])
    res.dead_lettered = {k: per_kind.get(k, 0) for k in KINDS}

    # The trainer's bookkeeping, from the progress and samples topics.
    progress = [e for e in read_events(cfg.bus, "progress") if isinstance(e, ProgressEvent)
                and not e.producer_id.startswith(FUZZ)]
    latest: dict[int, ProgressEvent] = {}
    sets: dict[int, set[frozenset]] = defaultdict(set)
    for ev in progress:
        if ev.group_ids:
            sets[ev.version].add(frozenset(ev.group_ids))
            if ev.version not in latest or ev.produced_at > latest[ev.version].produced_at:
                latest[ev.version] = ev
    res.versions_contiguous = sorted(latest) == list(range(1, res.steps + 1))
    res.trained_twice = sum(len(v) > 1 for v in sets.values())
    trained = [g for ev in latest.values() for g in ev.group_ids]
    res.trained_twice += len(trained) - len(set(trained))
    res.trained_groups = len(set(trained))
    res.fuzz_groups_trained = sorted(g for g in trained if g.startswith(FUZZ))
    rejected = {g for ev in progress for g in ev.rejected_group_ids}
    res.rejected_groups = len(rejected)
    samples: dict[str, SampleEvent] = {}
    first_offset: dict[str, tuple[int, int]] = {}
    with TopicReader(cfg.bus, "samples") as reader:
        for rec in reader.records(idle_s=0.5):
            if isinstance(rec.event, SampleEvent):
                samples.setdefault(rec.event.group_id, rec.event)
                first_offset.setdefault(rec.event.group_id, (rec.source.partition, rec.source.offset))
    stale = [version - 1 - samples[g].min_version for version, ev in latest.items()
             for g in ev.group_ids if g in samples]
    res.staleness_min, res.staleness_max = (min(stale), max(stale)) if stale else (-1, -1)
    samples_topic = cfg.bus.topic(topic_spec("samples"))
    committed = {row.partition: row.committed for row in
                 consumer_lag(cfg.bus, [f"{cfg.bus.topic_prefix}.trainer"])
                 if row.topic == samples_topic and row.committed is not None}
    read = {g for g, (p, off) in first_offset.items() if off < committed.get(p, 0)}
    # Lost: read by the trainer, neither trained nor rejected nor dead-lettered (fuzz).
    res.lost_groups = len({g for g in read - set(trained) - rejected if not g.startswith(FUZZ)})

    # The head gate: what the feeder admitted vs (eta + trained steps + 1) * B + freed.
    prompts = [e for e in read_events(cfg.bus, "prompts") if not e.group_id.startswith(FUZZ)]
    admitted = {e.group_id for e in prompts}
    res.admitted_groups = len(admitted)
    final_w = max(progress, key=lambda e: (e.version, e.produced_at))
    B = cfg.train_dataset.prompts_per_step
    res.gate_bound = ((cfg.rollout.max_head_offpolicyness + final_w.version - final_w.rollbacks + 1)
                      * B + len(rejected & admitted))
    with TopicReader(cfg.bus, "metrics", tail=2000) as reader:  # the feeder's last status
        for rec in reader.records(idle_s=0.5, timeout_s=60):
            ev = rec.event
            if ev is not None and ev.source.startswith("feeder"):
                res.feeder_ignored_rejections = max(
                    res.feeder_ignored_rejections, ev.metrics.get("feeder/ignored_rejections", 0.0))
    res.read_s = time.monotonic() - t0
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--last-round-fraction", type=float, default=0.5,
                        help="the last round goes out by this fraction of the steps")
    parser.add_argument("--run-dir", default="")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="tapioca-fuzz-")
    res = run_fuzz_loop(run_dir, steps=args.steps, rounds=args.rounds,
                        last_round_fraction=args.last_round_fraction, overrides=args.overrides)
    print(res.table())
    if res.missed:
        print("not dead-lettered:", json.dumps(res.missed, indent=1))
    if res.genuine_dead_lettered:
        print("genuine events dead-lettered:", *res.genuine_dead_lettered, sep="\n  ")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "fuzz_loop.json").write_text(json.dumps(dataclasses.asdict(res), indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
