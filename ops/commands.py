"""Commands that run roles: `tapioca train`, `tapioca demo`, `tapioca role`."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.live import Live
from rich.table import Table

from .cli_context import EXTRA_ARGS, G, console
from .eval_cli import held_out_cell, held_out_change

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO_CONFIG = "demo_cpu.yaml"


def _backlogs(status: dict[str, dict]) -> tuple[float, float] | None:
    """(prompt groups admitted but not yet generated, sample groups emitted but not yet
    consumed by the trainer), from every member's status event on metrics.v1."""
    def total(key: str) -> float:
        return sum(row.get(key, 0.0) for row in status.values())

    if not any("feeder/groups" in r for r in status.values()):
        return None
    prompts = total("feeder/groups") - total("rollout/groups_done")
    samples = (total("advantage/emitted") + total("advantage/dropped")
               - total("trainer/groups_consumed"))
    return max(prompts, 0.0), max(samples, 0.0)


def _supervision_caption(health: dict | None) -> str | None:
    """Restarts, pending restarts, alarms (red) and the latest notices of the launcher's
    supervisor (Launcher.health), or None when there is nothing to say."""
    if not health:
        return None
    lines = [f"[bold red]ALARM[/] {a}" for a in health.get("alarms", [])]
    restarts = health.get("restarts") or {}
    if restarts or health.get("pending"):
        text = "restarts: " + (", ".join(f"{m} x{n}" for m, n in sorted(restarts.items())) or "-")
        if health.get("pending"):
            text += f" (restarting: {', '.join(health['pending'])})"
        lines.append(f"[yellow]{text}[/]")
    lines += [f"[dim]{n}[/]" for n in health.get("notices", [])]
    return "\n".join(lines) or None


def _progress_table(rows: dict[str, dict], status: dict[str, dict], started: float,
                    recent: list[float], health: dict | None = None) -> Table:
    table = Table(title=f"tapioca — {time.monotonic() - started:,.0f} s", expand=False)
    for col in ("version", "reward (last 20 steps)", "tokens/s (train)", "tokens/s (rollout)",
                "backlog prompts/samples", "staleness mean/max", "rejected", "step s"):
        table.add_column(col, justify="right")
    held_out = held_out_cell(rows.get("evaluator", {}))  # producers/evaluator.py's last result
    if held_out:
        table.add_column("held-out pass@1", justify="right")
    t = rows.get("trainer", {})
    r = rows.get("rollout", {})
    fmt = lambda v, f="{:.3f}": f.format(v) if isinstance(v, (int, float)) else "-"  # noqa: E731
    smoothed = sum(recent[-20:]) / len(recent[-20:]) if recent else None
    backlog = _backlogs(status)
    table.add_row(
        fmt(t.get("step"), "{}"), fmt(smoothed),
        fmt(t.get("actor/tokens_per_s"), "{:,.0f}"), fmt(r.get("rollout/tokens_per_s"), "{:,.0f}"),
        f"{backlog[0]:.0f}/{backlog[1]:.0f}" if backlog else "-",
        f"{fmt(t.get('trainer/staleness_mean'), '{:.2f}')}/"
        f"{fmt(t.get('trainer/staleness_max'), '{:.0f}')}",
        fmt(t.get("trainer/rejected_stale"), "{:.0f}"), fmt(t.get("actor/step_time_s"), "{:.2f}"),
        *([held_out] if held_out else []),
    )
    table.caption = _supervision_caption(health)
    table.caption_justify = "left"
    return table


def run_training(config: Optional[str], overrides: list[str], *, live: bool = True) -> None:
    from transformers.utils import logging as hf_logging

    from ..config.loader import load_config
    from ..config.schema import TrainConfig
    from .launcher import Launcher

    hf_logging.disable_progress_bar()
    cfg = load_config(TrainConfig, config, overrides)
    # `docker stop` / systemd send SIGTERM: stop the roles as Ctrl-C would.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if G.bootstrap and not cfg.bus.bootstrap_servers:
        from ..runtime.run import resolve_run

        cfg = resolve_run(cfg, bootstrap=G.bootstrap)
    latest: dict[str, dict] = {}  # role -> its latest step metrics
    status: dict[str, dict] = {}  # member -> its latest status (bus counters, describe)
    recent: list[float] = []
    started = time.monotonic()
    if cfg.scheduler.type == "ray":  # every role a Ray actor (ops/ray_launcher.py)
        from .ray_launcher import RayLauncher as Launcher  # noqa: F811
    launcher = Launcher(cfg)
    with Live(_progress_table(latest, status, started, recent), console=console,
              refresh_per_second=2, transient=False, auto_refresh=live) as view:
        def redraw() -> None:
            view.update(_progress_table(latest, status, started, recent, launcher.health()))

        def on_metrics(row: dict) -> None:
            if "bus/handled" in row:
                status[row["source"]] = row
            else:
                role = row["source"].split("-")[0]
                latest[role] = row
                if role == "trainer" and "reward/mean" in row:
                    recent.append(row["reward/mean"])
            redraw()

        launcher.on_metrics = on_metrics
        # Restarts and alarms change when no metrics arrive (a stall): redraw each turn.
        launcher.on_tick = redraw
        try:
            launcher.start()
            cfg = launcher.cfg  # resolved: trial, run dir, broker, bus run id
            bus_id = "" if cfg.bus.run_id == cfg.run_id else f", bus run id {cfg.bus.run_id}"
            console.print(f"run {cfg.run_id}: {cfg.run_path} (broker {cfg.bus.bootstrap_servers}"
                          f"{bus_id}; `tapioca --run-dir {cfg.run_path} status`)")
            summary = launcher.wait()
        except KeyboardInterrupt:
            console.print("interrupted: stopping every role")
            raise typer.Exit(130)
        finally:
            launcher.stop()
    if not console.is_terminal:  # there, the live table's last line has no newline
        console.print()
    means = summary.window_means()
    supervision = summary.supervision_line()
    supervision = f" ({supervision})" if supervision else ""
    if means is None:
        console.print(f"done: no training step completed ({summary.run_dir}){supervision}")
        return
    first, last, w = means
    steps = f"{w} steps" if w > 1 else "step"
    held_out = held_out_change(summary.held_out)
    console.print(f"done: {summary.steps} steps in {summary.wall_s:.0f} s; mean reward "
                  f"{first:.3f} over the first {steps} -> {last:.3f} over the last {steps}"
                  f"{held_out}{supervision}. Metrics: {summary.run_dir}/metrics/metrics.jsonl")


@app.command("train", context_settings=EXTRA_ARGS)
def train(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file."),
    launcher: Optional[str] = typer.Option(
        None, "--launcher", help="local (child processes, the default) or ray (Ray actors); "
        "the same as scheduler.type=..."),
) -> None:
    """Run training: every role as its own process, meeting on the log. Extra
    arguments are dotted overrides, e.g. actor.lr=1e-3 gconfig.n_samples=8."""
    run_training(config, list(ctx.args) + ([f"scheduler.type={launcher}"] if launcher else []))


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
) -> None:
    """Write the tiny random-weight model and its tokenizer to DIRECTORY."""
    from ..runtime.run import create_tiny_checkpoint

    console.print(str(create_tiny_checkpoint(
        directory, task=task, num_heads=num_heads, num_kv_heads=min(num_kv_heads, num_heads),
        tie_word_embeddings=tie_word_embeddings)))
