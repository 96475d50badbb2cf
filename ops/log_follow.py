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
from ..schemas.errors import TapiocaError

log = logging.getLogger(__name__)

FOLLOW_FETCH_WAIT_MS = 500


class LogFollower:
    """``topics``: name -> tail (None: from the start). ``caught_up(name)`` is set once a
    topic was read to its end the first time."""

    def __init__(self, cfg: BusConfig, topics: dict[str, Optional[int]],
                 on_record: Callable[[str, Record], None], *, retry_s: float = 2.0,
                 on_error: Callable[[str, Exception], None] | None = None) -> None:
        self.cfg = dataclasses.replace(cfg, fetch_wait_max_ms=max(cfg.fetch_wait_max_ms, FOLLOW_FETCH_WAIT_MS))
        self.topics = dict(topics)
        self.on_record = on_record
        self.on_error = on_error
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._caught_up = {name: threading.Event() for name in self.topics}
        self._threads: list[threading.Thread] = []

    def start(self) -> "LogFollower":
        for name, tail in self.topics.items():
            t = threading.Thread(target=self._follow, args=(name, tail), name=f"follow-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def caught_up(self, name: str) -> threading.Event:
        return self._caught_up[name]

    def wait_caught_up(self, timeout_s: float | None = None) -> bool:
        return all(e.wait(timeout_s) for e in self._caught_up.values())

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)

    def _follow(self, name: str, tail: Optional[int]) -> None:
        while not self._stop.is_set():
            try:
                with TopicReader(self.cfg, name, tail=tail) as reader:
                    # To the end first (caught up), then follow in turns short enough to stop.
                    for record in reader.records(idle_s=0.5, timeout_s=None):
                        self.on_record(name, record)
                        if self._stop.is_set():
                            return
                    self._caught_up[name].set()
                    while not self._stop.is_set():
                        for record in reader.records(follow=True, timeout_s=0.5):
                            self.on_record(name, record)
            except (TapiocaError, Exception) as exc:  # a missing topic, a lost broker: retry
                log.debug("following %s: %s (retrying in %.0f s)", name, exc, self.retry_s)
                if self.on_error is not None:
                    self.on_error(name, exc)
                self._stop.wait(self.retry_s)
