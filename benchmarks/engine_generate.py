"""Rollout generation, the rollout row of docs/design.md#9-performance-targets (issue 14):
the paged engine, TorchEngine, HF ``generate`` and HF ``generate`` with a static cache +
``torch.compile``, side by side in one process.

Consumes nothing (random weights, random prompt ids); emits a table on stdout and a JSON
file (``--out``, or ``$OUT/engine_generate.json`` when ``$OUT`` is set). Model: a
Qwen2-0.5B-shaped causal LM (24 layers, width 896, 14/2 heads, vocab 151,936, tied
embeddings; :func:`tapioca.models.factory.build_tiny_model`), random weights in
``--dtype``, sdpa attention, no eos (every sequence runs to its length; checked).

Workloads (``--workloads``, default all):
  a  fixed: ``--n-seqs`` prompts of ``--prompt-len`` random ids, ``--new-tokens`` new each
     (256 x (128 + 256)), temperature 1;
  b  nano-vllm's bench: ``--nano-seqs`` sequences, prompt and output lengths uniform in
     [``--nano-min-len``, ``--nano-max-len``], ids < 10,000, temperature 0.6, ignore eos;
  c  GRPO: ``--grpo-prompts`` prompts x ``--grpo-samples`` samples of the same prompt ids,
     ``--prompt-len`` + ``--new-tokens``, temperature 1. Reports prefill tokens computed vs
     requested (the paged engine prefills a group's prompt once; the others every sample).
Systems (``--systems``, default all, run in this order per workload):
  hf         one batched ``model.generate(do_sample=True)`` (prompts left-padded; with
             per-row lengths (b) it generates the longest and only the requested tokens
             count);
  hf_static  the same with ``cache_implementation="static"`` and transformers' automatic
             ``torch.compile`` of the decode step (fullgraph, mode reduce-overhead; CUDA
             only, eager static cache on CPU). On (b) only with ``--hf-static-nano``: the
             new shapes cost a second compile;
  torch      TorchEngine (``engine.generate``, ``max_batch_size`` = the rows);
  paged      PagedEngine (the same API; KV cache of ``--kv-cache-tokens``).
Every system gets one warm-up run (compiles, graph captures) and ``--repeats`` timed runs
(median) -- except hf and torch on (b), timed cold (``--warmup-nano`` to warm them: their
(b) runs are the longest of the benchmark). tokens/s = new tokens / wall seconds; peak
memory = ``torch.cuda.max_memory_allocated`` over the timed runs (weights and the paged
engine's preallocated KV cache included).

For the paged engine also: ms per decode step (end to end from the engine's own
counters; and one CUDA-graph replay of the 256-row step, timed and under
``torch.profiler`` for kernels per step, next to the same step run eagerly), and the
training-inference agreement: mean / max |logprob(engine) - logprob(trainer forward)|
over the output tokens of ``--agreement-seqs`` sequences of (a), for a trainer forward
in bf16 (the bf16 model under autocast, as the trainer with ``autocast_dtype``) and in
fp32 (an fp32 copy of the model).

On the GPU box (~5 min; see docs/engine.md for the expected numbers):

    python benchmarks/engine_generate.py --device cuda

CPU self-check (~1 min): ``python benchmarks/engine_generate.py --tiny --device cpu``.
``benchmarks/trainer_step.py`` imports the model / CLI helpers below.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tapioca.engines.attention import use_decode_attention
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.torch_engine import TorchEngine
from tapioca.models.factory import build_tiny_model

# Qwen2-0.5B's published shape (as benchmarks/gpu_rl_loop.py builds it); head_dim 64.
QWEN2_05B_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                       num_heads=14, num_kv_heads=2, max_position_embeddings=32768)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=4096)
H200_BF16_DENSE_TFLOPS = 989.0
SYSTEMS = ("hf", "hf_static", "torch", "paged")
NAMES = {"hf": "HF generate", "hf_static": "HF static+compile", "torch": "TorchEngine",
         "paged": "PagedEngine"}


# ------------------------------------------------------------------ shared helpers

def build_model(tiny: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Random-weight Qwen2-shaped causal LM (seed 0) with sdpa attention, on ``device``."""
    shape = dict(TINY_SHAPE if tiny else QWEN2_05B_SHAPE)
    vocab = shape.pop("vocab_size")
    # No eos / pad in the config: generation must run to max_new_tokens.
    model = build_tiny_model(vocab, seed=0, dtype=dtype, **shape)
    model.set_attn_implementation("sdpa")  # no flash-attn on the GPU box
    return model.to(device)


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny model and sizes (a CPU self-check in < 1 min)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="write the results as JSON here")


