"""Commands that run roles: `tapioca train`, `tapioca demo`, `tapioca role`."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Optional

import typer
from rich.live import Live

from .cli_context import EXTRA_ARGS, G, console

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO_CONFIG = "demo_cpu.yaml"


def run_training(config: Optional[str], overrides: list[str], *,
                 live: Optional[bool] = None, resume: Optional[str] = None) -> None:
    """Launch the run and show it (ops/train_view.py): a live table on a terminal,
    progress lines otherwise (``live`` forces either). ``resume``: a run directory whose
    own config.yaml the run continues from (`tapioca train --resume RUN_DIR`)."""
    from transformers.utils import logging as hf_logging

    from ..config.loader import load_config
    from ..config.schema import TrainConfig
    from ..runtime.run import resolve_run
    from ..trainers.final_model import FINAL_DIR
    from . import train_view
    from .broker_state import train_bootstrap
    from .launcher import Launcher, RoleFailedError
    from .run_cli import resume_config

    hf_logging.disable_progress_bar()
    values: dict = {}
    if resume:  # the run's own config.yaml, back where it was (ops/run_cli.py)
        config, values, note = resume_config(resume, config, overrides)
        console.print(note)
    cfg = load_config(TrainConfig, config, overrides)
    if values:
        cfg = resolve_run(cfg, values=values)
    # `docker stop` / systemd send SIGTERM: stop the roles as Ctrl-C would.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if not cfg.bus.bootstrap_servers:
        # The flag / $TAPIOCA_BOOTSTRAP, else `tapioca broker up`'s, else the launcher's own.
        bootstrap, note = train_bootstrap(G.bootstrap)
        if note:
            console.print(note)
        if bootstrap:
            cfg = resolve_run(cfg, bootstrap=bootstrap)
    live = console.is_terminal if live is None else live
    # A named trial may have a checkpoint: the view starts at its step, not at 0.
    resumed = train_view.trainer_checkpoint(cfg.run_path) if cfg.trial_name else None
    if resumed is not None and resumed.trained >= cfg.total_train_steps \
            and (Path(cfg.run_path) / FINAL_DIR).exists():
        # Nothing to train: said before a broker or any role starts (it took ~19 s to start
        # every role and stop them again). Without final/ (a run killed while writing it)
        # the trainer starts, finds itself done and writes it on its way out.
        for line in (train_view.start_line(cfg, resumed),
                     train_view.ending(None, cfg, resumed, resume="", interrupted=False, failure=None).line):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    view = train_view.TrainView(cfg, resumed_at=resumed.version if resumed is not None else 0)
    if cfg.scheduler.type == "ray":  # every role a Ray actor (ops/ray_launcher.py)
        from .ray_launcher import RayLauncher as Launcher  # noqa: F811
    launcher = Launcher(cfg)
    interrupted = False
    failure: RoleFailedError | None = None
    summary = None
    # On a terminal the live table redraws itself; elsewhere it would print only at the
    # end, so lines are printed instead (every launcher.log_every_steps / log_every_s).
    display = (Live(view.table(), console=console, refresh_per_second=2, transient=False)
               if live else contextlib.nullcontext())
    with display as table_view:
        def redraw() -> None:
            if table_view is not None:
                table_view.update(view.table(launcher.health()))
                return
            for line in view.lines_due(launcher.health()):
                console.print(line, markup=False, highlight=False, soft_wrap=True)

        def on_metrics(row: dict) -> None:
            view.observe(row)
            if table_view is not None:
                redraw()

        launcher.on_metrics = on_metrics
        # Restarts and alarms change when no metrics arrive (a stall): redraw each turn.
        launcher.on_tick = redraw
        try:
            launcher.start()
            cfg = launcher.cfg  # resolved: trial, run dir, broker, bus run id
            bus_id = "" if cfg.bus.run_id == cfg.run_id else f", bus run id {cfg.bus.run_id}"
            # soft_wrap: a log file gets each message on one line, whatever its length.
            console.print(f"run {cfg.run_id}: {cfg.run_path} (broker {cfg.bus.bootstrap_servers}"
                          f"{bus_id}; `tapioca --run-dir {cfg.run_path} status`)", soft_wrap=True)
            if cfg.agent.online:  # docs/online.md
                console.print(f"online: the proxy serves http://{cfg.proxy.host}:{cfg.proxy.port}/v1 "
                              f"(admin key: {cfg.proxy.api_key_file or 'proxy.api_key'}); reward an "
                              f"ended session with `tapioca --run-dir {cfg.run_path} reward "
                              "SESSION_ID VALUE`", markup=False, soft_wrap=True)
            resuming = train_view.start_line(cfg, train_view.trainer_checkpoint(cfg.run_path))
            if resuming:
                console.print(resuming, markup=False, highlight=False, soft_wrap=True)
            summary = launcher.wait()
        except KeyboardInterrupt:
            console.print("stopping every role (Ctrl-C)")
            interrupted = True
        except RoleFailedError as exc:  # said below, after the closing line
            failure = exc
        finally:
            launcher.stop()
    if not console.is_terminal and live:  # there, the live table's last line has no newline
        console.print()
    for line in ([] if live else view.lines_at_end()):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    cfg = launcher.cfg  # resolved as far as the start got
    resume = (f"tapioca train --resume {cfg.run_path}" if resume else
              train_view.resume_command(config, overrides, cfg.trial_name, bootstrap=G.bootstrap,
                                        demo_config=str(EXAMPLES / DEMO_CONFIG)))
    # After the stop: the trainer checkpoints on its way out.
    ckpt = train_view.trainer_checkpoint(cfg.run_path)
    end = train_view.ending(summary or launcher.summary, cfg, ckpt, resume=resume, interrupted=interrupted,
                            failure=failure.why if failure is not None else None)
    console.print(end.line, markup=False, highlight=False, soft_wrap=True)
    if failure is not None:
        raise failure  # `error: ...` in full on stderr, and the role's exit status (ops/cli.py)
    if end.exit_code:  # stopped before total_train_steps, or Ctrl-C
        raise typer.Exit(end.exit_code)


@app.command("train", context_settings=EXTRA_ARGS)
def train(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file."),
    launcher: Optional[str] = typer.Option(
        None, "--launcher", help="local (child processes, the default) or ray (Ray actors); "
        "the same as scheduler.type=..."),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="Continue the trial in RUN_DIR (runs/EXPERIMENT/TRIAL) from its "
        "checkpoint, with the config it was started with; overrides apply on top (e.g. "
        "total_train_steps=1200)."),
) -> None:
    """Run training: every role as its own process, meeting on the log. Extra
    arguments are dotted overrides, e.g. actor.optimizer.lr=1e-3 gconfig.n_samples=8."""
    run_training(config, list(ctx.args) + ([f"scheduler.type={launcher}"] if launcher else []),
                 resume=resume)


@app.command("demo", context_settings=EXTRA_ARGS)
def demo(ctx: typer.Context) -> None:
    """Train the tiny model on the built-in synthetic task on the embedded broker."""
    run_training(str(EXAMPLES / DEMO_CONFIG), list(ctx.args))


@app.command("role", context_settings=EXTRA_ARGS)
def role(
    ctx: typer.Context,
    name: str = typer.Argument(
        ..., help="feeder | rollout | reward | advantage | trainer | archiver | evaluator"),
    config: str = typer.Option(..., "--config", "-c", help="YAML config file of the run."),
    member: int = typer.Option(0, help="Member index (for several rollout workers)."),
) -> None:
    """Run one role in this process (what `train` launches; also for docker-compose)."""
    from .role_main import run_role_process

    code = run_role_process(name, config, list(ctx.args), member)
    raise typer.Exit(code)


@app.command("model-init")
def model_init(
    directory: str = typer.Argument(..., help="Where to write the model + tokenizer."),
    task: str = typer.Option("synthetic", help="Task whose alphabet the tokenizer covers."),
    num_heads: int = typer.Option(4, help="Attention heads (head size = 64 / heads; vLLM on "
                                          "CPU needs >= 32: 2)."),
    num_kv_heads: int = typer.Option(2, help="Key/value heads (divides num_heads)."),
    tie_word_embeddings: bool = typer.Option(
        True,
        help="Share the LM head with the embeddings (vLLM on CPU: --no-tie-word-embeddings)."),
    arch: str = typer.Option("qwen2", help="qwen2, qwen3, llama, or a vision-language model: "
                                           "qwen2_5_vl, qwen3_vl (docs/vlm.md; task visual)."),
) -> None:
    """Write the tiny random-weight model and its tokenizer to DIRECTORY."""
    from ..runtime.run import create_tiny_checkpoint

    console.print(str(create_tiny_checkpoint(
        directory, task=task, num_heads=num_heads, num_kv_heads=min(num_kv_heads, num_heads),
        tie_word_embeddings=tie_word_embeddings, arch=arch)))
