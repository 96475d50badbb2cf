"""The paged engine's fused ops (engines/kernels/): Triton vs the plain-PyTorch reference.

Consumes nothing (random tensors at Qwen2-0.5B's shapes: hidden 896, 14 query / 2 KV
heads, head_dim 64, intermediate 4864, vocab 151936, 24 layers, bf16, block_size 16,
256 decode rows). For every op: checks the Triton output against the fp32 reference
(relative error), times both (``triton.testing.do_bench``, median, L2 flushed between
calls) and prints the bytes the op must move and the GB/s it reached, against the
~4.3 TB/s copy bandwidth of an H200. Then one decode step's worth of these ops
(24 x [2 rms_norm, rope + cache write, decode attention, silu_and_mul] + final norm +
sampling; matmuls excluded) summed from the per-op medians and measured as one CUDA
graph. ``--configs`` adds a bounded sweep of tile sizes / warps / stages / splits for
the attention and sampling kernels (it stops at ``--budget-s`` of wall time). Prints a
table at the end; writes ``$OUT/kernels.json`` when ``$OUT`` is set.

    python benchmarks/engine_kernels.py                 # ~1-2 min on an H200
    python benchmarks/engine_kernels.py --configs       # ~3-4 min
    python benchmarks/engine_kernels.py --smoke         # tiny shapes on the CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

COPY_GBPS = 4300.0  # measured copy bandwidth of the H200 (the floor every op is held to)


@dataclass
class Shape:
    rows: int = 256
    hidden: int = 896
    heads: int = 14
    kv_heads: int = 2
    head_dim: int = 64
    inter: int = 4864
    vocab: int = 151936
    layers: int = 24
    block: int = 16
    contexts: tuple[int, ...] = (384, 2048)
    small_rows: int = 32  # a decode tail: few rows, long context (split-K)
    prefill_seqs: int = 256
    prefill_len: int = 128
    eps: float = 1e-6


SMOKE = Shape(rows=4, hidden=64, heads=14, kv_heads=2, head_dim=16, inter=48, vocab=300, layers=2,
              block=4, contexts=(20, 40), small_rows=2, prefill_seqs=3, prefill_len=9)


@dataclass
class Row:
    op: str
    case: str
    bytes: float
    triton_us: float | None = None
    reference_us: float | None = None
    rel_err: float | None = None
    ok: bool | None = None
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.triton_us / 1e3 if self.triton_us else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", action="store_true", help="sweep attention / sampling tile configs")
    ap.add_argument("--budget-s", type=float, default=230.0, help="wall-time cap of the whole run with --configs")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--no-reference-graph", action="store_true", help="skip the reference decode-step graph")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated
    global torch, triton, R, TA, TN, TR, TS
    import torch
    import triton

    from tapioca.engines.kernels import reference as R
    from tapioca.engines.kernels import triton_attention as TA
    from tapioca.engines.kernels import triton_norm_act as TN
    from tapioca.engines.kernels import triton_rope as TR
    from tapioca.engines.kernels import triton_sampling as TS

    if args.smoke:
        _interpreter_numpy24_fix()
        shape, dev = SMOKE, torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            sys.exit("needs CUDA (or --smoke for a CPU check of this script)")
        shape, dev = Shape(), torch.device("cuda")
    start = time.perf_counter()
    bench = Bench(dev, quick=args.smoke)
    torch.manual_seed(0)
    rows: list[Row] = []
    rows += bench_norm_act(bench, shape, dev)
    rows.append(bench_rope(bench, shape, dev))
    for ctx in shape.contexts:
        rows.append(bench_decode(bench, shape, dev, shape.rows, ctx))
    rows.append(bench_decode(bench, shape, dev, shape.small_rows, shape.contexts[-1]))
    rows.append(bench_prefill(bench, shape, dev))
    rows.append(bench_sample(bench, shape, dev))
    steps = [decode_step(bench, shape, dev, rows, ctx, reference_graph=not args.no_reference_graph)
             for ctx in shape.contexts]
    sweep = run_sweep(bench, shape, dev, start, args.budget_s) if args.configs else []
    report(rows, steps, sweep, shape, time.perf_counter() - start)


# -- timing --------------------------------------------------------------------------------

class Bench:
    def __init__(self, dev, quick: bool) -> None:
        self.dev, self.quick = dev, quick

    def time_us(self, fn, rep_ms: int = 100) -> float:
        if self.dev.type == "cuda":
            return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3
        times = []
        for _ in range(1 if self.quick else 5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _dtype(dev):
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


# -- ops -----------------------------------------------------------------------------------

def bench_norm_act(bench: Bench, s: Shape, dev) -> list[Row]:
    dt = _dtype(dev)
    x = torch.randn(s.rows, s.hidden, device=dev).to(dt)
    res = torch.randn(s.rows, s.hidden, device=dev).to(dt)
    w = (1 + 0.1 * torch.randn(s.hidden, device=dev)).to(dt)
    out, r = TN.rms_norm(x, w, s.eps, res)
    ref_out, ref_r = R.rms_norm(x.float(), w.float(), s.eps, res.float())
    norm = Row("rms_norm+residual", f"{s.rows}x{s.hidden}", bytes=(4 * s.rows * s.hidden + s.hidden) * x.element_size(),
               triton_us=bench.time_us(lambda: TN.rms_norm(x, w, s.eps, res)),
               reference_us=bench.time_us(lambda: R.rms_norm(x, w, s.eps, res)),
               rel_err=max(rel_err(out, ref_out), rel_err(r, ref_r)))
    gate_up = torch.randn(s.rows, 2 * s.inter, device=dev).to(dt)
    act = Row("silu_and_mul", f"{s.rows}x{s.inter}", bytes=3 * s.rows * s.inter * gate_up.element_size(),
              triton_us=bench.time_us(lambda: TN.silu_and_mul(gate_up)),
              reference_us=bench.time_us(lambda: R.silu_and_mul(gate_up)),
              rel_err=rel_err(TN.silu_and_mul(gate_up), R.silu_and_mul(gate_up.float())))
    return [norm, act]


def _rope_inputs(s: Shape, dev, tokens: int, num_blocks: int):
    dt = _dtype(dev)
    qkv = torch.randn(tokens, (s.heads + 2 * s.kv_heads) * s.head_dim, device=dev).to(dt)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, s.head_dim, 2, device=dev).float() / s.head_dim))
    angles = torch.arange(4096, device=dev).float()[:, None] * inv_freq[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), device=dev)
    slots = torch.randperm(num_blocks * s.block, device=dev)[:tokens]
    k_cache = torch.zeros(num_blocks, s.block, s.kv_heads, s.head_dim, device=dev, dtype=dt)
    return qkv, table, positions, slots, k_cache, torch.zeros_like(k_cache)


def _split_qkv(s: Shape, qkv):
    sizes = [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim]
    return [t.view(qkv.shape[0], -1, s.head_dim) for t in qkv.split(sizes, dim=-1)]


def bench_rope(bench: Bench, s: Shape, dev) -> Row:
    qkv, table, positions, slots, k_cache, v_cache = _rope_inputs(s, dev, s.rows, s.rows // s.block + 8)
    outs = []
    for impl, dtype in ((TR, qkv.dtype), (R, torch.float32)):
        qkv_i, kc, vc = qkv.clone().to(dtype), k_cache.clone().to(dtype), v_cache.clone().to(dtype)
        impl.rope_and_store_kv(*_split_qkv(s, qkv_i), positions, table, kc, vc, slots)
        outs.append(torch.cat([qkv_i.flatten(), kc.flatten(), vc.flatten()]))
    q, k, v = _split_qkv(s, qkv)
    e = qkv.element_size()
    moved = s.rows * ((s.heads + 2 * s.kv_heads) * s.head_dim * e + (s.heads + 3 * s.kv_heads) * s.head_dim * e
                      + s.head_dim * 4 + 16)
    return Row("rope+store_kv", f"{s.rows} tokens", bytes=moved,
               triton_us=bench.time_us(
                   lambda: TR.rope_and_store_kv(q, k, v, positions, table, k_cache, v_cache, slots)),
               reference_us=bench.time_us(
                   lambda: R.rope_and_store_kv(q, k, v, positions, table, k_cache, v_cache, slots)),
               rel_err=rel_err(*outs))


def _decode_inputs(s: Shape, dev, rows: int, ctx: int, layers: int = 1):
    """Per-layer caches of exactly ``rows * ctx`` tokens in shuffled blocks, and one table."""
    dt = _dtype(dev)
    per_row = -(-ctx // s.block)
    num_blocks = rows * per_row
    table = torch.randperm(num_blocks, device=dev).view(rows, per_row).int()
    caches = [(torch.randn(num_blocks, s.block, s.kv_heads, s.head_dim, device=dev).to(dt),
               torch.randn(num_blocks, s.block, s.kv_heads, s.head_dim, device=dev).to(dt)) for _ in range(layers)]
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(rows, s.heads, s.head_dim, device=dev).to(dt)
    return q, caches, table, lens


def _decode_bytes(s: Shape, rows: int, ctx: int, e: int) -> float:
    return (2 * rows * s.heads * s.head_dim * e + rows * ctx * 2 * s.kv_heads * s.head_dim * e
            + rows * (-(-ctx // s.block)) * 4 + rows * 4)


def bench_decode(bench: Bench, s: Shape, dev, rows: int, ctx: int, sweep: bool = False, **knobs) -> Row:
    q, caches, table, lens = _decode_inputs(s, dev, rows, ctx)
    k_cache, v_cache = caches[0]
    scale = s.head_dim ** -0.5
    out = TA.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, **knobs)
    ref = R.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, scale)
    row = Row("decode_attention", f"{rows} rows x ctx {ctx}", bytes=_decode_bytes(s, rows, ctx, q.element_size()),
              triton_us=bench.time_us(
                  lambda: TA.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, **knobs)),
              reference_us=None if sweep else bench.time_us(
                  lambda: R.paged_decode_attention(q, k_cache, v_cache, table, lens, scale)),
              rel_err=rel_err(out, ref))
    row.extra["splits"] = knobs.get("num_splits") or TA.decode_splits(
        rows, s.kv_heads, table.shape[1] * s.block, dev, 64)
    if dev.type == "cuda" and not sweep:  # the contiguous-cache baseline (today's engine): SDPA with GQA
        kc = torch.randn(rows, s.kv_heads, ctx, s.head_dim, device=dev, dtype=q.dtype)
        vc = torch.randn_like(kc)
        q4 = q[:, :, None, :]
        row.extra["sdpa_gqa_contiguous_us"] = bench.time_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True))
    return row


def _prefill_inputs(s: Shape, dev):
    seqs, q_len = s.prefill_seqs, s.prefill_len
    q, caches, table, _ = _decode_inputs(s, dev, seqs, q_len)
    k_cache, v_cache = caches[0]
    q = torch.randn(seqs * q_len, s.heads, s.head_dim, device=dev).to(q.dtype)
    cu = torch.arange(0, seqs + 1, device=dev, dtype=torch.int32) * q_len
    lens = torch.full((seqs,), q_len, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, table, cu, lens


def bench_prefill(bench: Bench, s: Shape, dev, sweep: bool = False, **knobs) -> Row:
    q, k_cache, v_cache, table, cu, lens = _prefill_inputs(s, dev)
    scale, n = s.head_dim ** -0.5, s.prefill_len
    out = TA.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, n, **knobs)
    ref = R.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, cu, lens, scale, n)
    e = q.element_size()
    moved = 2 * q.numel() * e + s.prefill_seqs * n * 2 * s.kv_heads * s.head_dim * e
    row = Row("prefill_attention", f"{s.prefill_seqs} seqs x {n} tokens", bytes=moved,
              triton_us=bench.time_us(
                  lambda: TA.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, n, **knobs)),
              reference_us=None if sweep else bench.time_us(
                  lambda: R.paged_prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, n)),
              rel_err=rel_err(out, ref))
    flops = 4 * s.prefill_seqs * s.heads * s.head_dim * n * (n + 1) / 2  # causal QK^T and PV
    row.extra["tflops"] = flops / row.triton_us / 1e6
    return row


def _sample_inputs(s: Shape, dev, rows: int, greedy_only: bool = False):
    logits = (torch.randn(rows, s.vocab, device=dev) * 4).to(_dtype(dev))
    temps = torch.full((rows,), 0.0 if greedy_only else 0.8, device=dev)
    temps[::8] = 0.0  # some greedy rows
    return logits, temps, torch.tensor([1], dtype=torch.int64, device=dev)


def bench_sample(bench: Bench, s: Shape, dev, sweep: bool = False, greedy_only: bool = False, **knobs) -> Row:
    logits, temps, seed = _sample_inputs(s, dev, s.rows, greedy_only)
    tokens, logprobs = TS.sample_tokens(logits, temps, seed, 0, **knobs)
    greedy = temps == 0
    t = torch.where(greedy, torch.ones_like(temps), temps)
    expected = torch.log_softmax(logits.float() / t[:, None], -1).gather(1, tokens[:, None])[:, 0]
    greedy_ok = torch.equal(tokens[greedy], logits[greedy].float().argmax(-1))
    row = Row("sample_tokens", f"{s.rows}x{s.vocab}", bytes=s.rows * s.vocab * logits.element_size() + s.rows * 16,
              triton_us=bench.time_us(lambda: TS.sample_tokens(logits, temps, seed, 0, **knobs)),
              reference_us=None if sweep else bench.time_us(lambda: R.sample_tokens(logits, temps, seed)),
              rel_err=(logprobs - expected).abs().max().item())
    row.extra["greedy_exact"] = greedy_ok
    row.ok = greedy_ok and row.rel_err < 1e-4
    return row


# -- one decode step -----------------------------------------------------------------------

def decode_step(bench: Bench, s: Shape, dev, rows: list[Row], ctx: int, reference_graph: bool) -> dict:
    """Sum of per-op medians for one step, and the same ops captured as one CUDA graph."""
    def med(op, case_part=None):
        for r in rows:
            if r.op == op and (case_part is None or case_part in r.case) and r.case.startswith(f"{s.rows}"):
                return r
        raise KeyError(op)
    per_layer = ["rms_norm+residual", "rms_norm+residual", "rope+store_kv", "decode_attention", "silu_and_mul"]
    picked = [med(op, f"ctx {ctx}" if op == "decode_attention" else None) for op in per_layer]
    final = [med("rms_norm+residual"), med("sample_tokens")]
    step = {"context": ctx, "rows": s.rows, "layers": s.layers}
    for key in ("triton_us", "reference_us"):
        step[f"sum_{key}"] = s.layers * sum(getattr(r, key) for r in picked) + sum(getattr(r, key) for r in final)
    step["bytes"] = s.layers * sum(r.bytes for r in picked) + sum(r.bytes for r in final)
    step["floor_us"] = step["bytes"] / COPY_GBPS / 1e3
    step["kernels_per_step_triton"] = s.layers * 5 + 2  # split-K adds a reduce kernel per layer
    if dev.type == "cuda":
        step["graph_triton_us"] = _graph_step_us(bench, s, dev, ctx, use_triton=True)
        if reference_graph:
            step["graph_reference_us"] = _graph_step_us(bench, s, dev, ctx, use_triton=False)
    return step


def _graph_step_us(bench: Bench, s: Shape, dev, ctx: int, use_triton: bool) -> float:
    dt = _dtype(dev)
    q, caches, table, lens = _decode_inputs(s, dev, s.rows, ctx, layers=s.layers)
    x = torch.randn(s.rows, s.hidden, device=dev).to(dt)
    res = torch.randn(s.rows, s.hidden, device=dev).to(dt)
    w = torch.ones(s.hidden, device=dev, dtype=dt)
    qkv, table_cs, _, _, _, _ = _rope_inputs(s, dev, s.rows, 1)
    positions = lens.long() - 1
    slots = table[:, -1].long() * s.block + (ctx - 1) % s.block
    gate_up = torch.randn(s.rows, 2 * s.inter, device=dev).to(dt)
    logits, temps, seed = _sample_inputs(s, dev, s.rows)
    norm, rope, attn, act, sample = ((TN.rms_norm, TR.rope_and_store_kv, TA.paged_decode_attention,
                                      TN.silu_and_mul, TS.sample_tokens) if use_triton else
                                     (R.rms_norm, R.rope_and_store_kv, R.paged_decode_attention,
                                      R.silu_and_mul, R.sample_tokens))
    qh, kh, vh = _split_qkv(s, qkv)

    def step():
        h, r = x, res
        for k_cache, v_cache in caches:
            h, r = norm(h, w, s.eps, r)
            rope(qh, kh, vh, positions, table_cs, k_cache, v_cache, slots)
            o = attn(qh, k_cache, v_cache, table, lens, s.head_dim ** -0.5)
            h, r = norm(o.view(s.rows, -1)[:, :s.hidden], w, s.eps, r)
            act(gate_up)
        norm(h, w, s.eps, r)
        sample(logits, temps, seed, 0)
        seed.add_(1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    us = bench.time_us(graph.replay, rep_ms=300)
    del graph
    torch.cuda.empty_cache()
    return us


# -- config sweep --------------------------------------------------------------------------

def run_sweep(bench: Bench, s: Shape, dev, start: float, budget_s: float) -> list[dict]:
    """Bounded sweep; every entry is checked against the reference too."""
    out: list[dict] = []
    grids = []
    for ctx in s.contexts:
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    grids.append(("decode", s.rows, ctx, dict(block_n=block_n, num_warps=warps,
                                                              num_stages=stages, num_splits=1)))
        for splits in (2, 4, 8):
            grids.append(("decode", s.rows, ctx, dict(num_splits=splits)))
    for splits in (1, 2, 4, 8, 16):
        grids.append(("decode", s.small_rows, s.contexts[-1], dict(num_splits=splits)))
    for block_m in (32, 64, 128):
        for block_n in (32, 64):
            for warps in (4, 8):
                grids.append(("prefill", None, None, dict(block_m=block_m, block_n=block_n, num_warps=warps)))
    for block_v in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            grids.append(("sample", None, None, dict(block_v=block_v, num_warps=warps)))
    grids.append(("sample", None, None, dict(greedy_only=True)))  # no noise: what the RNG costs
    if bench.quick:  # --smoke: a few of each, enough to run every code path
        grids = [g for g in grids if g[3].get("num_warps", 4) == 4 and g[3].get("num_stages", 2) == 2]
        grids = [g for g in grids if g[3].get("block_n", 32) <= 64 and g[3].get("block_m", 32) <= 64
                 and g[3].get("block_v", 1024) <= 1024]
    for kind, rows, ctx, knobs in grids:
        if time.perf_counter() - start > budget_s:
            out.append({"kind": kind, "rows": rows, "context": ctx, **knobs, "skipped": "budget"})
            continue
        try:
            if kind == "decode":
                r = bench_decode(bench, s, dev, rows, ctx, sweep=True, **knobs)
            elif kind == "prefill":
                r = bench_prefill(bench, s, dev, sweep=True, **knobs)
            else:
                greedy_only = knobs.pop("greedy_only", False)
                r = bench_sample(bench, s, dev, sweep=True, greedy_only=greedy_only, **knobs)
                knobs["greedy_only"] = greedy_only
            out.append({"kind": kind, "rows": rows, "context": ctx, **knobs, "us": r.triton_us,
                        "gbps": r.gbps, "rel_err": r.rel_err, **{k: v for k, v in r.extra.items() if k == "tflops"}})
        except Exception as exc:  # a config that does not compile (shared memory, registers)
            out.append({"kind": kind, "rows": rows, "context": ctx, **knobs,
                        "error": f"{type(exc).__name__}: {exc}"[:200]})
    return out


# -- report --------------------------------------------------------------------------------

def _check(row: Row) -> bool:
    if row.ok is not None:
        return row.ok
    return row.rel_err is not None and row.rel_err < 2e-2


def report(rows: list[Row], steps: list[dict], sweep: list[dict], s: Shape, wall_s: float) -> None:
    if sweep:
        print("\n== config sweep (Triton, median us; one row per config) ==")
        for kind in ("decode", "prefill", "sample"):
            entries = [e for e in sweep if e["kind"] == kind]
            done = [e for e in entries if "us" in e]
            for e in entries:
                knobs = {k: v for k, v in e.items()
                         if k not in ("kind", "us", "gbps", "rel_err", "rows", "context", "tflops")}
                where = f"{e['rows']}x{e['context']}" if e["rows"] else ""
                if "us" in e:
                    print(f"  {kind:8s} {where:>10s} {knobs}  {e['us']:9.1f} us  {e['gbps']:7.0f} GB/s  "
                          f"err {e['rel_err']:.1e}")
                else:
                    print(f"  {kind:8s} {where:>10s} {knobs}  -- {e.get('error') or e.get('skipped')}")
            groups = {}
            for e in done:
                groups.setdefault((e["rows"], e["context"]), []).append(e)
            for key, group in groups.items():
                best = min(group, key=lambda e: e["us"])
                tuned = {k: v for k, v in best.items()
                         if k in ('block_n', 'block_m', 'block_v', 'num_warps', 'num_stages', 'num_splits')}
                print(f"  best {kind} {key}: {best['us']:.1f} us  {tuned}")
    print("\n== decode step (24 layers of the fused ops + final norm + sampling; matmuls excluded) ==")
    for st in steps:
        line = (f"  {st['rows']} rows x ctx {st['context']}: sum of op medians triton {st['sum_triton_us']:,.0f} us, "
                f"reference {st['sum_reference_us']:,.0f} us; bytes {st['bytes'] / 1e6:,.0f} MB -> floor "
                f"{st['floor_us']:,.0f} us at {COPY_GBPS:.0f} GB/s")
        if "graph_triton_us" in st:
            line += f"; one CUDA graph: triton {st['graph_triton_us']:,.0f} us"
            if "graph_reference_us" in st:
                line += f", reference {st['graph_reference_us']:,.0f} us"
        print(line)
    print(f"\n== per op (bf16 on the GPU; {'fp32 interpreter' if s is SMOKE else 'H200'}), median us ==")
    print(f"  {'op':20s} {'case':24s} {'bytes':>10s} {'triton us':>10s} {'GB/s':>7s} {'% copy':>7s} "
          f"{'ref us':>10s} {'speedup':>8s} {'rel err':>8s}  ok")
    for r in rows:
        extra = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.extra.items())
        print(f"  {r.op:20s} {r.case:24s} {r.bytes / 1e6:9.2f}M {r.triton_us:10.1f} {r.gbps:7.0f} "
              f"{100 * r.gbps / COPY_GBPS:6.0f}% {r.reference_us:10.1f} {r.reference_us / r.triton_us:7.1f}x "
              f"{r.rel_err:8.1e}  {'ok' if _check(r) else 'FAIL'}" + (f"  ({extra})" if extra else ""))
    print(f"\nwall time {wall_s:.0f} s; all checks {'passed' if all(_check(r) for r in rows) else 'FAILED'}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        payload = {"ops": [{**r.__dict__, "gbps": r.gbps, "ok": _check(r)} for r in rows], "decode_steps": steps,
                   "sweep": sweep, "wall_s": wall_s, "copy_gbps": COPY_GBPS,
                   "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "versions": {"torch": torch.__version__, "triton": triton.__version__}}
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "kernels.json"), "w") as f:
            json.dump(payload, f, indent=1, default=str)
        print(f"wrote {os.path.join(out_dir, 'kernels.json')}")


def _interpreter_numpy24_fix() -> None:
    """Triton 3.6's interpreter calls int() on 1-element arrays, which numpy 2.4 refuses
    (triton-lang/triton#9171); index the element instead (--smoke only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    main()
