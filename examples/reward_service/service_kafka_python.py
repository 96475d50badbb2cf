"""A standalone reward service for Tapioca: the length-penalty scorer on kafka-python.

The same service as ``service.py`` (same flags, same events, same contract:
docs/reward-services.md), on the pure-Python client kafka-python (>= 2.2, the first
with an idempotent producer) instead of confluent-kafka:
``pip install 'kafka-python>=2.2' jsonschema``. The scoring, validation and
dead letters are ``reward_core.py`` beside this file; this file is only the client's
consume -> produce -> flush -> commit loop. The settings, and why, are
docs/kafka-clients.md. What differs from confluent-kafka:

- kafka-python's default partitioner is already murmur2 (the Java client's), so a
  reward keyed by ``group_id`` lands on its trajectories' partition number;
- its defaults read from the end (``auto_offset_reset='latest'``) and auto-commit;
  both are turned off: a service started after its run began must score the
  trajectories already there, and offsets are committed only after delivery;
- ``allow_auto_create_topics=False``: a service started before
  ``tapioca topics create`` waits for the topic instead of creating it with the
  broker's default partition count, and ``metadata_max_age_ms=5000`` makes it see the
  topic within seconds once it exists (librdkafka looks for a missing topic by itself).

Run::

    python examples/reward_service/service_kafka_python.py \\
        --bootstrap-server 127.0.0.1:29092 --prefix tapioca --scorer length_penalty \\
        --run-id demo.ls1
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import CommitFailedError, KafkaError
from reward_core import Record, RewardCore, log, parse_args


def consumer_settings(bootstrap: str, group: str) -> dict:
    return {
        "bootstrap_servers": bootstrap,
        "group_id": group,
        "enable_auto_commit": False,  # commit after delivery, below
        "auto_offset_reset": "earliest",
        "allow_auto_create_topics": False,
        # Metadata is re-read this often; the default (5 min) is how long a service
        # started before `tapioca topics create` would go on waiting for its topic.
        "metadata_max_age_ms": 5000,
        # A ~3 s group join instead of ~23 s on Tansu (docs/kafka-clients.md).
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 500,
        # Tansu answers a waiting fetch only when this expires: it is the latency.
        "fetch_max_wait_ms": 10,
    }


def producer_settings(bootstrap: str) -> dict:
    return {
        "bootstrap_servers": bootstrap,
        "enable_idempotence": True,
        "acks": "all",
        "linger_ms": 2,
        "allow_auto_create_topics": False,
        # The default partitioner is murmur2, as Tapioca's and the Java client's.
    }


class RewardService:
    def __init__(self, args) -> None:
        self.core = RewardCore(args)
        self.stopping = False
        self.consumer = KafkaConsumer(**{**consumer_settings(args.bootstrap_server,
                                                             self.core.group),
                                         **args.consumer_config})
        self.producer = KafkaProducer(**{**producer_settings(args.bootstrap_server),
                                         **args.producer_config})

    def run(self, exit_when_idle_s: float | None = None) -> int:
        core = self.core
        self.consumer.subscribe([core.trajectories.topic])
        log.info("scoring %s -> %s as %r for %s (group %s)", core.trajectories.topic,
                 core.rewards.topic, core.scorer,
                 f"run {core.run_id}" if core.run_id else "every run", core.group)
        last = time.monotonic()
        try:
            while not self.stopping:
                batches = self.consumer.poll(timeout_ms=100, max_records=64)
                futures = []
                handled = 0
                for records in batches.values():
                    for r in records:
                        for out in core.handle(Record(r.topic, r.partition, r.offset,
                                                      r.key, r.value)):
                            futures.append(self.producer.send(
                                out.topic, key=out.key.encode(), value=out.value,
                                headers=out.headers))
                        handled += 1
                if not handled:
                    if exit_when_idle_s and time.monotonic() - last > exit_when_idle_s:
                        break
                    continue
                last = time.monotonic()
                # At-least-once: outputs delivered before the inputs are marked done.
                try:
                    self.producer.flush(timeout=30)
                except KafkaError as exc:
                    log.error("rewards not delivered (%s); exiting without committing", exc)
                    return 1
                failed = [f.exception for f in futures if not f.is_done or f.failed()]
                if failed:
                    log.error("rewards not delivered (%s); exiting without committing",
                              failed[0] or "timed out")
                    return 1
                try:
                    self.consumer.commit()  # synchronous: the positions of what was polled
                except CommitFailedError as exc:  # a rebalance took the partitions
                    log.warning("commit failed (the new owner re-reads; rewards are "
                                "idempotent): %s", exc)
        finally:
            self.consumer.close()  # leave the group now, not after a session timeout
            self.producer.close(timeout=5)
        log.info("stopped: %s", json.dumps(core.counts))
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward_service %(message)s")
    # kafka-python logs every reconnect and metadata retry at WARNING/INFO.
    logging.getLogger("kafka").setLevel(logging.ERROR)
    service = RewardService(args)

    def stop(*_: object) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return service.run(args.exit_when_idle_s)


if __name__ == "__main__":
    sys.exit(main())
