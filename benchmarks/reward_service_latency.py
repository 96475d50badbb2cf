"""Reward latency of the example reward services (examples/reward_service/), with each
client's default settings and with the settings docs/kafka-clients.md recommends.

For each client (confluent-kafka, kafka-python) and each settings profile, against an
embedded Tansu broker this script starts itself (a fresh topic prefix per case):

1. start the service as a subprocess and ``--first-after-s`` seconds later publish one
   trajectory (0: at once; 10: about when a run started next to the service publishes
   its first one);
2. ``first`` = seconds from that trajectory's publish to its reward arriving (whatever
   is left of the process start, imports and the group join included);
3. then ``--events`` more trajectories, one at a time, each published when the previous
   reward arrived: ``p50`` / ``max`` = seconds from publish to reward, service warm.

Rewards are read by a consumer assigned to every partition of rewards.v1 (no group, so
no join) with ``fetch.wait.max.ms=10``, which adds at most ~10 ms to every number.

    python benchmarks/reward_service_latency.py [--events 20] [--first-after-s 0 10] \
        [--json out.json]

Writes JSON to ``$OUT/reward_service_latency.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from tapioca.bus import BusConfig, EmbeddedBroker, EventProducer, ensure_topics
from tapioca.schemas import TrajectoryEvent, topic

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {
    "confluent-kafka": ROOT / "examples" / "reward_service" / "service.py",
    "kafka-python": ROOT / "examples" / "reward_service" / "service_kafka_python.py",
}
# Each client's own defaults for the settings the services set (librdkafka 2.x,
# kafka-python 3.0), passed back to the service to undo its choices.
DEFAULTS = {
    "confluent-kafka": {"session.timeout.ms": 45000, "heartbeat.interval.ms": 3000,
                        "fetch.wait.max.ms": 500},
    "kafka-python": {"session_timeout_ms": 45000, "heartbeat_interval_ms": 3000,
                     "fetch_max_wait_ms": 500},
}


def trajectory(i: int, run_id: str) -> TrajectoryEvent:
    return TrajectoryEvent(traj_id=f"t{i}", group_id=f"g{i}", prompt_id=f"p{i}",
                           sample_index=0, group_size=1, prompt_ids=[1, 2],
                           output_ids=[3], output_logprobs=[-0.5], output_versions=[0],
                           run_id=run_id)


class RewardWatcher:
    def __init__(self, bus: BusConfig) -> None:
        name = bus.topic(topic("rewards"))
        self.consumer = Consumer({"bootstrap.servers": bus.bootstrap_servers,
                                  "group.id": "unused", "enable.auto.commit": False,
                                  "fetch.wait.max.ms": 10})
        md = self.consumer.list_topics(name, timeout=10).topics[name]
        self.consumer.assign([TopicPartition(name, p, OFFSET_BEGINNING) for p in md.partitions])
        self.seen: dict[str, float] = {}

    def wait_for(self, traj_id: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while traj_id not in self.seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reward for {traj_id} after {timeout_s} s")
            got = self.consumer.consume(1, timeout=0.05)  # returns at the first record
            for msg in got + (self.consumer.consume(16, timeout=0) if got else []):
                if msg.error() is None:
                    self.seen.setdefault(json.loads(msg.value())["traj_id"], time.monotonic())
        return self.seen[traj_id]

    def close(self) -> None:
        self.consumer.close()


def measure(broker: EmbeddedBroker, client: str, profile: str, events: int,
            first_after_s: float) -> dict:
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"b{uuid.uuid4().hex[:10]}",
                    run_id="bench.run")
    ensure_topics(bus)
    watcher = RewardWatcher(bus)
    cmd = [sys.executable, str(SERVICES[client]), "-b", broker.bootstrap,
           "--prefix", bus.topic_prefix, "--run-id", bus.run_id]
    if profile == "client defaults":
        for key, value in DEFAULTS[client].items():
            cmd += ["--consumer-config", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPIOCA")}
    with EventProducer(bus, "bench") as producer:
        producer.flush()  # the producer is connected before the clock starts
        service = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env=env)
        try:
            time.sleep(first_after_s)
            producer.publish(trajectory(0, bus.run_id))
            producer.flush()
            t0 = time.monotonic()
            first = watcher.wait_for("t0", 120) - t0
            warm = []
            for i in range(1, events + 1):
                producer.publish(trajectory(i, bus.run_id))
                producer.flush()
                sent = time.monotonic()
                warm.append(watcher.wait_for(f"t{i}", 60) - sent)
        finally:
            service.send_signal(signal.SIGTERM)
            try:
                service.wait(30)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait(5)
            watcher.close()
    return {"client": client, "profile": profile, "first_after_s": first_after_s,
            "first_s": first,
            "p50_s": statistics.median(warm), "max_s": max(warm), "events": events}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=20)
    p.add_argument("--first-after-s", type=float, nargs="+", default=[0.0, 10.0],
                   help="When the first trajectory is published, seconds after the "
                   "service started (one case per value).")
    p.add_argument("--json", default="")
    args = p.parse_args()
    rows = []
    with EmbeddedBroker() as broker:
        for client in SERVICES:
            for profile in ("client defaults", "tuned"):
                for after in args.first_after_s:
                    rows.append(measure(broker, client, profile, args.events, after))
                    r = rows[-1]
                    print(f"{client:16s} {profile:16s} first at +{after:4.1f} s: reward after "
                          f"{r['first_s']:7.3f} s; then p50 {r['p50_s']:.4f} s "
                          f"max {r['max_s']:.4f} s", flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_avg_1m": os.getloadavg()[0], "rows": rows}
    print(f"\n{'client':16s} {'settings':16s} {'1st traj at':>11s} {'1st reward':>11s} "
          f"{'warm p50':>9s} {'warm max':>9s}")
    for r in rows:
        print(f"{r['client']:16s} {r['profile']:16s} {r['first_after_s']:9.1f} s "
              f"{r['first_s']:9.3f} s {r['p50_s']:7.4f} s {r['max_s']:7.4f} s")
    print(f"(load average {out['load_avg_1m']:.1f}, {out['date']})")
    paths = [args.json] if args.json else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], "reward_service_latency.json"))
    for path in paths:
        Path(path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
