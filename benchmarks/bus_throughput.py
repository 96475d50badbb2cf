"""Bus throughput and latency for the event Tapioca moves most: a TrajectoryEvent with
long outputs (per-token ids, logprobs, versions, loss mask).

Measures, on this machine:
  (a) encode_event / decode_event (decode includes validation) of such events;
  (b) against an embedded Tansu broker it starts itself: EventProducer publish + flush,
      then consuming them with a TopicReader (no group join) and with a RoleRunner
      (timed from its first received event, so the ~3 s group join is excluded);
  (c) end-to-end latency at a low rate: events stamped with their produce time just
      before publish, received (and decoded) by a TopicReader / RoleRunner in a thread.

    python benchmarks/bus_throughput.py [--events 1000] [--tokens 2048] [--json out.json]

MB is 10^6 bytes of encoded event (Kafka record value).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import orjson

from tapioca.bus import (
    BusConfig,
    EmbeddedBroker,
    EventProducer,
    Role,
    RoleRunner,
    TopicReader,
    ensure_topics,
    find_tansu,
)
from tapioca.schemas import TrajectoryEvent, decode_event, encode_event, topic

MB = 1e6


def make_trajectory(i: int, tokens: int, prompt_tokens: int, rng: random.Random) -> TrajectoryEvent:
    """A realistic trajectory: logprobs are float32 values widened to Python floats
    (what an engine hands over), so they print with full double precision."""
    import numpy as np

    np_rng = np.random.default_rng(rng.randrange(2**32))
    logprobs = (-np_rng.exponential(0.7, tokens)).astype(np.float32).tolist()
    return TrajectoryEvent(
        traj_id=f"traj-{i}", group_id=f"group-{i // 8}", prompt_id=f"prompt-{i // 8}",
        sample_index=i % 8, group_size=8,
        prompt_ids=[rng.randrange(151_000) for _ in range(prompt_tokens)],
        output_ids=[rng.randrange(151_000) for _ in range(tokens)],
        output_logprobs=logprobs,
        output_versions=[17] * tokens,
        loss_mask=[1] * tokens,
        finish_reason="length", task="bench", group_index=i // 8,
        timings={"queued_s": 0.01, "generate_s": 3.2},
    )


def rate(n: int, nbytes: int, seconds: float) -> dict[str, float]:
    seconds = max(seconds, 1e-9)
    return {"events": n, "seconds": seconds, "events_per_s": n / seconds,
            "mb_per_s": nbytes / MB / seconds}


def percentiles(values_ms: list[float]) -> dict[str, float]:
    xs = sorted(values_ms)

    def pct(p: float) -> float:  # nearest-rank
        return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))]

    return {"n": len(xs), "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
            "max_ms": xs[-1], "mean_ms": statistics.fmean(xs)}


# ---------------------------------------------------------------------- (a) codec


def bench_codec(events: list[TrajectoryEvent], repeats: int) -> dict[str, Any]:
    spec = topic("trajectories")
    encoded = [encode_event(e) for e in events]  # warm-up (compiles the validators)
    nbytes = sum(map(len, encoded))
    best_enc = best_dec = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for e in events:
            encode_event(e)
        best_enc = min(best_enc, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for raw in encoded:
            decode_event(raw, allowed_types=spec.value_types)
        best_dec = min(best_dec, time.perf_counter() - t0)
    return {"bytes_per_event": nbytes / len(events),
            "encode": rate(len(events), nbytes, best_enc),
            "decode": rate(len(events), nbytes, best_dec)}


# ---------------------------------------------------------------------- (b) broker


class _Counter(Role):
    """Counts trajectories; notes when the first and the n-th arrived (and, for the
    latency run, how old each event was on arrival)."""

    name = "bench-counter"
    group_inputs = ("trajectories",)

    def __init__(self, expect: int, latency: bool = False, topic: str = "trajectories") -> None:
        self.group_inputs = (topic,)
        self.expect = expect
        self.latency = latency
        self.count = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.lat_ms: list[float] = []
        self.done = threading.Event()

    def init_state(self):
        return None

    def handle(self, event, state, source):
        now = time.time()
        if self.first_at is None:
            self.first_at = time.perf_counter()
        if self.latency:
            self.lat_ms.append((now - event.produced_at) * 1000)
        self.count += 1
        if self.count >= self.expect:
            self.last_at = time.perf_counter()
            self.done.set()
        return ()


def bench_broker(bootstrap: str, events: list[TrajectoryEvent], raw_sizes: int) -> dict[str, Any]:
    n = len(events)
    out: dict[str, Any] = {}

    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"b{uuid.uuid4().hex[:8]}")
    ensure_topics(cfg)
    # Pre-encoded records (publish_raw) go to a topic of their own: the client + broker
    # part alone. One of them first warms the producer up (connection, InitProducerId),
    # a one-time cost timed separately.
    raw_cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"r{uuid.uuid4().hex[:8]}")
    ensure_topics(raw_cfg, [topic("trajectories")])
    raw_topic = raw_cfg.topic(topic("trajectories"))
    encoded = [encode_event(e) for e in events]
    t0 = time.perf_counter()
    producer = EventProducer(cfg, "bench")
    producer.publish_raw(raw_topic, b"warm-up", encoded[0])
    producer.flush()
    out["producer_start_s"] = time.perf_counter() - t0

    # Produce: publish (validates + encodes) and flush (every delivery confirmed).
    t0 = time.perf_counter()
    for e in events:
        producer.publish(e)
    producer.flush()
    out["produce"] = rate(n, raw_sizes, time.perf_counter() - t0)

    t0 = time.perf_counter()
    for e, value in zip(events, encoded):
        producer.publish_raw(raw_topic, e.group_id.encode(), value)
    producer.flush()
    out["produce_raw"] = rate(n, raw_sizes, time.perf_counter() - t0)
    producer.close()

    # Consume with a TopicReader (assign, no group): decoded + validated, and raw.
    for label, decode in (("consume_reader", True), ("consume_reader_raw", False)):
        with TopicReader(cfg, "trajectories") as reader:
            t0 = time.perf_counter()
            got = sum(1 for r in reader.records(max_records=n, timeout_s=120, decode=decode)
                      if not decode or r.event is not None)
            out[label] = rate(got, raw_sizes, time.perf_counter() - t0)
        if got != n:
            raise SystemExit(f"{label}: read {got} of {n} events")

    # Consume with a RoleRunner (consumer group, decode, handle, commit), timed from
    # its first event so the group join is not counted.
    role = _Counter(n)
    runner = RoleRunner(role, cfg, group_id=f"{cfg.topic_prefix}.bench-{uuid.uuid4().hex[:6]}")
    thread = threading.Thread(target=runner.run, kwargs={"max_seconds": 180}, daemon=True)
    t_start = time.perf_counter()
    thread.start()
    finished = role.done.wait(180)
    runner.stop()
    thread.join(30)
    if not finished:
        raise SystemExit(f"consume_runner: got {role.count} of {n} events")
    span = role.last_at - role.first_at
    # n-1 events arrived after the first one (its own fetch is not in the span).
    out["consume_runner"] = rate(n - 1, raw_sizes * (n - 1) // n, span)
    out["consume_runner"]["group_join_s"] = role.first_at - t_start
    return out


# ---------------------------------------------------------------------- (c) latency


def bench_latency(bootstrap: str, make, count: int, per_s: float, topic: str = "trajectories") -> dict[str, Any]:
    """Steady-state latency: the producer and the consumer are warmed up with one event
    first (its latency, which includes the producer's start, is reported apart).
    ``make(i)`` builds the events; ``topic``: the registry topic they go to."""
    out: dict[str, Any] = {}
    gap = 1.0 / per_s

    def series(producer: EventProducer) -> None:
        next_at = time.perf_counter()
        for i in range(count):
            next_at += gap
            e = make(i)
            e.produced_at = time.time()  # stamped just before publish
            producer.publish(e)
            producer.poll()
            time.sleep(max(0.0, next_at - time.perf_counter()))
        producer.flush()

    def run(label: str, lat_ms: list[float], alive) -> None:
        with EventProducer(cfg, "bench-latency") as producer:
            warm = make(-1)  # warm-up event: its latency includes the producer's start
            warm.produced_at = time.time()
            producer.publish(warm)
            producer.flush()
            deadline = time.monotonic() + 30
            while not lat_ms and alive() and time.monotonic() < deadline:
                time.sleep(0.005)
            if not lat_ms:
                raise SystemExit(f"latency ({label}): the warm-up event never arrived")
            series(producer)

    # TopicReader in a thread (assigned before the first event is produced).
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"l{uuid.uuid4().hex[:8]}")
    ensure_topics(cfg)
    lat: list[float] = []
    reader = TopicReader(cfg, topic)

    def read() -> None:
        for r in reader.records(follow=True, max_records=count + 1,
                                timeout_s=count / per_s + 60):
            lat.append((time.time() - r.event.produced_at) * 1000)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    run("reader", lat, t.is_alive)
    t.join(30)
    reader.close()
    if len(lat) != count + 1:
        raise SystemExit(f"latency (reader): got {len(lat) - 1} of {count} events")
    out["reader"] = {**percentiles(lat[1:]), "first_event_ms": lat[0]}

    # RoleRunner (consumer group); the warm-up event also waits out the group join.
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"l{uuid.uuid4().hex[:8]}")
    ensure_topics(cfg)
    role = _Counter(count + 1, latency=True, topic=topic)
    runner = RoleRunner(role, cfg)
    thread = threading.Thread(target=runner.run, kwargs={"max_seconds": count / per_s + 90},
                              daemon=True)
    thread.start()
    run("runner", role.lat_ms, thread.is_alive)
    role.done.wait(30)
    runner.stop()
    thread.join(30)
    if role.count != count + 1:
        raise SystemExit(f"latency (runner): got {role.count - 1} of {count} events")
    out["runner"] = percentiles(role.lat_ms[1:])
    return out


# ---------------------------------------------------------------------- main


def _fmt_rate(r: dict[str, float]) -> str:
    return f"{r['events_per_s']:>10,.0f} ev/s {r['mb_per_s']:>9,.1f} MB/s"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1000, help="events for (a) and (b)")
    ap.add_argument("--tokens", type=int, default=2048, help="output tokens per trajectory")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per trajectory")
    ap.add_argument("--repeats", type=int, default=3, help="codec passes; the best is kept")
    ap.add_argument("--latency-events", type=int, default=200)
    ap.add_argument("--latency-rate", type=float, default=50.0, help="events/s for (c)")
    ap.add_argument("--bootstrap-server", default=None,
                    help="use this Kafka instead of starting an embedded Tansu broker")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write results here")
    args = ap.parse_args(argv)

    import confluent_kafka

    rng = random.Random(0)
    events = [make_trajectory(i, args.tokens, args.prompt_tokens, rng) for i in range(args.events)]
    lat_template = make_trajectory(0, args.tokens, args.prompt_tokens, rng)

    def make_latency_event(i: int) -> TrajectoryEvent:
        return dataclasses.replace(lat_template, traj_id=f"lat-{i}", event_id=uuid.uuid4().hex)

    broker_version = "external"
    meta = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.argv[0]) if sys.argv[0] else "bus_throughput.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "cpu_count": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "confluent_kafka": confluent_kafka.version(),
        "librdkafka": confluent_kafka.libversion()[0],
        "orjson": orjson.__version__,
        "events": args.events, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
    }

    print(f"codec: {args.events} trajectories x {args.tokens} output tokens ...", flush=True)
    codec = bench_codec(events, args.repeats)

    broker = None
    bootstrap = args.bootstrap_server
    if bootstrap is None:
        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
        broker_version = subprocess.run([find_tansu(), "--version"], capture_output=True,
                                        text=True).stdout.strip() + " (memory storage)"
    meta["broker"] = broker_version
    try:
        sizes = sum(len(encode_event(e)) for e in events)
        print(f"broker {bootstrap}: produce / consume {args.events} events ...", flush=True)
        bus = bench_broker(bootstrap, events, sizes)
        print(f"latency: {args.latency_events} events at {args.latency_rate:g}/s ...", flush=True)
        latency = bench_latency(bootstrap, make_latency_event, args.latency_events,
                                args.latency_rate)
    finally:
        if broker is not None:
            broker.stop()

    results = {"meta": meta, "codec": codec, "bus": bus, "latency": latency}

    print()
    print(f"{meta['date']}  {meta['cpu_count']} CPU cores  {meta['broker']}  "
          f"confluent-kafka {meta['confluent_kafka']} (librdkafka {meta['librdkafka']})")
    print(f"TrajectoryEvent: {args.tokens} output + {args.prompt_tokens} prompt tokens, "
          f"{codec['bytes_per_event']:,.0f} bytes/event")
    rows = [
        ("encode_event (validate + orjson)", codec["encode"]),
        ("decode_event (orjson + validate)", codec["decode"]),
        ("produce: publish + flush", bus["produce"]),
        ("produce: publish_raw (pre-encoded) + flush", bus["produce_raw"]),
        ("consume: TopicReader, decoded", bus["consume_reader"]),
        ("consume: TopicReader, raw bytes", bus["consume_reader_raw"]),
        ("consume: RoleRunner, from 1st event", bus["consume_runner"]),
    ]
    print(f"{'':44} {'events/s':>15} {'MB/s':>14}")
    for label, r in rows:
        print(f"{label:44} {_fmt_rate(r)}")
    print(f"(not counted above: producer start, i.e. connect + InitProducerId + first "
          f"delivery, {bus['producer_start_s']:.2f} s; RoleRunner group join before its "
          f"first event {bus['consume_runner']['group_join_s']:.1f} s)")
    print(f"\nend-to-end latency, {args.latency_events} events at {args.latency_rate:g}/s "
          "(publish -> received + decoded; warmed-up producer and consumer):")
    for label, p in latency.items():
        print(f"  {label:8} p50 {p['p50_ms']:7.1f} ms   p90 {p['p90_ms']:7.1f} ms   "
              f"p99 {p['p99_ms']:7.1f} ms   max {p['max_ms']:7.1f} ms")
    print(f"  first event of a fresh producer (reader): {latency['reader']['first_event_ms']:.0f} ms")
    if args.json:
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(results, option=orjson.OPT_INDENT_2))
        print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    main()
