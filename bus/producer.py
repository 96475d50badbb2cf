"""The typed producer: events in, Kafka records out, every delivery checked.

Routes each event to its registry topic, keyed by the topic's key field. Idempotent
(``enable.idempotence``). ``flush()`` waits for every delivery report and raises
:class:`BusError` on a failed delivery — a lost event is an error, not a log line.

When the broker forgets our producer id (a memory broker restarted: UnknownProducerId
forever, see docs/kafka-clients.md) or the idempotent producer hits a fatal error, the
producer is recreated and the undelivered records are sent again. Consumers
de-duplicate by event identity, so a resend after an ambiguous failure is harmless.

Events of signed topics (control, weights) get the run's HMAC in the ``tapioca.sig``
header when the config names a key (bus/signing.py); ``publish_raw`` sends bytes as
they are (a republished record keeps only the headers it is given).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, Producer

from ..schemas.envelope import Event, encode_event, names_a_run
from ..schemas.errors import BusError
from ..schemas.registry import TopicSpec, topic_for
from .settings import BusConfig
from .signing import SIGNATURE_HEADER

log = logging.getLogger(__name__)

# Errors after which a fresh producer (new producer id) is the way out.
_RECREATE_CODES = {
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError._FATAL,
    KafkaError._MSG_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
}

Headers = list[tuple[str, bytes]]


class EventProducer:
    """Publishes typed events (``publish``) or raw records (``publish_raw``)."""

    def __init__(self, cfg: BusConfig, producer_id: str = "", *, max_recreates: int = 5) -> None:
        self.cfg = cfg
        self.producer_id = producer_id or cfg.client_id
        self.max_recreates = max_recreates
        self._seq = itertools.count()
        self._lock = threading.Lock()
        # seq -> (topic, key, value, headers), until its delivery report is a success.
        self._pending: dict[int, tuple[str, bytes | None, bytes, Headers | None]] = {}
        self._failed: dict[int, KafkaError] = {}
        self._fatal = False
        self.recreated = 0
        self.delivered = 0
        self._producer = self._make()

    def _make(self) -> Producer:
        return Producer({**self.cfg.producer_conf(), "error_cb": self._on_error})

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = True
        log.debug("producer error: %s", err)

    def _on_delivery(self, seq: int):
        def report(err: KafkaError | None, _msg: Any) -> None:
            with self._lock:
                if err is None:
                    self._pending.pop(seq, None)
                    self._failed.pop(seq, None)
                    self.delivered += 1
                else:
                    self._failed[seq] = err
        return report

    # ------------------------------------------------------------------ publishing

    def stamp(self, event: Event) -> Event:
        if not event.producer_id:
            event.producer_id = self.producer_id
        if not names_a_run(event.run_id) and names_a_run(self.cfg.run_id):
            event.run_id = self.cfg.run_id
        return event

    def publish(
        self, event: Event, *, topic: TopicSpec | None = None, headers: Headers | None = None,
    ) -> None:
        """Encode (validating first) and enqueue one event; ``flush()`` confirms delivery.
        Events of a signed topic are signed with the run's key (bus/signing.py)."""
        self.stamp(event)
        spec = topic or topic_for(event)
        value = encode_event(event, max_bytes=self.cfg.max_message_bytes)
        key = spec.key_of(event).encode()
        signing = self.cfg.signing_key() if spec.signed else None
        if signing is not None:
            headers = [*(headers or ()), (SIGNATURE_HEADER, signing.sign(value))]
        self.publish_raw(self.cfg.topic(spec), key, value, headers)

    def publish_raw(
        self, topic: str, key: bytes | None, value: bytes, headers: Headers | None = None,
    ) -> None:
        seq = next(self._seq)
        with self._lock:
            self._pending[seq] = (topic, key, value, headers)
        self._produce(seq, topic, key, value, headers)

    def _produce(self, seq: int, topic: str, key, value, headers) -> None:
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers,
                                       on_delivery=self._on_delivery(seq))
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._producer.poll(0.05)
        self._producer.poll(0)

    def poll(self) -> None:
        self._producer.poll(0)

    # ------------------------------------------------------------------ confirming

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every published record is delivered; raise BusError otherwise."""
        budget = timeout_s if timeout_s is not None else self.cfg.delivery_timeout_ms / 1000 + 10
        deadline = time.monotonic() + budget * (self.max_recreates + 1)
        attempts = 0
        while True:
            remaining = max(deadline - time.monotonic(), 0.1)
            left = self._producer.flush(min(remaining, budget))
            with self._lock:
                failed = dict(self._failed)
                pending = len(self._pending)
            if not failed and pending == 0:
                return
            if left and not failed and time.monotonic() < deadline:
                continue
            fatal_codes = {err.code() for err in failed.values()}
            missing = self._missing_topics() if attempts == 0 else []
            if missing:
                # No new producer helps: the topic is gone (a broker that lost its data).
                raise BusError(
                    f"{len(failed) or pending} event(s) were not delivered to "
                    f"{self.cfg.bootstrap_servers}: topic(s) {', '.join(missing)} do not exist "
                    "(did the broker lose its data?); `tapioca topics create` creates them")
            recreate = self._fatal or bool(fatal_codes & _RECREATE_CODES) or (left and not failed)
            if not recreate or attempts >= self.max_recreates or time.monotonic() >= deadline:
                first = next(iter(failed.values()), None)
                raise BusError(
                    f"{len(failed) or pending} event(s) were not delivered to "
                    f"{self.cfg.bootstrap_servers}: {first.str() if first else 'timed out'}; "
                    "check the broker, or raise bus.delivery_timeout_ms"
                )
            attempts += 1
            self._recreate()

    def _missing_topics(self) -> list[str]:
        """Topics of undelivered records that the cluster does not have (best effort)."""
        with self._lock:
            topics = sorted({t for t, *_ in self._pending.values()})
        missing = []
        try:
            md = self._producer.list_topics(timeout=2).topics
        except Exception:  # the broker is unreachable: that is not a missing topic
            return []
        for name in topics:
            t = md.get(name)
            if t is None or t.error is not None and t.error.code() in (
                    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                missing.append(name)
        return missing

    def _recreate(self) -> None:
        """Replace the producer (new producer id) and resend everything undelivered."""
        log.warning("recreating the Kafka producer (broker lost our producer id or a fatal error)")
        old = self._producer
        with self._lock:
            # Reports still trickling in from the old producer must not count.
            self._failed.clear()
            resend = sorted(self._pending.items())
            self._pending.clear()
        try:
            old.purge()
            old.flush(0)
        except Exception:  # the old instance may already be unusable
            pass
        self._fatal = False
        self._producer = self._make()
        self.recreated += 1
        for _seq, (topic, key, value, headers) in resend:
            new_seq = next(self._seq)
            with self._lock:
                self._pending[new_seq] = (topic, key, value, headers)
            self._produce(new_seq, topic, key, value, headers)

    def close(self) -> None:
        """Flush, then drop the client so its broker connections close now (the client
        and our callbacks refer to each other, so the garbage collector would be late)."""
        if self._producer is None:
            return
        try:
            self.flush()
        finally:
            self._producer = None

    def __enter__(self) -> "EventProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
