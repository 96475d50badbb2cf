"""Replay: republish logged events (from a Parquet archive or a live topic) to their
topics under another prefix, to one topic, or to a new run, at a bounded rate.

Consumes :class:`ReplayItem` s (source partition/offset/key, the raw record bytes and the
decoded event); emits the same records (byte for byte with their original key, unless
the run id is rewritten) through an ``EventProducer``. :class:`ReplayFilter` keeps or
drops by type, partition, offset, time, policy version and reward; version and reward
filters decide per group (``group_id``) so a group is replayed whole or not at all.
The ``tapioca replay`` command (ops/replay_cli.py) is the CLI over this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from ..schemas.envelope import Event
from ..schemas.errors import ConfigError, SchemaError
from .role import Source


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
        from .archive import flat_fields

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
        from ..schemas.events import SampleEvent

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
    # --skip-damaged: archive files and records skipped as damaged (bus/archive.py).
    damaged_files: int = 0
    damaged_records: int = 0


def items_from_archive(path: str, topics: list[str] | None, damaged=None) -> Iterator[ReplayItem]:
    """Archived records merged across topics by record time (close to the order the
    run's consumers saw them). ``damaged`` (a :class:`~tapioca.bus.archive.Damaged`):
    damaged files and undecodable records are skipped into it instead of raising."""
    from .archive import decoded_or_skip, iter_records

    for rec in iter_records(path, topic=topics or None, order="time", damaged=damaged):
        event = decoded_or_skip(rec, damaged)
        if event is not None:
            yield ReplayItem(rec.source, rec.payload.encode(), event)


def items_from_topic(cfg, name: str, stats: ReplayStats, *, partition: int | None = None,
                     from_offset: int | None = None) -> Iterator[ReplayItem]:
    """A live topic read without a consumer group: only ``partition`` if given, from
    ``from_offset`` (else the beginning). The upper offset and the time bounds stay
    filters: ``offsets_for_times`` is not dependable (docs/kafka-clients.md)."""
    from .reader import TopicReader

    with TopicReader(cfg, name, partitions=None if partition is None else [partition],
                     start_offset=from_offset) as reader:
        for r in reader.records(idle_s=1.0):
            if r.event is None:
                stats.undecodable += 1  # a dead letter already names it; not replayable
                continue
            yield ReplayItem(r.source, r.raw, r.event)


class Replayer:
    """Publishes items to their destination topic at a bounded rate."""

    def __init__(self, producer, dest_cfg, *, to_topic: str | None = None,
                 run_id: str | None = None, rate: float = 0.0) -> None:
        from ..schemas.registry import topic as topic_spec

        self.producer = producer
        self.dest_cfg = dest_cfg
        self.run_id = run_id
        self.rate = rate
        self.to_spec = topic_spec(to_topic) if to_topic else None
        self.to_name = None
        if to_topic:
            self.to_name = to_topic if to_topic.count(".") >= 2 else dest_cfg.topic(self.to_spec)

    def destination(self, item: ReplayItem) -> tuple[str, object]:
        from ..schemas.registry import topic as topic_spec

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
            dry_run: bool = False,
            progress: Callable[[int, ReplayStats, bool], None] | None = None) -> ReplayStats:
        """Republish the items that pass ``flt``. ``items`` may be a function giving a
        fresh iterator each call: group filtering reads the source twice (a first pass
        decides each group, the second publishes); a plain iterator only filters per
        event. ``progress(items read in this pass, stats, first_pass)`` is called after
        each item read."""
        from ..schemas.envelope import encode_event

        start = time.monotonic()
        verdicts = None
        if callable(items):
            if flt.by_group:
                first: dict[tuple[str, int], int] = {}

                def counted(it: Iterator[ReplayItem]) -> Iterator[ReplayItem]:
                    for n, item in enumerate(it, 1):
                        tp = (item.source.topic, item.source.partition)
                        first[tp] = max(first.get(tp, -1), item.source.offset)
                        if progress is not None:
                            progress(n, stats, True)
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
            if progress is not None:
                progress(stats.read, stats, False)
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
