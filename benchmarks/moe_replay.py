"""Rollout routing replay (R3, issue 23): the routes' bytes per token on the wire, the
trainer's overhead with replay on vs off, and the paged engine's with recording on vs off,
side by side in one process.

Consumes nothing (random weights, random token ids); emits a table on stdout and JSON
(``--out``, or ``$OUT/moe_replay.json``). Runs (``--only``):

  wire     per shape (the trainer benchmark's 12 MoE layers x top-8 of 64 experts,
           Qwen3-30B-A3B's 48 x top-8 of 128, Qwen3-235B-A22B's 94 x top-8 of 128): the
           raw ids per token (uint8), base64 on the event, a 2048-token trajectory
           event's JSON with and without its routes, and encode + decode ms per 1k tokens
           (schemas/routes.py; CPU work, no GPU);
  trainer  PPOActor on moe_trainer.py's 2.8B / 0.68B Qwen3-MoE (bf16 weights, fp32 router,
           liger on CUDA, micro-batches of 4096), 8 x 2048 tokens: router_replay disabled,
           R3 replaying the model's own routes (recorded by a no-grad forward first, so the
           experts' load is the one the live router gives: what differs is the replay's own
           work: decoding and packing the ids, the router's top-k for the agreement metric,
           the gather at the replayed ids), and with ppo_n_minibatches 2 disabled vs R2 (the
           second minibatch replays its pi_prox forward's routes) -- one warm-up step, then
           the median of ``--steps``;
  engine   the paged engine on the same 2.8B model, 64 rows x (128 + 128) tokens, with
           record_routes off and on (the route cache written in the decode graph, each
           finished row's routes gathered on a side stream): tokens/s.

One H200 (~3 min):  python benchmarks/moe_replay.py
CPU smoke test of the plumbing (tiny shapes, < 1 min):  python benchmarks/moe_replay.py --smoke
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark helpers
from engine_generate import Workload, engine_fn, env_info, measure, out_path, print_table, timed, write_json  # noqa: E402
from moe_engine import build  # noqa: E402
from moe_trainer import FAST, SHAPE, SMOKE  # noqa: E402
from trainer_systems import actor_config, fixed_batch  # noqa: E402

from tapioca.config.moe import MoeConfig  # noqa: E402
from tapioca.engines.paged_engine import PagedEngine  # noqa: E402
from tapioca.models.attention import packed_seqs, position_ids  # noqa: E402
from tapioca.schemas.envelope import encode_event  # noqa: E402
from tapioca.schemas.events import TrajectoryEvent  # noqa: E402
from tapioca.schemas.routes import decode_routes, encode_routes  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402

# (MoE layers, top_k, experts per layer)
WIRE_SHAPES = {"2.8B trainer shape": (12, 8, 64), "Qwen3-30B-A3B": (48, 8, 128), "Qwen3-235B-A22B": (94, 8, 128)}
TRAINER_RUNS = {"disabled": dict(moe=MoeConfig(router_replay="disabled")),
                "R3": dict(moe=MoeConfig(router_replay="R3")),
                "disabled_2mb": dict(moe=MoeConfig(router_replay="disabled"), ppo_n_minibatches=2),
                "R2_2mb": dict(moe=MoeConfig(router_replay="R2"), ppo_n_minibatches=2)}


def wire(tokens: int) -> dict:
    out = {}
    rng = np.random.default_rng(0)
    for name, (layers, k, experts) in WIRE_SHAPES.items():
        ids = rng.integers(0, experts, (tokens - 1, layers, k))
        t0 = time.perf_counter()
        routes = encode_routes(ids, inline_max_bytes=1 << 30, num_experts=experts)
        back = decode_routes(routes)
        codec_ms = (time.perf_counter() - t0) * 1000 * 1000 / tokens
        assert np.array_equal(back, ids)
        plain = TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p", sample_index=0, group_size=8,
                                prompt_ids=list(range(128)), output_ids=[7] * (tokens - 128),
                                output_logprobs=[-1.25] * (tokens - 128), output_versions=[3] * (tokens - 128))
        with_routes = TrajectoryEvent(**{**plain.__dict__, "event_id": "x", "routed_experts": routes})
        n_plain, n_routes = len(encode_event(plain)), len(encode_event(with_routes, max_bytes=1 << 30))
        out[name] = {"moe_layers": layers, "top_k": k, "experts": experts, "dtype": routes.dtype,
                     "raw_bytes_per_token": routes.num_bytes / (tokens - 1),
                     "base64_bytes_per_token": round(len(routes.data_b64) / (tokens - 1), 1),
                     "event_bytes_per_token_without": round(n_plain / tokens, 1),
                     "event_bytes_per_token_with": round(n_routes / tokens, 1),
                     "encode_decode_ms_per_1k_tokens": round(codec_ms, 3)}
    return out


def own_routes(actor: PPOActor, items) -> None:
    """Put on each item the experts the actor's packed forward routes its tokens to."""
    for it in items:
        ids = torch.tensor(it.input_ids[:-1], device=actor.device)
        with torch.no_grad():
            actor.packed(ids, position_ids([len(ids)]).to(actor.device), packed_seqs([len(ids)], actor.device))
        r = actor.packed.recorded_routes().permute(1, 0, 2).cpu().numpy().astype(np.uint8)
        it.routes = base64.b64encode(r.tobytes()).decode()


