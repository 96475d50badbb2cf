"""Regeneration check on a GPU (issue 41): does the paged engine reproduce its own
trajectories bit for bit from (prompt, request seed, per-token versions, weights)?

Consumes nothing (random weights, random prompt ids); emits a summary on stdout and a
JSON file (``--out``, or ``$OUT/regenerate_check.json`` when ``$OUT`` is set). Exit code
0 when the same-batch regeneration is bit for bit (tokens and logprobs, every request),
else 1.

1. **Generate** ``--n-seqs`` requests (``--prompt-len`` random ids, ``--new-tokens`` new,
   temperature 1, ``--top-p``; each with its own seed, ``request_seed(0, i)``) with the
   production path: :class:`PagedEngine`, CUDA graphs, overlapped steps, ``--dtype``,
   a Qwen2-0.5B-shaped model (``--tiny``: a 2-layer one). ``--switch-after-s`` seconds
   after the batch starts, the weights switch to version 1 (another random model) the way
   a rollout worker's update does (interruptible: in-flight rows continue, their KV kept),
   so the trajectories span versions 0 and 1. No eos: every row runs to its length.
2. **Same batch**: regenerate all of them together with
   :class:`~tapioca.engines.regenerate.ScheduledEngine` (version 1 loaded before the step
   that sampled the first version-1 token; CUDA graphs; the same batch in the same
   order). Expected: every token and every logprob identical, bit for bit.
3. **Alone**: regenerate the first ``--alone`` requests one at a time (a batch of one: other
   GEMM shapes, the 1-row graph bucket). Reported, not required: tokens identical unless
   the batch moved a logit across a near-tie of the Gumbel-max scores; the first differing
   position and the logprobs' largest difference before it.

On the H100 (about 2 minutes):

    python benchmarks/regenerate_check.py --device cuda

Expected there: ``same batch: 64/64 token-identical, 64/64 logprobs bit-identical`` with
most trajectories spanning both versions, and an ``alone`` line with the share of
token-identical trajectories and the logprob drift (bf16: ~1e-2 is plausible).
CPU self-check (seconds, what CI could run): ``python benchmarks/regenerate_check.py --smoke``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import time
from pathlib import Path

import torch

from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.regenerate import ScheduledEngine, compare
from tapioca.engines.sampling import request_seed
from tapioca.models.factory import build_tiny_model

QWEN2_05B_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                       num_heads=14, num_kv_heads=2, max_position_embeddings=32768)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=4096)


def build(shape: dict, seed: int, dtype: torch.dtype, device: str) -> torch.nn.Module:
    shape = dict(shape)
    vocab = shape.pop("vocab_size")
    return build_tiny_model(vocab, seed=seed, dtype=dtype, **shape).to(device).eval()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model instead of the 0.5B shape")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, few short requests")
    ap.add_argument("--n-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--alone", type=int, default=16, help="requests regenerated one at a time")
    ap.add_argument("--switch-after-s", type=float, default=None,
                    help="seconds after the start that version 1 comes (default: a third of a "
                         "measured version-0-only run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.tiny = "cpu", True
        args.n_seqs, args.prompt_len, args.new_tokens, args.alone = 8, 12, 24, 4
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    shape = TINY_SHAPE if args.tiny else QWEN2_05B_SHAPE
    model0 = build(shape, 0, dtype, args.device)
    sd1 = {k: v.detach().clone() for k, v in build(shape, 1, dtype, args.device).state_dict().items()}
    free()
    g = torch.Generator().manual_seed(0)
    reqs = [GenRequest(f"r{i}", torch.randint(0, min(10000, shape["vocab_size"]), (args.prompt_len,),
                                              generator=g).tolist(),
                       SamplingParams(temperature=1.0, top_p=args.top_p, max_new_tokens=args.new_tokens,
                                      seed=request_seed(0, f"r{i}")))
            for i in range(args.n_seqs)]
    kv = dict(kv_cache_tokens=args.n_seqs * (args.prompt_len + args.new_tokens) + 1024, kv_block_size_tokens=16,
              max_batch_size=args.n_seqs, device=args.device, prefix_caching=False)

    def production(switch_s: float | None):
        eng = PagedEngine(copy.deepcopy(model0), cuda_graphs=True, **kv)
        eng.generate(reqs[:1])  # warm-up: graph captures out of the timed batch
        eng.pause()
        futures = eng.submit_all(reqs)
        t0 = time.perf_counter()
        eng.resume()
        if switch_s is not None:
            time.sleep(switch_s)
            eng.update_weights(sd1, 1)
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
        eng.shutdown()
        del eng
        free()
        return results, wall

    switch_s = args.switch_after_s
    if switch_s is None:
        _, wall0 = production(None)
        switch_s = wall0 / 3
    logged, wall = production(switch_s)
    spanning = sum(len(set(r.output_versions)) > 1 for r in logged)
    schedule = max((r.output_versions for r in logged), key=lambda v: (len(set(v)), len(v)))

    def scheduled(batch: list[GenRequest], versions: list[int]):
        eng = ScheduledEngine(copy.deepcopy(model0), schedule=versions, weights={0: None, 1: sd1}.get,
                              cuda_graphs=True, **kv)
        out = eng.generate(batch)
        eng.shutdown()
        del eng
        free()
        return out

    # 2. The same batch, in the same order, with the batch's switch step.
    same = scheduled(reqs, schedule)
    cmp_same = [compare(r.output_ids, r.output_logprobs, r.output_versions, s) for r, s in zip(logged, same)]
    # 3. Alone.
    cmp_alone = []
    for req, r in list(zip(reqs, logged))[: args.alone]:
        (s,) = scheduled([req], r.output_versions)
        cmp_alone.append(compare(r.output_ids, r.output_logprobs, r.output_versions, s))

    firsts = [c.first_difference for c in cmp_alone if c.first_difference is not None]
    summary = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "model": "tiny" if args.tiny else "qwen2-0.5b-shape",
        "n_seqs": args.n_seqs, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "top_p": args.top_p, "switch_after_s": switch_s, "generate_wall_s": wall,
        "spanning_versions": spanning,
        "same_batch": {"requests": len(cmp_same), "token_identical": sum(c.identical for c in cmp_same),
                       "logprobs_bit_identical": sum(c.logprobs_identical for c in cmp_same),
                       "versions_identical": sum(c.versions_identical for c in cmp_same),
                       "logprob_max_abs_diff": max(c.logprob_max_abs_diff for c in cmp_same)},
        "alone": {"requests": len(cmp_alone), "token_identical": sum(c.identical for c in cmp_alone),
                  "logprobs_bit_identical": sum(c.logprobs_identical for c in cmp_alone),
                  "first_differences": firsts,
                  "logprob_max_abs_diff": max((c.logprob_max_abs_diff for c in cmp_alone), default=0.0)},
    }
    s, a = summary["same_batch"], summary["alone"]
    print(f"{summary['device']} {summary['dtype']} {summary['model']}: {args.n_seqs} x ({args.prompt_len} + "
          f"{args.new_tokens}), {spanning} spanning a weights switch (v0 -> v1 after {switch_s:.2f} s)")
    print(f"same batch: {s['token_identical']}/{s['requests']} token-identical, {s['logprobs_bit_identical']}/"
          f"{s['requests']} logprobs bit-identical, {s['versions_identical']}/{s['requests']} versions identical")
    print(f"alone: {a['token_identical']}/{a['requests']} token-identical, {a['logprobs_bit_identical']}/"
          f"{a['requests']} logprobs bit-identical, logprob max |diff| before a difference "
          f"{a['logprob_max_abs_diff']:.3g}, first differences at {firsts}")
    out = args.out or (os.path.join(os.environ["OUT"], "regenerate_check.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {out}")
    ok = s["token_identical"] == s["logprobs_bit_identical"] == s["versions_identical"] == s["requests"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
