"""Runs on disk, without a broker: `tapioca runs` (every trial under a run root, with its
state, step and last reward), `tapioca config show` (a config as a run would get it:
defaults, the YAML file, the dotted overrides, validated; nothing is started or created)
and what `tapioca train --resume RUN_DIR` resumes from (:func:`resume_config`).

Reads ``<root>/<experiment>/<trial>/``: ``config.yaml`` (what the run was started with),
``launcher.json`` (ops/run_record.py: is its launcher alive, how did it end),
``metrics/metrics.jsonl`` (the trainer's rows: step, reward) and ``final/``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from .cli_context import EXTRA_ARGS, OUTPUT_HELP, check_output, console, emit_json

# This module's commands and group; ops/cli.py adds them to `tapioca`.
app = typer.Typer()
config_app = typer.Typer(no_args_is_help=True, help="Configs: see what a run would get.")

KINDS = ("rl", "sft", "dpo", "rm", "distill")
# The metric that names a supervised trainer's kind in its metrics.jsonl.
_SUPERVISED_LOSS = {"sft/loss": "sft", "dpo/loss": "dpo", "rm/loss": "rm", "distill/loss": "distill"}
_TAIL_BYTES = 256 << 10
# The kind of a run `tapioca train-offline` made (no config.yaml: it has no launcher), told
# by the RL trainer's metrics, which no supervised trainer writes.
OFFLINE_RL = "offline-rl"
_RL_TRAINER_KEYS = ("reward/mean", "trainer/staleness_mean")
# `tapioca runs`' columns, the last dropped first when the table is too wide for the
# terminal: the run's name is never cut (`tapioca train --resume` needs all of it).
_RUNS_COLUMNS = ("run", "state", "step", "kind", "reward", "updated")


def _config_class(kind: str):
    from ..config.schema import TrainConfig
    from ..config.supervised import DistillConfig, DPOConfig, RewardModelConfig, SFTConfig

    return {"rl": TrainConfig, "sft": SFTConfig, "dpo": DPOConfig, "rm": RewardModelConfig,
            "distill": DistillConfig}[kind]


@config_app.command("show", context_settings=EXTRA_ARGS)
def config_show(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file."),
    kind: str = typer.Option("rl", "--kind", help="Whose config: rl (`tapioca train`), sft, "
                             "dpo, rm or distill."),
    output: str = typer.Option("yaml", "-o", "--output", help="yaml or json"),
) -> None:
    """Print the resolved config (defaults, then --config, then key=value overrides),
    validated, without running anything. An empty trial_name is named at start."""
    import dataclasses

    from ..config.loader import load_config, to_yaml
    from ..schemas.errors import ConfigError

    if kind not in KINDS:
        raise ConfigError(f"--kind {kind!r}: use one of {', '.join(KINDS)}")
    if output not in ("yaml", "json"):
        raise typer.BadParameter("--output must be yaml or json")
    cfg = load_config(_config_class(kind), config, list(ctx.args))
    if output == "json":
        emit_json(dataclasses.asdict(cfg))
    else:
        typer.echo(to_yaml(cfg), nl=False)


# ---------------------------------------------------------------------- runs


def _tail_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of the last ``_TAIL_BYTES`` of a JSONL file, oldest first."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return []
    if size > _TAIL_BYTES:
        lines = lines[1:]  # the first is cut
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return rows


def run_info(run: Path, root: Path) -> dict[str, Any]:
    """One trial: its name, kind, state, step / total, last reward and last update."""
    import yaml

    from . import run_record

    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    metrics = run / "metrics" / "metrics.jsonl"
    rows = _tail_rows(metrics)
    kind = "rl" if "rollout" in cfg else next(
        (k for key, k in _SUPERVISED_LOSS.items() if any(key in r for r in rows)),
        # The trainer role's rows without a launcher's config.yaml: `tapioca train-offline`.
        OFFLINE_RL if any(key in r for r in rows for key in _RL_TRAINER_KEYS) else "supervised")
    step = max((int(r.get("step", 0)) for r in rows), default=0)
    total = cfg.get("total_train_steps")
    rewards = [r["reward/mean"] for r in rows if isinstance(r.get("reward/mean"), (int, float))]
    record = run_record.read_record(run)
    if run_record.running(record):
        state = "running"
    elif record and record.get("outcome"):
        state = record["outcome"]
    elif (run / "final").is_dir() or (total and step >= total):
        state = "finished"
    else:
        state = "stopped"  # killed, or its launcher wrote no record
    try:
        updated = max(p.stat().st_mtime for p in (metrics, run / "config.yaml") if p.exists())
    except ValueError:
        updated = None
    return {"run": str(run.relative_to(root)), "path": str(run), "kind": kind, "state": state,
            "step": step, "total_steps": total, "last_reward": rewards[-1] if rewards else None,
            "updated_at": updated, "final": (run / "final").is_dir()}


def find_runs(root: Path) -> list[Path]:
    """Trial directories under ``root`` (``<experiment>/<trial>`` with a config.yaml or
    metrics), newest first."""
    found = [p for p in root.glob("*/*") if p.is_dir() and (
        (p / "config.yaml").is_file() or (p / "metrics" / "metrics.jsonl").is_file())]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _ago(t: float | None) -> str:
    if t is None:
        return "-"
    s = max(0.0, time.time() - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 \
        else f"{s / 3600:.0f} h ago"


@app.command("runs")
def runs(
    root: str = typer.Argument("runs", help="The run root (a config's run_dir)."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """List the trials under ROOT: state (running, finished, interrupted, failed,
    stopped), step, last mean reward, last update. `tapioca train --resume PATH`
    continues one."""
    check_output(output)
    base = Path(root)
    if not base.is_dir():
        from ..schemas.errors import ConfigError

        raise ConfigError(f"{root} is not a directory (the run root: a config's run_dir, "
                          "default runs)")
    infos = [run_info(p, base) for p in find_runs(base)]
    if output == "json":
        emit_json(infos)
        return
    if not infos:
        console.print(f"no runs under {root}")
        return
    console.print(runs_table(infos, f"runs under {root}", console))


def runs_table(infos: list[dict[str, Any]], title: str, out: Console) -> Table:
    """The trials as a table as wide as ``out``: columns are dropped (updated, reward,
    kind, step) before a run's name would be cut; a name wider than the terminal wraps."""
    cells = []
    for i in infos:
        step = f"{i['step']}/{i['total_steps']}" if i["total_steps"] else str(i["step"])
        reward = f"{i['last_reward']:.3f}" if i["last_reward"] is not None else "-"
        cells.append({"run": i["run"], "kind": i["kind"], "state": i["state"], "step": step,
                      "reward": reward, "updated": _ago(i["updated_at"])})
    def width(col: str) -> int:
        return max([len(col)] + [len(row[col]) for row in cells])

    shown = ["run", "kind", "state", "step", "reward", "updated"]
    while True:
        # A box border beside each column and one space either side of its text.
        others = sum(width(c) + 3 for c in shown if c != "run") + 4
        droppable = [c for c in reversed(_RUNS_COLUMNS) if c in shown and c not in ("run", "state")]
        if width("run") + others <= out.width or not droppable:
            break
        shown.remove(droppable[0])
    table = Table(title=title)
    for col in shown:  # the name wraps (never cut) only where it is wider than the terminal
        table.add_column(col, justify="left" if col in ("run", "kind", "state") else "right",
                         no_wrap=col != "run", overflow="fold",
                         min_width=max(min(width("run"), out.width - others), 8) if col == "run" else None)
    for row in cells:
        table.add_row(*(row[c] for c in shown))
    return table


