"""The memory planner (trainers/memory_plan.py, `tapioca plan`) against measured peaks.

Consumes nothing (random weights from the real ``transformers`` config classes, the
shapes and batches of benchmarks/trainer_step.py); emits a table on stdout and JSON to
``$OUT/plan_vs_measured.json``.

GPU (one H200; tp = cp = 1, the plain actor): for each run, one warm-up step, then one
step between ``reset_peak_memory_stats`` and ``max_memory_allocated``; the planner's peak
for the same shape and config beside it (target: within 15%), and the activations autograd
saved in one forward (counted tensor by tensor) beside the planner's activation term:

    python benchmarks/plan_vs_measured.py --device cuda

``--smoke`` (CPU, < 1 min): the activation accounting alone, on tiny models through the
packed forward (sdpa attention, PyTorch ops): saved bytes vs the planner for fp32, bf16
weights, fp32 + bf16 autocast, recompute_swiglu, activation checkpointing, Qwen3 (target
within 5%); then one real step of a tiny run to check the plumbing.

``--table``: the docs table (docs/distributed.md): 7B / 32B / 72B dense and Qwen3-30B-A3B
at 8k / 32k / 128k tokens per micro-batch (no torch needed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers

from tapioca.trainers import memory_plan as mp  # noqa: E402

SMOKE_TARGET = 0.05
GPU_TARGET = 0.15


def saved_bytes(forward, model) -> int:
    """Bytes of the distinct storages autograd saves during ``forward()`` (parameters
    excluded: they are counted as weights)."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    def local(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = local(t).untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
        out = forward()
    del out
    return sum(seen.values())


def planned_forward_saved(m: mp.ModelShape, t: mp.TrainShape) -> float:
    """What the planner says the forward keeps: the layers' activations, the LM head's
    saved part, and (fp32 weights under autocast) the bf16 weight copies."""
    fwd, _ = mp.activation_parts(m, t)
    head_saved, _ = mp.head_bytes(m, t)
    return fwd + head_saved + (2 * m.layers * m.layer_params if t.autocast else 0)


def shape_of(model, name: str) -> mp.ModelShape:
    return mp.ModelShape.from_hf_config(model.config.to_dict(), name=name)


def plan_for(model, name: str, cfg, mbs) -> mp.TrainShape:
    """The planner's TrainShape for this actor config and these micro-batches."""
    from tapioca.config.distributed import FSDPConfig

    biggest = max(mbs, key=lambda b: b.input_ids_N.numel())
    padded = biggest.seqs.n_seqs * biggest.seqs.max_len
    return mp.TrainShape(**{**mp.train_shape(cfg, FSDPConfig(), tokens=biggest.input_ids_N.numel(),
                                             micro_batches=len(mbs)).__dict__,
                            "scored_tokens": biggest.rows_M.numel(), "padded_tokens": padded})


# ------------------------------------------------------------------ CPU smoke

SMOKE_CASES = [
    ("fp32", "qwen2", "float32", {}),
    ("bf16 weights", "qwen2", "bfloat16", {}),
    ("fp32 + bf16 autocast", "qwen2", "float32", {"autocast_dtype": "bfloat16"}),
    ("bf16 + recompute_swiglu", "qwen2", "bfloat16", {"recompute_swiglu": True}),
    ("bf16 + activation checkpointing", "qwen2", "bfloat16", {"gradient_checkpointing": True}),
    ("qwen3 (q/k norms) bf16", "qwen3", "bfloat16", {}),
]


def smoke() -> list[dict]:
    rows = smoke_activations()
    # The run path: one real step of a tiny shape, the planner's figure beside it.
    return rows + gpu_runs(tiny=True, device="cpu", only=["0.5b bf16 torch ops"])


