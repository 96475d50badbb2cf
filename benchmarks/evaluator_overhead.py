"""The training step rate with the evaluator on and off: `tapioca demo` twice on this
machine (examples/demo_cpu.yaml; "off" sets no evaluator trigger, everything else equal,
the held-out pairs still left out of training), one run each, in the order given.

Reports per run the trainer's steps per second between step ``--skip`` and the last
(from the trainer's metrics.jsonl times), the wall time, the final training reward,
the CPU seconds each role process used (sampled from /proc while it runs: the
evaluator's share of the run's CPU is its cost, whatever else loads the machine) and,
with the evaluator, its held-out pass@1 / greedy by version (from eval/metrics.jsonl).

    python benchmarks/evaluator_overhead.py                    # on, then off, 600 steps
    python benchmarks/evaluator_overhead.py --order off,on --steps 300

On a shared machine other processes' load moves both numbers; run it when it is quiet
(``uptime``) and say what the load was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

OFF = ["evaluator.eval_before_train=false", "evaluator.freq_steps=null"]


def _rows(path: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["step"]] = row
    return rows


def _cpu_by_role(trial: str, stop: threading.Event, out: dict[str, float]) -> None:
    """Every second: the CPU seconds (user + system) of each role process of ``trial``
    (``tapioca.ops.role_main ROLE --config .../TRIAL/config.yaml``), the largest seen."""
    tick = os.sysconf("SC_CLK_TCK")
    while not stop.wait(1.0):
        for pid in os.listdir("/proc"):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                if b"tapioca.ops.role_main" not in cmd or not any(trial.encode() in c for c in cmd):
                    continue
                role = cmd[cmd.index(b"tapioca.ops.role_main") + 1].decode()
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / tick
                out[role] = max(out.get(role, 0.0), cpu)
            except (OSError, ValueError, IndexError):
                continue


def run(mode: str, args, root: Path) -> dict:
    trial = f"{mode}-{time.strftime('%H%M%S')}"
    cmd = [sys.executable, "-m", "tapioca.ops.cli", "demo", f"run_dir={root}", f"trial_name={trial}",
           f"total_train_steps={args.steps}", *(OFF if mode == "off" else [])]
    load_before = os.getloadavg()[0]
    cpu: dict[str, float] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_cpu_by_role, args=(trial, stop, cpu), daemon=True)
    sampler.start()
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    stop.set()
    sampler.join()
    run_dir = root / "demo" / trial
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    train = _rows(run_dir / "metrics" / "metrics.jsonl")
    steps = sorted(train)
    a, b = steps[min(args.skip, len(steps) - 2)], steps[-1]
    rate = (b - a) / (train[b]["time"] - train[a]["time"])
    held = _rows(run_dir / "eval" / "metrics.jsonl")
    last20 = [train[s]["reward/mean"] for s in steps[-20:]]
    return {"mode": mode, "steps": b, "steps_per_s": round(rate, 4), "wall_s": round(wall, 1),
            "load_avg_1min_before": round(load_before, 2),
            "load_avg_1min_after": round(os.getloadavg()[0], 2),
            "reward_last20": round(sum(last20) / len(last20), 3),
            "cpu_s_by_role": {r: round(v, 1) for r, v in sorted(cpu.items())},
            "evaluator_cpu_share": round(cpu.get("evaluator", 0.0) / max(sum(cpu.values()), 1e-9), 4),
            "held_out_pass@1": {v: round(r["eval/pass@1"], 3) for v, r in sorted(held.items())},
            "held_out_greedy": {v: round(r["eval/greedy"], 3) for v, r in sorted(held.items())},
            "evaluations": len(held), "run_dir": str(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="on,off")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--skip", type=int, default=20, help="steps of warm-up left out of the rate")
    ap.add_argument("--workdir", default="/tmp/tapioca-evaluator-overhead")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = []
    for mode in args.order.split(","):
        results.append(run(mode, args, Path(args.workdir)))
        print(json.dumps({k: v for k, v in results[-1].items() if not k.startswith("held_out")}),
              flush=True)
    rates = {r["mode"]: r["steps_per_s"] for r in results}
    if {"on", "off"} <= set(rates):
        print(json.dumps({"on_over_off": round(rates["on"] / rates["off"], 4)}))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
