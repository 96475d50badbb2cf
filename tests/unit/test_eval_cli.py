"""`tapioca eval` on the tiny synthetic model, in process (no broker): a model directory and
a run's weights at a version, the files it writes (recomputed by `--samples` to the same
numbers), both in-process engines, and the bad inputs (an empty dataset, a version no
longer on disk, k larger than the samples produced), each a clear error; and the display
(live column, plot, closing line) and the stall alarm beside an evaluator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapioca.config.loader import load_config, to_yaml
from tapioca.config.schema import TrainConfig
from tapioca.models.factory import load_model_and_tokenizer
from tapioca.ops.cli import app
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.weights.files import save_weights, weights_file

HELD_OUT = 6
DATA = ["valid_dataset.type=synthetic", "valid_dataset.split=test",
        f"valid_dataset.task_options.holdout_pairs={HELD_OUT}", "eval.k=3",
        "gconfig.max_new_tokens=3"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("model") / "m", "synthetic", seed=0)


def tapioca(*args: str):
    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    return result


def ok(*args: str) -> str:
    result = tapioca(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def error(*args: str) -> str:
    result = tapioca(*args)
    assert result.exit_code != 0 and result.exception is not None, result.output
    return str(result.exception)


@pytest.mark.parametrize("paged,scoring_workers", [
    ("true", 0), ("false", 0),  # PagedEngine, TorchEngine; scored in this process
    ("true", 2),                # scored by a pool of two processes
])
def test_eval_a_model_directory_writes_rows_and_a_summary_that_recompute(tiny_dir, tmp_path, paged,
                                                                         scoring_workers):
    out = tmp_path / "out"
    summary = json.loads(ok("eval", str(tiny_dir), *DATA, f"rollout.paged={paged}",
                            f"eval.scoring_workers={scoring_workers}",
                            "--out-dir", str(out), "-o", "json"))
    assert summary["engine"] == ("PagedEngine" if paged == "true" else "TorchEngine")
    total = summary["metrics"]["total"]
    assert total["prompts"] == HELD_OUT and total["samples"] == HELD_OUT * 3
    assert set(total) >= {"pass@1", "pass@2", "pass@3", "avg@3", "maj@3", "greedy"}
    assert summary["prompts_per_s"] > 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == HELD_OUT * 4 and sum(r["sample_index"] == -1 for r in rows) == HELD_OUT
    assert json.loads((out / "summary.json").read_text()) == summary
    # anyone can recompute the numbers from the rows
    again = json.loads(ok("eval", "--samples", str(out / "samples.jsonl"), "-o", "json"))
    assert again["k"] == 3 and again["metrics"] == summary["metrics"]
    # a table for people
    assert "pass@1" in ok("eval", "--samples", str(out))


@pytest.fixture(scope="module")
def run_dir(tiny_dir, tmp_path_factory) -> Path:
    """A run directory as `tapioca train` leaves it: config.yaml and weights v5, v6."""
    run = tmp_path_factory.mktemp("runs") / "exp" / "t0"
    cfg = load_config(TrainConfig, None, [f"model.path={tiny_dir}", *DATA])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    model, _ = load_model_and_tokenizer(str(tiny_dir))
    for v in (5, 6):
        save_weights(model.state_dict(), weights_file(run / "weights", v))
    return run


def test_eval_a_run_at_a_version_newest_by_default(run_dir):
    newest = json.loads(ok("eval", "--run-dir", str(run_dir), "-o", "json"))
    assert newest["version"] == 6 and newest["weights"].endswith("v000006.safetensors")
    # Version proof: every scored token was made by v6, nothing dropped.
    assert (newest["versions"], newest["mixed_version_samples"], newest["prompts_dropped"]) == ([6], 0, 0)
    assert (run_dir / "eval" / "manual-v000006" / "samples.jsonl").is_file()
    assert json.loads(ok("eval", "--run-dir", str(run_dir), "--version", "5", "-o", "json"))["version"] == 5
    # version 0 without a file is the run's initial model
    initial = json.loads(ok("eval", "--run-dir", str(run_dir), "--version", "0", "-o", "json"))
    assert initial["version"] == 0 and initial["weights"] == ""
    assert "scores from tokens of v5; every completion" in ok("eval", "--run-dir", str(run_dir),
                                                              "--version", "5")


def test_an_argument_of_the_form_key_value_is_an_override_not_the_model_directory(run_dir, tmp_path):
    """click hands the first extra argument to MODEL when none is given; eval.k=2 is an
    override all the same (it was "pass a model directory or --run-dir, not both")."""
    out = json.loads(ok("eval", "--run-dir", str(run_dir), "--version", "5", "eval.k=2",
                        "eval.greedy=false", "--out-dir", str(tmp_path / "o"), "-o", "json"))
    assert (out["version"], out["k"], out["greedy"]) == (5, 2, False)


def test_a_version_not_on_disk_any_more_says_which_are(run_dir):
    msg = error("eval", "--run-dir", str(run_dir), "--version", "3")
    assert "version 3 is not on disk any more" in msg and "v5..v6" in msg and "--version" in msg


def test_an_empty_dataset_says_what_to_do(tiny_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    msg = error("eval", str(tiny_dir), "--data", str(empty), "--out-dir", str(tmp_path / "o"))
    assert "has no prompts" in msg and "--data" in msg
    assert "set valid_dataset" in error("eval", str(tiny_dir))


def test_k_larger_than_the_samples_produced_says_what_to_do(tiny_dir, tmp_path):
    out = tmp_path / "out"
    ok("eval", str(tiny_dir), *DATA, "--out-dir", str(out))
    msg = error("eval", "--samples", str(out), "--k", "5")
    assert "needs 5 sampled completions" in msg and "has 3" in msg and "eval.k >= 5" in msg


def test_nothing_to_evaluate_or_a_directory_that_is_no_model(tmp_path):
    assert "nothing to evaluate" in error("eval")
    assert "not a Hugging Face model directory" in error("eval", str(tmp_path))


def test_plot_draws_held_out_curves_and_the_live_table_shows_the_last_score(tmp_path):
    import io
    from pathlib import Path

    from rich.console import Console

    from tapioca.config.schema import TrainConfig
    from tapioca.ops.launcher import RunSummary
    from tapioca.ops.plot import load_eval
    from tapioca.ops.train_view import Checkpoint, TrainView, closing_line

    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "metrics" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time": float(s), "reward/mean": s / 10}) + "\n" for s in range(1, 11)))
    (run / "eval" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time": float(s), "eval/pass@1": s / 20, "eval/greedy": s / 10,
                    "eval/maj@4": s / 15, "eval/easy/pass@1": 1.0}) + "\n" for s in (0, 5, 10)))
    assert [r["step"] for r in load_eval(run)] == [0, 5, 10]
    out = ok("plot", str(run), "-o", str(tmp_path / "curves.png"))
    assert "3 held-out evaluations" in out and (tmp_path / "curves.png").stat().st_size > 0
    assert load_eval(tmp_path) == []  # a run without an evaluator

    def render(view: TrainView) -> str:
        console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
        console.print(view.table())
        return console.export_text()

    cfg = TrainConfig(trial_name="t1", total_train_steps=600)
    view = TrainView(cfg)
    view.observe({"source": "trainer-0", "step": 600, "reward/mean": 1.0})
    assert "held-out" not in render(view) and "held-out" not in view.line()  # no evaluator yet
    view.observe({"source": "evaluator-0", "step": 600, "eval/pass@1": 0.9375})
    text = render(view)
    # The cell, by hand: pass@1 0.9375 to three places at version 600 -> "0.938@v600"
    # (0.9375 rounds half to even: 0.938). It fits the demo's 80 columns, whole.
    assert "held-out" in text and "0.938@v600" in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "held-out pass@1 0.938@v600" in view.line()
    # The closing line: the first and last held-out pass@1 by version.
    summary = RunSummary(run, steps=2, wall_s=12.0, rewards={1: 0.5, 2: 0.5},
                         held_out={600: 0.9375, 0: 0.016})
    line = closing_line(summary, TrainConfig(trial_name="t1", total_train_steps=2),
                        Checkpoint(Path("/r/c"), 2), resume="R")
    assert "held-out pass@1 0.016 (v0) -> 0.938 (v600)" in line, line


def test_the_evaluators_counters_are_no_sign_of_progress_to_the_stall_alarm(tmp_path):
    """The evaluator reads metrics.v1, where every member reports each second: its
    counters keep moving while the run is stalled (they must not reset the alarm)."""
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.ops.launcher import Launcher, RunSummary

    launcher = Launcher(load_config(TrainConfig, None, []))
    launcher.summary = RunSummary(tmp_path)
    launcher._observe("trainer-0", 1, {"bus/handled": 5.0, "bus/produced": 1.0})
    before = launcher._progress
    launcher._observe("evaluator-0", 1, {"bus/handled": 500.0, "bus/produced": 3.0})
    assert launcher._progress == before
    launcher._observe("evaluator-0", 10, {"eval/pass@1": 0.5, "eval/prompts": 16.0})
    assert launcher.summary.held_out == {10: 0.5}


def test_a_prompt_the_engine_cannot_generate_is_named(tiny_dir, tmp_path):
    # the tiny model has 256 positions: no prompt fits with 300 new tokens
    msg = error("eval", str(tiny_dir), *DATA, "eval_gconfig.max_new_tokens=300",
                "--out-dir", str(tmp_path / "o"))
    assert "prompt 'synthetic-max-" in msg and "cannot be generated" in msg
    assert "max_position_embeddings" in msg