def smoke_activations() -> list[dict]:
    """Saved activation bytes of one forward vs the planner, per SMOKE_CASES case."""
    import torch

    from tapioca.config.schema import ActorConfig
    from tapioca.models.factory import build_tiny_model
    from tapioca.trainers.batching import SeqItem
    from tapioca.trainers.ppo_actor import PPOActor

    torch.set_num_threads(1)
    rows = []
    for name, arch, dtype, opts in SMOKE_CASES:
        model = build_tiny_model(96, arch=arch, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                                 intermediate_size=160, seed=0, dtype=getattr(torch, dtype))
        cfg = ActorConfig(param_dtype=dtype, attention_backend="sdpa", logprob_kernel="torch",
                          mb_max_tokens=4096, **opts)
        actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0)
        g = torch.Generator().manual_seed(0)
        items = [SeqItem(group_id="g", input_ids=torch.randint(1, 96, (n,), generator=g).tolist(), prompt_len=16,
                         behav_logprobs=[-1.0] * (n - 16), versions=[0] * (n - 16), loss_mask=[1] * (n - 16),
                         advantage=1.0, reward=0.0) for n in (256, 200, 256, 180)]
        mbs = actor.micro_batches(items)
        model.train()
        got = saved_bytes(lambda: actor.logprobs(mbs[0]), model)
        want = planned_forward_saved(shape_of(model, arch), plan_for(model, arch, cfg, mbs))
        rows.append({"case": name, "saved_mib": round(got / 2**20, 3), "planned_mib": round(want / 2**20, 3),
                     "ratio": round(want / got, 4), "ok": abs(want / got - 1) <= SMOKE_TARGET})
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------ GPU runs

# (name, trainer_step shape, batch, ActorConfig options)
_BF16 = dict(packed_sequences=True, param_dtype="bfloat16", attention_backend="auto", fused_optimizer=True)
RUNS = [
    ("0.5b bf16 torch ops", "qwen2-0.5b", "16x1024", dict(_BF16, logprob_kernel="torch")),
    ("0.5b fast (liger, triton, keep logits)", "qwen2-0.5b", "16x1024",
     dict(_BF16, liger_kernels=True, logprob_kernel="auto", logprob_chunk_tokens=8192, logprob_keep_logits=True)),
    ("1.5b fast + recompute_swiglu", "qwen2.5-1.5b", "8x2048",
     dict(_BF16, liger_kernels=True, logprob_kernel="auto", recompute_swiglu=True)),
    ("1.5b fp32 + bf16 autocast", "qwen2.5-1.5b", "8x2048",
     dict(_BF16, param_dtype="float32", autocast_dtype="bfloat16", logprob_kernel="torch")),
    ("3b bf16 + activation checkpointing", "qwen2.5-3b", "8x2048",
     dict(_BF16, liger_kernels=True, gradient_checkpointing=True)),
    ("3b mb 4k (4 micro-batches)", "qwen2.5-3b", "8x2048",
     dict(_BF16, liger_kernels=True, recompute_swiglu=True, mb_max_tokens=4096)),
]


def gpu_runs(*, tiny: bool, device: str, only: list[str] | None = None) -> list[dict]:
    import torch
    from trainer_step import make_batches
    from trainer_systems import actor_config, build

    batches = make_batches(tiny, 0)
    cuda = device.startswith("cuda")
    rows = []
    for name, shape, batch_key, opts in RUNS:
        if only and name not in only:
            continue
        if not cuda:
            opts = dict(opts, liger_kernels=False, logprob_kernel="torch", logprob_keep_logits=False,
                        attention_backend="sdpa")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        try:
            cfg = actor_config(device, **dict(dict(mb_max_tokens=16384), **opts))
            model = build(shape, tiny, getattr(torch, cfg.param_dtype), device)
            from tapioca.trainers.ppo_actor import PPOActor

            actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=device)
            batch = batches[batch_key]
            items = batch.items(model.config.vocab_size)
            mbs = actor.micro_batches(items)
            actor.train_step(items, policy_version=0)  # warm-up: Adam's moments exist from here
            model.train()
            saved = saved_bytes(functools.partial(actor.logprobs, mbs[0], entropy=True), model)
            actor.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            actor.train_step(items, policy_version=1)
            peak = torch.cuda.max_memory_allocated() if cuda else None
            m = shape_of(model, shape)
            t = plan_for(model, shape, cfg, mbs)
            p = mp.plan(m, t)
            row = {"run": name, "shape": shape, "batch": batch.name, "tokens_per_mb": t.tokens,
                   "micro_batches": t.micro_batches, "planned_gib": round(p.peak / mp.GIB, 2),
                   "planned_at": p.peak_at, "measured_gib": None if peak is None else round(peak / mp.GIB, 2),
                   "saved_activations_gib": round(saved / mp.GIB, 3),
                   "planned_saved_gib": round(planned_forward_saved(m, t) / mp.GIB, 3),
                   "parts_gib": {k: round(v / mp.GIB, 3) for k, v in p.parts.items()}}
            if peak:
                row["ratio"] = round(p.peak / peak, 3)
                row["ok"] = abs(p.peak / peak - 1) <= GPU_TARGET
            del actor, model
        except Exception as exc:  # noqa: BLE001 -- an OOM or a kernel failure is a result too
            row = {"run": name, "error": f"{type(exc).__name__}: {exc}"[:400]}
        rows.append(row)
        print(row, flush=True)
    return rows


