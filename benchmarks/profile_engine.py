"""Where an engine's decode step spends its time: ``torch.profiler`` over one
``engine.generate`` of the engine_generate.py workload (a), smaller by default;
``--engine torch`` (TorchEngine, the default) or ``paged`` (PagedEngine).

Consumes nothing (random weights); prints the wall time per decode step, the GPU's
busy time over the profiled run (kernel time / wall: far below 1 means the step is
bound by the CPU side -- Python, transformers' per-layer code, launches), the top
kernels, and the top CPU operators (the engine runs on its own thread, so the profiler
follows all threads). On the GPU box:

    python benchmarks/profile_engine.py --device cuda --n-seqs 256 --new-tokens 64

``--engine paged --host-breakdown`` also times the paged engine's host functions around
one unprofiled run (wall per decode step in each: ``_process``, the rest of ``_launch``
(planning, staging), the graph replay call, the engine loop outside ``_step``), to say
where the host side of a step goes without the profiler's own overhead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_generate import Workload, build_model, engine_fn, sync  # noqa: E402

from tapioca.engines.paged_engine import PagedEngine  # noqa: E402
from tapioca.engines.torch_engine import TorchEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--n-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=25, help="operators to list")
    ap.add_argument("--engine", default="torch", choices=["torch", "paged"])
    ap.add_argument("--host-breakdown", action="store_true",
                    help="paged: time the engine's host functions over one unprofiled run")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(args.tiny, dtype, args.device)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.n_seqs, args.prompt_len),
                            generator=gen).tolist()
    if args.engine == "paged":
        engine = PagedEngine(model, device=args.device, max_batch_size=args.n_seqs,
                             kv_cache_tokens=2 * args.n_seqs * (args.prompt_len + args.new_tokens))
    else:
        engine = TorchEngine(model, device=args.device, max_batch_size=args.n_seqs)
    workload = Workload("a", prompts, [args.new_tokens] * args.n_seqs, 1.0, model.config.vocab_size)
    run = engine_fn(engine, workload, model if args.engine == "torch" else None)
    try:
        run()  # warm-up
        sync(args.device)
        t0 = time.perf_counter()
        run()
        sync(args.device)
        wall = time.perf_counter() - t0
        print(f"unprofiled: {wall:.3f} s, {wall / args.new_tokens * 1000:.1f} ms per decode "
              f"step (prefill included), {args.n_seqs * args.new_tokens / wall:,.0f} tok/s")
        if args.host_breakdown and args.engine == "paged":
            host_breakdown(engine, run, args)
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        t0 = time.perf_counter()
        all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with profile(activities=activities, experimental_config=all_threads) as prof:
            run()
            sync(args.device)
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    events = prof.key_averages()
    ops_s = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"profiled: {wall:.3f} s wall, {ops_s:.3f} s inside torch operators on the CPU "
          "(the rest of the engine thread's time is Python)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                       max_name_column_width=60))
    if not args.device.startswith("cuda"):
        return
    # Kernels only: the CPU operators that launched them carry the same device time.
    busy_s = sum(e.self_device_time_total for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    print(f"profiled: {wall:.3f} s wall, GPU kernels {busy_s:.3f} s busy "
          f"({busy_s / wall:.0%}); per decode step {busy_s / args.new_tokens * 1000:.2f} ms of kernels")
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows,
                       max_name_column_width=60))


def host_breakdown(engine: PagedEngine, run, args) -> None:
    """Wall time per decode step inside the paged engine's host-side functions (wrapped
    on the instance for one run; nested: ``_launch`` holds ``_decode`` holds the replay)."""
    spent: dict[str, float] = {}
    names = {"_step": engine, "_launch": engine, "_decode": engine, "_process": engine, "_compact": engine,
             "run": engine.graphs}
    originals = {name: getattr(obj, name) for name, obj in names.items()}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    for name, obj in names.items():
        setattr(obj, name, timed(name, originals[name]))
    try:
        sync(args.device)
        t0 = time.perf_counter()
        run()
        sync(args.device)
        wall = time.perf_counter() - t0
    finally:
        for name, obj in names.items():
            delattr(obj, name)  # back to the class's methods
    steps = max(engine.stats()["decode_only_steps"], 1)  # cumulative; per-step figures are indicative
    per = {k: 1000 * v / args.new_tokens for k, v in spent.items()}
    print(f"host breakdown, ms per decode step ({args.new_tokens} steps, {wall:.3f} s wall, "
          f"{steps} decode-only steps so far): step {per.get('_step', 0):.3f} = launch "
          f"{per.get('_launch', 0):.3f} (decode {per.get('_decode', 0):.3f}, of which replay call "
          f"{per.get('run', 0):.3f}; compact {per.get('_compact', 0):.3f}) + process {per.get('_process', 0):.3f} "
          f"(its one host sync included); engine loop outside _step "
          f"{1000 * wall / args.new_tokens - per.get('_step', 0):.3f}")


if __name__ == "__main__":
    main()
