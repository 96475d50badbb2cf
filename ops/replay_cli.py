"""`tapioca archive`, `tapioca replay` and `tapioca train-offline`: the log after the run.

- ``archive DIR``: the archiver role (consumers/archiver.py) against a broker, writing
  every topic (or ``--topic``) to Parquet under DIR (format: bus/archive.py).
- ``replay``: republishes events from a Parquet archive, or a live topic's offset or
  time range, to the same topics under another prefix, to one ``--to-topic``, or to a
  new run (``--run-id`` rewrites each event's ``run_id``), at ``--rate`` events per
  second, filtered by type, partition, offset, time, policy version and reward.
  Version and reward filters decide per group (``group_id``) for trajectories,
  rewards and samples, so a group is replayed whole or not at all (``--per-event``:
  per record). Records are republished byte for byte (``publish_raw``, original key)
  unless the run id is rewritten.
- ``train-offline``: the trainer role trained from an archive (trainers/offline.py).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer

from tapioca.bus.role import Source
from tapioca.ops.cli import G, app, bus_config, console, emit_json
from tapioca.schemas.envelope import Event
from tapioca.schemas.errors import ConfigError, SchemaError

OUTPUT_HELP = "table (for people) or json (for scripts)"


# ---------------------------------------------------------------------------- replay core


@dataclass
class ReplayItem:
    source: Source
    raw: bytes
    event: Event


# Event types whose version / reward filters are decided per group (group_id).
GROUP_TYPES = frozenset({"trajectory", "reward", "sample"})


@dataclass
class ReplayFilter:
    """Which records to republish.

    Partition, offset and time bounds select a range of the log, record by record.
    Version and reward bounds apply to events that carry one (see
    ``tapioca.bus.archive.flat_fields``) and let the others through. By default they are
    decided per group for trajectories, rewards and samples (:meth:`group_verdicts`): a
    group is kept only if every one of its events in range passes (each trajectory's
    versions, each reward, each sample sequence's versions and reward), and then all
    of its events are kept -- so ``--min-version 5`` keeps the rewards of the
    trajectories it keeps and drops those of the ones it drops, and no group is split.
    ``per_event`` decides every record alone (a sample by its mean reward).
    """

    types: frozenset[str] = frozenset()
    min_version: Optional[int] = None
    max_version: Optional[int] = None
    min_reward: Optional[float] = None
    max_reward: Optional[float] = None
    since_ms: Optional[int] = None
    until_ms: Optional[int] = None
    from_offset: Optional[int] = None
    to_offset: Optional[int] = None
    partition: Optional[int] = None
    per_event: bool = False

    @property
    def by_value(self) -> bool:
        return any(v is not None for v in (self.min_version, self.max_version,
                                           self.min_reward, self.max_reward))

    @property
    def by_group(self) -> bool:
        """True when version / reward bounds are decided per group (a first pass)."""
        return self.by_value and not self.per_event

    def keep(self, item: ReplayItem, verdicts: dict[str, bool] | None = None) -> bool:
        """Whether to republish ``item``; ``verdicts`` (group_id -> keep) from
        :meth:`group_verdicts` when filtering by group."""
        if self.types and item.event.type not in self.types:
            return False
        if not self.in_range(item):
            return False
        if verdicts is not None and _group_of(item) is not None:
            return verdicts.get(_group_of(item), False)
        return self.values_pass(item)

    def in_range(self, item: ReplayItem) -> bool:
        """The per-record bounds: partition, offsets, time."""
        src, event = item.source, item.event
        if self.partition is not None and src.partition != self.partition:
            return False
        if self.from_offset is not None and src.offset < self.from_offset:
            return False
        if self.to_offset is not None and src.offset > self.to_offset:
            return False
        ts = src.timestamp_ms if src.timestamp_ms > 0 else int(event.produced_at * 1000)
        if self.since_ms is not None and ts < self.since_ms:
            return False
        if self.until_ms is not None and ts > self.until_ms:
            return False
        return True

    def values_pass(self, item: ReplayItem) -> bool:
        """The version and reward bounds on this one record (a sample: its overall
        min/max version and mean reward)."""
        from tapioca.bus.archive import flat_fields

        flat = flat_fields(item.event)
        return self._bounds_pass(flat["min_version"], flat["max_version"], flat["reward"])

    def _bounds_pass(self, lo: Optional[int], hi: Optional[int], reward: Optional[float]) -> bool:
        if lo is not None:
            if self.min_version is not None and lo < self.min_version:
                return False
            if self.max_version is not None and hi > self.max_version:
                return False
        if reward is not None:
            if self.min_reward is not None and reward < self.min_reward:
                return False
            if self.max_reward is not None and reward > self.max_reward:
                return False
        return True

    def _member_passes(self, item: ReplayItem) -> bool:
        """Group mode: every trajectory of the group must pass, so a sample is judged
        sequence by sequence (not by its mean reward)."""
        from tapioca.schemas.events import SampleEvent

        event = item.event
        if isinstance(event, SampleEvent):
            if not self._bounds_pass(event.min_version, event.max_version, None):
                return False
            for q in event.sequences:
                v = q.output_versions
                if not self._bounds_pass(min(v) if v else None, max(v) if v else None, q.reward):
                    return False
            return True
        return self.values_pass(item)

    def group_verdicts(self, items: Iterator[ReplayItem]) -> dict[str, bool]:
        """First pass of group filtering: group_id -> keep, from the trajectories,
        rewards and samples in range (whatever ``--type`` publishes)."""
        verdicts: dict[str, bool] = {}
        for item in items:
            gid = _group_of(item)
            if gid is None or not self.in_range(item):
                continue
            verdicts[gid] = verdicts.get(gid, True) and self._member_passes(item)
        return verdicts


def _group_of(item: ReplayItem) -> Optional[str]:
    """The group an item is filtered with in group mode (None: filtered alone)."""
    if item.event.type not in GROUP_TYPES:
        return None
    return getattr(item.event, "group_id", None)


@dataclass
class ReplayStats:
    read: int = 0
    published: int = 0
    skipped: int = 0
    undecodable: int = 0
    groups_kept: Optional[int] = None  # group filtering only
    groups_dropped: Optional[int] = None
    wall_s: float = 0.0
    by_topic: dict[str, int] = field(default_factory=dict)


def items_from_archive(path: str, topics: list[str] | None) -> Iterator[ReplayItem]:
    """Archived records merged across topics by record time (close to the order the
    run's consumers saw them)."""
    from tapioca.bus.archive import iter_records

    for rec in iter_records(path, topic=topics or None, order="time"):
        yield ReplayItem(rec.source, rec.payload.encode(), rec.event())


def items_from_topic(cfg, name: str, stats: ReplayStats) -> Iterator[ReplayItem]:
    """A live topic read from the beginning without a consumer group. The offset and
    time bounds are filters: ``offsets_for_times`` is not dependable (KAFKA_NOTES.md)."""
    from tapioca.bus.reader import TopicReader

    with TopicReader(cfg, name) as reader:
        for r in reader.records(idle_s=1.0):
            if r.event is None:
                stats.undecodable += 1  # a dead letter already names it; not replayable
                continue
            yield ReplayItem(r.source, r.raw, r.event)


class Replayer:
    """Publishes items to their destination topic at a bounded rate."""

    def __init__(self, producer, dest_cfg, *, to_topic: str | None = None,
                 run_id: str | None = None, rate: float = 0.0) -> None:
        from tapioca.schemas.registry import topic as topic_spec

        self.producer = producer
        self.dest_cfg = dest_cfg
        self.run_id = run_id
        self.rate = rate
        self.to_spec = topic_spec(to_topic) if to_topic else None
        self.to_name = None
        if to_topic:
            self.to_name = to_topic if to_topic.count(".") >= 2 else dest_cfg.topic(self.to_spec)

    def destination(self, item: ReplayItem) -> tuple[str, object]:
        from tapioca.schemas.registry import topic as topic_spec

        if self.to_spec is not None:
            if type(item.event) not in self.to_spec.value_types:
                raise SchemaError(
                    f"a {item.event.type} event from {item.source.topic} does not belong on "
                    f"{self.to_name} (it carries {[c.TYPE for c in self.to_spec.value_types]}); "
                    "narrow the replay with --type or --topic")
            return self.to_name, self.to_spec
        spec = topic_spec(item.source.topic)
        return self.dest_cfg.topic(spec), spec

    def run(self, items: Iterator[ReplayItem] | Callable[[], Iterator[ReplayItem]],
            flt: ReplayFilter, stats: ReplayStats, *, limit: int | None = None,
            dry_run: bool = False) -> ReplayStats:
        """Republish the items that pass ``flt``. ``items`` may be a function giving a
        fresh iterator each call: group filtering reads the source twice (a first pass
        decides each group, the second publishes); a plain iterator only filters per
        event."""
        from tapioca.schemas.envelope import encode_event

        start = time.monotonic()
        verdicts = None
        if callable(items):
            if flt.by_group:
                first: dict[tuple[str, int], int] = {}

                def counted(it: Iterator[ReplayItem]) -> Iterator[ReplayItem]:
                    for item in it:
                        tp = (item.source.topic, item.source.partition)
                        first[tp] = max(first.get(tp, -1), item.source.offset)
                        yield item

                undecodable = stats.undecodable
                verdicts = flt.group_verdicts(counted(items()))
                stats.undecodable = undecodable  # counted again by the second pass
                stats.groups_kept = sum(verdicts.values())
                stats.groups_dropped = len(verdicts) - stats.groups_kept
                # A live topic may grow between the passes: what the first pass did not
                # see has no verdict, so the second pass stops where the first did.
                items = _seen_by_first_pass(items(), first, stats)
            else:
                items = items()
        elif flt.by_group:
            raise ConfigError("group filtering reads the source twice: pass a function "
                              "returning the items, or set per_event")
        for item in items:
            stats.read += 1
            if not flt.keep(item, verdicts):
                stats.skipped += 1
                continue
            if limit is not None and stats.published >= limit:
                break
            name, spec = self.destination(item)
            if self.rate > 0:  # pace to the rate: event n leaves at start + n / rate
                wait = start + stats.published / self.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            if not dry_run:
                if self.run_id is not None and item.event.run_id != self.run_id:
                    item.event.run_id = self.run_id
                    raw = encode_event(item.event, max_bytes=self.dest_cfg.max_message_bytes)
                    key = spec.key_of(item.event).encode()  # the key may be the run id
                else:
                    raw = item.raw
                    key = (item.source.key.encode() if item.source.key is not None
                           else spec.key_of(item.event).encode())
                self.producer.publish_raw(name, key, raw)
                if stats.published % 1000 == 999:
                    self.producer.flush()  # bound what is held in memory undelivered
            stats.published += 1
            stats.by_topic[name] = stats.by_topic.get(name, 0) + 1
        if not dry_run:
            self.producer.flush()
        stats.wall_s = time.monotonic() - start
        return stats


def _seen_by_first_pass(items: Iterator[ReplayItem], first: dict[tuple[str, int], int],
                        stats: ReplayStats) -> Iterator[ReplayItem]:
    for item in items:
        if item.source.offset <= first.get((item.source.topic, item.source.partition), -1):
            yield item
        else:
            stats.read += 1
            stats.skipped += 1


def parse_time(value: Optional[str], flag: str) -> Optional[int]:
    """Epoch seconds or an ISO-8601 time (UTC unless it names a zone) -> epoch ms."""
    if value is None:
        return None
    try:
        return int(float(value) * 1000)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"{flag} {value!r}: use epoch seconds or ISO 8601, e.g. "
                                 "2026-11-30T07:00:00Z") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return int(t.timestamp() * 1000)


@app.command("replay")
def replay(
    archive: Optional[str] = typer.Argument(
        None, help="Parquet archive directory (or one file) to replay."),
    from_topic: Optional[str] = typer.Option(
        None, "--from-topic", help="Replay a live topic instead (name or full name)."),
    topic: list[str] = typer.Option([], "--topic", "-t",
                                    help="Archive source: only these topics (repeatable)."),
    partition: Optional[int] = typer.Option(
        None, "--partition", help="Only this source partition (offsets are per partition)."),
    from_offset: Optional[int] = typer.Option(
        None, help="First source offset (inclusive), in every partition unless --partition."),
    to_offset: Optional[int] = typer.Option(
        None, help="Last source offset (inclusive), in every partition unless --partition."),
    since: Optional[str] = typer.Option(None, help="Record time from (epoch s or ISO 8601)."),
    until: Optional[str] = typer.Option(None, help="Record time until (inclusive)."),
    type_: list[str] = typer.Option([], "--type", help="Only these event types (repeatable)."),
    min_version: Optional[int] = typer.Option(None, help="Events whose versions are >= this."),
    max_version: Optional[int] = typer.Option(None, help="Events whose versions are <= this."),
    min_reward: Optional[float] = typer.Option(None, help="Rewards / sample means >= this."),
    max_reward: Optional[float] = typer.Option(None, help="Rewards / sample means <= this."),
    per_event: bool = typer.Option(
        False, "--per-event", help="Apply version / reward filters to each record alone "
        "(default: keep or drop whole groups of trajectories, rewards and samples)."),
    to_topic: Optional[str] = typer.Option(None, help="Publish everything to this one topic."),
    to_prefix: Optional[str] = typer.Option(
        None, help="Destination topic prefix (default: --prefix); topics are created."),
    run_id: Optional[str] = typer.Option(None, help="Rewrite every event's run_id (a new run)."),
    rate: float = typer.Option(0.0, help="Events per second (0: as fast as possible)."),
    limit: Optional[int] = typer.Option(None, help="Stop after publishing this many."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be published."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Republish a Parquet log, or a live topic's offset or time range, to a topic or a
    new run, with rate control and filters."""
    from tapioca.bus.admin import admin_client, ensure_topics
    from tapioca.bus.producer import EventProducer
    from tapioca.bus.reader import _full_name

    if output not in ("table", "json"):
        raise typer.BadParameter("--output must be table or json")
    if (archive is None) == (from_topic is None):
        raise ConfigError("give either an archive directory or --from-topic NAME (one source)")
    if rate < 0:
        raise typer.BadParameter("--rate must be >= 0 (0: as fast as possible)")
    from tapioca.schemas.envelope import event_types

    unknown = sorted(set(type_) - set(event_types()))
    if unknown:
        raise typer.BadParameter(f"--type {unknown}: event types are {sorted(event_types())}")
    flt = ReplayFilter(frozenset(type_), min_version, max_version, min_reward, max_reward,
                       parse_time(since, "--since"), parse_time(until, "--until"),
                       from_offset, to_offset, partition, per_event)
    if partition is not None and partition < 0:
        raise typer.BadParameter("--partition must be >= 0")
    needs_broker = from_topic is not None or not dry_run
    if needs_broker:
        src_cfg, dest_cfg = bus_config(), bus_config()
    else:  # counting an archive needs no broker
        from tapioca.bus.settings import BusConfig

        src_cfg = dest_cfg = BusConfig(topic_prefix=G.prefix)
    if to_prefix:
        dest_cfg.topic_prefix = to_prefix
    elif to_topic and to_topic.count(".") >= 2:
        # A full destination name carries its prefix: create that prefix's topics.
        dest_cfg.topic_prefix = to_topic.rsplit(".", 2)[0]
    replayer = Replayer(None, dest_cfg, to_topic=to_topic, run_id=run_id, rate=rate)
    stats = ReplayStats()
    if from_topic is not None:
        from tapioca.schemas.registry import topic as topic_spec

        full = _full_name(src_cfg, from_topic)
        target = replayer.to_name or dest_cfg.topic(topic_spec(full))
        if target == full and not dry_run:
            raise ConfigError(f"replaying {full} onto itself would read its own output; "
                              "pass --to-prefix or --to-topic")
        admin_client(src_cfg)

        def items() -> Iterator[ReplayItem]:
            return items_from_topic(src_cfg, full, stats)
    else:
        def items() -> Iterator[ReplayItem]:
            return items_from_archive(archive, list(topic))
    if not dry_run:
        ensure_topics(dest_cfg)
        replayer.producer = EventProducer(dest_cfg, "tapioca-replay")
    try:
        replayer.run(items, flt, stats, limit=limit, dry_run=dry_run)
    finally:
        if replayer.producer is not None:
            replayer.producer.close()
    if output == "json":
        emit_json(stats.__dict__)
        return
    verb = "would publish" if dry_run else "published"
    console.print(f"{verb} {stats.published} of {stats.read} events in {stats.wall_s:.1f} s "
                  f"({stats.skipped} filtered out, {stats.undecodable} undecodable)")
    if stats.groups_kept is not None:
        console.print(f"  groups: {stats.groups_kept} kept, {stats.groups_dropped} dropped "
                      "(whole; --per-event filters record by record)")
    for name, n in sorted(stats.by_topic.items()):
        console.print(f"  {name}: {n}")


# ---------------------------------------------------------------------------- archive


@app.command("archive")
def archive(
    directory: str = typer.Argument(..., help="Where the Parquet files go."),
    topic: list[str] = typer.Option([], "--topic", "-t", help="Only these topics (repeatable)."),
    roll_bytes: int = typer.Option(64 << 20, help="Roll a partition's file at this many bytes."),
    roll_interval_s: float = typer.Option(60.0, help="... or this many seconds after it opened."),
    group: Optional[str] = typer.Option(None, help="Consumer group (default PREFIX.archiver)."),
    run_id: str = typer.Option("default", help="Archive only this run's events (default: all)."),
    exit_when_idle_s: Optional[float] = typer.Option(
        None, help="Stop once nothing arrived for this long (batch use)."),
    max_seconds: Optional[float] = typer.Option(None, help="Stop after this long."),
) -> None:
    """Run the archiver against the broker until Ctrl-C (every topic to Parquet)."""
    from tapioca.bus.admin import admin_client
    from tapioca.bus.runner import RoleRunner
    from tapioca.config.schema import ArchiveConfig
    from tapioca.consumers.archiver import ALL_TOPICS, Archiver

    a = ArchiveConfig(enabled=True, dir=directory, roll_bytes=roll_bytes,
                      roll_interval_s=roll_interval_s, topics=list(topic))
    cfg = bus_config(run_id=run_id)
    admin_client(cfg)
    role = Archiver(a.dir, topics=tuple(a.topics) or ALL_TOPICS, roll_bytes=a.roll_bytes,
                    roll_interval_s=a.roll_interval_s, exit_when_idle_s=exit_when_idle_s)
    runner = RoleRunner(role, cfg, member_id="archiver-cli", group_id=group)
    state = runner.run(max_seconds=max_seconds)
    w = state.writer
    console.print(f"archived {state.archived} events into {w.files_written} files under "
                  f"{Path(directory).resolve()}")


# ---------------------------------------------------------------------------- offline RL


@app.command("train-offline",
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train_offline(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file."),
    from_archive: str = typer.Option(..., "--from-archive", help="Parquet archive directory."),
    source: str = typer.Option(
        "samples", help="samples (the run's advantages) or trajectories (recomputed from "
                        "trajectories + rewards with this config's advantage section)."),
    trial: str = typer.Option("offline", help="trial_name of the offline run (its own "
                                               "checkpoints, weights and metrics)."),
    max_steps: Optional[int] = typer.Option(None, help="Stop after this many steps."),
    publish: bool = typer.Option(True, help="Publish weights and metrics to the broker."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Train the policy from a Parquet log (decoupled PPO on the recorded behaviour
    logprobs; staleness gate off). Extra arguments are dotted overrides."""
    from tapioca.bus.archive import iter_events
    from tapioca.bus.producer import EventProducer
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.ops import broker_state
    from tapioca.ops.launcher import prepare_run
    from tapioca.ops.role_builders import build_role
    from tapioca.trainers.offline import OFFLINE_ETA, OfflineTrainer, samples_from_log

    if source not in ("samples", "trajectories"):
        raise typer.BadParameter("--source must be samples or trajectories")
    if not Path(from_archive).exists():
        raise ConfigError(f"archive {from_archive} does not exist; pass the archive "
                          "directory (archive.dir of the run, or `tapioca archive DIR`)")
    cfg = load_config(TrainConfig, config, list(ctx.args))
    cfg.trial_name = trial
    # Recorded versions count the online trainer's steps: no gate (see trainers/offline.py).
    cfg.rollout.max_head_offpolicyness = OFFLINE_ETA
    if G.prefix != "tapioca":
        cfg.bus.topic_prefix = G.prefix
    run_dir = prepare_run(cfg)
    producer = None
    if publish:
        cfg.bus.bootstrap_servers = cfg.bus.bootstrap_servers or broker_state.resolve_bootstrap(
            G.bootstrap)
        from tapioca.bus.admin import ensure_topics

        ensure_topics(cfg.bus)
        producer = EventProducer(cfg.bus, f"{cfg.run_id}-trainer-offline")
    trainer = build_role("trainer", cfg)
    if source == "samples":
        samples = samples_from_log(iter_events(from_archive, topic="samples"))
    else:
        samples = samples_from_log(
            iter_events(from_archive, topic=["trajectories", "rewards"], order="time"),
            build_role("advantage", cfg))
    try:
        result = OfflineTrainer(trainer, publish=producer.publish if producer else None,
                                max_steps=max_steps).run(samples)
    finally:
        if producer is not None:
            producer.close()
    summary = {"run_dir": str(run_dir), "steps": result.steps, "groups_read": result.groups_read,
               "final_version": result.final_version, "losses": result.losses,
               "weights": result.weights[-1].path if result.weights else None}
    if output == "json":
        emit_json(summary)
        return
    console.print(f"offline: {result.steps} steps from {result.groups_read} groups of "
                  f"{from_archive}; version {result.final_version}; weights "
                  f"{summary['weights']}; metrics {run_dir}/metrics/metrics.jsonl")
