"""Bus pieces that need no broker: de-duplication, config validation, dead letters."""

from __future__ import annotations

import base64

import pytest

from tapioca.bus import BOOTSTRAP_ENV, BusConfig, SeenSet, Source
from tapioca.bus.dlq import MAX_DLQ_PAYLOAD_BYTES, dead_letter, original_payload
from tapioca.schemas import ConfigError, DlqRecord, SchemaError, decode_event, encode_event
from tapioca.schemas.registry import topic, topic_for

# ---------------------------------------------------------------------------
# SeenSet


def test_seen_set_first_then_duplicate():
    seen = SeenSet()
    assert seen.first("a") is True
    assert seen.first("b") is True
    assert seen.first("a") is False
    assert seen.first("a") is False
    assert seen.duplicates == 2
    assert len(seen) == 2
    assert "a" in seen and "c" not in seen


def test_seen_set_tuple_identities():
    seen = SeenSet()
    assert seen.first(("t1", "exact"))
    assert seen.first(("t1", "judge"))
    assert not seen.first(("t1", "exact"))


def test_seen_set_evicts_oldest_at_capacity():
    seen = SeenSet(capacity=3)
    for x in "abcd":
        assert seen.first(x)
    assert len(seen) == 3
    assert "a" not in seen
    assert all(x in seen for x in "bcd")
    # The forgotten identity counts as new again; a remembered one does not.
    assert seen.first("d") is False
    assert seen.first("a") is True
    assert "b" not in seen  # "a" coming back evicted the next-oldest
    assert seen.duplicates == 1


def test_seen_set_duplicate_does_not_refresh_age():
    # Eviction is by first sighting: a duplicate offer does not make an identity younger.
    seen = SeenSet(capacity=2)
    seen.first("a")
    seen.first("b")
    seen.first("a")
    seen.first("c")
    assert "a" not in seen and "b" in seen and "c" in seen


@pytest.mark.parametrize("capacity", [0, -1])
def test_seen_set_rejects_non_positive_capacity(capacity):
    with pytest.raises(ValueError):
        SeenSet(capacity)


# ---------------------------------------------------------------------------
# BusConfig


def test_heartbeat_must_be_at_most_a_third_of_session_timeout():
    with pytest.raises(ConfigError, match="heartbeat_interval_ms"):
        BusConfig(bootstrap_servers="x:1", session_timeout_ms=6000, heartbeat_interval_ms=2001)
    BusConfig(bootstrap_servers="x:1", session_timeout_ms=6000, heartbeat_interval_ms=2000)


def test_other_config_bounds():
    with pytest.raises(ConfigError, match="max_message_bytes"):
        BusConfig(bootstrap_servers="x:1", max_message_bytes=100)
    with pytest.raises(ConfigError, match="handler_max_attempts"):
        BusConfig(bootstrap_servers="x:1", handler_max_attempts=0)


def test_missing_bootstrap_says_how_to_start_a_broker(monkeypatch):
    monkeypatch.delenv(BOOTSTRAP_ENV, raising=False)
    cfg = BusConfig()
    with pytest.raises(ConfigError, match="tapioca broker up"):
        cfg.require_bootstrap()
    with pytest.raises(ConfigError, match="tapioca broker up"):
        cfg.producer_conf()
    with pytest.raises(ConfigError, match="tapioca broker up"):
        cfg.consumer_conf("g")


def test_bootstrap_from_environment(monkeypatch):
    monkeypatch.setenv(BOOTSTRAP_ENV, "127.0.0.1:29092")
    assert BusConfig().require_bootstrap() == "127.0.0.1:29092"
    assert BusConfig(bootstrap_servers="h:1").bootstrap_servers == "h:1"


def test_client_settings_follow_the_config():
    cfg = BusConfig(bootstrap_servers="h:1", topic_prefix="p", delivery_timeout_ms=1234,
                    extra_consumer={"fetch.wait.max.ms": 100})
    prod = cfg.producer_conf()
    assert prod["enable.idempotence"] is True and prod["acks"] == "all"
    assert prod["message.timeout.ms"] == 1234
    assert prod["message.max.bytes"] > cfg.max_message_bytes
    cons = cfg.consumer_conf("grp")
    assert cons["group.id"] == "grp" and cons["enable.auto.commit"] is False
    assert cons["fetch.wait.max.ms"] == 100  # extra_consumer wins
    assert cons["session.timeout.ms"] == 6000 and cons["heartbeat.interval.ms"] == 500
    assert cfg.topic(topic("rewards")) == "p.rewards.v1"


# ---------------------------------------------------------------------------
# Dead letters


SOURCE = Source(topic="p.prompts.v1", partition=3, offset=41, key="g7")


def _headers(pairs):
    assert len({k for k, _ in pairs}) == len(pairs), "duplicate header names"
    return {k: v.decode() for k, v in pairs}


