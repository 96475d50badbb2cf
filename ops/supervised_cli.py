"""Supervised trainers on the RL run's backbone: `tapioca sft|dpo|rm|distill`.

Each takes ``--config X.yaml`` plus dotted overrides (``actor.optimizer.lr=1e-4 beta=0.2``),
trains in this process, and prints where the run directory, metrics and final model
are. With ``--bootstrap-server`` (or ``bus.bootstrap_servers`` / ``$TAPIOCA_BOOTSTRAP``)
it also publishes ``WeightsEvent``s and ``MetricsEvent``s, and can read a run's logged
trajectories (``train_dataset.source=topics``).
"""

from __future__ import annotations

import importlib
from typing import Optional

import typer

from .cli_context import EXTRA_ARGS, OUTPUT_HELP, G, check_output, console, emit_json, err_console
from .progress import CommandProgress

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()

_CONFIG_HELP = ("YAML config file (see examples/sft.yaml, dpo.yaml, reward_model.yaml, "
                "distill.yaml).")


def _run(kind: str, config: Optional[str], overrides: list[str], output: str) -> None:
    from ..config.loader import load_config
    from ..config.supervised import DistillConfig, DPOConfig, RewardModelConfig, SFTConfig
    from ..trainers.supervised.loop import run_metadata

    check_output(output)
    # kind -> (config class, trainer module, entry point); imported on use (torch is slow to import)
    classes = {"sft": (SFTConfig, "sft", "train_sft"), "dpo": (DPOConfig, "dpo", "train_dpo"),
               "rm": (RewardModelConfig, "reward_model", "train_reward_model"),
               "distill": (DistillConfig, "distill", "train_distill")}
    cls, module, entry = classes[kind]
    train = getattr(importlib.import_module(f"tapioca.trainers.supervised.{module}"), entry)
    from ..runtime.run import resolve_run

    cfg = load_config(cls, config, overrides)
    if G.bootstrap and not cfg.bus.bootstrap_servers:
        cfg = resolve_run(cfg, bootstrap=G.bootstrap)
    if cfg.train_dataset.source == "topics" and not cfg.bus.bootstrap_servers:
        # Reading a run's topics needs a broker: the embedded one of `tapioca broker up`
        # (or a clear error saying how to name one).
        from .broker_state import resolve_bootstrap

        cfg = resolve_run(cfg, bootstrap=resolve_bootstrap(None))
    if G.prefix and cfg.bus.topic_prefix == "tapioca":
        cfg = resolve_run(cfg, topic_prefix=G.prefix)
    # The run directory (absolute), the tiny model when model.path is empty, the run id.
    cfg = resolve_run(cfg, prepare=True)
    loss_key = f"{kind}/loss"
    out_console = console if output == "table" else err_console
    # SFT with valid_dataset + an evaluator trigger: held-out evaluations while training
    # (runtime/sft_eval.py), one line each; stop_at_eval may end training early.
    held_out = None
    if kind == "sft" and cfg.valid_dataset is not None and cfg.evaluator.enabled:
        from ..runtime.sft_eval import SFTHeldOut

        held_out = SFTHeldOut(cfg, on_result=lambda r: out_console.print(
            f"{kind}: step {r.step}: held-out " + ", ".join(
                f"{name} {r.metrics[f'eval/{name}']:.3f}" for name in ("pass@1", "greedy")
                if f"eval/{name}" in r.metrics) + f" ({r.wall_s:.1f} s)", soft_wrap=True))
    # -o json keeps stdout one document: the bar (or lines) go to stderr there.
    try:
        with CommandProgress(kind, "steps", console=out_console, total=cfg.total_train_steps) as shown:
            summary = train(cfg, progress=lambda step, total, metrics: shown.update(
                step, total, info=f"{loss_key} {metrics[loss_key]:.4f}" if loss_key in metrics else ""),
                **({"hook": held_out} if held_out is not None else {}))
    finally:
        if held_out is not None:
            held_out.close()
    meta = run_metadata(summary)
    if held_out is not None:
        meta["held_out"] = held_out.summary()
    if output == "json":
        emit_json(meta)
        return
    if summary.already_complete:
        console.print(f"{kind}: already complete: {summary.run_dir} has {summary.steps} steps "
                      f"(checkpoint {summary.checkpoint}); nothing to train (raise "
                      "total_train_steps to go on, or set a new trial_name)", soft_wrap=True)
        console.print(f"final model: {summary.final_model_dir}", soft_wrap=True)
        return
    first, last = meta["first"].get(loss_key), meta["last"].get(loss_key)
    trend = (f"; {loss_key} {first:.4f} -> {last:.4f}"
             if first is not None and last is not None else "")
    why = {"hook": f" (stopped: held-out {getattr(cfg, 'stop_at_eval_metric', '')} reached "
                   f"{getattr(cfg, 'stop_at_eval', None)})",
           "time_limit_s": f" (stopped: time_limit_s={cfg.time_limit_s:g})"}.get(summary.stopped, "")
    console.print(f"{kind}: {summary.steps} steps in {summary.wall_s:.1f} s{trend}{why}")
    console.print(f"metrics: {summary.run_dir}/metrics/metrics.jsonl; "
                  f"final model: {summary.final_model_dir}")


def _register(kind: str, doc: str) -> None:
    def command(ctx: typer.Context,
                config: Optional[str] = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
                output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
                ) -> None:
        _run(kind, config, list(ctx.args), output)

    command.__doc__ = doc
    app.command(kind, context_settings=EXTRA_ARGS)(command)


_register("sft", "Supervised fine-tuning: masked NLL on responses, from a dataset or from a "
                 "run's trajectories with reward >= train_dataset.min_reward.")
_register("dpo", "DPO (loss_type sigmoid | ipo) against a frozen reference, from preference "
                 "pairs or from a run's groups (best vs worst trajectory).")
_register("rm", "Bradley-Terry reward model: a one-label classification head on the policy "
                "backbone, trained on preference pairs.")
_register("distill", "Knowledge distillation: forward KL(teacher || student) on dataset tokens, "
                     "optionally mixed with NLL (kd_coef, nll_coef).")
