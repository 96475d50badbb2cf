"""Rollout generation, DESIGN.md §9 row 1: HF ``model.generate`` vs Tapioca's TorchEngine.

Consumes nothing (random weights, random prompt ids); emits a table on stdout and, with
``--out``, a JSON file. Both systems run in one process on the same model object, one
after the other: a Qwen2-0.5B-shaped model (24 layers, width 896, 14/2 heads, vocab
151,936, tied embeddings; built by :func:`tapioca.models.factory.build_tiny_model`),
random weights in ``--dtype``, sdpa attention, ``--n-seqs`` prompts of ``--prompt-len``
random token ids, exactly ``--new-tokens`` new tokens each (no eos: neither system is
given a stop token, and the script checks every sequence got the full length).
Sampling at temperature 1, no top-k / top-p, for both.

(a) HF: one batched ``model.generate(do_sample=True)`` call over all prompts.
(b) TorchEngine: ``engine.generate(requests)`` (the public API the rollout worker uses
    through ``submit``), ``max_batch_size = --n-seqs``, so it runs as one batch.

Each system gets one full-size warm-up run, then ``--repeats`` timed runs (median
reported). tokens/s = new tokens generated / wall seconds. Peak memory is
``torch.cuda.max_memory_allocated`` over the timed runs (weights included), reset
between systems.

On the GPU box (no tokenizer or network needed):

    python benchmarks/engine_generate.py --device cuda --out engine_generate.json

CPU self-check (< 1 min): ``python benchmarks/engine_generate.py --tiny --device cpu``.
``benchmarks/trainer_step.py`` imports the model / CLI helpers below.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.torch_engine import TorchEngine
from tapioca.models.factory import build_tiny_model

# Qwen2-0.5B's published shape (as benchmarks/gpu_rl_loop.py builds it); head_dim 64.
QWEN2_05B_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                       num_heads=14, num_kv_heads=2, max_position_embeddings=32768)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=4096)
H200_BF16_DENSE_TFLOPS = 989.0


# ------------------------------------------------------------------ shared helpers

def build_model(tiny: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Random-weight Qwen2-shaped causal LM (seed 0) with sdpa attention, on ``device``."""
    shape = dict(TINY_SHAPE if tiny else QWEN2_05B_SHAPE)
    vocab = shape.pop("vocab_size")
    # No eos / pad in the config: generation must run to max_new_tokens.
    model = build_tiny_model(vocab, seed=0, dtype=dtype, **shape)
    model.set_attn_implementation("sdpa")  # no flash-attn on the GPU box
    return model.to(device)


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny model and sizes (a CPU self-check in < 1 min)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="write the results as JSON here")


def fill_defaults(args: argparse.Namespace, full: dict, tiny: dict) -> argparse.Namespace:
    """Flags left at None take the full-size or the --tiny default."""
    defaults = tiny if args.tiny else full
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None  # CPU: no allocator statistics
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def timed(fn: Callable[[], int], device: str) -> tuple[int, float]:
    """``(fn(), wall seconds)`` with the device synchronised on both ends."""
    sync(device)
    t0 = time.perf_counter()
    n = fn()
    sync(device)
    return n, time.perf_counter() - t0


def measure(fn: Callable[[], int], device: str, repeats: int) -> dict:
    """One warm-up call, then ``repeats`` timed calls; ``fn`` returns its token count."""
    fn()
    reset_peak(device)
    runs = [timed(fn, device) for _ in range(repeats)]
    walls = [w for _, w in runs]
    tokens = runs[0][0]
    wall = statistics.median(walls)
    return {"tokens": tokens, "wall_s": round(wall, 3), "wall_s_all": [round(w, 3) for w in walls],
            "tokens_per_s": round(tokens / wall, 1), "peak_mem_gib": peak_gib(device)}


def env_info(device: str) -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [header] + [["-" if v is None else (f"{v:,}" if isinstance(v, (int, float)) else str(v))
                         for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


# ------------------------------------------------------------------ the two systems

def hf_generate_fn(model, prompts_BT: torch.Tensor, new_tokens: int, seed: int) -> Callable[[], int]:
    def run() -> int:
        torch.manual_seed(seed)
        with torch.inference_mode():
            out_BT = model.generate(
                input_ids=prompts_BT, attention_mask=torch.ones_like(prompts_BT),
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0,  # HF defaults top_k to 50
                max_new_tokens=new_tokens, pad_token_id=0)
        n_new = out_BT.shape[1] - prompts_BT.shape[1]
        if n_new != new_tokens:
            raise RuntimeError(f"HF generate stopped at {n_new} of {new_tokens} new tokens")
        return out_BT.shape[0] * n_new
    return run


def engine_fn(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> Callable[[], int]:
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens)
    calls = iter(range(10**9))

    def run() -> int:
        call = next(calls)
        results = engine.generate([GenRequest(f"bench-{call}:{i}", p, sampling)
                                   for i, p in enumerate(prompts)])
        short = [r.request_id for r in results if len(r.output_ids) != new_tokens]
        if short:
            raise RuntimeError(f"TorchEngine stopped {len(short)} sequences early, e.g. {short[:3]}")
        return sum(len(r.output_ids) for r in results)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--n-seqs", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true", help="measure the engine only")
    args = fill_defaults(ap.parse_args(),
                         full=dict(n_seqs=256, prompt_len=128, new_tokens=256, repeats=1),
                         tiny=dict(n_seqs=16, prompt_len=16, new_tokens=32, repeats=1))
    dtype = getattr(torch, args.dtype)
    model = build_model(args.tiny, dtype, args.device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts_BT = torch.randint(0, vocab, (args.n_seqs, args.prompt_len), generator=gen)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.dtype}, "
          f"{args.device}; {args.n_seqs} seqs x ({args.prompt_len} prompt + {args.new_tokens} new)",
          flush=True)

    results: dict[str, dict] = {}
    if not args.skip_hf:
        results["hf_generate"] = measure(
            hf_generate_fn(model, prompts_BT.to(args.device), args.new_tokens, args.seed),
            args.device, args.repeats)
        print("hf_generate", results["hf_generate"], flush=True)
    reset_peak(args.device)
    engine = TorchEngine(model, device=args.device, max_batch_size=args.n_seqs, seed=args.seed,
                         pad_token_id=0)  # eos_token_id=None: no stop token
    try:
        results["torch_engine"] = measure(engine_fn(engine, prompts_BT.tolist(), args.new_tokens),
                                          args.device, args.repeats)
    finally:
        engine.shutdown()
    print("torch_engine", results["torch_engine"], flush=True)

    names = {"hf_generate": "HF generate", "torch_engine": "TorchEngine"}
    print()
    print_table(["system", "new tokens", "wall s", "tokens/s", "peak GiB"],
                [[names[k], r["tokens"], r["wall_s"], r["tokens_per_s"], r["peak_mem_gib"]]
                 for k, r in results.items()])
    ratio = None
    if "hf_generate" in results:
        ratio = round(results["torch_engine"]["tokens_per_s"] / results["hf_generate"]["tokens_per_s"], 2)
        print(f"\nTorchEngine / HF generate: {ratio}x  (DESIGN §9 target >= 10x, stretch 20x)")
    write_json(args.out, {
        "benchmark": "engine_generate", "env": env_info(args.device),
        "config": {k: getattr(args, k) for k in ("tiny", "dtype", "n_seqs", "prompt_len",
                                                 "new_tokens", "repeats", "seed")},
        "results": results, "engine_over_hf": ratio})


if __name__ == "__main__":
    main()
