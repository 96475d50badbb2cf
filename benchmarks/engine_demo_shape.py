"""The rollout engines alone on the CPU demo's shape: PagedEngine vs TorchEngine, one process.

Consumes nothing; emits a table and JSON (``--out``, or ``$OUT/engine_demo_shape.json``).
The shape of ``examples/demo_cpu.yaml``: the tiny Qwen2 (2 layers, width 64, 4/2 heads,
the synthetic task's 30-token vocabulary), ``--prompts`` groups x ``--samples`` samples
of ~12-token prompts, ``--new-tokens`` new tokens at temperature 1, ``max_batch_size``
512, one intra-op thread; each round submits every group with ``submit_all`` (as the
rollout worker does) and waits for all. Reports wall and process CPU seconds per round
(the CPU time is the steadier figure on a shared machine).

    python benchmarks/engine_demo_shape.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_generate import env_info, out_path, print_table, write_json  # noqa: E402

from tapioca.engines import GenRequest, PagedEngine, SamplingParams, TorchEngine  # noqa: E402
from tapioca.models.factory import build_tiny_model  # noqa: E402


def rounds(engine, n_rounds: int, args, gen: torch.Generator) -> tuple[float, float]:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(n_rounds):
        futures = []
        for g in range(args.prompts):
            prompt = torch.randint(3, 30, (args.prompt_len,), generator=gen).tolist()
            futures += engine.submit_all([GenRequest(f"{k}-{g}-{i}", prompt, sampling)
                                          for i in range(args.samples)])
        for f in futures:
            f.result()
    return (time.perf_counter() - t0) / n_rounds, (time.process_time() - c0) / n_rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_model(30, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=256, max_position_embeddings=256, seed=0)
    results = {}
    for name, cls in (("torch", TorchEngine), ("paged", PagedEngine)):
        engine = cls(model, max_batch_size=512, seed=0)
        try:
            gen = torch.Generator().manual_seed(0)
            rounds(engine, 2, args, gen)  # warm-up
            wall, cpu = rounds(engine, args.rounds, args, gen)
        finally:
            engine.shutdown()
        results[name] = {"wall_ms_per_round": round(wall * 1000, 1), "cpu_ms_per_round": round(cpu * 1000, 1)}
        print(name, results[name], flush=True)
    print()
    print_table(["engine", "wall ms / round", "CPU ms / round"],
                [[k, r["wall_ms_per_round"], r["cpu_ms_per_round"]] for k, r in results.items()])
    write_json(out_path(args, "engine_demo_shape"), {"benchmark": "engine_demo_shape", "env": env_info("cpu"),
                                                     "config": vars(args), "results": results})


if __name__ == "__main__":
    main()
