"""A standalone reward service for Tapioca: a length-penalty scorer.

It uses only a plain Kafka client (confluent-kafka) and Tapioca's exported JSON
Schemas (``schemas/json/*.schema.json``, validated with ``jsonschema``); it never
imports Tapioca. The contract it follows is docs/reward-services.md:

- consumes ``<prefix>.trajectories.v1`` in its own consumer group
  (``<prefix>.reward-service.<scorer>``), so it sees every trajectory independently
  of the built-in scorer and the advantage processor;
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
:func:`score` with your own (a judge model, unit tests, ...).

Run::

    python examples/reward_service/service.py --bootstrap-server 127.0.0.1:29092 \\
        --prefix tapioca --scorer length_penalty --budget-tokens 64
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, Producer
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

log = logging.getLogger("reward_service")

DEFAULT_SCHEMAS = Path(__file__).resolve().parents[2] / "schemas" / "json"
# Tapioca reads at most this much of a dead letter's payload back; keep well under it.
MAX_DLQ_PAYLOAD_BYTES = 1024 * 1024
# Namespace of the deterministic reward event ids (any fixed UUID works).
EVENT_ID_NAMESPACE = uuid.UUID("6f1c3a52-7d1e-4d55-9b1e-2b5a0d7c9e10")


class Contract:
    """One event type's JSON Schema, its topic and its key field (``x-topic``,
    ``x-key`` in the exported schema)."""

    def __init__(self, schemas_dir: Path, name: str, prefix: str) -> None:
        path = schemas_dir / f"{name}.schema.json"
        if not path.exists():
            sys.exit(f"error: {path} not found; pass --schemas DIR (Tapioca's schemas/json)")
        schema = json.loads(path.read_text())
        self.validator = Draft202012Validator(schema)
        self.type = schema["properties"]["type"]["const"]
        # x-topic is "tapioca.<name>.v<N>"; only the prefix is deployment-specific.
        self.topic = f"{prefix}.{schema['x-topic'].split('.', 1)[1]}"
        self.key_field = schema["x-key"]

    def error(self, obj: object) -> str | None:
        err = best_match(self.validator.iter_errors(obj))
        if err is None:
            return None
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        return f"{where}: {err.message}"


def _reject_constant(name: str) -> float:
    # Python's json reads NaN / Infinity, which are not JSON and which Tapioca rejects.
    raise ValueError(f"{name} is not a JSON number")


def score(trajectory: dict, budget_tokens: int) -> tuple[float, dict]:
    n = len(trajectory["output_ids"])
    return max(0.0, 1.0 - n / budget_tokens), {"output_tokens": n, "budget_tokens": budget_tokens}


class RewardService:
    def __init__(self, args: argparse.Namespace) -> None:
        schemas = Path(args.schemas)
        self.trajectories = Contract(schemas, "trajectory", args.prefix)
        self.rewards = Contract(schemas, "reward", args.prefix)
        self.dlq = Contract(schemas, "dlq", args.prefix)
        self.scorer = args.scorer
        self.budget = args.budget_tokens
        self.run_id = args.run_id
        self.group = args.group or f"{args.prefix}.reward-service.{args.scorer}"
        self.producer_id = f"{args.scorer}-{socket.gethostname()}-{os.getpid()}"
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.seen_capacity = 1_000_000
        self.counts = {"scored": 0, "duplicates": 0, "dead_lettered": 0, "other_runs": 0}
        self.failed: list[str] = []
        self.stopping = False
        self.consumer = Consumer({
            "bootstrap.servers": args.bootstrap_server,
            "group.id": self.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            # Fast group joins and low fetch latency (Tapioca's KAFKA_NOTES.md).
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "fetch.wait.max.ms": 10,
        })
        self.producer = Producer({
            "bootstrap.servers": args.bootstrap_server,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            # Same partition for the same key as Tapioca's producers (and Java's).
            "partitioner": "murmur2_random",
        })

    # ------------------------------------------------------------------ one record

    def handle(self, msg) -> None:
        raw = msg.value()
        try:
            trajectory = json.loads(raw, parse_constant=_reject_constant)
        except (TypeError, ValueError) as exc:
            return self.dead_letter(msg, f"not valid JSON: {exc}", "JSONDecodeError")
        problem = self.trajectories.error(trajectory)
        if problem is not None:
            return self.dead_letter(msg, f"not a valid {self.trajectories.type} event: "
                                         f"{problem}", "SchemaValidationError")
        if self.run_id and trajectory.get("run_id", "default") != self.run_id:
            self.counts["other_runs"] += 1
            return None
        traj_id = trajectory["traj_id"]
        if traj_id in self.seen:  # a redelivery: scored already
            self.counts["duplicates"] += 1
            return None
        value, details = score(trajectory, self.budget)
        reward = {
            "event_id": uuid.uuid5(EVENT_ID_NAMESPACE, f"{traj_id}/{self.scorer}").hex,
            "type": self.rewards.type,
            "schema_version": 1,
            "run_id": trajectory.get("run_id", "default"),
            "produced_at": time.time(),
            "producer_id": self.producer_id,
            "traj_id": traj_id,
            "group_id": trajectory["group_id"],
            "reward": value,
            "scorer": self.scorer,
            "details": details,
        }
        problem = self.rewards.error(reward)
        if problem is not None:  # a bug here, not bad input: stop before publishing it
            raise RuntimeError(f"our reward event does not match the schema: {problem}")
        self.produce(self.rewards.topic, reward[self.rewards.key_field], reward)
        self.seen[traj_id] = None
        if len(self.seen) > self.seen_capacity:
            self.seen.popitem(last=False)
        self.counts["scored"] += 1
        return None

    def dead_letter(self, msg, error: str, error_type: str) -> None:
        payload = msg.value() or b""
        key = msg.key()
        record = {
            "event_id": uuid.uuid4().hex,
            "type": self.dlq.type,
            "schema_version": 1,
            "run_id": self.run_id or "default",
            "produced_at": time.time(),
            "producer_id": self.producer_id,
            "source_topic": msg.topic(),
            "source_partition": msg.partition(),
            "source_offset": msg.offset(),
            "source_key": key.decode(errors="replace") if key is not None else None,
            "error": error[:4000],
            "error_type": error_type,
            "consumer_group": self.group,
            "payload_b64": base64.b64encode(payload[:MAX_DLQ_PAYLOAD_BYTES]).decode(),
            "payload_truncated": len(payload) > MAX_DLQ_PAYLOAD_BYTES,
            "attempts": 1,
        }
        problem = self.dlq.error(record)
        if problem is not None:
            raise RuntimeError(f"our dead letter does not match the schema: {problem}")
        # The same facts in headers, as Tapioca's own dead letters carry them.
        headers = [("tapioca.error", error[:1000].encode()),
                   ("tapioca.error_type", error_type.encode()),
                   ("tapioca.source_topic", msg.topic().encode()),
                   ("tapioca.source_partition", str(msg.partition()).encode()),
                   ("tapioca.source_offset", str(msg.offset()).encode()),
                   ("tapioca.consumer_group", self.group.encode())]
        log.warning("dead-lettered %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(),
                    error)
        self.produce(self.dlq.topic, record[self.dlq.key_field], record, headers)
        self.counts["dead_lettered"] += 1

    def produce(self, topic: str, key: str, event: dict, headers=None) -> None:
        def report(err, _msg) -> None:
            if err is not None:
                self.failed.append(err.str())

        while True:
            try:
                self.producer.produce(topic, key=key.encode(), value=json.dumps(event).encode(),
                                      headers=headers, on_delivery=report)
                return
            except BufferError:  # local queue full: serve delivery reports, retry
                self.producer.poll(0.05)

    # ------------------------------------------------------------------ the loop

    def run(self, exit_when_idle_s: float | None = None) -> int:
        self.consumer.subscribe([self.trajectories.topic])
        log.info("scoring %s -> %s as %r (group %s)", self.trajectories.topic,
                 self.rewards.topic, self.scorer, self.group)
        last = time.monotonic()
        try:
            while not self.stopping:
                msgs = self.consumer.consume(64, timeout=0.1)
                handled = 0
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        if err.fatal():
                            raise RuntimeError(f"consumer failed: {err.str()}")
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("consumer error (will retry): %s", err.str())
                        continue
                    self.handle(msg)
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
                self.consumer.commit(asynchronous=False)
        finally:
            self.consumer.close()  # leave the group now, not after a session timeout
        log.info("stopped: %s", json.dumps(self.counts))
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap-server", "-b",
                   default=os.environ.get("TAPIOCA_BOOTSTRAP", "127.0.0.1:29092"))
    p.add_argument("--prefix", default="tapioca", help="Topic prefix of the run.")
    p.add_argument("--scorer", default="length_penalty",
                   help="RewardEvent.scorer (the key of advantage.reward_weights).")
    p.add_argument("--budget-tokens", type=int, default=64)
    p.add_argument("--run-id", default="", help="Only score this run's trajectories.")
    p.add_argument("--group", default="", help="Consumer group (default per scorer).")
    p.add_argument("--schemas", default=str(DEFAULT_SCHEMAS),
                   help="Directory of Tapioca's exported *.schema.json files.")
    p.add_argument("--exit-when-idle-s", type=float, default=None)
    args = p.parse_args(argv)
    if args.budget_tokens < 1:
        p.error("--budget-tokens must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward_service %(message)s")
    service = RewardService(args)

    def stop(*_: object) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return service.run(args.exit_when_idle_s)


if __name__ == "__main__":
    sys.exit(main())
