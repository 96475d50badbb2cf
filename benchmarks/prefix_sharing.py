"""Tree training (``actor.enable_tree_training``, prefix sharing) against plain packing on
a GRPO step: issue 28's shape, 1,024-token prompts x 8 samples x 512-token answers.

Consumes nothing (random weights from the real ``transformers`` config classes, random
token ids; the samples of a group share their prompt token for token, as a GRPO group
does); emits a table on stdout and JSON to ``--out`` and ``$OUT/prefix_sharing.json``.

Per model shape, the same PPOActor step (the fast configuration of
``benchmarks/trainer_step.py``) with tree training off and on, in one process:

* tokens/s: the sequences' tokens (prompt counted once per sample, as without sharing)
  over the step's wall time (median of ``--steps`` after one warm-up); the ratio is the
  speed-up (target >= 2x on one H200);
* the FLOPs of one step, counted from the shapes (6 x matmul parameters x tokens for the
  decoder body, 6 x H x V per scored row for the LM head, 12 x heads x head_dim per
  attended query-key pair and layer) with and without sharing: the reduction is what the
  kernels can give at best;
* peak memory, the step's micro-batches and its ``actor/tree_tokens_frac``.

Then one gradient check on the first shape: the same weights, the same batch, one step
each way (lr ~ 0): relative L2 error of all gradients, tree against unshared (bf16 on
the GPU: rounding only; fp32 on the CPU: ~1e-7).

    python benchmarks/prefix_sharing.py --device cuda          # 0.5B and 1.5B, 4 groups; ~2 min
    python benchmarks/prefix_sharing.py --smoke --device cpu   # a tiny Qwen2, 2 groups of 64 x 4 x 32
    python benchmarks/prefix_sharing.py --smoke --shapes small --device cpu   # 256 hidden, 2 x 256 x 4 x 128
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from engine_generate import H200_BF16_DENSE_TFLOPS, env_info, print_table, timed, write_json  # noqa: E402
from trainer_step import FAST, FAST_BIG, M05, M15, cpu_safe, reset  # noqa: E402
from trainer_systems import SHAPES, TINY, actor_config, compare, param_counts  # noqa: E402
from trainer_systems import build as build_shape  # noqa: E402

from tapioca.trainers.batching import SeqItem  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402
from tapioca.trainers.prefix_packing import tree_tokens  # noqa: E402

# CPU shapes for --smoke: the plumbing one, and one big enough that compute, not
# per-call overhead, sets the step time (CPU figures of the speed-up).
SMOKE_SHAPES = {"tiny": TINY, "small": dict(TINY, hidden_size=256, intermediate_size=1024, num_layers=4)}


def shape_kw(shape: str, smoke: bool) -> dict:
    return dict(SMOKE_SHAPES[shape] if smoke else SHAPES[shape])


def build(shape: str, smoke: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    if not smoke:
        return build_shape(shape, False, dtype, device)
    from tapioca.models.factory import build_tiny_model

    kw = shape_kw(shape, True)
    vocab = kw.pop("vocab_size")
    return build_tiny_model(vocab, seed=0, dtype=dtype, device=device, max_position_embeddings=4096, **kw)


def grpo_items(n_groups: int, prompt_len: int, samples: int, answer_len: int, vocab: int,
               seed: int) -> list[SeqItem]:
    """``n_groups`` groups of ``samples`` sequences: one random prompt per group, one
    random answer per sample, advantages +-1, behaviour logprobs of -log(V) (on-policy)."""
    rng = random.Random(seed)
    items = []
    for g in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for _ in range(samples):
            answer = [rng.randrange(vocab) for _ in range(answer_len)]
            items.append(SeqItem(group_id=f"g{g}", input_ids=prompt + answer, prompt_len=prompt_len,
                                 behav_logprobs=[-math.log(vocab)] * answer_len, versions=[0] * answer_len,
                                 loss_mask=[1] * answer_len, advantage=rng.choice((-1.0, 1.0)), reward=0.0))
    return items


def step_flops(kw: dict, counts: dict, items: list[SeqItem], shared: bool) -> dict:
    """FLOPs of one training step (forward + backward = 3x forward) from the shapes."""
    hidden, layers = kw["hidden_size"], kw["num_layers"]
    heads, head_dim = kw["num_heads"], kw.get("head_dim") or kw["hidden_size"] // kw["num_heads"]
    vocab = kw["vocab_size"]
    groups: dict[str, list[SeqItem]] = {}
    for it in items:
        groups.setdefault(it.group_id, []).append(it)
    tokens = pairs = 0
    for members in groups.values():
        for it in members:
            L, P = it.length, it.prompt_len
            if shared:  # the prompt once per group (below); each answer attends prompt + itself
                n = L - P
                tokens += n
                pairs += n * P + n * (n + 1) // 2
            else:
                tokens += L
                pairs += L * (L + 1) // 2
        if shared:  # every member shares the group's prompt here (grpo_items)
            P = members[0].prompt_len
            tokens += P
            pairs += P * (P + 1) // 2
    scored = sum(it.length - it.prompt_len for it in items)
    body = 6 * (counts["matmul"] - hidden * vocab) * tokens
    head = 6 * hidden * vocab * scored
    attn = 3 * 4 * heads * head_dim * pairs * layers
    return {"tokens": tokens, "attended_pairs": pairs, "body_flop": body, "head_flop": head,
            "attention_flop": attn, "total_flop": body + head + attn}


def run_one(shape: str, items: list[SeqItem], opts: dict, args) -> dict:
    device = args.device
    cfg = actor_config(device, **dict(dict(mb_max_tokens=args.mb_tokens), **opts))
    reset(device)
    model = build(shape, args.smoke, getattr(torch, cfg.param_dtype), device)
    actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=device)
    metrics: dict = {}

    def step() -> int:
        metrics.update(actor.train_step(items, policy_version=0).metrics)
        return 0

    t0 = time.perf_counter()
    timed(step, device)
    warmup = time.perf_counter() - t0
    reset(device)
    walls = [timed(step, device)[1] for _ in range(args.steps)]
    wall = statistics.median(walls)
    tokens = sum(it.length for it in items)
    counts = param_counts(model)
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None
    return {"shape": shape, "tree": bool(opts.get("enable_tree_training")), "wall_s": round(wall, 4),
            "wall_s_all": [round(w, 4) for w in walls], "warmup_s": round(warmup, 1),
            "tokens_per_s": round(tokens / wall, 1), "peak_mem_gib": peak,
            "micro_batches": metrics.get("actor/micro_batches"),
            "tree_tokens_frac": metrics.get("actor/tree_tokens_frac"), "params": counts,
            "kernels": actor.packed.describe() if actor.packed is not None else "padded HF forward"}


def grad_check(shape: str, items: list[SeqItem], opts: dict, args) -> dict:
    """Same weights and batch, one step unshared and one shared: all gradients compared."""
    device = args.device
    base = build(shape, args.smoke, getattr(torch, opts.get("param_dtype", "float32")), device)
    out = {}
    for tree in (False, True):
        model = copy.deepcopy(base)
        cfg = actor_config(device, **dict(opts, mb_max_tokens=args.mb_tokens, lr=1e-30, max_grad_norm=1e30,
                                          enable_tree_training=tree))
        actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=device)
        loss = actor.train_step(items, policy_version=0).metrics["actor/loss"]
        out[tree] = (loss, [p.grad.detach().float().clone() for p in model.parameters()])
        del actor, model
    del base
    reset(device)
    return compare(*out[True], *out[False])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model and shapes (CPU self-check)")
    ap.add_argument("--shapes", default=f"{M05},{M15}", help="comma list of model shapes (trainer_systems.SHAPES)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=512)
    ap.add_argument("--mb-tokens", type=int, default=16384, help="actor.mb_max_tokens")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attention-backend", default="auto", help="actor.attention_backend (auto: FA4 where installed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--flops-only", action="store_true",
                    help="print the FLOPs of a step with and without sharing (no step runs; any machine)")
    args = ap.parse_args()
    if args.smoke:  # CPU: "tiny" by default (plumbing), "small" for a compute-bound CPU figure
        args.shapes = args.shapes if args.shapes in SMOKE_SHAPES else "tiny"
        small = args.shapes == "small"
        args.groups, args.prompt_tokens, args.samples, args.answer_tokens = \
            (2, 256, 4, 128) if small else (2, 64, 4, 32)
        args.mb_tokens = min(args.mb_tokens, 4096 if small else 512)
    cuda = args.device.startswith("cuda")
    start = time.perf_counter()
    print(f"{env_info(args.device)}; {args.groups} groups x {args.prompt_tokens} prompt x {args.samples} samples "
          f"x {args.answer_tokens} answer, mb {args.mb_tokens}", flush=True)
    vocab = TINY["vocab_size"] if args.smoke else SHAPES[M05]["vocab_size"]
    items = grpo_items(args.groups, args.prompt_tokens, args.samples, args.answer_tokens, vocab, args.seed)
    flat_tokens = sum(it.length for it in items)
    print(f"tokens: {flat_tokens} unshared, {tree_tokens([it.input_ids for it in items])} in the prefix tree",
          flush=True)
    results, flops = [], {}
    if args.flops_only:
        for shape in args.shapes.split(","):
            kw = shape_kw(shape, args.smoke)
            counts = param_counts(build(shape, args.smoke, torch.bfloat16, "meta"))
            f, t = (step_flops(kw, counts, items, shared) for shared in (False, True))
            print(f"{shape}: TFLOP/step {f['total_flop'] / 1e12:.2f} -> {t['total_flop'] / 1e12:.2f} "
                  f"(/{f['total_flop'] / t['total_flop']:.2f}); body /{f['body_flop'] / t['body_flop']:.2f}, "
                  f"attention /{f['attention_flop'] / t['attention_flop']:.2f}, LM head x1 "
                  f"({t['head_flop'] / t['total_flop']:.0%} of the shared step); tokens {f['tokens']} -> {t['tokens']}")
        return
    for shape in args.shapes.split(","):
        base = FAST_BIG if shape not in (M05, *SMOKE_SHAPES) else FAST
        base = base if cuda else cpu_safe("actor", dict(base, param_dtype="float32"))
        base = dict(base, attention_backend=args.attention_backend)
        kw = shape_kw(shape, args.smoke)
        for tree in (False, True):
            try:
                r = run_one(shape, items, dict(base, enable_tree_training=tree), args)
            except Exception as e:  # noqa: BLE001 -- an OOM or a kernel failure is a result too
                r = {"shape": shape, "tree": tree, "error": f"{type(e).__name__}: {e}"[:500]}
            results.append(r)
            print(r, f"[{time.perf_counter() - start:.0f} s]", flush=True)
            if "params" in r:
                flops[(shape, tree)] = step_flops(kw, r["params"], items, tree)
    rows = []
    for r in results:
        f = flops.get((r["shape"], r["tree"]), {})
        mfu = None
        if "wall_s" in r and cuda:
            mfu = round(100 * f["total_flop"] / 1e12 / r["wall_s"] / H200_BF16_DENSE_TFLOPS, 1)
        rows.append([f"{r['shape']} {'tree' if r['tree'] else 'flat'}", r.get("tokens_per_s", r.get("error", "")[:40]),
                     r.get("wall_s"), f.get("tokens"), f"{f['total_flop'] / 1e12:.4g}" if f else None, mfu,
                     r.get("peak_mem_gib"),
                     r.get("micro_batches")])
    print()
    print_table(["run", "tokens/s", "step s", "computed tokens", "TFLOP/step", "MFU % (computed)", "peak GiB",
                 "micro-batches"], rows)
    summary = {}
    for shape in args.shapes.split(","):
        flat, tree = ([r for r in results if r["shape"] == shape and r["tree"] is t and "wall_s" in r]
                      for t in (False, True))
        if flat and tree:
            speed = tree[0]["tokens_per_s"] / flat[0]["tokens_per_s"]
            reduction = flops[(shape, False)]["total_flop"] / flops[(shape, True)]["total_flop"]
            summary[shape] = {"speedup": round(speed, 3), "flop_reduction": round(reduction, 3),
                              "token_reduction": round(flops[(shape, False)]["tokens"]
                                                       / flops[(shape, True)]["tokens"], 3)}
            print(f"  {shape}: tree / flat tokens/s = {speed:.2f}x (target >= 2x on one H200); FLOPs "
                  f"/{reduction:.2f}, tokens /{summary[shape]['token_reduction']:.2f}")
    check = None
    first = args.shapes.split(",")[0]
    try:
        opts = dict(FAST if cuda else cpu_safe("actor", dict(FAST, param_dtype="float32")))
        check = grad_check(first, items if args.smoke else items[: 2 * args.samples], opts, args)
        print(f"gradients, tree vs flat at {first}: rel L2 {check['grad_rel_l2']:.2e}, worst param "
              f"{check['grad_rel_l2_worst_param']:.2e}, min cosine {check['grad_cosine_min']:.6f}, loss "
              f"{check['loss_rel_diff']:.2e}", flush=True)
    except Exception as e:  # noqa: BLE001
        check = {"error": f"{type(e).__name__}: {e}"[:500]}
        print("gradient check failed:", check["error"], flush=True)
    payload = {"benchmark": "prefix_sharing", "env": env_info(args.device),
               "elapsed_s": round(time.perf_counter() - start, 1),
               "shape": {"groups": args.groups, "prompt_tokens": args.prompt_tokens, "samples": args.samples,
                         "answer_tokens": args.answer_tokens, "mb_max_tokens": args.mb_tokens},
               "results": results, "flops": {f"{s} {'tree' if t else 'flat'}": v for (s, t), v in flops.items()},
               "summary": summary, "grad_check": check}
    write_json(args.out, payload)
    if os.environ.get("OUT"):
        write_json(str(Path(os.environ["OUT"]) / "prefix_sharing.json"), payload)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