def fill_defaults(args: argparse.Namespace, full: dict, tiny: dict) -> argparse.Namespace:
    """Flags left at None take the full-size or the --tiny default."""
    defaults = tiny if args.tiny else full
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None  # CPU: no allocator statistics
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def timed(fn: Callable[[], int], device: str) -> tuple[int, float]:
    """``(fn(), wall seconds)`` with the device synchronised on both ends."""
    sync(device)
    t0 = time.perf_counter()
    n = fn()
    sync(device)
    return n, time.perf_counter() - t0


def measure(fn: Callable[[], int], device: str, repeats: int, warmup: bool = True,
            after_warmup: Callable[[], None] | None = None) -> dict:
    """One warm-up call (unless ``warmup`` is False), then ``after_warmup()``, then
    ``repeats`` timed calls; ``fn`` returns its token count."""
    if warmup:
        fn()
    if after_warmup is not None:
        after_warmup()
    reset_peak(device)
    runs = [timed(fn, device) for _ in range(repeats)]
    walls = [w for _, w in runs]
    tokens = runs[0][0]
    wall = statistics.median(walls)
    return {"tokens": tokens, "wall_s": round(wall, 3), "wall_s_all": [round(w, 3) for w in walls],
            "tokens_per_s": round(tokens / wall, 1), "peak_mem_gib": peak_gib(device),
            "warm": warmup}


