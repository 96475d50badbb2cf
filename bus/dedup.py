"""Idempotent sinks: remember which event identities were already handled.

Delivery is at-least-once (docs/design.md#2b-delivery-semantics), so every consumer
that changes something asks ``seen.first(identity)`` before acting; a redelivered event
then changes nothing.
Identities are whatever names the fact: ``event_id``, ``traj_id``, ``group_id``,
``(traj_id, scorer)``. Memory is bounded: the oldest identities are forgotten first,
which is safe because redeliveries come close behind the original.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class SeenSet:
    def __init__(self, capacity: int = 1_000_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self.duplicates = 0

    def first(self, identity: Hashable) -> bool:
        """True the first time an identity is offered; False (and counted) after."""
        if identity in self._seen:
            self.duplicates += 1
            return False
        self._seen[identity] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True

    def __contains__(self, identity: Hashable) -> bool:
        return identity in self._seen

    def __len__(self) -> int:
        return len(self._seen)
