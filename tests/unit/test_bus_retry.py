"""Non-blocking retries (bus/retry.py): a failed record parks its partition until its
backoff passes, later records of that partition wait behind it in order, other
partitions are untouched. Pure bookkeeping, no broker."""

from __future__ import annotations

import pytest

from tapioca.bus.retry import ParkedPartitions, backoff_s


def test_backoff_doubles_from_the_base():
    assert [backoff_s(0.2, n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]


def test_parked_partition_is_due_after_its_backoff_only():
    parked = ParkedPartitions(base_backoff_s=1.0)
    due = parked.park(("t", 0), "r5", attempts=1, now=100.0)
    assert due == 101.0
    assert ("t", 0) in parked and ("t", 1) not in parked
    assert parked.due(100.5) == []
    assert parked.due(101.0) == [("t", 0)]
    # Second failure: twice the wait.
    head, attempts, behind = parked.take(("t", 0))
    assert (head, attempts, behind) == ("r5", 1, [])
    assert parked.park(("t", 0), head, attempts=2, now=200.0) == 202.0


def test_later_records_wait_behind_in_order():
    parked = ParkedPartitions(base_backoff_s=0.5)
    parked.park(("t", 0), "r5", attempts=1, now=0.0)
    parked.hold(("t", 0), "r6")
    parked.hold(("t", 0), "r7")
    assert parked.waiting() == 3
    head, attempts, behind = parked.take(("t", 0))
    assert head == "r5" and behind == ["r6", "r7"]
    assert ("t", 0) not in parked and parked.waiting() == 0
    # Parked again with what was behind it (it failed once more).
    parked.park(("t", 0), head, attempts + 1, now=1.0, behind=behind)
    assert parked.take(("t", 0))[2] == ["r6", "r7"]


def test_due_lists_earliest_first_and_drop_forgets_revoked_partitions():
    parked = ParkedPartitions(base_backoff_s=1.0)
    parked.park(("t", 0), "a", attempts=2, now=0.0)  # due 2.0
    parked.park(("t", 1), "b", attempts=1, now=0.5)  # due 1.5
    parked.hold(("t", 1), "c")
    assert parked.next_due() == 1.5
    assert parked.due(5.0) == [("t", 1), ("t", 0)]
    assert parked.drop([("t", 1), ("t", 9)]) == 2
    assert parked.keys() == [("t", 0)]


def test_a_partition_is_parked_once():
    parked = ParkedPartitions(base_backoff_s=1.0)
    parked.park(("t", 0), "a", attempts=1, now=0.0)
    with pytest.raises(ValueError):
        parked.park(("t", 0), "b", attempts=1, now=0.0)
