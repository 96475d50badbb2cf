"""Rollout generation of a Qwen3-30B-A3B-shaped MoE (issue 23): the paged engine, HF
``generate`` and TorchEngine side by side in one process.

Consumes nothing (random bf16 weights from transformers' Qwen3MoeConfig, random prompt
ids); emits a table on stdout and JSON (``--out``, or ``$OUT/moe_engine.json``). Model:
48 layers, width 2048, 32 / 4 heads of 128, 128 experts of width 768, top 8,
``norm_topk_prob``, vocab 151,936, untied (30.5B parameters, 3.3B active per token),
sdpa attention, no eos (every sequence runs to its length; checked).

Workloads (``--workloads``): (a) 64 x (128 + 128) and (b) 256 x (128 + 256), temperature
1, random prompt ids. Systems: ``paged`` (one warm-up run: graph captures and the MoE
kernels' autotuning; then ``--repeats`` timed runs, median), ``hf`` (one batched
``model.generate(do_sample=True)``) and ``torch`` (TorchEngine): at 266 tok/s a run of
(a) is ~30 s, so they run once, cold, and only on the workloads in ``--baselines``
(default a). tokens/s = new tokens / wall seconds, prefill included.

Also, for the paged engine: ms per decode step (end to end, from the engine's counters;
and one CUDA-graph replay, timed and profiled: kernels per step, the top kernels), the
decode floor (the bytes one step must read: the experts the rows' tokens hit, counted by
routing random activations through the real routers, plus the dense weights, at
``--hbm-tb-s``), the Triton MoE kernels against the PyTorch reference on layer 0
(max |diff| of one layer's output, bf16), and the engine's logprobs against the HF
forward in bf16 (mean / max |diff| over ``--agreement-seqs`` sequences).

One H200 (~5 min; issue 23's targets: (a) >= 3k tok/s, (b) >= 12k tok/s):

    python benchmarks/moe_engine.py

CPU smoke test of the plumbing (a tiny MoE, < 1 min): ``python benchmarks/moe_engine.py --smoke``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from engine_generate import (  # noqa: E402
    Workload,
    decode_step_profile,
    engine_fn,
    env_info,
    hf_fn,
    measure,
    out_path,
    print_table,
    reset_peak,
    write_json,
)

from tapioca.engines import kernels  # noqa: E402
from tapioca.engines.kernels import reference  # noqa: E402
from tapioca.engines.paged_engine import PagedEngine  # noqa: E402
from tapioca.engines.torch_engine import TorchEngine  # noqa: E402
from tapioca.models.factory import build_tiny_model  # noqa: E402

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                     intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
SMOKE = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
WORKLOADS = {"a": (64, 128, 128), "b": (256, 128, 256)}
SMOKE_WORKLOADS = {"a": (4, 8, 8), "b": (8, 8, 12)}
NAMES = {"paged": "PagedEngine", "hf": "HF generate", "torch": "TorchEngine"}
TARGETS = {"a": 3000.0, "b": 12000.0}


def build(shape: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-weight Qwen3-MoE of ``shape`` (seed 0) created on ``device``, sdpa attention
    (also benchmarks/moe_trainer.py's)."""
    kw = dict(shape)
    vocab = kw.pop("vocab_size")
    model = build_tiny_model(vocab, arch="qwen3_moe", seed=0, dtype=dtype, device=device, tie_word_embeddings=False,
                             max_position_embeddings=4096, **kw)
    model.set_attn_implementation("sdpa")
    return model


def workloads(smoke: bool, names: str, vocab: int, seed: int) -> dict[str, Workload]:
    rng = random.Random(seed)
    out = {}
    for name, (rows, prompt, new) in (SMOKE_WORKLOADS if smoke else WORKLOADS).items():
        if name in names:
            prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(rows)]
            out[name] = Workload(name, prompts, [new] * rows, 1.0, vocab)
    return out


