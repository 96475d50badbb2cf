"""Does the flagship example fit the card, and how fast does it step? (issue 37)

Runs ``examples/gsm8k_grpo.yaml`` as written (plus ``model.path``, the step count and
eta) on random-weight models of the published Qwen2.5 shapes, with Qwen2's real BPE
tokenizer built offline, every role its own process on one GPU, and reports per run:

- the exit code, the closing line, and the restarts the launcher made;
- the device's peak memory (NVML, sampled every 0.2 s over the whole run, every process);
- the planner's prediction for the same config (``tapioca plan -o json``) beside it;
- seconds per step (median after the first two) and the step timeline's parts
  (tapioca.ops.timeline: generation, the trainer's step, the hops) beside the cycle;
- sleep mode's count and cost, from the rollout worker's status metrics.

    python benchmarks/example_fit.py --sizes 0.5b,1.5b --etas 0,4 --steps 20 --out fit.json
    python benchmarks/example_fit.py --lora --sizes 7b --etas 4 --steps 10     # the LoRA example
    python benchmarks/example_fit.py --smoke                                   # CPU, tiny: the plumbing

A random model never stops early: every row generates max_new_tokens (512), the
example's worst case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Qwen2.5's published shapes: hidden, intermediate, layers, heads, kv heads, tied, vocab
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2, True, 151936),
    "1.5b": (1536, 8960, 28, 12, 2, True, 151936),
    "3b": (2048, 11008, 36, 16, 2, True, 151936),
    "7b": (3584, 18944, 28, 28, 4, False, 152064),
}


def build_model(size: str, path: Path, device: str) -> None:
    if (path / "config.json").exists():
        return
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tapioca.models.factory import build_qwen_tokenizer

    hidden, inter, layers, heads, kv, tied, vocab = SHAPES[size]
    tok = build_qwen_tokenizer()
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, tie_word_embeddings=tied, use_sliding_window=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds, not minutes, at 7B
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


class PeakMemory:
    """The device's used memory (all processes), sampled on a thread."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._interval = interval_s
        try:
            import pynvml

            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # no GPU (the smoke): nothing to sample
            self._nvml = None
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._nvml is not None:
                used = self._nvml.nvmlDeviceGetMemoryInfo(self._h).used / 2**20
                self.peak_mib = max(self.peak_mib, used)
            self._stop.wait(self._interval)

    def __enter__(self) -> "PeakMemory":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def card() -> dict:
    """The GPU's name and memory by NVML: no CUDA context in this process (one through
    torch took 0.6 GiB of the card in the first H100 runs, counted in their peaks)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return {"name": name.decode() if isinstance(name, bytes) else name,
                "total_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1)}
    except Exception:
        return {"name": "cpu", "total_gib": None}


def planned(config: str, overrides: list[str]) -> dict:
    """``tapioca plan`` for the same config: its JSON, or the error it printed."""
    proc = subprocess.run([sys.executable, "-m", "tapioca.ops.cli", "plan", "--config", config, *overrides,
                           "-o", "json"], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip()[-400:]}
    try:
        rows = json.loads(proc.stdout)
    except ValueError:
        return {"error": proc.stdout.strip()[-400:]}
    row = rows[0] if isinstance(rows, list) and rows else rows  # `-o json` prints a list of one
    # The shared device's planned total (every process on it), what the peak is compared with.
    row["device_gib"] = max((d.get("total_gib", 0.0) for d in row.get("devices", [])), default=None)
    return row


def run_one(args, size: str, eta: int, model_path: Path | None, root: Path) -> dict:
    trial = f"{size}-eta{eta}" + ("-lora" if args.lora else "")
    config = str(REPO / "examples" / ("demo_cpu.yaml" if args.smoke else
                                      ("lora/gsm8k_grpo_lora.yaml" if args.lora else "gsm8k_grpo.yaml")))
    overrides = [f"total_train_steps={args.steps}", f"rollout.max_head_offpolicyness={eta}",
                 f"run_dir={root}", "experiment_name=fit", f"trial_name={trial}", "archive.enabled=true"]
    if model_path is not None:
        overrides.append(f"model.path={model_path}")
    if args.data:
        overrides.append(f"train_dataset.path={args.data}")
    overrides += args.override
    plan = planned(config, overrides)
    t0 = time.time()
    with PeakMemory() as mem:
        proc = subprocess.run([sys.executable, "-m", "tapioca.ops.cli", "train", "--config", config, *overrides],
                              capture_output=True, text=True, cwd=REPO)
    wall = time.time() - t0
    out = (proc.stdout + proc.stderr).strip().splitlines()
    closing = next((line for line in reversed(out) if line.startswith(("done:", "stopped", "error"))), out[-1:])
    run_dir = root / "fit" / trial
    row = {"size": size, "eta": eta, "lora": args.lora, "rc": proc.returncode, "closing": closing,
           "wall_s": round(wall, 1), "peak_gpu_gib": round(mem.peak_mib / 1024, 2),
           "plan": {k: plan.get(k) for k in ("peak_gib", "device_gib", "fits", "parts", "error") if k in plan}}
    # The KV cache the run started with: the engines' own size, or what the memory check
    # sized it to beside the trainer's planned peak (ops/memory_check.py; config.yaml).
    cfg_path = run_dir / "config.yaml"
    if cfg_path.exists():
        import yaml

        row["kv_cache_tokens"] = (yaml.safe_load(cfg_path.read_text()) or {}).get("rollout", {}).get(
            "kv_cache_tokens")
    metrics_path = run_dir / "metrics" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    times = [r["time"] for r in rows]
    steps = [b - a for a, b in zip(times, times[1:])][2:] or [b - a for a, b in zip(times, times[1:])]
    row.update(steps=len(rows), s_per_step=round(statistics.median(steps), 2) if steps else None)
    if rows:
        row["train_s"] = round(statistics.median(r["actor/step_time_s"] for r in rows[1:] or rows), 2)
        row["train_tokens_per_s"] = round(statistics.median(r["actor/tokens_per_s"] for r in rows[1:] or rows))
    if proc.returncode != 0:
        logs = sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").exists() else []
        row["log_tails"] = {p.name: p.read_text()[-1500:] for p in logs}
    archive = run_dir / "archive"
    if archive.exists() and rows:
        from tapioca.ops.timeline import events_from_archive, format_table, step_timelines, summarize

        tl = step_timelines(events_from_archive(archive))
        s = summarize(tl)
        row["timeline"] = s
        if s.get("cycle_s") and s.get("generation_s") is not None and s.get("step_s") is not None:
            # eta 0: the cycle is generation, then the step, plus hops; eta > 0 overlaps them
            parts = (s["generation_s"] + s["step_s"]) if eta == 0 else max(s["generation_s"], s["step_s"])
            row["cycle_over_parts"] = round(s["cycle_s"] / parts, 2) if parts else None
        print(f"--- {trial} step timeline\n{format_table(tl)}", flush=True)
        row["sleep"] = sleep_stats(events_from_archive(archive))
    return row


def sleep_stats(events) -> dict:
    """Sleep mode's count and time from the rollout worker's last status (metrics.v1)."""
    last: dict = {}
    for e in events:
        m = getattr(e, "metrics", None) or {}
        if getattr(e, "source", "").startswith("rollout") and "rollout/engine/sleeps" in m:
            last = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("rollout/engine/")}
    return last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.5b")
    ap.add_argument("--etas", default="0,4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lora", action="store_true", help="examples/lora/gsm8k_grpo_lora.yaml")
    ap.add_argument("--data", default="", help="train_dataset.path (default: the example's)")
    ap.add_argument("--override", action="append", default=[], help="one more key=value")
    ap.add_argument("--workdir", default="/tmp/tapioca-fit")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="the CPU demo config with its tiny model")
    ap.add_argument("--build", nargs=2, metavar=("SIZE", "DIR"), help="only write a model directory")
    args = ap.parse_args()
    if args.build:
        build_model(args.build[0], Path(args.build[1]), "cuda")
        return
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    info = card()
    print(f"card: {info}", flush=True)
    results = []
    for size in args.sizes.split(","):
        model_path = None
        if not args.smoke:
            model_path = root / f"qwen2.5-{size}"
            t0 = time.time()
            # in a child process: a CUDA context here would sit on the card through every run
            subprocess.run([sys.executable, __file__, "--build", size, str(model_path)], check=True, cwd=REPO)
            print(f"model {size}: {time.time() - t0:.0f} s to build", flush=True)
        for eta in (int(e) for e in args.etas.split(",")):
            row = run_one(args, size, eta, model_path, root)
            row["card"] = info
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("timeline", "log_tails")}), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'run':<16} {'rc':>3} {'steps':>5} {'s/step':>7} {'peak GiB':>9} {'plan GiB':>9} "
          f"{'cycle/parts':>11}  closing")
    for r in results:
        name = f"{r['size']} eta{r['eta']}" + (" lora" if r["lora"] else "")
        print(f"{name:<16} {r['rc']:>3} {r['steps']:>5} {r['s_per_step'] or '-':>7} {r['peak_gpu_gib']:>9} "
              f"{r['plan'].get('peak_gib', '-')!s:>9} {r.get('cycle_over_parts', '-')!s:>11}  {r['closing']}")
    if os.environ.get("OUT") and not args.out:
        Path(os.environ["OUT"], "example_fit.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
