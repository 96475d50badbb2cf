"""The sharded trainer's step on one device: ``PPOActor`` vs ``ShardedActor`` (FSDP2,
world size 1), side by side in one process.

Consumes nothing (random weights and token ids); emits a table on stdout and JSON to
``$OUT/fsdp_step.json`` (or ``--out``). What it shows on one GPU: the cost of the FSDP2
path itself (the root and per-layer units, bf16 mixed precision with fp32 master
weights and fp32 gradient reduction, the planner, the JSON control channel, the
global-unit gradient scaling), not data-parallel speed-up, which needs 2+ GPUs (a
separate measurement). Also timed for the sharded actor: gathering the whole weights
for the publisher (``full_state_dict``) and one sharded checkpoint (safetensors via
torch.distributed.checkpoint) to a temporary directory.

(a) ``ppo_actor``: PPOActor.train_step, fp32 weights, bf16 autocast (today's trainer).
(b) ``sharded_ws1``: ShardedActor.train_step, world size 1 (nccl on CUDA, gloo on the
    CPU), fp32 sharded weights gathered in bf16 (``fsdp.param_dtype``), no autocast.

Both: Qwen2-0.5B shape (benchmarks/engine_generate.py), ``--n-seqs`` x ``--seq-len``
tokens, the first ``--prompt-len`` not trained, one warm-up then ``--steps`` timed steps.

On the GPU box (one H200, ~2-3 min):

    python benchmarks/fsdp_step.py --device cuda

CPU self-check (< 1 min): ``python benchmarks/fsdp_step.py --tiny --device cpu``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_generate import (  # noqa: E402
    H200_BF16_DENSE_TFLOPS,
    QWEN2_05B_SHAPE,
    TINY_SHAPE,
    add_common_args,
    build_model,
    env_info,
    fill_defaults,
    measure,
    print_table,
    reset_peak,
    sync,
    write_json,
)

from tapioca.config.distributed import FSDPConfig  # noqa: E402
from tapioca.config.optimizer import OptimizerConfig  # noqa: E402
from tapioca.config.schema import ActorConfig  # noqa: E402
from tapioca.trainers.batching import SeqItem  # noqa: E402
from tapioca.trainers.checkpoint import TrainerProgress  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402

LR = 1e-6


def make_items(ids_BT: torch.Tensor, adv_B: torch.Tensor, prompt_len: int, vocab: int) -> list[SeqItem]:
    n_out = ids_BT.shape[1] - prompt_len
    # Behaviour logprobs of -log(V): a random model's are about uniform, so the
    # pi_prox/pi_behav weights stay near 1 as in an on-policy step.
    return [SeqItem(group_id=f"g{b // 8}", input_ids=row, prompt_len=prompt_len,
                    behav_logprobs=[-math.log(vocab)] * n_out, versions=[0] * n_out,
                    loss_mask=[1] * n_out, advantage=float(adv_B[b]), reward=0.0)
            for b, row in enumerate(ids_BT.tolist())]


def step_fn(actor, items):
    n_train = sum(len(it.loss_mask) for it in items)

    def run() -> int:
        result = actor.train_step(items, policy_version=0)
        if result.n_tokens != n_train:
            raise RuntimeError(f"trained {result.n_tokens} tokens, expected {n_train}")
        return sum(it.length for it in items)
    return run


def sharded_actor(model, cfg: ActorConfig, device: str):
    from tapioca.trainers.fsdp_actor import ShardedActor
    from tapioca.trainers.fsdp_ranks import (
        Channel,
        RankInfo,
        free_port,
        init_process_groups,
        rank_device,
    )

    fsdp = FSDPConfig(world_size=1, param_dtype="bfloat16", grad_reduce_dtype="float32")
    info = RankInfo(0, 1, 0, "127.0.0.1", free_port("127.0.0.1"))
    dev = rank_device(device, info)  # cuda -> cuda:0 (nccl wants an indexed device)
    channel = Channel(init_process_groups(fsdp, info, dev), info)
    return ShardedActor(model, cfg, fsdp, channel=channel, temperature=1.0, pad_token_id=0, device=dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--n-seqs", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up")
    ap.add_argument("--mb-tokens", type=int, default=None, help="actor.mb_max_tokens (default 8192)")
    args = fill_defaults(ap.parse_args(),
                         full=dict(n_seqs=16, seq_len=1024, prompt_len=128, steps=3, repeats=1),
                         tiny=dict(n_seqs=4, seq_len=128, prompt_len=16, steps=2, repeats=1))
    if not args.out and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "fsdp_step.json")
    device = args.device
    mb_tokens = args.mb_tokens or 8192
    gen = torch.Generator().manual_seed(args.seed)
    vocab = (TINY_SHAPE if args.tiny else QWEN2_05B_SHAPE)["vocab_size"]
    ids_BT = torch.randint(0, vocab, (args.n_seqs, args.seq_len), generator=gen)
    adv_B = (torch.randint(0, 2, (args.n_seqs,), generator=gen) * 2 - 1).float()
    items = make_items(ids_BT, adv_B, args.prompt_len, vocab)
    tokens = args.n_seqs * args.seq_len
    bf16 = device.startswith("cuda") or args.dtype == "bfloat16"
    results: dict[str, dict] = {}
    n_params = None
    for name in ("ppo_actor", "sharded_ws1"):
        reset_peak(device)
        model = build_model(args.tiny, torch.float32, "cpu" if name == "sharded_ws1" else device)
        n_params = sum(p.numel() for p in model.parameters())
        if name == "ppo_actor":
            cfg = ActorConfig(optimizer=OptimizerConfig(lr=LR), mb_max_tokens=mb_tokens, device=device,
                              autocast_dtype="bfloat16" if bf16 else "")
            actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=device)
        else:
            cfg = ActorConfig(optimizer=OptimizerConfig(lr=LR), mb_max_tokens=mb_tokens, device=device)
            actor = sharded_actor(model, cfg, device)
        try:
            r = measure(step_fn(actor, items), device, args.steps)
        except torch.cuda.OutOfMemoryError as e:
            r = {"error": f"CUDA out of memory: {str(e).splitlines()[0]}"}
        if "tokens_per_s" in r:
            tflops = 6 * n_params * r["tokens_per_s"] / 1e12
            r["tflops_6nd"], r["mfu"] = round(tflops, 2), round(tflops / H200_BF16_DENSE_TFLOPS, 4)
        if name == "sharded_ws1" and "error" not in r:
            sync(device)
            t0 = time.perf_counter()
            full = actor.full_state_dict()
            r["full_state_dict_s"] = round(time.perf_counter() - t0, 3)
            r["full_state_dict_gib"] = round(sum(t.numel() * t.element_size() for t in full.values()) / 2**30, 3)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                actor.save_checkpoint(Path(tmp) / "trainer.pt", TrainerProgress(version=1))
                r["sharded_checkpoint_s"] = round(time.perf_counter() - t0, 3)
            actor.close()
        results[name] = r
        print(name, r, flush=True)
        del actor, model
        reset_peak(device)

    print()
    print_table(["trainer", "step s", "tokens/s", "TFLOP/s 6ND", "MFU %", "peak GiB", "gather s", "ckpt s"],
                [[k, r.get("wall_s", r.get("error")), r.get("tokens_per_s"), r.get("tflops_6nd"),
                  round(100 * r["mfu"], 1) if "mfu" in r else None, r.get("peak_mem_gib"),
                  r.get("full_state_dict_s"), r.get("sharded_checkpoint_s")]
                 for k, r in results.items()])
    print(f"\n{n_params / 1e6:.0f}M params, {tokens:,} tokens/step, mb_max_tokens {mb_tokens}, {device}")
    write_json(args.out, {"benchmark": "fsdp_step", "env": env_info(device),
                          "config": {k: getattr(args, k) for k in ("tiny", "n_seqs", "seq_len",
                                                                   "prompt_len", "steps", "seed")}
                          | {"mb_tokens": mb_tokens, "tokens_per_step": tokens},
                          "results": results})


if __name__ == "__main__":
    main()
