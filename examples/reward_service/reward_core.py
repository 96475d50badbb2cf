"""The Kafka-client-free half of the example reward services: parse, validate, score,
build the reward or the dead letter, and the command line.

``service.py`` (confluent-kafka) and ``service_kafka_python.py`` (kafka-python) each
add only their client's consume -> produce -> flush -> commit loop around
:meth:`RewardCore.handle`. Like them, this file never imports Tapioca: it reads the
exported JSON Schemas (``schemas/json/*.schema.json``) and validates with
``jsonschema``. The contract is docs/reward-services.md; the client settings are
docs/kafka-clients.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

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
    """The reward and its audit details. Replace this with your own scorer."""
    n = len(trajectory["output_ids"])
    return max(0.0, 1.0 - n / budget_tokens), {"output_tokens": n, "budget_tokens": budget_tokens}


@dataclass
class Record:
    """What the core needs of a consumed Kafka record, whatever the client."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass
class Output:
    """One event to publish: the client's loop produces it and waits for delivery."""

    topic: str
    key: str
    value: bytes
    headers: list[tuple[str, bytes]] | None = None


class RewardCore:
    """Turns one trajectory record into its reward (or a dead letter), idempotently by
    ``traj_id``. Counts what it did in ``counts`` (printed when the service stops)."""

    def __init__(self, args: argparse.Namespace) -> None:
        schemas = Path(args.schemas)
        self.trajectories = Contract(schemas, "trajectory", args.prefix)
        self.rewards = Contract(schemas, "reward", args.prefix)
        self.dlq = Contract(schemas, "dlq", args.prefix)
        self.scorer = args.scorer
        self.budget = args.budget_tokens
        self.run_id = args.run_id  # "" with --all-runs
        # One group per run: a service left running for an earlier run must not share
        # (and commit past) the partitions of this run's service.
        self.group = args.group or (f"{args.prefix}.reward-service.{args.scorer}"
                                    + (f".{args.run_id}" if args.run_id else ""))
        self.producer_id = f"{args.scorer}-{socket.gethostname()}-{os.getpid()}"
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.seen_capacity = 1_000_000
        self.counts = {"scored": 0, "duplicates": 0, "dead_lettered": 0, "other_runs": 0}

    def of_our_run(self, run_id: object) -> bool:
        """Whether a trajectory's ``run_id`` is the run this service scores: the run id
        itself, or one of its later broker lifetimes (``RUN@2``, a run resumed on a new
        log), or any with --all-runs."""
        return not self.run_id or run_id == self.run_id or (
            isinstance(run_id, str) and run_id.startswith(f"{self.run_id}@"))

    def handle(self, rec: Record) -> list[Output]:
        try:
            trajectory = json.loads(rec.value or b"", parse_constant=_reject_constant)
        except (TypeError, ValueError) as exc:
            return [self.dead_letter(rec, f"not valid JSON: {exc}", "JSONDecodeError")]
        # Another run's trajectory is skipped before the (slower) validation: a broker
        # with history holds many of them before this run's first.
        other = trajectory.get("run_id") if isinstance(trajectory, dict) else None
        if isinstance(other, str) and other != "default" and not self.of_our_run(other):
            self.counts["other_runs"] += 1
            return []
        problem = self.trajectories.error(trajectory)
        if problem is not None:
            return [self.dead_letter(rec, f"not a valid {self.trajectories.type} event: "
                                          f"{problem}", "SchemaValidationError")]
        if not self.of_our_run(trajectory.get("run_id", "default")):  # names no run
            self.counts["other_runs"] += 1
            return []
        traj_id = trajectory["traj_id"]
        if traj_id in self.seen:  # a redelivery: scored already
            self.counts["duplicates"] += 1
            return []
        value, details = score(trajectory, self.budget)
        reward = {
            "event_id": uuid.uuid5(EVENT_ID_NAMESPACE, f"{traj_id}/{self.scorer}").hex,
            "type": self.rewards.type,
            "schema_version": 1,
            # Copy the trajectory's: a run with a run id dead-letters a reward without one.
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
        self.seen[traj_id] = None
        if len(self.seen) > self.seen_capacity:
            self.seen.popitem(last=False)
        self.counts["scored"] += 1
        return [Output(self.rewards.topic, reward[self.rewards.key_field],
                       json.dumps(reward).encode())]

    def dead_letter(self, rec: Record, error: str, error_type: str) -> Output:
        payload = rec.value or b""
        record = {
            "event_id": uuid.uuid4().hex,
            "type": self.dlq.type,
            "schema_version": 1,
            "run_id": self.run_id or "default",
            "produced_at": time.time(),
            "producer_id": self.producer_id,
            "source_topic": rec.topic,
            "source_partition": rec.partition,
            "source_offset": rec.offset,
            "source_key": rec.key.decode(errors="replace") if rec.key is not None else None,
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
                   ("tapioca.source_topic", rec.topic.encode()),
                   ("tapioca.source_partition", str(rec.partition).encode()),
                   ("tapioca.source_offset", str(rec.offset).encode()),
                   ("tapioca.consumer_group", self.group.encode())]
        log.warning("dead-lettered %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, error)
        self.counts["dead_lettered"] += 1
        return Output(self.dlq.topic, record[self.dlq.key_field], json.dumps(record).encode(),
                      headers)


def _setting(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:  # numbers and booleans typed (kafka-python wants them so); anything else a string
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--bootstrap-server", "-b",
                   default=os.environ.get("TAPIOCA_BOOTSTRAP", "127.0.0.1:29092"))
    p.add_argument("--prefix", default="tapioca", help="Topic prefix of the run.")
    p.add_argument("--scorer", default="length_penalty",
                   help="RewardEvent.scorer (the key of advantage.reward_weights).")
    p.add_argument("--budget-tokens", type=int, default=64)
    p.add_argument("--run-id", default="",
                   help="Score only this run's trajectories: its experiment_name.trial_name "
                        "(e.g. demo.ls1 for `tapioca train ... trial_name=ls1`); required "
                        "unless --all-runs.")
    p.add_argument("--all-runs", action="store_true",
                   help="Score every run's trajectories on the prefix, from the start of "
                        "the topic (old runs' included).")
    p.add_argument("--group", default="", help="Consumer group (default per scorer).")
    p.add_argument("--schemas", default=str(DEFAULT_SCHEMAS),
                   help="Directory of Tapioca's exported *.schema.json files.")
    p.add_argument("--exit-when-idle-s", type=float, default=None)
    p.add_argument("--consumer-config", "-C", type=_setting, action="append", default=[],
                   metavar="KEY=VALUE", help="Extra or overriding consumer setting "
                   "(the client's own names; repeatable). See docs/kafka-clients.md.")
    p.add_argument("--producer-config", "-P", type=_setting, action="append", default=[],
                   metavar="KEY=VALUE", help="Extra or overriding producer setting.")
    args = p.parse_args(argv)
    if args.budget_tokens < 1:
        p.error("--budget-tokens must be >= 1")
    # Without a run the service would score every old trajectory on the topic before the
    # new run's first (a broker with history holds many), and the run would wait for it.
    if not args.run_id and not args.all_runs:
        p.error("pass --run-id RUN (the run's experiment_name.trial_name, e.g. demo.ls1 with "
                "`tapioca train ... trial_name=ls1`), or --all-runs to score every run's "
                "trajectories on the topic, old ones included")
    if args.run_id and args.all_runs:
        p.error("--run-id and --all-runs exclude each other; pass one")
    args.consumer_config = dict(args.consumer_config)
    args.producer_config = dict(args.producer_config)
    return args
