"""Retries that never block a role's loop: a failed record waits, its partition with it.

When a handler fails on a record the runner does not sleep. It *parks* the record's
partition: the record is retried once its backoff has passed
(``bus.handler_backoff_s * 2 ** (attempts - 1)``), and every later record of that
partition fetched meanwhile waits behind it, in order. Other partitions, ticks,
heartbeats and control commands go on. After ``bus.handler_max_attempts`` failures the
record is dead-lettered and the records behind it are handled.

Delivery guarantees are unchanged: a partition's handled position (and so its commit)
never passes a parked record, so a crash while one is parked re-reads it and everything
behind it (at-least-once), and records of one partition are handled in order.

Pure bookkeeping: the runner (bus/runner.py) does the Kafka I/O (pausing the partition
while it is parked, so the client does not fetch an unbounded backlog into memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Hashable, Iterable, TypeVar

T = TypeVar("T")


def backoff_s(base_s: float, attempts: int) -> float:
    """Delay before attempt ``attempts + 1``: ``base_s * 2 ** (attempts - 1)``."""
    return base_s * (2 ** max(attempts - 1, 0))


@dataclass
class _Parked(Generic[T]):
    head: T
    attempts: int  # failures of ``head`` so far
    due: float  # monotonic time of its next attempt
    behind: list[T] = field(default_factory=list)


class ParkedPartitions(Generic[T]):
    """Per partition key: the failed record at its head, how often it failed, when it is
    due again, and the records that arrived behind it."""

    def __init__(self, base_backoff_s: float) -> None:
        self.base_backoff_s = base_backoff_s
        self._parked: dict[Hashable, _Parked[T]] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._parked

    def __len__(self) -> int:
        return len(self._parked)

    def keys(self) -> list[Hashable]:
        return list(self._parked)

    def park(self, key: Hashable, record: T, attempts: int, now: float,
             behind: Iterable[T] = ()) -> float:
        """``record`` failed for the ``attempts``-th time: hold its partition until the
        backoff has passed (returns the due time). ``behind``: records already waiting."""
        if key in self._parked:
            raise ValueError(f"partition {key!r} is already parked")
        due = now + backoff_s(self.base_backoff_s, attempts)
        self._parked[key] = _Parked(record, attempts, due, list(behind))
        return due

    def hold(self, key: Hashable, record: T) -> None:
        """A later record of a parked partition: it waits behind the failed one."""
        self._parked[key].behind.append(record)

    def due(self, now: float) -> list[Hashable]:
        """Parked partitions whose failed record may be tried again, earliest first."""
        ready = [(p.due, k) for k, p in self._parked.items() if p.due <= now]
        return [k for _, k in sorted(ready, key=lambda x: x[0])]

    def take(self, key: Hashable) -> tuple[T, int, list[T]]:
        """Unpark: (the failed record, its failures so far, the records behind it)."""
        p = self._parked.pop(key)
        return p.head, p.attempts, p.behind

    def drop(self, keys: Iterable[Hashable]) -> int:
        """Forget these partitions (revoked: their new owner re-reads them from the
        committed offset). Returns how many records were dropped."""
        n = 0
        for key in keys:
            p = self._parked.pop(key, None)
            if p is not None:
                n += 1 + len(p.behind)
        return n

    def waiting(self) -> int:
        """Records waiting, failed ones included."""
        return sum(1 + len(p.behind) for p in self._parked.values())

    def next_due(self) -> float | None:
        return min((p.due for p in self._parked.values()), default=None)