def test_dead_letter_record_and_headers():
    raw = b"\xff\x00not json"
    record, headers = dead_letter(raw, SOURCE, SchemaError("not valid JSON: boom"),
                                  consumer_group="p.scorer", attempts=2)
    assert isinstance(record, DlqRecord)
    assert (record.source_topic, record.source_partition, record.source_offset) == (
        "p.prompts.v1", 3, 41)
    assert record.source_key == "g7"
    assert record.error == "not valid JSON: boom"
    assert record.error_type == "SchemaError"
    assert record.consumer_group == "p.scorer"
    assert record.attempts == 2
    assert record.payload_truncated is False
    assert original_payload(record) == raw
    h = _headers(headers)
    assert h == {
        "tapioca.error": "not valid JSON: boom",
        "tapioca.error_type": "SchemaError",
        "tapioca.source_topic": "p.prompts.v1",
        "tapioca.source_partition": "3",
        "tapioca.source_offset": "41",
        "tapioca.consumer_group": "p.scorer",
    }
    # The record is a valid event on the dlq topic, keyed by its source topic.
    assert topic_for(record) is topic("dlq")
    assert topic("dlq").key_of(record) == "p.prompts.v1"
    assert decode_event(encode_event(record)) == record


def test_dead_letter_truncates_large_payload_and_long_errors():
    raw = bytes(range(256)) * (MAX_DLQ_PAYLOAD_BYTES // 256 + 10)
    assert len(raw) > MAX_DLQ_PAYLOAD_BYTES
    err = RuntimeError("e" * 10_000)
    record, headers = dead_letter(raw, SOURCE, err, consumer_group="g")
    assert record.payload_truncated is True
    assert original_payload(record) == raw[:MAX_DLQ_PAYLOAD_BYTES]
    assert len(record.error) == 4000
    assert len(_headers(headers)["tapioca.error"]) == 1000
    assert record.error_type == "RuntimeError"
    encode_event(record)  # still publishable


def test_dead_letter_payload_exactly_at_limit_is_not_truncated():
    raw = b"a" * MAX_DLQ_PAYLOAD_BYTES
    record, _ = dead_letter(raw, SOURCE, ValueError("x"), consumer_group="g")
    assert record.payload_truncated is False
    assert base64.b64decode(record.payload_b64) == raw


def test_dead_letter_of_tombstone_and_message_less_error():
    record, headers = dead_letter(None, Source("t.a.v1", 0, 0), KeyError(), consumer_group="g")
    assert record.payload_b64 == "" and record.payload_truncated is False
    assert record.source_key is None
    assert record.error == "KeyError"  # an empty message falls back to the type name
    assert _headers(headers)["tapioca.error"] == "KeyError"


@pytest.mark.parametrize("own, event_run, another", [
    ("demo.b", "demo.a", True),         # an earlier run on the prefix: skipped, unchecked
    ("demo.b", "demo.b", False),        # this run's (or a forgery claiming it): checked
    ("demo.b", "default", False),       # names no run: checked, then skipped / dead-lettered
    ("demo.b", "demo.b@2", True),       # the run's next broker lifetime is another run id
    ("default", "demo.a", False),       # a member of no run reads (and checks) every run's
])
def test_of_another_run(own, event_run, another):
    from tapioca.schemas.envelope import of_another_run

    assert of_another_run(own, event_run) is another


# ---------------------------------------------------------------------------
# RoleRunner's poll waits (no broker: consumers that record how long they were asked to wait)


class _WaitRecorder:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list:
        self.waits.append(timeout)
        return []


def _runner_with(group: bool, bcast: bool):
    from tapioca.bus.role import Role
    from tapioca.bus.runner import RoleRunner

    class Idle(Role[None]):
        name = "idle"

        def init_state(self) -> None:
            return None

        def handle(self, event, state, source):
            return ()

    runner = RoleRunner(Idle(), BusConfig(bootstrap_servers="127.0.0.1:9", broadcast_wait_slice_ms=5),
                        poll_timeout_s=0.05)
    runner._group = _WaitRecorder() if group else None
    runner._bcast = _WaitRecorder() if bcast else None
    return runner


def test_runner_waits_in_slices_beside_a_broadcast_input():
    """A weights event must not wait out the group consumer's whole poll timeout: beside a
    broadcast input the group wait is one slice (bus.broadcast_wait_slice_ms)."""
    runner = _runner_with(group=True, bcast=True)
    runner._poll_once()
    assert runner._bcast.waits == [0]
    assert runner._group.waits == [0.005]


def test_runner_group_only_waits_the_poll_timeout_and_broadcast_only_blocks_on_it():
    group_only = _runner_with(group=True, bcast=False)
    group_only._poll_once()
    assert group_only._group.waits == [0.05]
    bcast_only = _runner_with(group=False, bcast=True)  # the feeder: no sleep, a blocking wait
    bcast_only._poll_once()
    assert bcast_only._bcast.waits == [0.05]


def test_bus_config_refuses_a_zero_broadcast_slice():
    with pytest.raises(ConfigError, match="broadcast_wait_slice_ms"):
        BusConfig(bootstrap_servers="127.0.0.1:9", broadcast_wait_slice_ms=0)