def env_info(device: str) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [header] + [["-" if v is None else (f"{v:,}" if isinstance(v, (int, float)) else str(v))
                         for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


def out_path(args: argparse.Namespace, name: str) -> str:
    """``--out``, else ``$OUT/<name>.json`` when ``$OUT`` is set, else nothing."""
    if args.out:
        return args.out
    return str(Path(os.environ["OUT"]) / f"{name}.json") if os.environ.get("OUT") else ""


# ------------------------------------------------------------------ workloads

@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # one per sequence (a group's samples repeat its prompt)
    new_tokens: list[int]  # per sequence
    temperature: float

    vocab: int = 0

    @property
    def rows(self) -> int:
        return len(self.prompts)

    def prompts_for(self, call: int) -> list[list[int]]:
        """The prompts of timed call ``call``: the same lengths (and groups), other ids, so no
        call reuses the paged engine's prefix cache of an earlier one."""
        return [[(t + 7919 * call) % self.vocab for t in p] for p in self.prompts]

    @property
    def prefill_tokens_requested(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workloads(args: argparse.Namespace, vocab: int) -> dict[str, Workload]:
    rng = random.Random(args.seed)
    out: dict[str, Workload] = {}
    if "a" in args.workloads:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.n_seqs)]
        out["a"] = Workload("a", prompts, [args.new_tokens] * args.n_seqs, 1.0, vocab)
    if "b" in args.workloads:
        lo, hi = args.nano_min_len, args.nano_max_len
        ids = min(vocab, 10000)
        prompts = [[rng.randrange(ids) for _ in range(rng.randint(lo, hi))] for _ in range(args.nano_seqs)]
        out["b"] = Workload("b", prompts, [rng.randint(lo, hi) for _ in range(args.nano_seqs)], 0.6, vocab)
    if "c" in args.workloads:
        prompts = []
        for _ in range(args.grpo_prompts):
            p = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            prompts += [p] * args.grpo_samples
        out["c"] = Workload("c", prompts, [args.new_tokens] * len(prompts), 1.0, vocab)
    return out


# ------------------------------------------------------------------ systems

def hf_fn(model, w: Workload, device: str, seed: int, static: bool) -> Callable[[], int]:
    """One batched ``generate`` over the whole workload (left-padded prompts)."""
    from transformers import CompileConfig

    length = max(len(p) for p in w.prompts)
    max_new = max(w.new_tokens)
    calls = iter(range(10**9))
    kwargs: dict = {}
    if static:
        kwargs["cache_implementation"] = "static"
        if device.startswith("cuda"):
            kwargs["compile_config"] = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
        else:
            kwargs["disable_compile"] = True

    def run() -> int:
        ids_BT = torch.zeros(w.rows, length, dtype=torch.long)
        mask_BT = torch.zeros(w.rows, length, dtype=torch.long)
        for i, p in enumerate(w.prompts_for(next(calls))):
            ids_BT[i, length - len(p):] = torch.tensor(p)
            mask_BT[i, length - len(p):] = 1
        ids_BT, mask_BT = ids_BT.to(device), mask_BT.to(device)
        model.set_attn_implementation("sdpa")  # TorchEngine switches it to its own decode attention
        torch.manual_seed(seed)
        with torch.inference_mode():
            out_BT = model.generate(
                input_ids=ids_BT, attention_mask=mask_BT, do_sample=True, temperature=w.temperature,
                top_p=1.0, top_k=0,  # HF defaults top_k to 50
                max_new_tokens=max_new, pad_token_id=0, **kwargs)
        n_new = out_BT.shape[1] - length
        if n_new != max_new:
            raise RuntimeError(f"HF generate stopped at {n_new} of {max_new} new tokens")
        return sum(w.new_tokens)  # only the requested tokens count
    return run


def engine_fn(engine, w: Workload, model=None) -> Callable[[], int]:
    calls = iter(range(10**9))
    samplings = {n: SamplingParams(temperature=w.temperature, top_p=1.0, top_k=0, max_new_tokens=n)
                 for n in set(w.new_tokens)}

    def run() -> int:
        if model is not None:
            use_decode_attention(model)  # undo the HF runs' reset (TorchEngine only)
        call = next(calls)
        results = engine.generate([GenRequest(f"bench-{w.name}{call}:{i}", p, samplings[n])
                                   for i, (p, n) in enumerate(zip(w.prompts_for(call), w.new_tokens))])
        short = [r.request_id for r, n in zip(results, w.new_tokens) if len(r.output_ids) != n]
        if short:
            raise RuntimeError(f"{type(engine).__name__} stopped {len(short)} sequences early, e.g. {short[:3]}")
        run.last = results  # type: ignore[attr-defined]
        return sum(len(r.output_ids) for r in results)
    return run


# ------------------------------------------------------------------ paged engine extras

def decode_step_profile(engine: PagedEngine, rows: int, device: str, replays: int) -> dict:
    """One decode step of ``rows`` rows: graph replay time, kernels per replay (profiler),
    and the same step run eagerly."""
    if not device.startswith("cuda"):
        return {}
    keys = [k for k in engine.graphs.keys() if k[0] == engine.graphs.rows_for(rows) and k[2]]
    if not keys:
        return {"note": f"no captured {rows}-row graph"}
    key = max(keys, key=lambda k: k[1])
    for _ in range(3):
        engine.graphs.replay(key)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(replays):
        engine.graphs.replay(key)
    sync(device)
    graph_ms = (time.perf_counter() - t0) / replays * 1000
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            engine.graphs.replay(key)
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    busy_ms = sum(e.device_time_total for e in kernels) / 1000 / replays
    with torch.inference_mode():
        engine.graphs.eager_step(key[0], key[1])
        sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            engine.graphs.eager_step(key[0], key[1])
        sync(device)
        eager_ms = (time.perf_counter() - t0) / 3 * 1000
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as eager_prof:
            engine.graphs.eager_step(key[0], key[1])
            sync(device)
    # The same kernels as the graph's; a cross-check when the profiler does not see inside graphs.
    eager_kernels = [e for e in eager_prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and not e.name.startswith(("Memcpy", "Memset"))]
    top: dict[str, float] = {}
    for e in kernels:
        top[e.name] = top.get(e.name, 0.0) + e.device_time_total / 1000 / replays
    return {"rows": key[0], "block_table_width": key[1], "graph_replay_ms": round(graph_ms, 3),
            "kernels_per_step": round(len(kernels) / replays, 1), "kernel_busy_ms": round(busy_ms, 3),
            "eager_step_ms": round(eager_ms, 3), "kernels_per_step_eager": len(eager_kernels),
            "top_kernels_ms": {k[:80]: round(v, 3) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:8]}}


