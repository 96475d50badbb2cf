"""LoRA (issue 30), side by side in one process: the trainer step against plain transformers +
peft, the paged engine's adapter switch, and its decode speed with and without an adapter.

Consumes nothing (random weights from the real ``transformers`` config classes, random token
ids); emits a table on stdout and JSON to ``--out`` / ``$OUT/lora.json``. Sections
(``--only``, default all):

* ``trainer``: Qwen2-7B's shape (28 layers, width 3584, 28/4 heads, MLP 18944, vocab 152,064,
  untied), a rank-16 adapter on every linear layer, one step of 4 x 2048 tokens (batch
  ``--batch``). ``hf+peft``: the issue's anchor, what a user has without Tapioca -- the bf16
  model, ``peft.get_peft_model`` (LoRA r 16, alpha 16, all-linear; peft keeps the adapter
  in fp32), gradient checkpointing (``use_reentrant=False``), bf16 autocast, full logits +
  fp32 log-softmax of the sampled tokens times the advantage, fused AdamW over the adapter
  (issue 30 measured 7.1k tok/s, 32.7 GiB on one H200). ``ours``: PPOActor with
  ``actor.lora.enabled`` on the packed forward (flash varlen / sdpa, liger kernels, the Triton
  logprob kernel, bf16 weights with fp32 master weights of the adapter, fused AdamW) with
  gradient checkpointing every layer (``ac``), every second layer (``ac/2``) and none.
  Target: >= 1.5x the tokens/s of hf+peft at <= its peak memory.
* ``switch``: the paged engine on the 7B shape (bf16, CUDA graphs) switching to a new r-16
  adapter (merge at the switch from its kept base copy: one addmm per projection): the
  first switch (cold: it copies the base of every targeted weight) and ``--repeats`` warm
  ones, wall ms of ``engine.update_adapter`` with the adapter's tensors already on the GPU
  (what the ipc / nccl receiver hands it); next to a whole-weights update of the same
  engine (device to device). Target: warm < 10 ms. Peak memory before and after the base
  copy (its cost: the targeted weights once more, ~13 GB at 7B in bf16).
* ``engine``: workload (a) of benchmarks/engine_generate.py (Qwen2-0.5B shape, 256 x (128 +
  256), temperature 1) on the paged engine without and with a merged r-16 adapter. A
  merged adapter runs the same decode graph as the base, so the ratio measures noise;
  target >= 0.9x.

GPU (one H200; liger-kernel and peft installed; ~4 min):

    python benchmarks/lora.py --device cuda

CPU self-check (tiny shapes, ~1 min): ``python benchmarks/lora.py --smoke``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from engine_generate import (  # noqa: E402
    QWEN2_05B_SHAPE,
    TINY_SHAPE,
    engine_fn,
    env_info,
    make_workloads,
    measure,
    out_path,
    peak_gib,
    print_table,
    sync,
    write_json,
)
from trainer_systems import MAX_GRAD_NORM, actor_config, fixed_batch  # noqa: E402

from tapioca.config.lora import LoraConfig, LoraSpec  # noqa: E402
from tapioca.config.policy import PolicySpec  # noqa: E402
from tapioca.engines.paged_engine import PagedEngine  # noqa: E402
from tapioca.models.factory import build_tiny_model  # noqa: E402
from tapioca.models.forward import autocast_context  # noqa: E402
from tapioca.models.lora import LoraAdapter, adapter_state_dict, apply_lora  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402

QWEN2_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                num_kv_heads=4, max_position_embeddings=32768)
TINY = dict(TINY_SHAPE, tie_word_embeddings=False)
RANK = 16
LR = 1e-5
FAST = dict(packed_sequences=True, param_dtype="bfloat16", autocast_dtype="", attention_backend="auto",
            liger_kernels=True, logprob_kernel="auto", fused_optimizer=True, logprob_chunk_tokens=8192,
            logprob_keep_logits=False, mb_max_tokens=16384,
            lora=LoraConfig(enabled=True, rank=RANK, alpha=RANK))


def build(shape: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    kw = dict(shape)
    vocab = kw.pop("vocab_size")
    kw.setdefault("tie_word_embeddings", False)
    model = build_tiny_model(vocab, seed=0, dtype=dtype, device=device, **kw)
    model.set_attn_implementation("sdpa")  # no flash-attn package on the GPU box
    return model


def reset(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def timed_steps(step, device: str, repeats: int) -> dict:
    t0 = time.perf_counter()
    step()  # warm-up: Triton JIT, allocator
    sync(device)
    warm = time.perf_counter() - t0
    reset(device)
    walls = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        walls.append(time.perf_counter() - t0)
    return {"warmup_s": round(warm, 2), "wall_s": round(statistics.median(walls), 4),
            "wall_s_all": [round(w, 4) for w in walls], "peak_mem_gib": peak_gib(device)}


# ------------------------------------------------------------------ trainer

def hf_peft_step(model, batch, device: str):
    """The anchor: transformers + peft as a user writes it (see the module docstring)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    peft_model = get_peft_model(model, PeftLoraConfig(r=RANK, lora_alpha=RANK, target_modules="all-linear",
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW(params, lr=LR, fused=True if cuda else None)
    ids_BT = torch.tensor(batch.ids, device=device)
    adv_B = torch.tensor(batch.advantages, device=device)
    mask_BT = torch.zeros(ids_BT.shape[0], ids_BT.shape[1] - 1, device=device)
    for b, p in enumerate(batch.prompt_lens):
        mask_BT[b, p - 1:] = 1.0

    def run() -> None:
        peft_model.train()
        with autocast_context(device, "bfloat16" if cuda else ""):
            logits_BTV = peft_model(input_ids=ids_BT, use_cache=False).logits
        logp_BT = logits_BTV[:, :-1].float().log_softmax(-1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
        loss = -(logp_BT * adv_B[:, None] * mask_BT).sum() / mask_BT.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run, sum(p.numel() for p in params)


def ours_step(model, batch, device: str, **overrides):
    if not device.startswith("cuda"):  # Triton kernels need CUDA
        overrides = dict(overrides, liger_kernels=False)
    cfg = actor_config(device, lr=LR, **dict(FAST, **overrides))
    spec = LoraSpec(peft_type="lora", rank=RANK, alpha=RANK, target_modules=("all-linear",), name="lora",
                    max_rank=64, max_loaded=3)
    actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=device,
                     policy=PolicySpec(adapter=spec))
    items = batch.items(model.config.vocab_size)

    def run() -> None:
        actor.train_step(items, policy_version=0)
    return run, sum(v.numel() for v in adapter_state_dict(actor.model).values()), actor


def section_trainer(args) -> dict:
    shape = TINY if args.smoke else QWEN2_7B
    n, length = (2, 64) if args.smoke else args.batch
    batch = fixed_batch(n, length, min(128, length // 4), shape["vocab_size"], 0)
    out: dict = {"shape": "tiny" if args.smoke else "qwen2-7b", "rank": RANK, "batch": batch.name,
                 "real_tokens": batch.real_tokens}
    variants = [("hf+peft", None), ("ours ac", dict(gradient_checkpointing=True)),
                ("ours ac/2", dict(gradient_checkpointing=True, gradient_checkpointing_every_n_layers=2)),
                ("ours", {})]
    for name, opts in variants:
        reset(args.device)
        try:
            model = build(shape, torch.bfloat16, args.device)
            if opts is None:
                step, n_adapter = hf_peft_step(model, batch, args.device)
                kernels = "HF forward + peft, full logits"
            else:
                step, n_adapter, actor = ours_step(model, batch, args.device, **opts)
                kernels = actor.packed.describe()
            row = timed_steps(step, args.device, args.repeats)
            row.update(kernels=kernels, adapter_params=n_adapter,
                       tokens_per_s=round(batch.real_tokens / row["wall_s"], 1))
        except Exception as exc:  # an OOM of one variant must not lose the others
            row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out[name] = row
        del model
        step = None
        print(name, row, flush=True)
    base = out["hf+peft"]
    for name, _ in variants[1:]:
        r = out[name]
        if "tokens_per_s" in r and "tokens_per_s" in base:
            r["speedup_vs_hf_peft"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
            if r["peak_mem_gib"] is not None:
                r["peak_mem_vs_hf_peft_gib"] = round(r["peak_mem_gib"] - base["peak_mem_gib"], 2)
    return out


# ------------------------------------------------------------------ engine

def random_adapter(model: torch.nn.Module, seed: int, device: str) -> LoraAdapter:
    """An r-16 all-linear adapter for ``model``'s shape with random (non-zero) A and B, its
    tensors on ``device`` (a meta copy of the model names them; no second model)."""
    with torch.device("meta"):
        ghost = type(model)(model.config)
    targets = apply_lora(ghost, rank=RANK, alpha=RANK, target_modules=["all-linear"])
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=g, device=device, dtype=torch.bfloat16) * 0.01
               for k, v in adapter_state_dict(ghost).items()}
    return LoraAdapter(name=f"lora-v{seed}", rank=RANK, alpha=float(RANK), target_modules=targets, tensors=tensors)


def section_switch(args) -> dict:
    shape = TINY if args.smoke else QWEN2_7B
    reset(args.device)
    model = build(shape, torch.bfloat16 if args.device.startswith("cuda") else torch.float32, args.device)
    engine = PagedEngine(model, device=args.device, kv_cache_tokens=8192, max_batch_size=64,
                         cuda_graphs=args.device.startswith("cuda"))
    adapters = [random_adapter(model, s, args.device) for s in range(1, 3)]
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters[0].tensors.values())
    del model
    out: dict = {"shape": "tiny" if args.smoke else "qwen2-7b", "rank": RANK,
                 "adapter_mib": round(adapter_bytes / 2**20, 1),
                 "mem_before_gib": round(torch.cuda.memory_allocated() / 2**30, 2)
                 if args.device.startswith("cuda") else None}
    try:
        def switch(v: int) -> float:
            sync(args.device)
            t0 = time.perf_counter()
            engine.update_adapter(adapters[v % 2], v)
            sync(args.device)
            return (time.perf_counter() - t0) * 1000

        out["cold_ms"] = round(switch(1), 2)
        if args.device.startswith("cuda"):
            out["mem_after_base_copy_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        warm = [switch(v) for v in range(2, 2 + args.switches)]
        out["warm_ms_median"] = round(statistics.median(warm), 2)
        out["warm_ms_all"] = [round(w, 2) for w in warm]
        full = {k: v.clone() for k, v in engine.decoder.hf_state_dict().items()}
        sync(args.device)
        t0 = time.perf_counter()
        engine.update_weights(full, 1000)
        sync(args.device)
        out["whole_weights_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        del full
    finally:
        engine.shutdown()
    print("switch", out, flush=True)
    return out


def section_engine(args) -> dict:
    shape = dict(TINY_SHAPE if args.smoke else QWEN2_05B_SHAPE)
    vocab = shape["vocab_size"]
    wa = argparse.Namespace(workloads="a", seed=0, n_seqs=16 if args.smoke else 256,
                            prompt_len=16 if args.smoke else 128, new_tokens=16 if args.smoke else 256)
    w = make_workloads(wa, vocab)["a"]
    out: dict = {"workload": f"a: {w.rows} x ({wa.prompt_len} + {wa.new_tokens})"}
    reset(args.device)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    kw = dict(shape)
    kw.pop("vocab_size")
    model = build_tiny_model(vocab, seed=0, dtype=dtype, device=args.device, **kw)
    adapter = random_adapter(model, 7, args.device)
    engine = PagedEngine(model, device=args.device, max_batch_size=w.rows,
                         kv_cache_tokens=w.rows * (wa.prompt_len + wa.new_tokens + 32),
                         cuda_graphs=args.device.startswith("cuda"))
    del model
    try:
        out["base"] = measure(engine_fn(engine, w), args.device, args.repeats)
        engine.update_adapter(adapter, 1)
        out["adapter"] = measure(engine_fn(engine, w), args.device, args.repeats)
    finally:
        engine.shutdown()
    out["adapter_vs_base"] = round(out["adapter"]["tokens_per_s"] / out["base"]["tokens_per_s"], 3)
    print("engine", out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU self-check)")
    ap.add_argument("--only", default="trainer,switch,engine")
    ap.add_argument("--batch", default="4x2048", help="trainer batch: SEQSxTOKENS")
    ap.add_argument("--repeats", type=int, default=None, help="timed trainer steps / engine runs")
    ap.add_argument("--switches", type=int, default=10, help="warm adapter switches timed")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.batch = tuple(int(x) for x in args.batch.split("x"))
    if args.repeats is None:
        args.repeats = 2 if args.smoke else 3
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    results: dict = {"env": env_info(args.device), "smoke": args.smoke}
    for name, fn in (("trainer", section_trainer), ("switch", section_switch), ("engine", section_engine)):
        if name in args.only.split(","):
            try:
                results[name] = fn(args)
            except Exception as exc:
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                print(name, results[name], flush=True)
    print()
    t = results.get("trainer", {})
    rows = [[k, v.get("tokens_per_s"), v.get("peak_mem_gib"), v.get("speedup_vs_hf_peft"), v.get("wall_s"),
             (v.get("error") or v.get("kernels", ""))[:50]]
            for k, v in t.items() if isinstance(v, dict)]
    if rows:
        print_table(["trainer (r16 all-linear)", "tokens/s", "peak GiB", "x hf+peft", "step s",
                     "kernels / error"], rows)
    s = results.get("switch", {})
    if "warm_ms_median" in s:
        print(f"\nadapter switch ({s['shape']}, r {RANK}, {s['adapter_mib']} MiB): cold {s['cold_ms']} ms, "
              f"warm {s['warm_ms_median']} ms (target < 10), whole weights {s['whole_weights_ms']} ms")
    e = results.get("engine", {})
    if "adapter_vs_base" in e:
        print(f"paged engine, workload {e['workload']}: {e['base']['tokens_per_s']} tok/s base, "
              f"{e['adapter']['tokens_per_s']} with an adapter ({e['adapter_vs_base']}x, target >= 0.9)")
    write_json(out_path(args, "lora"), results)


if __name__ == "__main__":
    main()