def kernel_check(model, decoder, device: str, tokens: int = 64) -> dict:
    """Layer 0's experts on random activations: the dispatched kernels (Triton on CUDA)
    against the PyTorch reference, same routing."""
    moe = decoder.layers[0].moe
    x = torch.randn(tokens, model.config.hidden_size, device=device, dtype=decoder.dtype)
    logits = torch.nn.functional.linear(x.float(), moe.router_w)
    w, ids = kernels.moe_route(logits, moe.top_k, moe.norm_topk_prob)
    rw, rids = reference.moe_route(logits, moe.top_k, moe.norm_topk_prob)
    out = kernels.fused_moe(x, moe.w13, moe.w2, w, ids)
    ref = reference.fused_moe(x, moe.w13, moe.w2, rw, rids, gather=False)
    return {"route_ids_equal": bool(torch.equal(ids, rids)), "route_weights_max_abs_diff": float((w - rw).abs().max()),
            "experts_max_abs_diff": float((out.float() - ref.float()).abs().max()),
            "experts_max_abs": float(ref.float().abs().max()), "tokens": tokens}


def decode_floor(model, decoder, rows: int, hbm_tb_s: float, device: str) -> dict:
    """Bytes one decode step of ``rows`` rows reads: every hit expert's weights (routes of
    random rows: near-uniform routing, as a random model's), attention, norms, the LM head,
    the embedding rows; and the time that takes at ``hbm_tb_s``."""
    cfg = model.config
    bytes_per = decoder.dtype.itemsize
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * bytes_per
    x = torch.randn(rows, cfg.hidden_size, device=device, dtype=decoder.dtype)
    hit = 0
    for layer in decoder.layers:
        if layer.moe is not None:
            _, ids = kernels.moe_route(torch.nn.functional.linear(x.float(), layer.moe.router_w),
                                       layer.moe.top_k, layer.moe.norm_topk_prob)
            hit += int(torch.unique(ids).numel())
    dense = sum(t.numel() * t.element_size() for layer in decoder.layers
                for t in (layer.qkv_w, layer.o_w) if t is not None) + decoder.lm_head.numel() * bytes_per
    total = hit * expert_bytes + dense
    return {"rows": rows, "experts_hit_per_step": hit, "expert_gb": round(hit * expert_bytes / 1e9, 2),
            "dense_gb": round(dense / 1e9, 2), "floor_ms": round(total / (hbm_tb_s * 1e12) * 1e3, 2),
            "floor_tok_s": round(rows / (total / (hbm_tb_s * 1e12)), 1)}


