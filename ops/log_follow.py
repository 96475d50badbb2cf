"""Following a few topics of a run without joining a consumer group: for the exporters
that derive their state from the log (`tapioca metrics serve`, `tapioca traces export
--follow`).

Consumes the named topics, each in its own thread through
:class:`~tapioca.bus.reader.TopicReader` (from its start, or from the last ``tail``
records of each partition), and hands every record, decoded or not, to
``on_record(topic name, record)``; emits nothing. A topic that does not exist yet, or a
broker that went away, is retried every ``retry_s`` seconds, from the same start again:
the exporters' state is idempotent, so records read twice change nothing. The readers
fetch with a long ``fetch.wait.max.ms`` (the data path's 10 ms would cost an idle broker
a fetch per 10 ms per topic; a metric a few hundred milliseconds late is no loss).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Optional

from ..bus.reader import Record, TopicReader
from ..bus.settings import BusConfig

log = logging.getLogger(__name__)

FOLLOW_FETCH_WAIT_MS = 500


class LogFollower:
    """``topics``: name -> tail (None: from the start)."""

    def __init__(self, cfg: BusConfig, topics: dict[str, Optional[int]],
                 on_record: Callable[[str, Record], None], *, retry_s: float = 2.0) -> None:
        self.cfg = dataclasses.replace(cfg, fetch_wait_max_ms=max(cfg.fetch_wait_max_ms, FOLLOW_FETCH_WAIT_MS))
        self.topics = dict(topics)
        self.on_record = on_record
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._warned: set[str] = set()

    def start(self) -> "LogFollower":
        for name, tail in self.topics.items():
            t = threading.Thread(target=self._follow, args=(name, tail), name=f"follow-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def _follow(self, name: str, tail: Optional[int]) -> None:
        while not self._stop.is_set():
            try:
                with TopicReader(self.cfg, name, tail=tail) as reader:
                    # In turns short enough to see a stop.
                    while not self._stop.is_set():
                        for record in reader.records(follow=True, timeout_s=0.5):
                            self._hand(name, record)
            except Exception as exc:  # a missing topic, a lost broker: read again
                log.debug("following %s: %s (retrying in %.0f s)", name, exc, self.retry_s)
                self._stop.wait(self.retry_s)

    def _hand(self, name: str, record: Record) -> None:
        """One record to ``on_record``; one it cannot take is skipped (read again from the
        start, it would fail again, forever), and said once per topic."""
        try:
            self.on_record(name, record)
        except Exception as exc:
            if name not in self._warned:
                self._warned.add(name)
                log.warning("skipped a record of %s at %d@%d that could not be used: %s", name,
                            record.source.partition, record.source.offset, exc)
