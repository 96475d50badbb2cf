"""`tapioca eval`: pass@k, avg@k, maj@k and greedy accuracy of a model on held-out data.

What it evaluates: a Hugging Face model directory (``tapioca eval MODEL_DIR``), or a
run's weights at a version (``tapioca eval --run-dir R [--version V]``: the run's
config.yaml and ``R/weights/vNNNNNN.safetensors``, the newest by default; version 0
without a file is the run's initial model). On what: the config's ``valid_dataset``, or
``--data PATH`` (JSONL / Parquet / a ``save_to_disk`` directory, as the trainer reads),
scored by the task's reward (producers/eval_run.py). Settings: ``eval.*`` and
``eval_gconfig.*`` (config/evaluation.py) as dotted overrides, with the engine of
``rollout.*`` (PagedEngine, TorchEngine with ``rollout.paged=false``, or a vLLM / SGLang
server with ``rollout.engine=vllm``), built as a rollout worker builds it.

Writes ``samples.jsonl`` (one row per completion) and ``summary.json`` to ``--out-dir``
and prints a table (``-o json``: the summary). ``--samples FILE`` recomputes the
metrics of an earlier evaluation's samples.jsonl without a model. Scores are version
proof: a completion counts only when all its tokens carry the evaluated version.

``--online`` (a run with ``agent.mode: online``, docs/online.md): the score of live
traffic per version, from the run's ``trajectories.v1`` and ``rewards.v1``: each rewarded
trajectory counts for the version all its loss-bearing tokens carry; one that spans
versions is dropped and counted (algorithms/eval_metrics.py ``live_scores``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..schemas.errors import ConfigError
from .cli_context import EXTRA_ARGS, OUTPUT_HELP, G, check_output, console, emit_json

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()


def metrics_table(metrics: dict[str, Any], title: str) -> Table:
    """One row for the total and one per subset; a column per metric, its standard error
    (``pass@1_stderr``, ``greedy_stderr``) beside it in the same cell."""
    total = metrics["total"]
    skip = {"prompts", "samples", "greedy_prompts"}
    cols = [k for k in total if k not in skip and not k.endswith("_stderr")]
    table = Table("subset", "prompts", *cols, title=title)
    rows = [("all", total)] + sorted(metrics["subsets"].items())

    def cell(values: dict[str, Any], c: str) -> str:
        if c not in values:
            return "-"
        se = values.get(f"{c}_stderr")
        return f"{values[c]:.3f}" + (f" ±{se:.3f}" if se is not None else "")

    for name, values in rows:
        table.add_row(name or "-", f"{values['prompts']:.0f}", *(cell(values, c) for c in cols))
    return table


def proof_line(summary: dict[str, Any]) -> str:
    """What the version proof says under the table: the versions behind the scores and
    what it dropped (producers/eval_run.py ``version_proof``)."""
    versions = ", ".join(f"v{v}" for v in summary.get("versions", [])) or "none"
    dropped = summary.get("mixed_version_samples", 0)
    tail = (f"; {dropped} completion(s) not all of version {summary['version']} dropped, their "
            f"{summary.get('prompts_dropped', 0)} prompt(s) left out" if dropped else
            "; every completion's tokens are of the evaluated version")
    return f"scores from tokens of {versions}{tail}"


def held_out_cell(row: dict[str, Any]) -> str | None:
    """The live table's held-out cell from the evaluator's latest metrics row: its pass@1
    and version, ``"0.938@v600"`` (None: no result yet)."""
    if "eval/pass@1" not in row:
        return None
    return f"{row['eval/pass@1']:.3f}@v{row['step']}"


def held_out_change(held_out: dict[int, float]) -> str:
    """The closing line's part: the first and last held-out pass@1 by version ("" when
    the run had no evaluator)."""
    if not held_out:
        return ""
    (v0, first), (v1, last) = min(held_out.items()), max(held_out.items())
    return f"; held-out pass@1 {first:.3f} (v{v0}) -> {last:.3f} (v{v1})"


# A dotted override (``eval.k=4``, ``valid_dataset.task_options.n=3``): a key, then ``=``.
_OVERRIDE = re.compile(r"[A-Za-z_][\w.\-]*=")


def split_overrides(model: Optional[str], extra: list[str]) -> tuple[Optional[str], list[str]]:
    """(model directory, overrides): an argument of the form ``key=value`` is an override,
    never the model directory, though click hands the first one to the MODEL argument
    when no directory is given (``tapioca eval --run-dir R eval.k=4``)."""
    if model is not None and _OVERRIDE.match(model):
        return None, [model, *extra]
    return model, list(extra)


def _dataset_type(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        return "hf_disk"
    return "parquet" if p.suffix.lower() in (".parquet", ".pq") else "jsonl"


def _config(model: Optional[str], run_dir: Optional[str], config: Optional[str],
            data: Optional[str], overrides: list[str]):
    from dataclasses import replace

    from ..config.loader import load_config
    from ..config.schema import DatasetConfig, TrainConfig
    from ..runtime.run import resolve_run

    if model and run_dir:
        raise ConfigError("pass a model directory or --run-dir, not both")
    if not model and not run_dir:
        raise ConfigError("nothing to evaluate: pass a Hugging Face model directory "
                          "(`tapioca eval DIR`) or a run (`tapioca eval --run-dir RUN_DIR`)")
    if run_dir:
        config = config or str(Path(run_dir) / "config.yaml")
        if not Path(config).is_file():
            raise ConfigError(f"{config} does not exist: --run-dir takes the directory `tapioca "
                              "train` made (runs/EXPERIMENT/TRIAL, with its config.yaml)")
    if model:
        if not Path(model, "config.json").is_file():
            raise ConfigError(f"{model} is not a Hugging Face model directory (no config.json); "
                              "pass one (e.g. made by `tapioca model-init DIR`) or --run-dir")
        # An override, not a later change: the config's checks see the model it will run.
        overrides = [*overrides, f"model.path={Path(model).resolve()}"]
    if data:  # as an override too, so valid_dataset.type=gsm8k finds its path
        overrides = [*overrides, f"valid_dataset.path={data}"]
    cfg = load_config(TrainConfig, config, overrides)
    values: dict[str, Any] = {}
    if data:
        base = cfg.valid_dataset or DatasetConfig()
        kind = base.type if base.type == "gsm8k" else _dataset_type(data)
        values["valid_dataset"] = replace(base, type=kind, path=data)
    return resolve_run(cfg, values=values)


def _weights(run_dir: str, version: Optional[int]):
    """The WeightsEvent of the run's file at ``version`` (newest if None), or None for
    version 0 without a file (the run's initial model, model.path)."""
    from ..schemas.events import WeightsEvent
    from ..weights.files import WEIGHTS_DIR, saved_versions, sha256_file

    wdir = Path(run_dir) / WEIGHTS_DIR
    saved = dict(saved_versions(wdir))
    if version is None:
        if not saved:
            raise ConfigError(f"no weights files in {wdir}: the run has published no version; "
                              "pass --version 0 for its initial model")
        version = max(saved)
    if version not in saved:
        if version == 0:
            return 0, None
        have = (f"it holds v{min(saved)}..v{max(saved)} ({len(saved)} files)" if saved
                else "it holds none")
        raise ConfigError(f"version {version} is not on disk any more in {wdir} ({have}; the "
                          "trainer keeps only its last versions' files): pick one of those with "
                          "--version, or leave --version out for the newest")
    path = saved[version]
    return version, WeightsEvent(version=version, path=str(path), sha256=sha256_file(path))


def online_scores(run_dir: Optional[str], output: str) -> None:
    """``--online``: mean reward per version of the run's rewarded live traffic."""
    from ..algorithms.eval_metrics import live_scores
    from ..algorithms.reward_shaping import weighted_reward
    from ..bus.reader import read_events
    from ..schemas.envelope import ANY_RUN
    from .cli_context import bus_config, run_bus_section, run_dir_run_id

    if run_dir:
        G.run_dir = run_dir
    if not G.run_dir:
        raise ConfigError("--online scores a run's live traffic: pass --run-dir RUN_DIR")
    weights = {}
    config = Path(G.run_dir) / "config.yaml"
    if config.is_file():
        import yaml

        raw = yaml.safe_load(config.read_text()) or {}
        weights = dict(((raw.get("advantage") or {}).get("reward_weights")) or {})
    run_bus_section(G.run_dir)  # a clear error for a directory that is no run
    bus, run_id = bus_config(), run_dir_run_id()
    mine = (lambda e: True) if run_id == ANY_RUN else (lambda e: e.run_id == run_id)
    trajs = {e.traj_id: e for e in read_events(bus, "trajectories") if mine(e)}
    rewards: dict[str, dict[str, float]] = {}
    for e in read_events(bus, "rewards"):
        if mine(e) and e.traj_id in trajs:
            rewards.setdefault(e.traj_id, {})[e.scorer] = e.reward
    # One reward per trajectory: the run's weighted sum of its scorers, else its one scorer's.
    items = [(trajs[t].output_versions, trajs[t].loss_mask,
              weighted_reward(r, weights) if weights else next(iter(r.values())))
             for t, r in rewards.items() if not weights or all(s in r for s in weights)]
    scores, dropped = live_scores(items)
    summary = {"run_dir": G.run_dir, "rewarded_trajectories": len(items), "mixed_version_dropped": dropped,
               "versions": {str(v): {"trajectories": s.trajectories, "mean_reward": s.mean_reward}
                            for v, s in scores.items()}}
    if output == "json":
        emit_json(summary)
        return
    table = Table("version", "trajectories", "mean reward", title=f"live traffic of {G.run_dir}")
    for v, s in scores.items():
        table.add_row(f"v{v}", str(s.trajectories), f"{s.mean_reward:.3f}")
    console.print(table)
    console.print(f"{len(items)} rewarded trajectories; {dropped} spanning several versions dropped "
                  "(a score counts for a version only when every loss-bearing token carries it)")


def recompute(samples: str, k: Optional[int], output: str) -> None:
    from ..algorithms.eval_metrics import summarize
    from ..producers.eval_run import read_samples

    prompts = read_samples(samples)
    k = k or min((len(p.samples) for p in prompts), default=1)
    metrics = summarize(prompts, k)
    if output == "json":
        emit_json({"k": k, "metrics": metrics})
    else:
        console.print(metrics_table(metrics, f"{samples} (k={k})"))


@app.command("eval", context_settings=EXTRA_ARGS)
def eval_command(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, help="A Hugging Face model directory."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="A run's directory "
                                          "(runs/EXPERIMENT/TRIAL): its config and weights."),
    version: Optional[int] = typer.Option(None, "--version", help="The run's policy version "
                                          "(default: the newest weights file)."),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config (default: "
                                         "the run's config.yaml; without a run: the defaults)."),
    data: Optional[str] = typer.Option(None, "--data", help="A dataset file or save_to_disk "
                                       "directory instead of the config's valid_dataset."),
    out_dir: Optional[str] = typer.Option(None, "--out-dir", help="Where samples.jsonl and "
                                          "summary.json go (default: RUN_DIR/eval/manual-vN, "
                                          "or ./eval/MODEL_NAME)."),
    samples: Optional[str] = typer.Option(None, "--samples", help="Recompute the metrics of an "
                                          "evaluation's samples.jsonl (no model)."),
    k: Optional[int] = typer.Option(None, "--k", help="With --samples: k of pass@k / avg@k / "
                                    "maj@k (default: the samples per prompt)."),
    online: bool = typer.Option(False, "--online", help="The run's live traffic (agent.mode "
                                "online): mean reward per version, from its trajectories and "
                                "rewards on the log."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Evaluate a model (or a run's version) on held-out data: pass@k, avg@k, maj@k,
    greedy accuracy. Extra arguments are dotted overrides, e.g. eval.k=8
    eval_gconfig.max_new_tokens=512 rollout.paged=false."""
    check_output(output)
    if samples:
        recompute(samples, k, output)
        return
    if online:
        online_scores(run_dir, output)
        return
    from transformers.utils import logging as hf_logging

    from ..config.sections import eval_section
    from ..engines.base import SamplingParams
    from ..producers.eval_run import EvalRun, Scorer
    from ..runtime.builders import build_eval_parts

    hf_logging.disable_progress_bar()
    run_dir = run_dir or G.run_dir
    model, overrides = split_overrides(model, ctx.args)
    cfg = _config(model, run_dir, config, data, overrides)
    sec = eval_section(cfg)
    event = None
    if run_dir:
        version, event = _weights(run_dir, version)
    else:
        version = 0
    name = f"v{version:06d}" if run_dir else Path(cfg.model.path).name
    out = Path(out_dir or (Path(run_dir) / "eval" / f"manual-{name}" if run_dir else Path("eval") / name))
    out.mkdir(parents=True, exist_ok=True)
    task, bundle, decode = build_eval_parts(sec, log_dir=str(out))
    engine = bundle.engine
    scorer = Scorer(task, sec.eval.scoring_workers)
    try:
        if event is not None:
            bundle.load_weights(event)
        run = EvalRun(task, engine, SamplingParams.from_generation(sec.sampling), k=sec.eval.k,
                      greedy=sec.eval.greedy, decode=decode, version=version,
                      correct_min_reward=sec.eval.correct_min_reward, scorer=scorer)
        with Progress(TextColumn("[bold]eval[/] {task.description}"), BarColumn(),
                      MofNCompleteColumn(), TextColumn("prompts"), TimeElapsedColumn(),
                      console=console, transient=True, disable=output == "json") as bar:
            job = bar.add_task(f"{task.dataset} ({type(engine).__name__})",
                               total=len(task.prompts))
            run.start()
            while not run.done:
                if not run.poll():
                    time.sleep(0.02)
                bar.update(job, completed=run.prompts_done)
        summary = run.write(out, model=cfg.model.path, run_dir=run_dir or "",
                            weights=event.path if event is not None else "",
                            engine=type(engine).__name__)
    finally:
        try:
            engine.shutdown()
        finally:
            scorer.close()
    if output == "json":
        emit_json(summary)
        return
    console.print(metrics_table(summary["metrics"], f"{task.dataset}, version {version}"))
    console.print(proof_line(summary))
    console.print(f"{len(task.prompts)} prompts x {sec.eval.k} samples"
                  f"{' + greedy' if sec.eval.greedy else ''} in {summary['wall_s']:.1f} s: "
                  f"{summary['prompts_per_s']:.2f} prompts/s, "
                  f"{summary['output_tokens_per_s']:,.0f} output tokens/s. Samples: "
                  f"{out / 'samples.jsonl'}; summary: {out / 'summary.json'}")