def agreement(model, results, device: str, n_seqs: int) -> dict:
    """|engine logprob - HF forward logprob| (the model's dtype, no autocast) per output token."""
    from tapioca.models.forward import causal_token_logprobs

    diffs = []
    model.set_attn_implementation("sdpa")
    for r in results[:n_seqs]:
        seq = r.prompt_ids + r.output_ids
        p, n = len(r.prompt_ids), len(r.output_ids)
        labels = torch.full((1, len(seq) - 1), -100, dtype=torch.long)
        labels[0, p - 1:p - 1 + n] = torch.tensor(r.output_ids)
        with torch.no_grad():
            lp, _ = causal_token_logprobs(model, torch.tensor([seq], device=device),
                                          torch.ones(1, len(seq), dtype=torch.long, device=device),
                                          labels.to(device), temperature=1.0, chunk_tokens=4096)
        diffs.append((lp[0, p - 1:p - 1 + n].float().cpu() - torch.tensor(r.output_logprobs)).abs())
    d = torch.cat(diffs)
    return {"mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max()), "tokens": int(d.numel())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny MoE, tiny workloads (CPU plumbing check)")
    ap.add_argument("--workloads", default="ab")
    ap.add_argument("--systems", default="paged,hf,torch")
    ap.add_argument("--baselines", default="a", help="workloads hf and torch run on")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8, help="H200: 4.8 TB/s")
    ap.add_argument("--agreement-seqs", type=int, default=8)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    t_build = time.perf_counter()
    model = build(SMOKE if args.smoke else QWEN3_30B_A3B, dtype, dev).eval()
    total = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3-MoE, {total / 1e9:.2f}B params, {dtype}, built in {time.perf_counter() - t_build:.0f} s",
          flush=True)
    loads = workloads(args.smoke, args.workloads, model.config.vocab_size, args.seed)
    systems = [s for s in args.systems.split(",") if s]
    max_rows = max(w.rows for w in loads.values())
    cache_tokens = int(1.1 * max(sum(len(p) + n for p, n in zip(w.prompts, w.new_tokens)) for w in loads.values()))
    results: dict[str, dict] = {}
    extras: dict = {}
    paged = torch_engine = None
    try:
        for w in loads.values():
            res = results.setdefault(w.name, {})
            for system in systems:
                t0 = time.perf_counter()
                if system == "paged":
                    if paged is None:
                        reset_peak(dev)
                        paged = PagedEngine(model, device=dev, max_batch_size=max_rows, seed=args.seed,
                                            kv_cache_tokens=cache_tokens, max_prefill_tokens=args.max_prefill_tokens)
                        extras["kernel_check"] = kernel_check(model, paged.decoder, dev)
                        print("kernel check:", json.dumps(extras["kernel_check"]), flush=True)
                    fn = engine_fn(paged, w)
                    res[system] = measure(fn, dev, args.repeats)
                    res[system]["decode_step_ms"] = paged.stats()["decode_only_step_ms"]
                    profile = decode_step_profile(paged, w.rows, dev, replays=10)
                    res[system]["graph_replay_ms"] = profile.get("graph_replay_ms")
                    extras.setdefault("decode_step", {})[w.name] = profile
                    extras.setdefault("decode_floor", {})[w.name] = decode_floor(
                        model, paged.decoder, w.rows, args.hbm_tb_s, dev)
                    if w.name == min(loads):
                        extras["agreement"] = agreement(model, fn.last, dev, args.agreement_seqs)
                elif w.name in args.baselines:
                    if system == "hf":
                        res[system] = measure(hf_fn(model, w, dev, args.seed, static=False), dev, 1, warmup=False)
                    elif system == "torch":
                        if torch_engine is None:
                            torch_engine = TorchEngine(model, device=dev, max_batch_size=max_rows, seed=args.seed)
                        res[system] = measure(engine_fn(torch_engine, w, model), dev, 1, warmup=False)
                if system in res:
                    res[system]["system_wall_s"] = round(time.perf_counter() - t0, 1)
                    print(f"({w.name}) {system}", json.dumps(res[system]), flush=True)
    finally:
        for engine in (paged, torch_engine):
            if engine is not None:
                engine.shutdown()
    rows = []
    for wname, res in results.items():
        for system, r in res.items():
            rows.append([f"({wname}) {NAMES[system]}", r["tokens"], r["wall_s"], r["tokens_per_s"], r["peak_mem_gib"],
                         r.get("decode_step_ms"), r.get("graph_replay_ms")])
    print()
    print_table(["workload / system", "new tokens", "wall s", "tokens/s", "peak GiB", "ms/decode step",
                 "ms/graph replay"], rows)
    ratios = {w: {f"paged_over_{s}": round(res["paged"]["tokens_per_s"] / r["tokens_per_s"], 2)
                  for s, r in res.items() if s != "paged"} for w, res in results.items() if "paged" in res}
    met = {w: res["paged"]["tokens_per_s"] >= TARGETS[w] for w, res in results.items()
           if "paged" in res and not args.smoke}
    print("\nspeed-ups of the paged engine:", json.dumps(ratios))
    print("decode floor (bytes a step reads):", json.dumps(extras.get("decode_floor")))
    print("decode step (CUDA graph replay, kernels):", json.dumps(extras.get("decode_step")))
    print("engine vs HF forward |delta logprob|:", json.dumps(extras.get("agreement")))
    print("targets (a) >= 3k tok/s, (b) >= 12k tok/s; met:", json.dumps(met))
    write_json(out_path(args, "moe_engine"), {
        "benchmark": "moe_engine", "env": env_info(dev), "config": {k: v for k, v in vars(args).items() if k != "out"},
        "params": total, "kv_cache_tokens": cache_tokens, "results": results, "ratios": ratios, "targets_met": met,
        **extras})


if __name__ == "__main__":
    main()
