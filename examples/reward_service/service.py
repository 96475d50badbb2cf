"""A standalone reward service for Tapioca: a length-penalty scorer (confluent-kafka).

It uses only a plain Kafka client (confluent-kafka) and Tapioca's exported JSON
Schemas (``schemas/json/*.schema.json``, validated with ``jsonschema`` in
``reward_core.py`` beside this file); it never imports Tapioca.
``service_kafka_python.py`` is the same service on kafka-python. The contract it
follows is docs/reward-services.md; the client settings are docs/kafka-clients.md:

- consumes ``<prefix>.trajectories.v1`` in its own consumer group
  (``<prefix>.reward-service.<scorer>.<run>``), so it sees every trajectory independently
  of the built-in scorer and the advantage processor, and scores those of its run
  (``--run-id``; or of every run, ``--all-runs``);
- publishes one ``RewardEvent`` JSON per trajectory to ``<prefix>.rewards.v1``, keyed
  by ``group_id`` with the murmur2 partitioner (the Java client's, and Tapioca's), so a
  reward lands on the same partition number as its trajectory;
- is idempotent by ``traj_id``: a trajectory it already scored is skipped, and the
  reward's ``event_id`` is derived from ``(traj_id, scorer)``, so even a rescoring
  after a crash republishes the same event (and the advantage processor keeps the
  first reward per ``(traj_id, scorer)`` anyway);
- dead-letters input it cannot use (not JSON, not a valid trajectory) to
  ``<prefix>.dlq.v1`` as a ``DlqRecord`` JSON with the original bytes, and goes on;
- commits its input offsets only after its outputs are delivered (at-least-once).

The reward: ``max(0, 1 - len(output_ids) / budget_tokens)``, i.e. 1 for an empty
answer falling linearly to 0 at ``--budget-tokens`` output tokens. Replace
``reward_core.score`` with your own (a judge model, unit tests, ...).

Run::

    python examples/reward_service/service.py --bootstrap-server 127.0.0.1:29092 \\
        --prefix tapioca --scorer length_penalty --run-id demo.ls1

(``--run-id``: the run's ``experiment_name.trial_name``; or ``--all-runs``.)
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from reward_core import Record, RewardCore, log, parse_args


def consumer_settings(bootstrap: str, group: str) -> dict:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "enable.auto.commit": False,  # commit after delivery, below
        "auto.offset.reset": "earliest",
        # A ~3 s group join instead of ~23 s on Tansu (docs/kafka-clients.md); on Apache
        # Kafka they only make a dead member's partitions move sooner.
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 500,
        # Tansu answers a waiting fetch only when this expires: it is the latency.
        "fetch.wait.max.ms": 10,
    }


def producer_settings(bootstrap: str) -> dict:
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        # Same partition for the same key as Tapioca's producers (and Java's).
        "partitioner": "murmur2_random",
    }


class RewardService:
    def __init__(self, args) -> None:
        self.core = RewardCore(args)
        self.failed: list[str] = []
        self.stopping = False
        self.consumer = Consumer({**consumer_settings(args.bootstrap_server, self.core.group),
                                  **args.consumer_config})
        self.producer = Producer({**producer_settings(args.bootstrap_server),
                                  **args.producer_config})

    def produce(self, out) -> None:
        def report(err, _msg) -> None:
            if err is not None:
                self.failed.append(err.str())

        while True:
            try:
                self.producer.produce(out.topic, key=out.key.encode(), value=out.value,
                                      headers=out.headers, on_delivery=report)
                return
            except BufferError:  # local queue full: serve delivery reports, retry
                self.producer.poll(0.05)

    def run(self, exit_when_idle_s: float | None = None) -> int:
        core = self.core
        self.consumer.subscribe([core.trajectories.topic])
        log.info("scoring %s -> %s as %r for %s (group %s)", core.trajectories.topic,
                 core.rewards.topic, core.scorer,
                 f"run {core.run_id}" if core.run_id else "every run", core.group)
        last = time.monotonic()
        try:
            while not self.stopping:
                # consume(n, t) waits for n records or t seconds: wait for one, then take
                # what is already there, so a lone trajectory is not held for 0.1 s.
                msgs = self.consumer.consume(1, timeout=0.1)
                if msgs:
                    msgs += self.consumer.consume(63, timeout=0)
                handled = 0
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.fatal():
                            raise RuntimeError(f"consumer failed: {err.str()}")
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("consumer error (will retry): %s", err.str())
                        continue
                    for out in core.handle(Record(msg.topic(), msg.partition(), msg.offset(),
                                                  msg.key(), msg.value())):
                        self.produce(out)
                    handled += 1
                if not handled:  # none, or only errors (e.g. no topic yet): nothing to commit
                    if exit_when_idle_s and time.monotonic() - last > exit_when_idle_s:
                        break
                    continue
                last = time.monotonic()
                # At-least-once: outputs delivered before the inputs are marked done.
                undelivered = self.producer.flush(30)
                if self.failed or undelivered:
                    log.error("rewards not delivered (%s); exiting without committing",
                              self.failed[:1] or "timed out")
                    return 1
                try:
                    self.consumer.commit(asynchronous=False)
                except KafkaException as exc:  # e.g. a rebalance took the partitions
                    log.warning("commit failed (the new owner re-reads; rewards are "
                                "idempotent): %s", exc)
        finally:
            self.consumer.close()  # leave the group now, not after a session timeout
        log.info("stopped: %s", json.dumps(core.counts))
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward_service %(message)s")
    service = RewardService(args)

    def stop(*_: object) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return service.run(args.exit_when_idle_s)


if __name__ == "__main__":
    sys.exit(main())
