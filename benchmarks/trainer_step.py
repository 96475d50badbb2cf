"""Trainer step, DESIGN.md §9 row 2: plain HF full-logits training vs ``PPOActor.train_step``.

Consumes nothing (random weights, random token ids); emits a table on stdout and, with
``--out``, a JSON file. Same model as ``benchmarks/engine_generate.py`` (Qwen2-0.5B
shape, random weights, sdpa attention), fp32 master weights + AdamW, forward/backward
under ``--dtype`` autocast (bfloat16 on cuda, off for float32), one batch of ``--n-seqs``
x ``--seq-len`` tokens (the first ``--prompt-len`` of each a "prompt": not trained).

(a) baseline: ``model(ids).logits`` over the full vocabulary, ``.float().log_softmax(-1)``,
    gather the next-token logprobs, policy-gradient loss ``-(logp * A)`` token-mean over
    the trained tokens, backward, grad clip, ``AdamW.step``.
(b) Tapioca: :meth:`tapioca.trainers.ppo_actor.PPOActor.train_step` on the same
    sequences as :class:`~tapioca.trainers.batching.SeqItem` (decoupled PPO, pi_prox from
    the training forward, chunked logprobs + entropy from hidden states, never [B,T,V]
    fp32 logits), one micro-batch of ``--mb-tokens`` (default: the whole batch).

Each gets a fresh model (same seed), one warm-up step, then ``--steps`` timed steps
(median reported). tokens/s = n_seqs x seq_len / step wall time. TFLOP/s = 6·N·D / time
with D = tokens per step and N = matmul parameters = non-embedding parameters + the LM
head (vocab x hidden; tied to the embedding here, so N = all 494M parameters, the
convention of DESIGN §9's 265 TFLOP/s baseline); attention's own FLOPs are not counted.
The JSON also has MFU with N = non-embedding parameters only. MFU = TFLOP/s / 989 (H200
bf16 dense peak). Peak memory = ``torch.cuda.max_memory_allocated`` over the timed steps
(weights, grads and AdamW state included), reset between (a) and (b).

On the GPU box:

    python benchmarks/trainer_step.py --device cuda --out trainer_step.json

CPU self-check (< 1 min): ``python benchmarks/trainer_step.py --tiny --device cpu``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's helpers
from engine_generate import (  # noqa: E402
    H200_BF16_DENSE_TFLOPS, QWEN2_05B_SHAPE, TINY_SHAPE, add_common_args, build_model, env_info, fill_defaults, measure,
    print_table, reset_peak, write_json,
)

from tapioca.config.schema import ActorConfig  # noqa: E402
from tapioca.models.forward import autocast_context  # noqa: E402
from tapioca.trainers.batching import SeqItem  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402

LR = 1e-6
MAX_GRAD_NORM = 1.0


def param_counts(model: torch.nn.Module) -> dict:
    total = sum(p.numel() for p in model.parameters())  # a tied weight is counted once
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    return {"total": total, "non_embedding": total - embed, "matmul": total - embed + head}


def hf_baseline_fn(model, ids_BT, adv_B, prompt_len: int, autocast_dtype: str, device: str):
    """One full-logits training step per call (the DESIGN §9 baseline)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # same defaults as PPOActor's AdamW
    ones_BT = torch.ones_like(ids_BT)
    # Position t predicts token t+1; trained positions predict the non-prompt tokens.
    mask_BT = torch.zeros(ids_BT.shape[0], ids_BT.shape[1] - 1, device=device)
    mask_BT[:, prompt_len - 1:] = 1.0

    def run() -> int:
        model.train()
        with autocast_context(device, autocast_dtype):
            logits_BTV = model(input_ids=ids_BT, attention_mask=ones_BT).logits
        logp_BTV = logits_BTV[:, :-1].float().log_softmax(-1)  # full fp32 logits
        logp_BT = logp_BTV.gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
        loss = -(logp_BT * adv_B[:, None] * mask_BT).sum() / mask_BT.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return ids_BT.numel()
    return run


