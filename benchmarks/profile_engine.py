"""Where an engine's decode step spends its time: ``torch.profiler`` over one
``engine.generate`` of the engine_generate.py workload (a), smaller by default;
``--engine torch`` (TorchEngine, the default) or ``paged`` (PagedEngine).

Consumes nothing (random weights); prints the wall time per decode step, the GPU's
busy time over the profiled run (kernel time / wall: far below 1 means the step is
bound by the CPU side -- Python, transformers' per-layer code, launches), the top
kernels, and the top CPU operators (the engine runs on its own thread, so the profiler
follows all threads). On the GPU box:

    python benchmarks/profile_engine.py --device cuda --n-seqs 256 --new-tokens 64
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


if __name__ == "__main__":
    main()
