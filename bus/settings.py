"""Client settings for one Kafka cluster: the only place that knows librdkafka keys.

Defaults follow docs/kafka-clients.md: fast group joins (``session.timeout.ms=6000``,
``heartbeat.interval.ms=500``), low fetch latency (``fetch.wait.max.ms=10``, because
some brokers do not answer a waiting fetch when data arrives), manual commits, and a
raised message size limit. ``extra_producer`` / ``extra_consumer`` pass anything else.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from tapioca.schemas.envelope import DEFAULT_MAX_EVENT_BYTES
from tapioca.schemas.errors import ConfigError
from tapioca.schemas.registry import DEFAULT_PREFIX, TopicSpec

BOOTSTRAP_ENV = "TAPIOCA_BOOTSTRAP"

_kafka_log = logging.getLogger("tapioca.kafka")


class _ClientLogger:
    """Routes librdkafka's own log lines (connection refused, reconnects, ...) to Python
    logging at DEBUG, so a broker restart does not spray stderr; errors that matter
    surface as exceptions from the bus."""

    def log(self, level: int, msg: str, *args: object) -> None:
        _kafka_log.debug(msg, *args)

    def __getattr__(self, name: str):
        return self.log


@dataclass
class BusConfig:
    bootstrap_servers: str = ""
    topic_prefix: str = DEFAULT_PREFIX
    run_id: str = "default"
    # Empty: tapioca-HOST-PID of the process that uses it.
    client_id: str = ""
    max_message_bytes: int = DEFAULT_MAX_EVENT_BYTES
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 500
    fetch_wait_max_ms: int = 10
    # How long a produced event may stay undelivered before it is an error (or, when
    # the broker lost our producer id, before the producer is recreated).
    delivery_timeout_ms: int = 30000
    linger_ms: int = 2
    # Bounded retry of a failing handler before its event is dead-lettered.
    handler_max_attempts: int = 3
    handler_backoff_s: float = 0.2
    # Fleet control (bus/fleet.py): how often every member heartbeats on fleet.v1. Not
    # Kafka's group heartbeat (heartbeat_interval_ms above); a member whose last
    # heartbeat is older than three intervals is shown as stale by `tapioca status`.
    fleet_heartbeat_interval_s: float = 2.0
    extra_producer: dict[str, Any] = field(default_factory=dict)
    extra_consumer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bootstrap_servers:
            self.bootstrap_servers = os.environ.get(BOOTSTRAP_ENV, "")
        if not self.client_id:
            self.client_id = f"tapioca-{socket.gethostname()}-{os.getpid()}"
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ConfigError(
                f"bus.heartbeat_interval_ms={self.heartbeat_interval_ms} must be at most a third "
                f"of bus.session_timeout_ms={self.session_timeout_ms}"
            )
        if self.max_message_bytes < 1024:
            raise ConfigError("bus.max_message_bytes must be at least 1024")
        if self.handler_max_attempts < 1:
            raise ConfigError("bus.handler_max_attempts must be >= 1")
        if not self.fleet_heartbeat_interval_s > 0:
            raise ConfigError(
                f"bus.fleet_heartbeat_interval_s={self.fleet_heartbeat_interval_s} must be > 0 "
                "(seconds between a member's heartbeats on fleet.v1)")

    def require_bootstrap(self) -> str:
        if not self.bootstrap_servers:
            raise ConfigError(
                "no Kafka bootstrap server configured: pass --bootstrap-server HOST:PORT, "
                f"set {BOOTSTRAP_ENV}, or start the embedded broker with `tapioca broker up`"
            )
        return self.bootstrap_servers

    def topic(self, spec: TopicSpec) -> str:
        return spec.full_name(self.topic_prefix)

    def common_conf(self) -> dict[str, Any]:
        return {
            "bootstrap.servers": self.require_bootstrap(),
            "client.id": self.client_id,
            "broker.address.family": "v4",
            "logger": _ClientLogger(),
        }

    def producer_conf(self) -> dict[str, Any]:
        conf = {
            **self.common_conf(),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": self.linger_ms,
            "message.max.bytes": self.max_message_bytes + 64 * 1024,
            "message.timeout.ms": self.delivery_timeout_ms,
            "compression.type": "none",
            # The Java client's partitioner: a group's trajectories (ours) and rewards
            # (an external scorer's, maybe in Java) must land on the same partition.
            "partitioner": "murmur2_random",
        }
        conf.update(self.extra_producer)
        return conf

    def consumer_conf(self, group_id: str) -> dict[str, Any]:
        conf = {
            **self.common_conf(),
            "group.id": group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": self.session_timeout_ms,
            "heartbeat.interval.ms": self.heartbeat_interval_ms,
            "fetch.wait.max.ms": self.fetch_wait_max_ms,
            "fetch.max.bytes": max(self.max_message_bytes * 2, 52428800),
            "max.partition.fetch.bytes": self.max_message_bytes + 64 * 1024,
            "receive.message.max.bytes": max(self.max_message_bytes * 2, 52428800) + 1024 * 1024,
        }
        conf.update(self.extra_consumer)
        return conf

    def admin_conf(self) -> dict[str, Any]:
        return self.common_conf()