def agreement(model, results, temperature: float, device: str, n_seqs: int) -> dict:
    """|engine behaviour logprob - trainer-forward logprob| over output tokens."""
    from tapioca.models.forward import autocast_context, causal_token_logprobs

    results = results[:n_seqs]
    length = max(len(r.prompt_ids) + len(r.output_ids) for r in results)
    ids_BT = torch.zeros(len(results), length, dtype=torch.long)
    mask_BT = torch.zeros_like(ids_BT)
    labels_BT = torch.full((len(results), length - 1), -100, dtype=torch.long)
    engine_BT = torch.zeros(len(results), length - 1)
    for i, r in enumerate(results):
        seq = r.prompt_ids + r.output_ids
        p, n = len(r.prompt_ids), len(r.output_ids)
        ids_BT[i, : len(seq)] = torch.tensor(seq)
        mask_BT[i, : len(seq)] = 1
        labels_BT[i, p - 1 : p - 1 + n] = torch.tensor(r.output_ids)
        engine_BT[i, p - 1 : p - 1 + n] = torch.tensor(r.output_logprobs)
    scored = labels_BT != -100
    model.set_attn_implementation("sdpa")
    out = {}
    fp32 = copy.deepcopy(model).float() if next(model.parameters()).dtype != torch.float32 else model
    for name, m, autocast in (("bf16", model, "bfloat16" if device.startswith("cuda") else ""),
                              ("fp32", fp32, "")):
        with torch.no_grad(), autocast_context(device, autocast):
            lp_BT, _ = causal_token_logprobs(m, ids_BT.to(device), mask_BT.to(device), labels_BT.to(device),
                                             temperature=temperature, chunk_tokens=4096)
        diff = (lp_BT.float().cpu() - engine_BT).abs()[scored]
        out[name] = {"mean_abs_diff": float(diff.mean()), "max_abs_diff": float(diff.max()),
                     "tokens": int(scored.sum())}
    del fp32
    return out


