"""Following ``weights.v1``: the one home of the rule every member that loads weights applies.

Consumes the weights events a role reads (the newest recovered at start, then the
replayed broadcast topic) and the outcome of its loads. Decides, and loads nothing by
itself (the role passes its loader to :meth:`WeightsFollow.load_head`, on its tick):

- Versions only go forward (weights/versions.py): an event older than the loaded
  version is refused (BadEventError, dead-lettered by the bus).
- The same version is a repeat where its checksums agree with the loaded ones (the
  trainer repeats a version only to say that a durable file for it is ready, or at its
  start; the file's sha256 is then learned), else a conflict, refused (a version names
  one set of weights). A repeat carries nothing else: the trainer's counts are on
  ``progress.v1``, which no weights follower needs.
- A newer one is a *candidate*. Candidates are kept highest version first (first arrived
  among equals): the first is loaded next, the others are fallbacks should it be
  dead-lettered (one of several events claiming a version may be forged).
- A load that raises is retried by the bus, then dead-lettered (``forget``); the member
  keeps its version. A refusal (WeightsRefusedError: a LoRA adapter for another base,
  other target modules, a rank over the engine's maximum) is dead-lettered at once. A
  head that failed is dead-lettered at once when a higher version supersedes it. A fast
  transport that no longer holds the version (WeightsUnavailableError) is not the
  event's fault: it is dropped, not dead-lettered.
- Once loaded, lower candidates are superseded (dropped) and other claims of the loaded
  version are dead-lettered as conflicts.
- After ``recover`` the replayed topic's older events are skipped up to the recovered one.

Used by the rollout worker (producers/rollout.py), the agent proxy's weights follower
(producers/proxy/gate.py) and the evaluator (producers/evaluator.py), which loads only
the versions it evaluates (``keep``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from ..bus.role import DeadLetter, Source
from ..schemas.envelope import Event
from ..schemas.errors import BadEventError
from ..schemas.events import WeightsEvent
from .files import WeightsRefusedError, WeightsUnavailableError
from .versions import is_newer

# Weights events kept as candidates at most (the lowest versions are dropped first).
MAX_WEIGHTS_CANDIDATES = 16
WeightsId = tuple[str, tuple[str, ...]]
log = logging.getLogger(__name__)


def weights_id(event: WeightsEvent) -> WeightsId:
    """What names a version's bytes: its file's sha256 and the fast transports' bucket
    checksums. An event of a fast transport may carry only the checksums (its durable
    file, with the sha256, is written and re-announced later), so two events of one
    version conflict only where both name the same kind of checksum and differ."""
    return event.sha256, tuple(event.bucket_checksums)


def _differ(a: WeightsId, b: WeightsId) -> bool:
    return any(x and y and x != y for x, y in zip(a, b))


def _merge_ids(a: WeightsId | None, b: WeightsId) -> WeightsId:
    return b if a is None else (a[0] or b[0], a[1] or b[1])


def conflict_message(event: WeightsEvent, loaded: WeightsId) -> str:
    sha, buckets = weights_id(event)
    return (f"weights version {event.version} ({event.path or event.transport}, sha256 "
            f"{sha[:12] or '-'}, bucket checksums {','.join(b[:8] for b in buckets) or '-'}) "
            f"conflicts with the loaded weights of that version (sha256 {loaded[0][:12] or '-'}, "
            f"bucket checksums {','.join(b[:8] for b in loaded[1]) or '-'}); "
            "a version names one set of weights")


@dataclass
class WeightsFollow:
    """One member's following of ``weights.v1`` (kept in the role's state).

    ``member`` names it in error messages ("this rollout worker"); ``loaded_version`` is
    its engine's version at start."""

    member: str
    loaded_version: int = 0
    # What names the loaded version's bytes (weights_id; None: not known).
    loaded_id: WeightsId | None = None
    # Newer weights events with where they were read (None: recovered), highest first.
    candidates: list[tuple[WeightsEvent, Source | None]] = field(default_factory=list)
    head_failed: bool = False  # a load of the first candidate raised at least once
    # Older weights events on the replayed broadcast topic are skipped up to this one.
    skip_until: str = ""
    loads: int = 0
    load_failures: int = 0  # loads that failed (any cause)
    dead_lettered: int = 0

    @property
    def head(self) -> WeightsEvent | None:
        """The weights event loaded next (None: none newer than the loaded one)."""
        return self.candidates[0][0] if self.candidates else None

    def recover(self, latest: list[Event]) -> WeightsEvent | None:
        """The newest of the recovered events (None: none). The highest version (the
        latest of equals), not merely the latest event: a re-published old event must not
        set the version a restarted member runs. Newer than the loaded one: the head."""
        weights = [e for e in latest if isinstance(e, WeightsEvent)]
        if not weights:
            return None
        newest = max(weights, key=lambda e: e.version)
        if newest.version > self.loaded_version:
            self.candidates = [(newest, None)]
        elif newest.version == self.loaded_version:
            self.loaded_id = weights_id(newest)
        self.skip_until = newest.event_id
        return newest

    def replayed(self, event: WeightsEvent) -> bool:
        """True: an event at or before the recovered one on the replayed topic (ignore it)."""
        if not self.skip_until:
            return False
        if event.event_id == self.skip_until:
            self.skip_until = ""
        return True

    def offer(self, event: WeightsEvent, source: Source | None) -> list[DeadLetter]:
        """A weights event read: raises BadEventError for an older version or a conflicting
        claim of the loaded one; a repeat of the loaded one changes nothing (but the
        checksums it adds); a newer one becomes a candidate. Returns the head that failed
        to load, dead-lettered once superseded."""
        if not is_newer(event, self.loaded_version, self.member):
            if self.loaded_id is None or not _differ(self.loaded_id, weights_id(event)):
                self.loaded_id = _merge_ids(self.loaded_id, weights_id(event))
                return []
            raise BadEventError(conflict_message(event, self.loaded_id))
        if any(c.event_id == event.event_id for c, _ in self.candidates):
            return []  # read again
        out = []
        head = self.head
        if head is not None and event.version > head.version and self.head_failed:
            out.append(DeadLetter(head, BadEventError(
                f"weights version {head.version} ({head.path}) could not be loaded and was "
                f"superseded by version {event.version}"), self.candidates.pop(0)[1]))
            self.dead_lettered += 1
        self.candidates.append((event, source))
        self.candidates.sort(key=lambda c: -c[0].version)  # stable: arrival among equals
        del self.candidates[MAX_WEIGHTS_CANDIDATES:]
        if self.head is not head:
            self.head_failed = False
        return out

    def load_head(self, load: Callable[[WeightsEvent], Any]) -> list[DeadLetter]:
        """Loads the head with ``load``. A failure raises a retryable BadEventError naming
        the head (the bus retries the tick, then dead-letters it and calls ``forget``);
        WeightsUnavailableError drops it. Returns the conflicting claims of the version
        loaded, to dead-letter."""
        event, source = self.candidates[0]
        try:
            load(event)
        except WeightsUnavailableError as exc:
            # A fast transport no longer holds this version (superseded in the trainer's
            # buffers, or a restarted trainer): nothing is wrong with the event, so it is
            # dropped, not dead-lettered; the next event (or its durable file) brings it.
            self.load_failures += 1
            self.candidates.pop(0)
            self.head_failed = False
            log.warning("weights version %d not available over %s (staying on %d): %s",
                        event.version, event.transport, self.loaded_version, exc)
            return []
        except Exception as exc:
            self.load_failures += 1
            self.head_failed = True  # kept: the bus retries, then dead-letters it
            raise BadEventError(
                f"weights version {event.version} ({event.path}) cannot be loaded: "
                f"{type(exc).__name__}: {exc}; {self.member} stays on version "
                f"{self.loaded_version}", event=event, source=source,
                # A refusal (another base, ...) is the event's for good: no retry.
                retryable=not isinstance(exc, WeightsRefusedError)) from exc
        self.loaded_version, self.loaded_id = event.version, weights_id(event)
        self.loads += 1
        # Lower candidates are superseded; others claiming this version conflict with it.
        conflicts = [DeadLetter(e, BadEventError(conflict_message(e, self.loaded_id)), src)
                     for e, src in self.candidates[1:]
                     if e.version == event.version and _differ(weights_id(e), self.loaded_id)]
        self.candidates = [c for c in self.candidates if c[0].version > event.version]
        self.head_failed = False
        return conflicts

    def keep(self, wanted: Callable[[WeightsEvent], bool]) -> None:
        """Drop the candidates ``wanted`` refuses: versions this member will never load
        (the evaluator's versions between its evaluation points). Nothing is
        dead-lettered; the head is tried afresh if it changed."""
        head = self.head
        self.candidates = [c for c in self.candidates if wanted(c[0])]
        if self.head is not head:
            self.head_failed = False

    def forget(self, event: Event) -> None:
        """The bus dead-lettered ``event`` after its loads failed: the next candidate, if
        any, is tried afresh."""
        before = len(self.candidates)
        self.candidates = [c for c in self.candidates if c[0].event_id != event.event_id]
        if len(self.candidates) < before:
            self.dead_lettered += 1
            self.head_failed = False