# ---------------------------------------------------------------------- resume


def resume_config(run_dir: str, config: Optional[str], overrides: list[str]
                  ) -> tuple[str, dict[str, Any], str]:
    """`tapioca train --resume RUN_DIR`: the run's own config.yaml, the values that put
    the run back where it was (its directory; no broker address when its broker was the
    launcher's own embedded one, which stopped with it), and a line saying from which step
    it goes on."""
    from ..schemas.errors import ConfigError
    from ..trainers.checkpoint import SUFFIX, read_progress
    from . import run_record

    if config:
        raise ConfigError("--resume RUN_DIR trains with the run's own RUN_DIR/config.yaml: drop "
                          "--config (key=value overrides still apply on top)")
    run = Path(run_dir).resolve()
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; a run directory is "
                          "runs/EXPERIMENT/TRIAL, as `tapioca runs` lists them")
    record = run_record.read_record(run)
    if run_record.running(record):
        raise ConfigError(f"--resume {run_dir}: that trial is running (launcher pid "
                          f"{record['pid']}); stop it first, or watch it with "
                          f"`tapioca --run-dir {run_dir} status`")
    values = {"run_dir": str(run.parent.parent), "experiment_name": run.parent.name,
              "trial_name": run.name}
    own_broker = record.get("own_broker") if record else (run / "logs" / "broker.log").exists()
    if own_broker and not any(o.startswith("bus.bootstrap_servers=") for o in overrides):
        values["bus.bootstrap_servers"] = ""
    progress = read_progress(run / "checkpoints" / f"trainer{SUFFIX}")
    if progress is None or progress.version == 0:
        note = f"no checkpoint in {run}: trial {run.name} starts from step 0"
    else:
        note = f"resuming trial {run.name} from step {progress.version} ({run / 'checkpoints'})"
    return str(run / "config.yaml"), values, note