# ------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--workloads", default="abc", help="any of a, b, c")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--n-seqs", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--nano-seqs", type=int, default=None)
    ap.add_argument("--nano-min-len", type=int, default=None)
    ap.add_argument("--nano-max-len", type=int, default=None)
    ap.add_argument("--grpo-prompts", type=int, default=None)
    ap.add_argument("--grpo-samples", type=int, default=None)
    ap.add_argument("--hf-static-nano", action="store_true", help="also run hf_static on (b)")
    ap.add_argument("--warmup-nano", action="store_true", help="warm hf and torch up on (b) too")
    ap.add_argument("--kv-cache-tokens", type=int, default=0,
                    help="paged engine's KV cache (0: what the largest workload needs, +10%%)")
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--agreement-seqs", type=int, default=32)
    ap.add_argument("--profile-replays", type=int, default=10)
    args = fill_defaults(ap.parse_args(),
                         full=dict(n_seqs=256, prompt_len=128, new_tokens=256, repeats=1, nano_seqs=256,
                                   nano_min_len=100, nano_max_len=1024, grpo_prompts=32, grpo_samples=8),
                         tiny=dict(n_seqs=16, prompt_len=16, new_tokens=32, repeats=1, nano_seqs=16,
                                   nano_min_len=8, nano_max_len=64, grpo_prompts=4, grpo_samples=4))
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; use {', '.join(SYSTEMS)}")
    dev = args.device
    dtype = getattr(torch, args.dtype)
    model = build_model(args.tiny, dtype, dev)
    workloads = make_workloads(args, model.config.vocab_size)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.dtype}, {dev}; "
          + "; ".join(f"({w.name}) {w.rows} seqs, {w.prefill_tokens_requested} prompt + "
                      f"{sum(w.new_tokens)} new tokens" for w in workloads.values()), flush=True)
    max_rows = max(w.rows for w in workloads.values())
    cache_tokens = args.kv_cache_tokens or int(1.1 * max(
        sum(len(p) + n for p, n in zip(w.prompts, w.new_tokens)) for w in workloads.values()))

    torch_engine = paged = None
    results: dict[str, dict[str, dict]] = {}
    extras: dict[str, dict] = {}
    try:
        for w in workloads.values():
            res = results.setdefault(w.name, {})
            nano = w.name == "b"
            for system in systems:
                t_sys = time.perf_counter()
                if system in ("hf", "hf_static"):
                    if system == "hf_static" and nano and not args.hf_static_nano:
                        continue
                    fn = hf_fn(model, w, dev, args.seed, static=system == "hf_static")
                    res[system] = measure(fn, dev, args.repeats, warmup=not nano or args.warmup_nano
                                          or system == "hf_static")
                elif system == "torch":
                    if torch_engine is None:
                        torch_engine = TorchEngine(model, device=dev, max_batch_size=max_rows, seed=args.seed)
                    res[system] = measure(engine_fn(torch_engine, w, model), dev, args.repeats,
                                          warmup=not nano or args.warmup_nano)
                else:
                    if paged is None:
                        reset_peak(dev)
                        paged = PagedEngine(model, device=dev, max_batch_size=max_rows, seed=args.seed,
                                            kv_cache_tokens=cache_tokens,
                                            max_prefill_tokens=args.max_prefill_tokens,
                                            cuda_graphs=not args.no_cuda_graphs)
                        extras["paged_kv_cache_gib"] = round(paged.kv_cache.numel()
                                                             * paged.kv_cache.element_size() / 2**30, 2)
                    fn = engine_fn(paged, w)
                    # The engine's counters over the timed runs only: the warm-up's steps
                    # include the CUDA graph captures (3.8 ms a step on (a) before this).
                    marks = []
                    res[system] = measure(fn, dev, args.repeats, after_warmup=lambda: marks.append(paged.stats()))
                    before, after = marks[0], paged.stats()
                    runs = args.repeats
                    res[system]["prefill_tokens_computed"] = (
                        after["prefill_tokens_computed"] - before["prefill_tokens_computed"]) // runs
                    steps = after["decode_only_steps"] - before["decode_only_steps"]
                    res[system]["decode_step_ms"] = round(
                        (after["decode_only_step_ms"] * after["decode_only_steps"]
                         - before["decode_only_step_ms"] * before["decode_only_steps"]) / max(1, steps), 3)
                    res[system]["cuda_graphs"] = after["cuda_graphs"]
                    if w.name == "a":
                        extras["decode_step"] = decode_step_profile(paged, w.rows, dev, args.profile_replays)
                        extras["agreement"] = agreement(model, fn.last, w.temperature, dev, args.agreement_seqs)
                if system in res:
                    res[system].setdefault("prefill_tokens_computed", w.prefill_tokens_requested)
                    res[system]["prefill_tokens_requested"] = w.prefill_tokens_requested
                    res[system]["system_wall_s"] = round(time.perf_counter() - t_sys, 1)
                    print(f"({w.name}) {system}", json.dumps(res[system]), flush=True)
    finally:
        for engine in (torch_engine, paged):
            if engine is not None:
                engine.shutdown()

    print()
    rows = []
    for wname, res in results.items():
        for system, r in res.items():
            rows.append([f"({wname}) {NAMES[system]}", r["tokens"], r["wall_s"], r["tokens_per_s"],
                         r["peak_mem_gib"], f"{r['prefill_tokens_computed']:,}/{r['prefill_tokens_requested']:,}",
                         r.get("decode_step_ms")])
    print_table(["workload / system", "new tokens", "wall s", "tokens/s", "peak GiB",
                 "prefill computed/requested", "ms/decode step"], rows)
    ratios = {}
    for wname, res in results.items():
        if "paged" in res:
            ratios[wname] = {f"paged_over_{s}": round(res["paged"]["tokens_per_s"] / r["tokens_per_s"], 2)
                             for s, r in res.items() if s != "paged"}
    print("\nspeed-ups of the paged engine:", json.dumps(ratios))
    if "decode_step" in extras:
        print("decode step (paged, CUDA graph):", json.dumps(extras["decode_step"]))
    if "agreement" in extras:
        print("training-inference |delta logprob| (engine vs trainer forward):", json.dumps(extras["agreement"]))
    print("(issue 14 target: (a) >= 100k tok/s end to end, >= 4x HF static+compile)")
    write_json(out_path(args, "engine_generate"), {
        "benchmark": "engine_generate", "env": env_info(dev),
        "config": {k: v for k, v in vars(args).items() if k != "out"}, "kv_cache_tokens": cache_tokens,
        "results": results, "ratios": ratios, **extras})


if __name__ == "__main__":
    main()
