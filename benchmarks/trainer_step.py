"""Trainer step, the trainer rows of docs/design.md#9-performance-targets and issue 16:
today's PPOActor path, the packed fast path with each speed / memory switch, and the
plain HF step, side by side.

Consumes nothing (random weights from the real ``transformers`` config classes, random
token ids); emits a table on stdout and JSON to ``--out`` and ``$OUT/trainer_step.json``.
Runs, in this order (``--only`` picks groups or run names; ``--list`` prints them):

* ``check``: packed vs padded loss and gradients on one heavy-tailed batch, same weights
  (fp32 reference; bf16 figures against it and against each other).
* ``core``: Qwen2-0.5B 16 x 1024 (plain HF, today's PPOActor, fast); Qwen2.5-1.5B,
  Qwen2.5-3B, Qwen3-1.7B at 8 x 2048 (plain HF eager; fast; for 3B also with
  activation checkpointing).
* ``tail``: heavy-tailed lengths (lognormal, median 1024, sigma 1, capped at 8192),
  today's path vs fast, tokens/s on real tokens only.
* ``switches``: at 0.5B, the fast path with ONE switch changed per row.
* ``compile``: torch.compile (of each decoder layer): the fast path with compile instead
  of liger at 0.5B; the plain HF step compiled at 1.5B and 3B.
* ``example``: ``examples/gsm8k_grpo.yaml``'s actor settings (8k-token micro-batches,
  activation checkpointing, 4k logprob chunks) on its step's shape (256 x 612 tokens), then
  one change a row (no checkpointing, 32k-token micro-batches): the loop's trainer alone.
* ``fa4``: the fast path with ``attention_backend: fa4`` (needs ``pip install
  flash-attn-4``; an error row without it). Prefix sharing has its own benchmark,
  ``benchmarks/prefix_sharing.py``.

today = ``PPOActor`` as it was: right-padded HF forward, fp32 weights under bf16
autocast, foreach AdamW, PyTorch chunked logprobs. fast = packed sequences, flash varlen
attention, liger-kernel RMSNorm / rotary / SwiGLU, Triton logprob kernel keeping the
logits for backward, bf16 weights with fp32 master weights, fused AdamW (plus
``recompute_swiglu`` at >= 1.5B).
plain HF = fp32 weights, bf16 autocast, full logits + fp32 log-softmax (cross-entropy of
the sampled tokens), fused AdamW.

Each run gets a fresh model, one warm-up step (compiles; its time is reported), then
``--steps`` timed steps (median). tokens/s counts real tokens (no padding). MFU = 6·N·D /
step time / 989 TFLOP/s with N = non-embedding + LM-head parameters and D = real tokens
(attention FLOPs and recomputation not counted). Peak memory =
``torch.cuda.max_memory_allocated`` over the timed steps. A run that would start after
``--budget-s`` seconds is skipped (the table says so); a failing run records its error.

GPU (one H200; liger-kernel installed):

    python benchmarks/trainer_step.py --device cuda

CPU self-check of the plumbing (< 2 min): ``python benchmarks/trainer_step.py --tiny --device cpu``.

``--world1-ab`` (issue 25): at world size 1 the tensor / context-parallel code costs
nothing. Side by side in one process, alternating, on the ``--only`` runs (default
0.5b/fast, 1.5b/fast): A = the world-1 trainer (PPOActor, the packed forward) and B = the
same step through the parallel forward at tp = cp = 1 on a one-rank mesh
(models/parallel.py's layers and head, trainers/fsdp_actor.py's logprobs). Reports
tokens/s of both and B / A (target >= 0.98); A is today's code path (this change only
adds a host-side no-op to its packing), comparable with RESULTS.md's 0.5b/fast figures:

    python benchmarks/trainer_step.py --device cuda --world1-ab
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from engine_generate import H200_BF16_DENSE_TFLOPS, env_info, print_table, timed, write_json  # noqa: E402
from trainer_systems import (  # noqa: E402
    TINY,
    VOCAB,
    actor_config,
    actor_step,
    build,
    fixed_batch,
    heavy_tailed_batch,
    hf_plain_step,
    packed_vs_padded,
    param_counts,
)

TODAY = dict(packed_sequences=False, param_dtype="float32", autocast_dtype="bfloat16",
             fused_optimizer=False, logprob_kernel="torch")
# The Triton logprob path keeps one bf16 [C, V] buffer (not two fp32 ones): bigger chunks.
FAST = dict(packed_sequences=True, param_dtype="bfloat16", autocast_dtype="", attention_backend="auto",
            liger_kernels=True, logprob_kernel="auto", fused_optimizer=True, logprob_chunk_tokens=8192,
            logprob_keep_logits=True)
FAST_BIG = dict(FAST, recompute_swiglu=True)
# examples/gsm8k_grpo.yaml's actor on a GPU (issue 37: the loop's trainer at ~1/3 of the fast row).
EXAMPLE = dict(FAST, mb_max_tokens=8192, gradient_checkpointing=True, logprob_chunk_tokens=4096,
               logprob_keep_logits=False)
M05, M15, M3, Q3 = "qwen2-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen3-1.7b"

# (group, name, shape, batch, system, options, estimated seconds on an H200)
RUNS = [
    ("core", "0.5b/hf", M05, "16x1024", "hf", {}, 8),
    ("core", "0.5b/today", M05, "16x1024", "actor", TODAY, 8),
    ("core", "0.5b/fast", M05, "16x1024", "actor", FAST, 20),
    ("core", "1.5b/hf", M15, "8x2048", "hf", {}, 10),
    ("core", "1.5b/fast", M15, "8x2048", "actor", FAST_BIG, 12),
    ("core", "3b/hf+ac", M3, "8x2048", "hf", {"checkpointing": True}, 14),
    ("core", "3b/fast mb4k", M3, "8x2048", "actor", dict(FAST_BIG, mb_max_tokens=4096), 14),
    ("core", "3b/fast mb2k", M3, "8x2048", "actor", dict(FAST_BIG, mb_max_tokens=2048), 14),
    ("core", "3b/fast ac", M3, "8x2048", "actor", dict(FAST, gradient_checkpointing=True), 14),
    ("core", "qwen3-1.7b/hf", Q3, "8x2048", "hf", {}, 10),
    ("core", "qwen3-1.7b/fast", Q3, "8x2048", "actor", FAST_BIG, 12),
    ("tail", "0.5b/tail today", M05, "tail", "actor", TODAY, 12),
    ("tail", "0.5b/tail fast", M05, "tail", "actor", FAST, 8),
    ("tail", "1.5b/tail today", M15, "tail", "actor", TODAY, 25),
    ("tail", "1.5b/tail fast", M15, "tail", "actor", FAST_BIG, 12),
    ("switches", "0.5b/fast -liger", M05, "16x1024", "actor", dict(FAST, liger_kernels=False), 6),
    ("switches", "0.5b/fast -triton logprob", M05, "16x1024", "actor",
     dict(FAST, logprob_kernel="torch", logprob_chunk_tokens=4096), 6),
    ("switches", "0.5b/fast fp32 weights+autocast", M05, "16x1024", "actor",
     dict(FAST, param_dtype="float32", autocast_dtype="bfloat16"), 6),
    ("switches", "0.5b/fast -keep logits", M05, "16x1024", "actor", dict(FAST, logprob_keep_logits=False), 6),
    ("switches", "0.5b/fast -fused adamw", M05, "16x1024", "actor", dict(FAST, fused_optimizer=False), 6),
    ("switches", "0.5b/fast +ac", M05, "16x1024", "actor", dict(FAST, gradient_checkpointing=True), 6),
    ("switches", "0.5b/fast +ac every 2", M05, "16x1024", "actor",
     dict(FAST, gradient_checkpointing=True, gradient_checkpointing_every_n_layers=2), 6),
    ("switches", "0.5b/fast +recompute swiglu", M05, "16x1024", "actor", dict(FAST, recompute_swiglu=True), 6),
    ("switches", "0.5b/fast +offload optimizer", M05, "16x1024", "actor", dict(FAST, offload_optimizer=True), 10),
    ("switches", "0.5b/fast attention sdpa", M05, "16x1024", "actor", dict(FAST, attention_backend="sdpa"), 6),
    ("switches", "0.5b/fast -packed (padded)", M05, "16x1024", "actor",
     dict(FAST, packed_sequences=False, liger_kernels=False), 6),
    ("switches", "0.5b/fast mb 4k", M05, "16x1024", "actor", dict(FAST, mb_max_tokens=4096), 6),
    # One change at a time toward the MFU target, A/B against "fast" in the same call.
    ("tuned", "0.5b/fast -fused", M05, "16x1024", "actor", dict(FAST, fused_optimizer=False), 6),
    ("tuned", "1.5b/fast -fused", M15, "8x2048", "actor", dict(FAST_BIG, fused_optimizer=False), 12),
    ("tuned", "1.5b/fast -fused -recompute", M15, "8x2048", "actor", dict(FAST, fused_optimizer=False), 12),
    ("tuned", "3b/fast mb4k -fused", M3, "8x2048", "actor",
     dict(FAST_BIG, mb_max_tokens=4096, fused_optimizer=False), 14),
    ("tuned", "3b/fast mb8k ac/2 -fused", M3, "8x2048", "actor",
     dict(FAST, mb_max_tokens=8192, gradient_checkpointing=True, gradient_checkpointing_every_n_layers=2,
          fused_optimizer=False), 14),
    ("tuned", "qwen3-1.7b/fast -fused", Q3, "8x2048", "actor", dict(FAST_BIG, fused_optimizer=False), 12),
    # Toward 45% at 1.5B: one change from 1.5b/fast each (run with --profile to see why).
    ("explore", "1.5b/fast -recompute", M15, "8x2048", "actor", dict(FAST), 12),
    ("explore", "1.5b/fast lp chunk 16k", M15, "8x2048", "actor", dict(FAST_BIG, logprob_chunk_tokens=16384), 12),
    ("explore", "1.5b/fast -keep logits", M15, "8x2048", "actor", dict(FAST_BIG, logprob_keep_logits=False), 12),
    # FlashAttention-4 (pip install flash-attn-4; models/attention_fa4.py) against FA2 varlen, pinned
    # (with FA4 installed, "auto" is FA4).
    ("fa4", "0.5b/fast varlen", M05, "16x1024", "actor", dict(FAST, attention_backend="varlen"), 25),
    ("fa4", "1.5b/fast varlen", M15, "8x2048", "actor", dict(FAST_BIG, attention_backend="varlen"), 15),
    ("fa4", "3b/fast mb4k varlen", M3, "8x2048", "actor",
     dict(FAST_BIG, mb_max_tokens=4096, attention_backend="varlen"), 15),
    ("fa4", "0.5b/fast fa4", M05, "16x1024", "actor", dict(FAST, attention_backend="fa4"), 25),
    ("fa4", "1.5b/fast fa4", M15, "8x2048", "actor", dict(FAST_BIG, attention_backend="fa4"), 15),
    ("fa4", "3b/fast mb4k fa4", M3, "8x2048", "actor", dict(FAST_BIG, mb_max_tokens=4096, attention_backend="fa4"), 15),
    ("compile", "0.5b/fast compile", M05, "16x1024", "actor", dict(FAST, liger_kernels=False, compile_layers=True), 60),
    ("compile", "1.5b/hf compiled", M15, "8x2048", "hf", {"compiled": True}, 60),
    # The example's step in isolation: 256 sequences of 100 prompt + 512 new tokens (a random
    # model's GSM8K rows), its settings, then one change a row.
    ("example", "0.5b/example", M05, "256x612", "actor", EXAMPLE, 30),
    ("example", "0.5b/example -ac", M05, "256x612", "actor", dict(EXAMPLE, gradient_checkpointing=False), 25),
    ("example", "0.5b/example mb 32k", M05, "256x612", "actor", dict(EXAMPLE, mb_max_tokens=32768), 30),
    ("example", "0.5b/example mb 32k -ac", M05, "256x612", "actor",
     dict(EXAMPLE, mb_max_tokens=32768, gradient_checkpointing=False), 25),
    ("example", "1.5b/example", M15, "256x612", "actor", EXAMPLE, 45),
    ("example", "1.5b/example mb 32k", M15, "256x612", "actor", dict(EXAMPLE, mb_max_tokens=32768), 45),
    ("compile", "3b/hf+ac compiled", M3, "8x2048", "hf", {"checkpointing": True, "compiled": True}, 70),
]


def make_batches(tiny: bool, seed: int) -> dict:
    vocab = TINY["vocab_size"] if tiny else VOCAB
    if tiny:
        return {"16x1024": fixed_batch(4, 64, 8, vocab, seed), "8x2048": fixed_batch(2, 128, 8, vocab, seed),
                "tail": heavy_tailed_batch(8, 48, 1.0, 256, vocab, seed),
                "check": heavy_tailed_batch(4, 32, 1.0, 128, vocab, seed),
                "256x612": fixed_batch(16, 40, 8, vocab, seed)}
    return {"16x1024": fixed_batch(16, 1024, 128, vocab, seed), "8x2048": fixed_batch(8, 2048, 128, vocab, seed),
            "tail": heavy_tailed_batch(32, 1024, 1.0, 8192, vocab, seed),
            "check": heavy_tailed_batch(8, 512, 1.0, 2048, vocab, seed),
            "256x612": fixed_batch(256, 612, 100, vocab, seed)}


def cpu_safe(system: str, opts: dict) -> dict:
    """On the CPU self-check: no liger / compile (Triton needs CUDA; compile is slow)."""
    if system == "hf":
        return dict(opts, compiled=False)
    return dict(opts, liger_kernels=False, compile_layers=False)


def reset(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_one(run, batches, args) -> dict:
    group, name, shape, batch_key, system, opts, _ = run
    device = args.device
    batch = batches[batch_key]
    opts = cpu_safe(system, opts) if not device.startswith("cuda") else opts
    reset(device)
    if system == "hf":
        model = build(shape, args.tiny, torch.float32, device)
        step = hf_plain_step(model, batch, device, **opts)
        describe = ("plain HF" + (" +ac" if opts.get("checkpointing") else "")
                    + (" compiled" if opts.get("compiled") else ""))
    else:
        cfg = actor_config(device, **dict(dict(mb_max_tokens=16384, logprob_chunk_tokens=args.chunk_tokens), **opts))
        model = build(shape, args.tiny, getattr(torch, cfg.param_dtype), device)
        step, actor = actor_step(model, batch, cfg, device)
        triton_lp = cfg.logprob_kernel == "triton" or (cfg.logprob_kernel == "auto" and device.startswith("cuda"))
        describe = (actor.packed.describe() if actor.packed is not None else "padded HF forward") + \
            f" lp={'triton' if triton_lp else 'torch'} w={'bf16' if cfg.param_dtype == 'bfloat16' else 'fp32'}"
    counts = param_counts(model)
    t0 = time.perf_counter()
    step()  # warm-up: compiles (torch.compile, Triton JIT), allocates
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    reset(device)
    walls = [timed(step, device)[1] for _ in range(args.steps)]
    wall = statistics.median(walls)
    tokens = batch.real_tokens
    tflops = 6 * counts["matmul"] * tokens / wall / 1e12
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None
    if args.profile:
        profile_step(name, step, device, wall)
    return {"group": group, "shape": shape, "batch": batch.name, "system": system, "options": opts,
            "kernels": describe, "params": counts, "real_tokens": tokens, "warmup_s": round(warmup_s, 1),
            "wall_s": round(wall, 4), "wall_s_all": [round(w, 4) for w in walls],
            "tokens_per_s": round(tokens / wall, 1), "tflops_6nd": round(tflops, 1),
            "mfu": round(tflops / H200_BF16_DENSE_TFLOPS, 4), "peak_mem_gib": peak}


def profile_step(name: str, step, device: str, wall_s: float) -> None:
    """One more step under torch.profiler: the kernels that take the step's time, and how
    much of the wall the GPU is busy (the rest is launch / host time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    events = prof.key_averages()
    attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # Kernel rows only: an operator row's self device time repeats its kernels'.
    busy_us = sum(getattr(e, attr) for e in events
                  if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    print(f"--- profile {name}: GPU busy {busy_us / 1e3:.1f} ms of a {wall_s * 1e3:.1f} ms step "
          f"({100 * busy_us / 1e3 / (wall_s * 1e3):.0f}%)", flush=True)
    sort = "self_device_time_total" if attr == "self_device_time_total" else "self_cuda_time_total"
    print(events.table(sort_by=sort, row_limit=int(os.environ.get("PROFILE_ROWS", "30")),
                       max_name_column_width=70), flush=True)


def selected(args) -> list:
    keys = [k.strip() for k in args.only.split(",") if k.strip()] if args.only else []
    if not keys:
        return list(RUNS)
    return [r for r in RUNS if any(k == r[0] or fnmatch.fnmatch(r[1], k) for k in keys)]


def summary(results: dict, check: dict | None, args) -> None:
    rows = []
    for name, r in results.items():
        if "error" in r or "skipped" in r:
            rows.append([name, r.get("error", r.get("skipped"))[:60], None, None, None, None, None])
            continue
        kernels = ("FALLBACK " if "fallback_from" in r else "") + r["kernels"]
        rows.append([name, kernels[:52], r["tokens_per_s"], round(100 * r["mfu"], 1), r["peak_mem_gib"],
                     r["wall_s"], r["warmup_s"]])
    print()
    print_table(["run", "kernels / error", "tokens/s", "MFU %", "peak GiB", "step s", "warm-up s"], rows)

    def get(name, key):
        return results.get(name, {}).get(key)

    print("\nswitches at 0.5B, 16 x 1024 (one change from fast):")
    base_t, base_m = get("0.5b/fast", "wall_s"), get("0.5b/fast", "peak_mem_gib")
    srows = []
    for name, r in results.items():
        if r.get("group") == "switches" or name in ("0.5b/fast compile",):
            if "wall_s" in r and base_t:
                srows.append([name, round(r["wall_s"] / base_t, 3),
                              None if base_m is None else round(r["peak_mem_gib"] - base_m, 2)])
    print_table(["switch", "step time vs fast", "peak GiB vs fast"], srows)

    print("\ntargets:")
    today, fast = get("0.5b/today", "tokens_per_s"), get("0.5b/fast", "tokens_per_s")
    if today and fast:
        print(f"  0.5B 16x1024: fast / today = {fast / today:.2f}x (target >= 2x), "
              f"peak {get('0.5b/fast', 'peak_mem_gib')} GiB (target <= 40)")
    for name in ("1.5b/fast", "3b/fast mb4k", "3b/fast mb2k", "3b/fast ac", "qwen3-1.7b/fast"):
        if get(name, "mfu") is not None:
            print(f"  {name}: MFU {100 * get(name, 'mfu'):.1f}% (target >= 45), peak {get(name, 'peak_mem_gib')} GiB "
                  "(target <= 60)")
    for base in ("0.5b/fast", "1.5b/fast", "3b/fast mb4k"):
        a, b = get(f"{base} varlen", "tokens_per_s"), get(f"{base} fa4", "tokens_per_s")
        if a and b:
            print(f"  {base} fa4: {b / a:.2f}x tokens/s of FA2 varlen, MFU {100 * get(f'{base} fa4', 'mfu'):.1f}%")
    for size in ("0.5b", "1.5b"):
        t, f = get(f"{size}/tail today", "tokens_per_s"), get(f"{size}/tail fast", "tokens_per_s")
        if t and f:
            print(f"  {size} heavy-tailed: fast {f:,.0f} vs today {t:,.0f} real tokens/s ({f / t:.2f}x)")
    if check:
        print("\npacked vs padded, same weights and batch (relative L2 error of all gradients; loss):")
        for k, v in check.items():
            if isinstance(v, dict):
                print(f"  {k}: grad {v['grad_rel_l2']:.2e} (worst param {v['grad_rel_l2_worst_param']:.2e}, "
                      f"min cosine {v['grad_cosine_min']:.5f}), loss {v['loss_rel_diff']:.2e}")


def world1_ab(args, batches) -> dict:
    """``--world1-ab``: A (PPOActor) and B (the parallel forward at tp = cp = 1) on the same
    shapes, alternating rounds so drift in clocks or load hits both alike."""
    import torch.distributed as dist

    from tapioca.config.distributed import FSDPConfig
    from tapioca.models.parallel import MeshDims
    from tapioca.trainers.fsdp_actor import build_mesh, parallel_batch_logprobs
    from tapioca.trainers.fsdp_ranks import free_port
    from tapioca.trainers.ppo_actor import PPOActor

    class ParallelPath(PPOActor):
        def logprobs(self, batch, *, entropy=False):
            return parallel_batch_logprobs(self, batch, entropy)

    device = args.device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1)
    dims = MeshDims(build_mesh(FSDPConfig(), torch.device(device)), tp=1, cp=1)
    names = [k.strip() for k in args.only.split(",") if k.strip()] or ["0.5b/fast", "1.5b/fast"]
    out: dict[str, dict] = {}
    for run in (r for r in RUNS if r[1] in names):
        _, name, shape, batch_key, _, opts, _ = run
        opts = cpu_safe("actor", opts) if not device.startswith("cuda") else opts
        batch = batches[batch_key]
        cfg = actor_config(device, **dict(dict(mb_max_tokens=16384, logprob_chunk_tokens=args.chunk_tokens), **opts))
        steps = {}
        for label, cls, kw in (("A", PPOActor, {}), ("B", ParallelPath, {"parallel": dims})):
            model = build(shape, args.tiny, getattr(torch, cfg.param_dtype), device)
            actor = cls(model, cfg, temperature=1.0, pad_token_id=0, device=device, **kw)
            items = batch.items(model.config.vocab_size)
            steps[label] = lambda actor=actor, items=items: actor.train_step(items, policy_version=0).n_tokens
            steps[label]()  # warm-up
        walls: dict[str, list[float]] = {"A": [], "B": []}
        for _ in range(max(3, args.steps)):
            for label in ("A", "B"):
                walls[label].append(timed(steps[label], device)[1])
        tps = {k: batch.real_tokens / statistics.median(v) for k, v in walls.items()}
        out[name] = {"tokens_per_s_A": round(tps["A"], 1), "tokens_per_s_B": round(tps["B"], 1),
                     "B_over_A": round(tps["B"] / tps["A"], 4), "walls": walls}
        print(name, out[name], flush=True)
        del steps
        reset(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU self-check)")
    ap.add_argument("--only", default="", help="comma list of groups (check, core, tail, switches, example, "
                                                 "compile) or run-name globs, e.g. '1.5b/*'")
    ap.add_argument("--list", action="store_true", help="print the runs and exit")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up")
    ap.add_argument("--chunk-tokens", type=int, default=4096,
                    help="actor.logprob_chunk_tokens where a run does not set it (today: 4096; fast: 8192)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="skip runs whose estimated end passes this many seconds from the start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--profile", action="store_true",
                    help="after each run's timings, profile one more step (torch.profiler) and print "
                         "its top kernels")
    ap.add_argument("--world1-ab", action="store_true",
                    help="the world-1 trainer vs the tensor / context-parallel forward at tp = cp = 1, "
                         "side by side (issue 25)")
    args = ap.parse_args()
    if args.world1_ab:
        result = world1_ab(args, make_batches(args.tiny, args.seed))
        payload = {"benchmark": "trainer_step_world1_ab", "env": env_info(args.device), "results": result}
        write_json(args.out, payload)
        if os.environ.get("OUT"):
            write_json(str(Path(os.environ["OUT"]) / "trainer_step_world1_ab.json"), payload)
        return
    runs = selected(args)
    want_check = not args.only or any(k.strip() == "check" for k in args.only.split(","))
    if args.list:
        for r in runs:
            print(f"{r[0]:9s} {r[1]:34s} {r[2]:13s} {r[3]:8s} ~{r[6]} s")
        return
    start = time.perf_counter()
    print(f"{env_info(args.device)}; {len(runs)} runs{' + check' if want_check else ''}; budget {args.budget_s:g} s",
          flush=True)
    batches = make_batches(args.tiny, args.seed)
    check = None
    if want_check:
        for liger in ([True, False] if args.device.startswith("cuda") else [False]):
            try:
                check = dict(packed_vs_padded("qwen2-0.5b", args.tiny, batches["check"], args.device, liger=liger),
                             batch=batches["check"].name, liger=liger, error_with_liger=(check or {}).get("error"))
                print("check", check, flush=True)
                break
            except Exception as e:  # noqa: BLE001 -- report and go on with the timings
                check = {"error": f"{type(e).__name__}: {e}"[:500]}
                print("check failed:", check["error"], flush=True)
                reset(args.device)
        reset(args.device)
    results: dict[str, dict] = {}
    for run in runs:
        name, est = run[1], run[6]
        elapsed = time.perf_counter() - start
        if not args.tiny and elapsed + est > args.budget_s:
            results[name] = {"group": run[0], "skipped": f"time budget ({elapsed:.0f} s + ~{est} s)"}
            print(name, results[name], flush=True)
            continue
        try:
            results[name] = run_one(run, batches, args)
        except Exception as e:  # noqa: BLE001 -- an OOM or a kernel failure is a result too
            results[name] = {"group": run[0], "error": f"{type(e).__name__}: {e}"[:500]}
            opts = run[5]
            if run[4] == "actor" and not isinstance(e, torch.cuda.OutOfMemoryError) and (
                    opts.get("liger_kernels") or opts.get("logprob_kernel", "auto") != "torch"):
                # A Triton kernel (liger's or ours) failed here: measure the rest anyway.
                reset(args.device)
                retry = run[:5] + (dict(opts, liger_kernels=False, logprob_kernel="torch"),) + run[6:]
                try:
                    results[name] = dict(run_one(retry, batches, args), fallback_from=results[name]["error"])
                except Exception as e2:  # noqa: BLE001
                    results[name]["retry_error"] = f"{type(e2).__name__}: {e2}"[:500]
        finally:
            if run[1].endswith("compile") or run[1].endswith("compiled"):
                torch._dynamo.reset()
            reset(args.device)
        print(name, results[name], f"[{time.perf_counter() - start:.0f} s]", flush=True)
    summary(results, check, args)
    payload = {"benchmark": "trainer_step", "env": env_info(args.device),
               "elapsed_s": round(time.perf_counter() - start, 1),
               "peak_tflops": H200_BF16_DENSE_TFLOPS, "steps": args.steps, "chunk_tokens": args.chunk_tokens,
               "batches": {k: {"name": b.name, "real_tokens": b.real_tokens, "lengths": [len(r) for r in b.ids]}
                           for k, b in batches.items()},
               "check": check, "results": results}
    write_json(args.out, payload)
    if os.environ.get("OUT"):
        write_json(str(Path(os.environ["OUT"]) / "trainer_step.json"), payload)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