def ppo_actor_fn(model, ids_BT, adv_B, prompt_len: int, autocast_dtype: str, device: str,
                 mb_tokens: int, chunk_tokens: int):
    """One ``PPOActor.train_step`` per call, on the same sequences as the baseline."""
    cfg = ActorConfig(lr=LR, max_grad_norm=MAX_GRAD_NORM, mb_max_tokens=mb_tokens,
                      logprob_chunk_tokens=chunk_tokens, autocast_dtype=autocast_dtype,
                      device=device)
    actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=device)
    vocab = model.config.vocab_size
    n_out = ids_BT.shape[1] - prompt_len
    # A random model's logprobs are close to uniform: behaviour logprobs of -log(V) keep
    # the pi_prox/pi_behav weights near 1, as in a real on-policy step.
    items = [SeqItem(group_id=f"g{b // 8}", input_ids=row, prompt_len=prompt_len,
                     behav_logprobs=[-math.log(vocab)] * n_out, versions=[0] * n_out,
                     loss_mask=[1] * n_out, advantage=float(adv_B[b]), reward=0.0)
             for b, row in enumerate(ids_BT.tolist())]

    def run() -> int:
        result = actor.train_step(items, policy_version=0)
        if result.n_tokens != len(items) * n_out:
            raise RuntimeError(f"PPOActor trained {result.n_tokens} tokens, expected {len(items) * n_out}")
        return sum(it.length for it in items)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--n-seqs", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (prompt + output)")
    ap.add_argument("--prompt-len", type=int, default=None, help="leading tokens not trained")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up")
    ap.add_argument("--mb-tokens", type=int, default=None, help="actor.mb_max_tokens (default: whole batch)")
    ap.add_argument("--chunk-tokens", type=int, default=4096, help="actor.logprob_chunk_tokens")
    ap.add_argument("--skip-hf", action="store_true", help="measure PPOActor only")
    args = fill_defaults(ap.parse_args(),
                         full=dict(n_seqs=16, seq_len=1024, prompt_len=128, steps=3, repeats=1),
                         tiny=dict(n_seqs=4, seq_len=128, prompt_len=16, steps=2, repeats=1))
    if args.repeats != 1:
        ap.error("use --steps for the number of timed steps")
    mb_tokens = args.mb_tokens or args.n_seqs * args.seq_len
    autocast_dtype = "" if args.dtype == "float32" else args.dtype
    device = args.device
    gen = torch.Generator().manual_seed(args.seed)
    vocab_size = (TINY_SHAPE if args.tiny else QWEN2_05B_SHAPE)["vocab_size"]
    ids_BT = torch.randint(0, vocab_size, (args.n_seqs, args.seq_len), generator=gen).to(device)
    adv_B = (torch.randint(0, 2, (args.n_seqs,), generator=gen) * 2 - 1).float().to(device)
    tokens_per_step = args.n_seqs * args.seq_len

    systems = {
        "hf_full_logits": lambda m: hf_baseline_fn(m, ids_BT, adv_B, args.prompt_len,
                                                   autocast_dtype, device),
        "ppo_actor": lambda m: ppo_actor_fn(m, ids_BT, adv_B, args.prompt_len, autocast_dtype,
                                            device, mb_tokens, args.chunk_tokens),
    }
    if args.skip_hf:
        systems.pop("hf_full_logits")
    results: dict[str, dict] = {}
    counts = None
    for name, make in systems.items():
        reset_peak(device)
        model = build_model(args.tiny, torch.float32, device)  # fp32 master weights
        counts = param_counts(model)
        if name == "hf_full_logits":
            print(f"model: {counts['total'] / 1e6:.1f}M params (non-embedding "
                  f"{counts['non_embedding'] / 1e6:.1f}M, matmul N {counts['matmul'] / 1e6:.1f}M), "
                  f"fp32 weights, autocast {autocast_dtype or 'off'}, {device}; "
                  f"{args.n_seqs} x {args.seq_len} tokens per step", flush=True)
        try:
            r = measure(make(model), device, args.steps)
        except torch.cuda.OutOfMemoryError as e:  # the baseline may not fit: record it
            r = {"error": f"CUDA out of memory: {str(e).splitlines()[0]}"}
        if "tokens_per_s" in r:
            for key, n in (("", counts["matmul"]), ("_non_embedding", counts["non_embedding"])):
                tflops = 6 * n * r["tokens_per_s"] / 1e12
                r[f"tflops_6nd{key}"] = round(tflops, 2)
                r[f"mfu{key}"] = round(tflops / H200_BF16_DENSE_TFLOPS, 4)
        results[name] = r
        print(name, r, flush=True)
        del model, make
        reset_peak(device)

    names = {"hf_full_logits": "HF fwd/bwd + AdamW, full logits", "ppo_actor": "PPOActor.train_step"}
    print()
    print_table(["system", "step s", "tokens/s", "TFLOP/s 6ND", "MFU %", "peak GiB"],
                [[names[k], r.get("wall_s", r.get("error")), r.get("tokens_per_s"), r.get("tflops_6nd"),
                  round(100 * r["mfu"], 1) if "mfu" in r else None, r.get("peak_mem_gib")]
                 for k, r in results.items()])
    print(f"\nN = {counts['matmul']:,} matmul params (non-embedding + LM head), "
          f"D = {tokens_per_step:,} tokens/step, peak {H200_BF16_DENSE_TFLOPS:g} TFLOP/s "
          "(DESIGN §9 target: >= 45% MFU, <= 40 GiB)")
    write_json(args.out, {
        "benchmark": "trainer_step", "env": env_info(device), "param_counts": counts,
        "config": {k: getattr(args, k) for k in ("tiny", "dtype", "n_seqs", "seq_len", "prompt_len",
                                                 "steps", "chunk_tokens", "seed")}
                  | {"mb_tokens": mb_tokens, "lr": LR, "tokens_per_step": tokens_per_step},
        "results": results})


if __name__ == "__main__":
    main()
