"""`tapioca plot RUN_DIR -o out.png`: reward, staleness and throughput curves of a run.

Reads the trainer's ``RUN_DIR/metrics/metrics.jsonl`` (one line per step: ``step``,
``time``, ``reward/mean``, ``trainer/staleness_mean|max``, ``actor/tokens_per_s``, ...;
after a trainer restart a redone step's last line wins) and, when the run had an
evaluator, its ``RUN_DIR/eval/metrics.jsonl`` (one line per evaluated version: held-out
``eval/pass@1``, ``eval/greedy``, ...; drawn beside the training reward), and writes a
PNG with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ..schemas.errors import ConfigError
from .cli_context import console

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()


def metrics_file(path: str | Path) -> Path:
    """The metrics JSONL of a run directory (or the file itself)."""
    path = Path(path)
    candidates = [path] if path.is_file() else [path / "metrics" / "metrics.jsonl",
                                                 path / "metrics.jsonl"]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"no metrics file at {path} (looked for "
                      f"{', '.join(str(c) for c in candidates)}); pass a run directory "
                      "(run_dir/experiment/trial) or its metrics/metrics.jsonl")


def load_steps(path: str | Path) -> list[dict[str, Any]]:
    """One row per step, in step order (the last line of a step wins)."""
    rows: dict[int, dict[str, Any]] = {}
    file = metrics_file(path)
    lines = file.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                continue  # a line being written while we read
            raise ConfigError(f"{file}:{n} is not JSON; is this a Tapioca metrics file?") from None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows[row["step"]] = row
    if not rows:
        raise ConfigError(f"{file} has no step rows yet; plot again once the trainer has "
                          "finished a step")
    return [rows[s] for s in sorted(rows)]


def load_eval(path: str | Path) -> list[dict[str, Any]]:
    """The evaluator's rows of a run directory (``eval/metrics.jsonl``), one per evaluated
    version in version order; [] when the run had no evaluator (or is given as a file)."""
    file = Path(path) / "eval" / "metrics.jsonl"
    if not Path(path).is_dir() or not file.is_file():
        return []
    return load_steps(file)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def render(rows: list[dict[str, Any]], out: str | Path, *, title: str = "",
           eval_rows: list[dict[str, Any]] = ()) -> Path:
    """Three panels against the trainer step: reward (with the held-out ``eval_rows``),
    staleness, throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, len(rows) // 50)
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    steps, reward = _series(rows, "reward/mean")
    if reward:
        ax.plot(steps, reward, alpha=0.35, label="reward/mean")
        ax.plot(steps, _smooth(reward, window), label=f"mean of {window} steps")
    for key in sorted({k for r in eval_rows for k in r if k.count("/") == 1 and (
            k.split("/")[1] in ("pass@1", "greedy") or k.split("/")[1].startswith("maj@"))}):
        s, v = _series(eval_rows, key)
        ax.plot(s, v, marker="o", markersize=3, label=f"held-out {key.split('/')[1]}")
    ax.set_ylabel("reward")
    ax.legend(loc="best")
    ax = axes[1]
    for key in ("trainer/staleness_mean", "trainer/staleness_max"):
        s, v = _series(rows, key)
        if v:
            ax.plot(s, v, label=key.split("/")[1])
    ax.set_ylabel("staleness (versions)")
    ax.legend(loc="best")
    ax = axes[2]
    s, tps = _series(rows, "actor/tokens_per_s")
    if tps:
        ax.plot(s, _smooth(tps, window), label="trained tokens/s")
        ax.set_ylabel("tokens/s")
    else:  # derive steps per minute from the rows' wall-clock times
        times = [(r["step"], r["time"]) for r in rows if isinstance(r.get("time"), (int, float))]
        pts = [(b[0], 60.0 * (b[0] - a[0]) / (b[1] - a[1]))
               for a, b in zip(times, times[1:]) if b[1] > a[1]]
        ax.plot([p[0] for p in pts], _smooth([p[1] for p in pts], window), label="steps/min")
        ax.set_ylabel("steps/min")
    ax.legend(loc="best")
    ax.set_xlabel("trainer step (policy version)")
    fig.suptitle(title or "Tapioca run")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


@app.command("plot")
def plot(
    run_dir: str = typer.Argument(..., help="Run directory (or its metrics/metrics.jsonl)."),
    output: str = typer.Option("metrics.png", "-o", "--output", help="PNG file to write."),
) -> None:
    """Render reward (and held-out scores), staleness and throughput curves of a run to a PNG."""
    rows = load_steps(run_dir)
    eval_rows = load_eval(run_dir)
    path = render(rows, output, title=str(Path(run_dir).resolve().name), eval_rows=eval_rows)
    held_out = f", {len(eval_rows)} held-out evaluations" if eval_rows else ""
    console.print(f"{path} ({len(rows)} steps{held_out})")