# ------------------------------------------------------------------ the docs table

TABLE_MODELS = ("qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "qwen3-30b-a3b")
TABLE_TOKENS = (8192, 32768, 131072)
TABLE_WORLDS = (8, 16, 32, 64)


def docs_table(gpu_gib: float = 141.0) -> str:
    """Per model and micro-batch size: for 8 / 16 / 32 / 64 GPUs, the layout with the
    most data parallelism whose peak fits ``gpu_gib``, and that peak (sharded bf16
    compute, fp32 masters and Adam, activation checkpointing on every layer, flash
    varlen, chunked logprobs of 4096 rows (Triton at tp 1), every token scored, gradients
    accumulated)."""
    base = mp.TrainShape(tokens=8192, micro_batches=2, fsdp_param_dtype="bfloat16", checkpoint_every=1,
                         attention="varlen", chunk_tokens=4096)
    head = "| model | tokens / micro-batch | " + " | ".join(f"{w} GPUs" for w in TABLE_WORLDS) + " |"
    lines = [head, "|" + "---|" * (2 + len(TABLE_WORLDS))]
    for name in TABLE_MODELS:
        m = mp.PRESETS[name]
        for tokens in TABLE_TOKENS:
            cells = []
            for world in TABLE_WORLDS:
                best = None
                for dp, tp, cp in mp.layouts(world):
                    if not mp.valid_layout(m, tp, cp):
                        continue
                    # logprob_kernel auto: the Triton kernel at tp 1, PyTorch's chunks under tp.
                    p = mp.plan(m, mp.replace(base, tokens=tokens, dp=dp, tp=tp, cp=cp,
                                              logprob_kernel="triton" if tp == 1 else "torch"))
                    if p.fits(gpu_gib) and (best is None or (dp, -tp) > (best[0], -best[1])):
                        best = (dp, tp, cp, p.peak)
                cells.append("—" if best is None else
                             f"d{best[0]}t{best[1]}c{best[2]}: {best[3] / mp.GIB:.0f} GiB")
            lines.append(f"| {name} ({m.params / 1e9:.1f}B) | {tokens // 1024}k | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU: the activation accounting on tiny models")
    ap.add_argument("--table", action="store_true", help="print the docs table and exit")
    ap.add_argument("--gpu-gib", type=float, default=141.0)
    ap.add_argument("--only", default="", help="comma list of run names")
    args = ap.parse_args()
    if args.table:
        print(docs_table(args.gpu_gib))
        return
    if args.smoke:
        rows = smoke()
    else:
        rows = gpu_runs(tiny=False, device=args.device, only=[s for s in args.only.split(",") if s] or None)
    print()
    for r in rows:
        if "error" in r:
            print(f"{r['run']:<42s} ERROR {r['error'][:70]}")
        elif "case" in r:
            print(f"{r['case']:<42s} saved {r['saved_mib']:8.3f} MiB planned {r['planned_mib']:8.3f} "
                  f"({r['ratio']:.3f}) {'ok' if r['ok'] else 'OFF'}")
        else:
            print(f"{r['run']:<42s} planned {r['planned_gib']:7.2f} GiB measured {r['measured_gib']} GiB "
                  f"ratio {r.get('ratio')} ; activations planned {r['planned_saved_gib']} saved "
                  f"{r['saved_activations_gib']} GiB")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "plan_vs_measured.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r.get("ok") is False or "error" in r]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
