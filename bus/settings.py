"""Client settings for one Kafka cluster: the only place that knows librdkafka keys.

Defaults follow docs/kafka-clients.md: fast group joins (``session.timeout.ms=6000``,
``heartbeat.interval.ms=500``), low fetch latency (``fetch.wait.max.ms=10``, because
some brokers do not answer a waiting fetch when data arrives), manual commits, and a
raised message size limit. ``extra_producer`` / ``extra_consumer`` pass anything else.

Security (docs/security.md): ``security_protocol``, ``sasl_*`` and ``ssl_*`` go to every
client (producer, consumer, admin). Passwords are never config values: they are read
at connect time from an environment variable or a 0600 file and never logged; the
config (and the run's config.yaml) holds only where to find them. ``signing_key_path``
names the run's HMAC key (bus/signing.py) for the signed topics.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from ..schemas.envelope import ANY_RUN, DEFAULT_MAX_EVENT_BYTES
from ..schemas.errors import ConfigError
from ..schemas.registry import DEFAULT_PREFIX, TopicSpec
from .signing import KEY_FILE_ENV, SigningKey, cached_key, read_secret_file

BOOTSTRAP_ENV = "TAPIOCA_BOOTSTRAP"
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")

_kafka_log = logging.getLogger("tapioca.kafka")


class _ClientLogger:
    """Routes librdkafka's own log lines (connection refused, reconnects, ...) to Python
    logging at DEBUG, so a broker restart does not spray stderr; errors that matter
    surface as exceptions from the bus."""

    def log(self, level: int, msg: str, *args: object) -> None:
        _kafka_log.debug(msg, *args)

    def __getattr__(self, name: str):
        return self.log


@dataclass(frozen=True, kw_only=True)
class BusConfig:
    bootstrap_servers: str = ""
    topic_prefix: str = DEFAULT_PREFIX
    run_id: str = ANY_RUN
    # Empty: tapioca-HOST-PID of the process that uses it.
    client_id: str = ""
    max_message_bytes: int = DEFAULT_MAX_EVENT_BYTES
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 500
    fetch_wait_max_ms: int = 10
    # How long a produced event may stay undelivered before it is an error (or, when
    # the broker lost our producer id, before the producer is recreated).
    delivery_timeout_ms: int = 30000
    # librdkafka's own default. 0 sends every event at once, which saved ~8 ms a step on
    # the H200 loop (2 ms of linger was a third of a hop's cost, benchmarks/bus_hop.py),
    # but on Tansu's memory engine every record is then a batch of its own, and with
    # hundreds of thousands of them its fetches slowed until the CPU demo stalled after
    # ~450 of its 600 steps (rewards 30+ s late; measured 2026-12-06, the same with the
    # tree before this change): with 5 the demo ran its 600 steps in 232 s. A latency-
    # bound loop on Apache Kafka may set 0.
    linger_ms: int = 5
    # A member with broadcast inputs (rollout's weights, the feeder's progress) and a
    # group input waits on the group consumer in slices this long, checking the
    # broadcast one between them: one blocking wait on the group let a weights event sit
    # for up to the whole poll timeout (50 ms) while the worker idled for it.
    broadcast_wait_slice_ms: int = 5
    # Bounded retry of a failing handler before its event is dead-lettered.
    handler_max_attempts: int = 3
    handler_backoff_s: float = 0.2
    # Fleet control (bus/fleet.py): how often every member heartbeats on fleet.v1. Not
    # Kafka's group heartbeat (heartbeat_interval_ms above); a member whose last
    # heartbeat is older than three intervals is shown as stale by `tapioca status`.
    fleet_heartbeat_interval_s: float = 2.0
    # The run's HMAC key file (bus/signing.py; `tapioca train` creates
    # <run dir>/secrets/bus.key). Empty: $TAPIOCA_SIGNING_KEY_FILE, else control and
    # weights events are neither signed nor verified.
    signing_key_path: str = ""
    # Kafka security, passed to every client (docs/security.md). PLAINTEXT, SSL,
    # SASL_PLAINTEXT or SASL_SSL.
    security_protocol: str = "PLAINTEXT"
    # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER or GSSAPI (SASL_* protocols).
    sasl_mechanism: str = ""
    sasl_username: str = ""
    # The SASL password is never a config value: the environment variable named here,
    # or (when set) a file readable by its owner only.
    sasl_password_env: str = "TAPIOCA_SASL_PASSWORD"
    sasl_password_file: str = ""
    # CA bundle that signed the brokers' certificates (SSL, SASL_SSL); empty: the
    # system's CAs.
    ssl_ca_location: str = ""
    # Client certificate and key for mutual TLS (optional), and the key's password
    # from an environment variable.
    ssl_certificate_location: str = ""
    ssl_key_location: str = ""
    ssl_key_password_env: str = ""
    # "https" checks the broker's host name against its certificate; "none" does not.
    ssl_endpoint_identification_algorithm: str = "https"
    extra_producer: dict[str, Any] = field(default_factory=dict)
    extra_consumer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Filled in at construction from the environment (frozen: set once, here).
        if not self.bootstrap_servers:
            object.__setattr__(self, "bootstrap_servers", os.environ.get(BOOTSTRAP_ENV, ""))
        if not self.signing_key_path:
            object.__setattr__(self, "signing_key_path", os.environ.get(KEY_FILE_ENV, ""))
        if not self.client_id:
            object.__setattr__(self, "client_id", f"tapioca-{socket.gethostname()}-{os.getpid()}")
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ConfigError(
                f"bus.heartbeat_interval_ms={self.heartbeat_interval_ms} must be at most a third "
                f"of bus.session_timeout_ms={self.session_timeout_ms}"
            )
        if self.broadcast_wait_slice_ms <= 0 or self.linger_ms < 0:
            raise ConfigError("bus.broadcast_wait_slice_ms must be > 0 and bus.linger_ms >= 0")
        if self.max_message_bytes < 1024:
            raise ConfigError("bus.max_message_bytes must be at least 1024")
        if self.handler_max_attempts < 1:
            raise ConfigError("bus.handler_max_attempts must be >= 1")
        if not self.fleet_heartbeat_interval_s > 0:
            raise ConfigError(
                f"bus.fleet_heartbeat_interval_s={self.fleet_heartbeat_interval_s} must be > 0 "
                "(seconds between a member's heartbeats on fleet.v1)")
        self._check_security()

    def _check_security(self) -> None:
        if self.security_protocol.upper() not in SECURITY_PROTOCOLS:
            raise ConfigError(f"bus.security_protocol={self.security_protocol!r}: use one of "
                              f"{', '.join(SECURITY_PROTOCOLS)}")
        object.__setattr__(self, "security_protocol", self.security_protocol.upper())
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and self.sasl_mechanism.upper() not in SASL_MECHANISMS:
            raise ConfigError(f"bus.security_protocol={self.security_protocol} needs "
                              f"bus.sasl_mechanism: one of {', '.join(SASL_MECHANISMS)}")
        if not sasl and self.sasl_mechanism:
            raise ConfigError(f"bus.sasl_mechanism={self.sasl_mechanism} needs "
                              "bus.security_protocol SASL_PLAINTEXT or SASL_SSL")
        if sasl and self.sasl_mechanism.upper() in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512") \
                and not self.sasl_username:
            raise ConfigError(f"bus.sasl_mechanism={self.sasl_mechanism} needs bus.sasl_username "
                              "(the password comes from $" + (self.sasl_password_env or "...")
                              + " or bus.sasl_password_file)")
        if self.ssl_endpoint_identification_algorithm not in ("https", "none"):
            raise ConfigError("bus.ssl_endpoint_identification_algorithm must be https or none")

    def signing_key(self) -> SigningKey | None:
        """The run's signing key (read once per file version), or None when unsigned."""
        return cached_key(self.signing_key_path) if self.signing_key_path else None

    def verify(self, spec: TopicSpec | None, value: bytes | None, headers) -> None:
        """Raise SignatureError (a SchemaError) when ``spec`` is a signed topic, this
        config has a key, and the record's signature does not verify under it."""
        if spec is None or not spec.signed:
            return
        key = self.signing_key()
        if key is not None:
            key.verify(value, headers)

    def sasl_password(self) -> str:
        """The SASL password, from bus.sasl_password_file or $bus.sasl_password_env."""
        if self.sasl_password_file:
            return read_secret_file(self.sasl_password_file, "the SASL password file")
        value = os.environ.get(self.sasl_password_env, "") if self.sasl_password_env else ""
        if not value:
            raise ConfigError(
                f"bus.sasl_mechanism={self.sasl_mechanism} needs a password: set "
                f"${self.sasl_password_env or 'TAPIOCA_SASL_PASSWORD'} or bus.sasl_password_file "
                "(a file readable by its owner only)")
        return value

    def security_conf(self) -> dict[str, Any]:
        """librdkafka's security keys for this config (secrets resolved now)."""
        conf: dict[str, Any] = {}
        if self.security_protocol == "PLAINTEXT":
            return conf
        conf["security.protocol"] = self.security_protocol
        if self.security_protocol.startswith("SASL_"):
            mech = self.sasl_mechanism.upper()
            conf["sasl.mechanism"] = mech
            if mech in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
                conf["sasl.username"] = self.sasl_username
                conf["sasl.password"] = self.sasl_password()
        if self.security_protocol in ("SSL", "SASL_SSL"):
            conf["ssl.endpoint.identification.algorithm"] = (
                self.ssl_endpoint_identification_algorithm)
            for key, value in (("ssl.ca.location", self.ssl_ca_location),
                               ("ssl.certificate.location", self.ssl_certificate_location),
                               ("ssl.key.location", self.ssl_key_location)):
                if value:
                    conf[key] = value
            if self.ssl_key_password_env:
                password = os.environ.get(self.ssl_key_password_env, "")
                if not password:
                    raise ConfigError(f"bus.ssl_key_password_env names "
                                      f"${self.ssl_key_password_env}, which is not set")
                conf["ssl.key.password"] = password
        return conf

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
            **self.security_conf(),
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
            # Never let a produce create a topic: after a broker lost its topics, the
            # broker's defaults (4 partitions for weights.v1, no cleanup policy) would
            # silently replace the registry's. A missing topic is an error instead, and
            # `tapioca topics create` (or the launcher) re-creates it right.
            "allow.auto.create.topics": False,
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