def trainer(shape: dict, batch, args) -> dict:
    dev = args.device
    out = {}
    fast = dict(FAST, mb_max_tokens=4096 if not args.smoke else 64)
    if not dev.startswith("cuda"):
        fast.update(liger_kernels=False, param_dtype="float32")
    dtype = torch.bfloat16 if fast["param_dtype"] == "bfloat16" else torch.float32
    for name, opts in TRAINER_RUNS.items():
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        actor = PPOActor(build(shape, dtype, dev), actor_config(dev, **fast, **opts), temperature=1.0,
                         pad_token_id=0, device=dev)
        items = batch.items(shape["vocab_size"])
        if opts["moe"].router_replay == "R3":
            own_routes(actor, items)

        last: dict = {}

        def step(actor=actor, items=items, last=last):
            last.update(actor.train_step(items, policy_version=0).metrics)
            return batch.real_tokens

        step()
        walls = [timed(step, dev)[1] for _ in range(args.steps)]
        wall = statistics.median(walls)
        m = last
        out[name] = {"wall_s": round(wall, 4), "tokens_per_s": round(batch.real_tokens / wall, 1),
                     "router_replay_agreement": m.get("actor/router_replay_agreement"),
                     "router_replay_tokens": m.get("actor/router_replay_tokens")}
        print("trainer", name, json.dumps(out[name]), flush=True)
        del actor, step
    for on, off in (("R3", "disabled"), ("R2_2mb", "disabled_2mb")):
        out[f"{on}_overhead"] = round(out[on]["wall_s"] / out[off]["wall_s"] - 1, 4)
    return out


def engine(shape: dict, args) -> dict:
    dev = args.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model = build(shape, dtype, dev).eval()
    rows, prompt, new = (4, 8, 8) if args.smoke else (64, 128, 128)
    rng = random.Random(0)
    w = Workload("a", [[rng.randrange(shape["vocab_size"]) for _ in range(prompt)] for _ in range(rows)],
                 [new] * rows, 1.0, shape["vocab_size"])
    out = {}
    for record in (False, True):
        eng = PagedEngine(model, device=dev, max_batch_size=rows, seed=0, record_routes=record,
                          kv_cache_tokens=int(1.1 * rows * (prompt + new)))
        try:
            fn = engine_fn(eng, w)
            r = measure(fn, dev, args.repeats)
            r["decode_step_ms"] = eng.stats()["decode_only_step_ms"]
            if record:
                r["routes_shape"] = list(fn.last[0].routed_experts.shape)
        finally:
            eng.shutdown()
        out["record_on" if record else "record_off"] = r
        print("engine", "on" if record else "off", json.dumps(r), flush=True)
    out["record_overhead"] = round(out["record_off"]["tokens_per_s"] / out["record_on"]["tokens_per_s"] - 1, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU plumbing check)")
    ap.add_argument("--only", default="wire,trainer,engine")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else SHAPE
    wanted = [k.strip() for k in args.only.split(",") if k.strip()]
    results: dict = {}
    if "wire" in wanted:
        results["wire"] = wire(256 if args.smoke else 2048)
        print_table(["shape", "dtype", "raw B/token", "base64 B/token", "event B/token without", "with",
                     "codec ms/1k tokens"],
                    [[n, r["dtype"], r["raw_bytes_per_token"], r["base64_bytes_per_token"],
                      r["event_bytes_per_token_without"], r["event_bytes_per_token_with"],
                      r["encode_decode_ms_per_1k_tokens"]] for n, r in results["wire"].items()])
    if "trainer" in wanted:
        batch = fixed_batch(2, 48, 8, shape["vocab_size"], seed=0) if args.smoke else \
            fixed_batch(8, 2048, 128, shape["vocab_size"], seed=0)
        results["trainer"] = trainer(shape, batch, args)
    if "engine" in wanted:
        results["engine"] = engine(shape, args)
    print("\nR3 overhead (step time, replay on / off - 1):",
          json.dumps({k: v for k, v in results.get("trainer", {}).items() if k.endswith("overhead")}),
          "engine recording:", results.get("engine", {}).get("record_overhead"))
    write_json(out_path(args, "moe_replay"), {"benchmark": "moe_replay", "env": env_info(args.device),
                                              "config": vars(args), "results": results})


if __name__ == "__main__":
    main()
