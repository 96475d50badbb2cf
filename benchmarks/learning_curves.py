"""Does the algorithm learn? GRPO, DAPO and PPO-with-critic on the synthetic task, CPU.

Each algorithm runs as `tapioca train` would run it: the launcher starts an embedded
broker and every role as its own process. The config is examples/demo_cpu.yaml (the
synthetic ``max(a,b)=`` task, 32 prompts x 16 samples, lr 5e-4, eta 2) with the
switches of examples/algorithms/<algo>.yaml laid over it, and ``--steps`` steps.

Printed per algorithm (and written as JSON with ``--json``):

* ``trainer reward``: the trainer's ``reward/mean`` (the shaped reward of the groups
  it trained), mean of the first and of the last ``--window`` steps;
* ``task reward``: the scorer's raw reward of *every* trajectory, filtered groups
  included, by the policy version that generated it (DAPO trains only groups with
  reward variance and subtracts an overlong penalty, so its trainer reward is not the
  task accuracy), mean over the first and the last ``--window`` versions;
* wall time from launch to the trainer's exit.

Run one algorithm at a time on a shared machine (the command used for RESULTS.md)::

    nice .venv/bin/python benchmarks/learning_curves.py --algos grpo --steps 100
    nice .venv/bin/python benchmarks/learning_curves.py --algos dapo --steps 100
    nice .venv/bin/python benchmarks/learning_curves.py --algos ppo --steps 100

``--warm-start RUN_DIR`` starts from the newest published weights of an earlier run
(e.g. a GRPO run's ``run_path``) instead of the random tiny model; extra positional
arguments are dotted overrides (``advantage.overlong_tokens=1``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "demo_cpu.yaml"
ALGOS = REPO / "examples" / "algorithms"


def flatten(d: dict, prefix: str = "") -> list[str]:
    """``{"actor": {"optimizer": {"lr": 1}}}`` -> ``["actor.optimizer.lr=1"]`` (dotted overrides)."""
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += flatten(v, key + ".")
        else:
            out.append(f"{key}={'null' if v is None else json.dumps(v) if isinstance(v, str) else v}")
    return out


def build_config(algo: str, steps: int, run_dir: str, extra: list[str]):
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig

    switches = yaml.safe_load((ALGOS / f"{algo}.yaml").read_text()) or {}
    switches.pop("experiment_name", None)
    return load_config(TrainConfig, str(DEMO), flatten(switches) + [
        f"experiment_name=learn-{algo.replace('_', '-')}", f"trial_name=t{int(time.time())}",
        f"run_dir={run_dir}", f"total_train_steps={steps}",
        "actor.checkpoint_every_steps=10",  # the demo's 1 costs wall time, not learning
    ] + extra)


def window(values: list[float], w: int) -> tuple[float, float]:
    w = max(1, min(w, len(values) // 2))
    return sum(values[:w]) / w, sum(values[-w:]) / w


def task_reward_by_version(cfg) -> dict[int, float]:
    """Mean raw scorer reward of every trajectory, keyed by the oldest policy version of
    its tokens (filtered and rejected groups included)."""
    from tapioca.bus import read_events

    version = {}
    for ev in read_events(cfg.bus, "trajectories", timeout_s=120):
        if ev.run_id == cfg.run_id and ev.output_versions:
            version[ev.traj_id] = min(ev.output_versions)
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    seen = set()
    for ev in read_events(cfg.bus, "rewards", timeout_s=120):
        if ev.run_id != cfg.run_id or ev.traj_id in seen or ev.traj_id not in version:
            continue
        seen.add(ev.traj_id)
        s = sums[version[ev.traj_id]]
        s[0] += ev.reward
        s[1] += 1
    return {v: s[0] / s[1] for v, s in sorted(sums.items())}


def warm_start_dir(run_path: str, out: Path) -> Path:
    """An HF model directory with the newest published weights of an earlier run
    (its ``model/`` config and tokenizer, ``weights/v*.safetensors`` as the weights)."""
    import shutil

    src = Path(run_path)
    newest = sorted((src / "weights").glob("v*.safetensors"))[-1]
    shutil.copytree(src / "model", out, dirs_exist_ok=True)
    shutil.copyfile(newest, out / "model.safetensors")
    return out


def run_one(algo: str, steps: int, w: int, run_dir: str, extra: list[str]) -> dict:
    from tapioca.ops.launcher import Launcher
    from tapioca.trainers.trainer import read_metrics

    cfg = build_config(algo, steps, run_dir, extra)
    launcher = Launcher(cfg)
    t0 = time.monotonic()
    launcher.start()
    cfg = launcher.cfg  # resolved: the run's bus run id, model and run dir
    try:
        launcher.wait(timeout_s=1800)
        wall_s = time.monotonic() - t0
        by_version = task_reward_by_version(cfg)
    finally:
        launcher.stop()
    # The trainer's own metrics file: the launcher may exit before reading the last event.
    rows = read_metrics(cfg.run_path)
    by_step = {r["step"]: r["reward/mean"] for r in rows}
    trainer = [by_step[s] for s in sorted(by_step)]
    # Versions 0..steps-1 generated the trained data; later ones only the tail.
    task = [r for v, r in by_version.items() if v < steps]
    t_first, t_last = window(trainer, w)
    k_first, k_last = window(task, w)
    return {"algo": algo, "steps": len(trainer), "wall_s": round(wall_s, 1),
            "trainer_reward_first": round(t_first, 3), "trainer_reward_last": round(t_last, 3),
            "task_reward_first": round(k_first, 3), "task_reward_last": round(k_last, 3),
            "versions_scored": len(task), "window": w, "run_path": cfg.run_path,
            "overrides": extra,
            "task_reward_by_version": [round(r, 3) for r in task],
            "rejected_dropped": rows[-1].get("trainer/rejected_dropped") if rows else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algos", default="grpo,dapo,ppo",
                    help="comma-separated names of examples/algorithms/*.yaml")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--run-dir", default="", help="default: a temporary directory")
    ap.add_argument("--json", default="", help="append one JSON line per algorithm here")
    ap.add_argument("--warm-start", default="",
                    help="start from the newest weights of this earlier run directory")
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides, e.g. actor.optimizer.lr=1e-3")
    args = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="tapioca-learn-")
    if args.warm_start:
        model = warm_start_dir(args.warm_start, Path(run_dir) / f"warm-{int(time.time())}")
        args.overrides = [f"model.path={model}"] + args.overrides
    for algo in [a for a in args.algos.split(",") if a]:
        res = run_one(algo, args.steps, args.window, run_dir, args.overrides)
        extra = ' ' + ' '.join(args.overrides) if args.overrides else ''
        print(f"{algo}{extra}: {res['steps']} steps in {res['wall_s']} s; trainer reward "
              f"first-{res['window']} {res['trainer_reward_first']} -> last-{res['window']} "
              f"{res['trainer_reward_last']}; task reward by version "
              f"{res['task_reward_first']} -> {res['task_reward_last']}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
