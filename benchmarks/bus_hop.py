"""One event hop through the bus against an in-process queue, for the events of an RL loop.

Consumes a run's archive (``--archive RUN_DIR/archive``: one event of each kind, the one of
median size, is the payload) or, without one, stand-ins of the GSM8K loop's shapes;
emits a table and JSON. For each kind of event on a synchronous step's critical path
(weights -> feeder, prompt -> rollout worker, trajectory -> scorer, reward -> advantage
processor, sample -> trainer), at a low rate with warmed-up clients, the p50 latency of:

* ``bus``: ``EventProducer.publish`` -> a ``RoleRunner`` consumer's ``handle`` (the path
  every role takes: encode, librdkafka, the embedded Tansu broker, poll, decode + validate);
* ``queue``: ``queue.Queue.put`` of the event object -> ``get`` in another thread (what
  one process passing events in memory would pay);
* ``queue+codec``: the same with ``encode_event`` / ``decode_event`` (a process boundary
  without a broker).

``bus_cost_s``: the sum over the five hops of bus - queue, i.e. what the bus adds to a
synchronous step against an in-process loop (``benchmarks/gpu_rl_loop.py --timeline``
divides it by the measured step).

    python benchmarks/bus_hop.py [--archive RUN_DIR/archive] [--events 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from bus_throughput import bench_latency, make_trajectory, percentiles  # noqa: E402

from tapioca.bus import EmbeddedBroker  # noqa: E402
from tapioca.schemas import decode_event, encode_event  # noqa: E402
from tapioca.schemas.envelope import Event  # noqa: E402
from tapioca.schemas.events import (  # noqa: E402
    PromptEvent,
    RewardEvent,
    SampleEvent,
    SampleSequence,
    TrajectoryEvent,
    WeightsEvent,
)

# The critical path of a synchronous step, in order: (registry topic, event class).
HOPS = (("weights", WeightsEvent), ("prompts", PromptEvent), ("trajectories", TrajectoryEvent),
        ("rewards", RewardEvent), ("samples", SampleEvent))


def archive_payloads(path: str | Path) -> dict[str, Event]:
    """Per hop, the archived event of median encoded size."""
    from tapioca.bus.archive import iter_events

    found: dict[str, list[Event]] = {name: [] for name, _ in HOPS}
    kinds = {cls: name for name, cls in HOPS}
    for _, e in iter_events(path):
        if type(e) in kinds:
            found[kinds[type(e)]].append(e)
    out = {}
    for name, events in found.items():
        if events:
            events.sort(key=lambda e: len(encode_event(e)))
            out[name] = events[len(events) // 2]
    return out


def standin_payloads(samples: int = 8, tokens: int = 256, prompt_tokens: int = 128) -> dict[str, Event]:
    """Events of the GSM8K loop's shape (8 samples x 256 tokens, a 128-token prompt)."""
    rng = random.Random(0)
    traj = make_trajectory(0, tokens, prompt_tokens, rng)
    seq = SampleSequence(traj_id=traj.traj_id, output_ids=traj.output_ids, behav_logprobs=traj.output_logprobs,
                         output_versions=traj.output_versions, reward=1.0, advantage=0.5)
    return {
        "weights": WeightsEvent(version=3, path="/tmp/w/v3.safetensors", sha256="ab" * 32, num_bytes=10**9,
                                group_ids=[f"group-{i}" for i in range(16)], transport="ipc",
                                transport_info={"slot": 1, "handle": "x" * 200}),
        "prompts": PromptEvent(group_id="group-0", prompt_id="p0", group_index=0, n_samples=samples,
                               prompt_ids=traj.prompt_ids, prompt_text="q " * prompt_tokens,
                               task_data={"answer": "42"}),
        "trajectories": traj,
        "rewards": RewardEvent(traj_id=traj.traj_id, group_id=traj.group_id, reward=1.0, scorer="gsm8k"),
        "samples": SampleEvent(group_id="group-0", prompt_id="p0", prompt_ids=traj.prompt_ids,
                               sequences=[dataclasses.replace(seq, traj_id=f"t{i}") for i in range(samples)]),
    }


def queue_hop(event: Event, count: int, per_s: float, codec: bool) -> dict[str, float]:
    """put -> get latency of ``event`` through a ``queue.Queue`` between two threads."""
    q: queue.Queue = queue.Queue()
    lat: list[float] = []

    def consume() -> None:
        for _ in range(count):
            sent, item = q.get()
            if codec:
                decode_event(item)
            lat.append((time.perf_counter() - sent) * 1000)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    gap = 1.0 / per_s
    for _ in range(count):
        t0 = time.perf_counter()
        q.put((t0, encode_event(event) if codec else event))
        time.sleep(gap)
    t.join(30)
    return percentiles(lat)


def hop_costs(payloads: dict[str, Event], *, count: int = 50, per_s: float = 50.0,
              bootstrap: str | None = None) -> dict[str, Any]:
    """The three latencies per hop (p50 ms) and ``bus_cost_s`` (see the module docstring)."""
    broker = None
    if bootstrap is None:
        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
    rows: dict[str, dict[str, float]] = {}
    try:
        for name, _ in HOPS:
            if name not in payloads:
                continue
            event = payloads[name]

            def make(i: int, event=event) -> Event:
                return dataclasses.replace(event, event_id=uuid.uuid4().hex)

            bus = bench_latency(bootstrap, make, count, per_s, topic=name)["runner"]
            rows[name] = {"bytes": len(encode_event(event)), "bus_p50_ms": bus["p50_ms"], "bus_p90_ms": bus["p90_ms"],
                          "queue_p50_ms": queue_hop(event, count, per_s, codec=False)["p50_ms"],
                          "queue_codec_p50_ms": queue_hop(event, count, per_s, codec=True)["p50_ms"]}
            print(name, rows[name], flush=True)
    finally:
        if broker is not None:
            broker.stop()
    cost = sum(r["bus_p50_ms"] - r["queue_p50_ms"] for r in rows.values()) / 1000
    return {"hops": rows, "bus_cost_s": cost, "events_per_hop": count, "rate_per_s": per_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archive", default="", help="a run's archive directory (payloads); default: stand-ins")
    ap.add_argument("--events", type=int, default=50, help="events per hop measurement")
    ap.add_argument("--rate", type=float, default=50.0, help="events/s")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    payloads = archive_payloads(args.archive) if args.archive else standin_payloads()
    out = hop_costs(payloads, count=args.events, per_s=args.rate)
    print(f"\n{'hop':13} {'bytes':>9} {'bus p50 ms':>11} {'queue p50 ms':>13} {'queue+codec p50 ms':>19}")
    for name, r in out["hops"].items():
        print(f"{name:13} {r['bytes']:>9,} {r['bus_p50_ms']:>11.2f} {r['queue_p50_ms']:>13.3f} "
              f"{r['queue_codec_p50_ms']:>19.3f}")
    print(f"the bus adds {1000 * out['bus_cost_s']:.1f} ms to a synchronous step's critical path "
          f"({len(out['hops'])} hops) against an in-process queue "
          f"(median of the hop medians: {statistics.median(r['bus_p50_ms'] for r in out['hops'].values()):.1f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
