"""Reading a topic without joining a consumer group: for the CLI (`tail`), for roles
that rebuild a fact from the log (the feeder's last group number), and for tests.

The end of a topic is found by reading until nothing arrives for ``idle_s``, not from
watermarks, which some brokers report wrong (docs/kafka-clients.md).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Collection, Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from ..schemas.envelope import Event, decode_event
from ..schemas.errors import BusError, SchemaError
from ..schemas.registry import topic as topic_spec
from .role import Source
from .settings import BusConfig


@dataclass
class Record:
    source: Source
    raw: bytes | None
    event: Event | None
    error: SchemaError | None
    headers: list[tuple[str, bytes]]


def _full_name(cfg: BusConfig, name: str) -> str:
    if name.count(".") >= 2:
        return name
    return cfg.topic(topic_spec(name))


class TopicReader:
    """Reads every partition of one topic (or only ``partitions``), from the beginning,
    from ``start_offset``, or from ``tail`` records before the (approximate) end of each
    partition."""

    def __init__(self, cfg: BusConfig, name: str, *, tail: int | None = None,
                 partitions: Collection[int] | None = None,
                 start_offset: int | None = None) -> None:
        self.cfg = cfg
        self.topic = _full_name(cfg, name)
        try:
            self.spec = topic_spec(self.topic)
        except SchemaError:
            self.spec = None
        self.consumer = Consumer({
            **cfg.consumer_conf(f"tapioca-reader-{uuid.uuid4().hex[:8]}"),
        })
        try:
            self._assign(tail, partitions, start_offset)
        except KafkaException as exc:
            self.consumer.close()
            raise BusError(f"cannot read {self.topic} from {cfg.bootstrap_servers}: {exc}; "
                           "is the broker up (`tapioca broker status`)?") from None

    def _assign(self, tail: int | None, partitions: Collection[int] | None,
                start_offset: int | None) -> None:
        md = self.consumer.list_topics(self.topic, timeout=10).topics.get(self.topic)
        if md is None or md.error is not None or not md.partitions:
            self.consumer.close()
            raise BusError(f"topic {self.topic!r} does not exist; create it with "
                           "`tapioca topics create` (or check --prefix)")
        wanted = sorted(md.partitions) if partitions is None else sorted(set(partitions))
        missing = [p for p in wanted if p not in md.partitions]
        if missing:
            self.consumer.close()
            raise BusError(f"topic {self.topic!r} has no partition {missing[0]}; its partitions "
                           f"are 0..{len(md.partitions) - 1}")
        assignment = []
        # Watermarks may undercount (docs/kafka-clients.md) but never overcount: reading at
        # least up to them before trusting an idle gap is a safe lower bound, and it
        # keeps a slow first fetch from looking like an empty topic.
        self._targets: dict[int, int] = {}
        for p in wanted:
            low, high = self.consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                            timeout=10)
            start = OFFSET_BEGINNING if start_offset is None else max(start_offset, low, 0)
            if tail is not None and high >= 0:
                # A watermark that undercounts only makes us read a little more.
                start = max(low, high - tail)
            if high > max(low, 0, start):
                self._targets[p] = high
            assignment.append(TopicPartition(self.topic, p, start))
        self.consumer.assign(assignment)

    def records(self, *, idle_s: float = 0.5, follow: bool = False,
                max_records: int | None = None, timeout_s: float | None = None,
                decode: bool = True) -> Iterator[Record]:
        """Yield records until none arrives for ``idle_s`` (or forever with ``follow``),
        at most ``max_records``, for at most about ``timeout_s``. Every record consumed is
        yielded before it returns: a caller that calls again on the same reader (a
        follower polling with a timeout) misses nothing."""
        last = time.monotonic()
        start = last
        count = 0
        while True:
            # Never more than max_records still wants: the rest of a batch would be lost
            # to the next call (the consumer's position has passed it).
            room = 256 if max_records is None else max_records - count
            msgs = self.consumer.consume(1, timeout=0.05)
            if msgs and room > 1:
                msgs += self.consumer.consume(min(255, room - 1), timeout=0)
            now = time.monotonic()
            if timeout_s is not None and now - start > timeout_s and not msgs:
                return
            if not msgs:
                # Below a watermark, wait longer before calling it the end (a slow fetch);
                # transaction markers can keep the last offsets unreadable, so not forever.
                patience = idle_s if not self._targets else max(5.0, 10 * idle_s)
                if not follow and now - last > patience:
                    return
                continue
            last = now
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise BusError(f"reading {self.topic} failed: {err.str()}")
                if msg.offset() + 1 >= self._targets.get(msg.partition(), 0):
                    self._targets.pop(msg.partition(), None)
                source = Source.of(msg)
                event, error = None, None
                if decode:
                    try:
                        event = decode_event(
                            msg.value(),
                            allowed_types=self.spec.value_types if self.spec else None,
                            max_bytes=self.cfg.max_message_bytes)
                        # Signed topics: an unsigned or forged record is an error, not an event.
                        self.cfg.verify(self.spec, msg.value(), msg.headers())
                    except SchemaError as exc:
                        event, error = None, exc
                yield Record(source, msg.value(), event, error, list(msg.headers() or []))
                count += 1
                if max_records is not None and count >= max_records:
                    return
            # Checked once the batch is out (it used to be dropped, consumed but unseen).
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                return

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> "TopicReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(cfg: BusConfig, name: str, *, idle_s: float = 0.5,
                timeout_s: float | None = 60.0) -> list[Event]:
    """Every decodable event on a topic, in partition order (for tests and recovery)."""
    with TopicReader(cfg, name) as reader:
        return [r.event for r in reader.records(idle_s=idle_s, timeout_s=timeout_s)
                if r.event is not None]
