"""Trainer step on a Qwen3-MoE with 2.8B total / 0.68B active parameters (issue 23): the
packed trainer (PPOActor) against the plain HF step, side by side in one process.

Consumes nothing (random weights from transformers' Qwen3MoeConfig, random token ids);
emits a table on stdout and JSON (``--out``, or ``$OUT/moe_trainer.json``). Model: 12
layers, width 1024, 16 / 4 heads of 128, 64 experts of width 1024, top 8, vocab 151,936,
untied (2.79B parameters; 0.68B active per token, embedding included). Batch: 8 x 2048
random ids (prompt 128), advantages +-1.

Runs (``--only``):
  check        a small MoE (width 256, 16 experts, top 4): the packed step in bf16 (the
               grouped_mm expert path on CUDA) and in fp32, against the padded fp32 step:
               loss and gradient relative differences (the GPU's correctness check);
  hf           the plain HF step (issue 16's anchor): fp32 weights, bf16 autocast, full
               logits and fp32 log-softmax, fused AdamW;
  hf_bf16      the same on bf16 weights (transformers' grouped_mm experts run in bf16);
  fast         PPOActor, packed: bf16 weights with fp32 masters, liger kernels, Triton
               logprobs (logits recomputed), fused AdamW, fp32 router, one 16k micro-batch;
  fast_mb4k    the same in micro-batches of 4096 tokens (activation memory / 4);
  fast_mb4k_ac the same with activation checkpointing.
Each run: a fresh model, one warm-up step, ``--steps`` timed steps (median). tokens/s
counts real tokens; MFU on active parameters = 6 * N_active * tokens / step time / 989
TFLOP/s, N_active = the matmul weights one token uses (attention, router, its k experts,
the LM head; not the embedding); attention FLOPs are not counted. Peak memory =
``torch.cuda.max_memory_allocated`` over the timed steps. Every step includes the
optimizer (AdamW) for both systems.

One H200 (~3 min; issue 23's target: fast >= 2x hf tokens/s at <= 60 % of its memory):

    python benchmarks/moe_trainer.py

CPU smoke test of the plumbing (tiny shapes, < 1 min): ``python benchmarks/moe_trainer.py --smoke``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from engine_generate import H200_BF16_DENSE_TFLOPS, env_info, out_path, print_table, timed, write_json  # noqa: E402
from moe_engine import build  # noqa: E402
from trainer_systems import _grads_after_step, actor_config, actor_step, compare, fixed_batch, hf_plain_step  # noqa: E402

from tapioca.config.moe import MoeConfig  # noqa: E402

SHAPE = dict(vocab_size=151936, hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, head_dim=128,
             intermediate_size=3072, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024)
SMOKE = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CHECK = dict(vocab_size=4096, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
             intermediate_size=512, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)
FAST = dict(packed_sequences=True, param_dtype="bfloat16", autocast_dtype="", attention_backend="auto",
            liger_kernels=True, logprob_kernel="auto", fused_optimizer=True, logprob_chunk_tokens=4096,
            mb_max_tokens=16384, moe=MoeConfig(router_dtype="fp32"))
RUNS = {"hf": ("hf", torch.float32, {}), "hf_bf16": ("hf", torch.bfloat16, {}),
        "fast": ("actor", torch.bfloat16, FAST), "fast_mb4k": ("actor", torch.bfloat16, dict(FAST, mb_max_tokens=4096)),
        "fast_mb4k_ac": ("actor", torch.bfloat16, dict(FAST, mb_max_tokens=4096, gradient_checkpointing=True))}


def active_params(model) -> dict:
    """Total parameters, and the matmul weights one token uses (MFU's N)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    per_layer = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        per_layer += sum(getattr(attn, n).weight.numel() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            e = mlp.experts
            per_layer += mlp.gate.weight.numel() + cfg.num_experts_per_tok * (e.gate_up_proj[0].numel()
                                                                              + e.down_proj[0].numel())
        else:
            per_layer += sum(p.numel() for p in mlp.parameters())
    head = model.get_output_embeddings().weight.numel()
    embed = model.get_input_embeddings().weight.numel()
    return {"total": total, "active_matmul": per_layer + head, "active_with_embedding": per_layer + head + embed}


def reset(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def check(device: str) -> dict:
    """Packed (bf16 weights; fp32) vs the padded fp32 step on a small MoE: relative loss and
    gradient differences (lr ~ 0, no clipping: the gradients of one step)."""
    batch = fixed_batch(4, 256, 32, CHECK["vocab_size"], seed=1)
    base = build(CHECK, torch.float32, device)
    out = {}
    ref_loss, ref = _grads_after_step(copy.deepcopy(base), batch, device, packed_sequences=False,
                                      logprob_kernel="torch")
    for name, dtype, cfg in (("packed_fp32", torch.float32, dict(attention_backend="sdpa")),
                             ("packed_bf16_weights", torch.bfloat16, dict(param_dtype="bfloat16"))):
        loss, grads = _grads_after_step(copy.deepcopy(base).to(dtype), batch, device, packed_sequences=True,
                                        mb_max_tokens=1 << 20, **cfg)
        out[f"{name}_vs_padded_fp32"] = compare(loss, grads, ref_loss, ref)
    return out


def run_one(name: str, shape: dict, batch, args) -> dict:
    system, dtype, opts = RUNS[name]
    device = args.device
    if not device.startswith("cuda"):
        opts = dict(opts, liger_kernels=False) if opts else opts
    reset(device)
    model = build(shape, dtype, device)
    counts = active_params(model)
    if system == "hf":
        step = hf_plain_step(model, batch, device)
        describe = f"plain HF, {str(dtype).removeprefix('torch.')} weights"
    else:
        step, actor = actor_step(model, batch, actor_config(device, **opts), device)
        describe = actor.packed.describe() + f" mb={opts['mb_max_tokens']}"
    t0 = time.perf_counter()
    step()
    warmup_s = time.perf_counter() - t0
    reset(device)
    walls = [timed(step, device)[1] for _ in range(args.steps)]
    wall = statistics.median(walls)
    tokens = batch.real_tokens
    tflops = 6 * counts["active_matmul"] * tokens / wall / 1e12
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None
    return {"system": system, "kernels": describe, "params": counts, "real_tokens": tokens,
            "warmup_s": round(warmup_s, 1), "wall_s": round(wall, 4), "wall_s_all": [round(w, 4) for w in walls],
            "tokens_per_s": round(tokens / wall, 1), "tflops_6nd_active": round(tflops, 1),
            "mfu_active": round(tflops / H200_BF16_DENSE_TFLOPS, 4), "peak_mem_gib": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU plumbing check)")
    ap.add_argument("--only", default="check," + ",".join(RUNS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = args.device
    shape = SMOKE if args.smoke else SHAPE
    batch = fixed_batch(2, 64, 8, shape["vocab_size"], seed=0) if args.smoke else \
        fixed_batch(8, 2048, 128, shape["vocab_size"], seed=0)
    wanted = [k.strip() for k in args.only.split(",") if k.strip()]
    results: dict[str, dict] = {}
    if "check" in wanted:
        results["check"] = check(dev)
        print("check:", json.dumps(results["check"]), flush=True)
    for name in (n for n in wanted if n in RUNS):
        try:
            results[name] = run_one(name, shape, batch, args)
        except Exception as exc:  # one failing system must not hide the others' figures
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        print(name, json.dumps(results[name]), flush=True)
    rows = []
    for name, r in results.items():
        if name == "check":
            continue
        if "error" in r:
            rows.append([name, r["error"][:60], None, None, None, None])
            continue
        rows.append([name, r["kernels"], r["tokens_per_s"], r["mfu_active"], r["peak_mem_gib"], r["wall_s"]])
    print()
    print_table(["run", "kernels", "tokens/s", "MFU (active)", "peak GiB", "step s"], rows)
    verdict = {}
    hf = results.get("hf", {})
    for name, r in results.items():
        if name.startswith("fast") and "error" not in r and "tokens_per_s" in hf:
            verdict[name] = {"speedup_over_hf": round(r["tokens_per_s"] / hf["tokens_per_s"], 2),
                             "memory_share_of_hf": (round(r["peak_mem_gib"] / hf["peak_mem_gib"], 3)
                                                    if r["peak_mem_gib"] and hf.get("peak_mem_gib") else None)}
    print("\nagainst the plain HF step (target: >= 2x tokens/s at <= 0.6 of its memory):", json.dumps(verdict))
    write_json(out_path(args, "moe_trainer"), {"benchmark": "moe_trainer", "env": env_info(dev),
                                               "config": vars(args), "results": results, "verdict": verdict})


if __name__ == "__main__":
    main()
