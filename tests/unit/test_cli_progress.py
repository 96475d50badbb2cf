"""The CLI around long commands, without a broker: progress off a terminal (a line every
``$TAPIOCA_PROGRESS_EVERY_S``; `tapioca replay` of an archive as a person runs it),
global options after the command, and the compact numbers of the narrow tables."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from tapioca.bus.archive import ArchiveWriter, count_records
from tapioca.bus.role import Source
from tapioca.ops.cli import app, hoist_global_options
from tapioca.ops.fleet_cli import shown_versions
from tapioca.ops.progress import CommandProgress
from tapioca.ops.render import compact, duration
from tapioca.schemas import RewardEvent
from tapioca.schemas.envelope import encode_event
from tapioca.schemas.errors import EXIT_CONFIG

TAPIOCA = str(Path(sys.executable).parent / "tapioca")


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def test_progress_off_a_terminal_is_a_line_every_interval():
    out = io.StringIO()
    clock = Clock()
    console = Console(file=out, width=80)
    assert not console.is_terminal
    with CommandProgress("sft", "steps", console=console, total=100, every=10.0,
                         clock=clock) as shown:
        for step in range(1, 41):  # a step every 0.5 s
            clock.t += 0.5
            shown.update(step, info=f"sft/loss {1 / step:.4f}")
    lines = out.getvalue().splitlines()
    # By hand: lines at 10 s and 20 s (steps 20 and 40); the rate counts from the first
    # update (step 1 at 0.5 s): 19 steps in 9.5 s = 2 steps/s, 80 steps left -> 40 s.
    assert lines == ["sft: 20/100 steps (20%) in 10s (2.0/s, ETA 40s); sft/loss 0.0500",
                     "sft: 40/100 steps (40%) in 20s (2.0/s, ETA 30s); sft/loss 0.0250"]


def archive_of_rewards(directory: Path, n: int) -> Path:
    writer = ArchiveWriter(directory, roll_bytes=1 << 30, roll_interval_s=3600)
    for i in range(n):
        event = RewardEvent(traj_id=f"g{i}:0", group_id=f"g{i}", reward=0.5, scorer="s",
                            run_id="r1")
        writer.add(Source("p.rewards.v1", i % 2, i // 2, key=f"g{i}", timestamp_ms=1000 + i),
                   event, encode_event(event))
    writer.flush_all()
    return directory


def test_replay_off_a_terminal_prints_progress_lines(tmp_path):
    archive = archive_of_rewards(tmp_path / "archive", 30)
    assert count_records(archive) == 30 and count_records(archive, topic="samples") == 0
    # 30 events at 20 / s: 1.45 s; a line every 0.3 s.
    result = CliRunner().invoke(app, ["--prefix", "p", "replay", str(archive), "--dry-run",
                                      "--rate", "20"], env={"TAPIOCA_PROGRESS_EVERY_S": "0.3"})
    assert result.exit_code == 0, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.startswith("replay: ")]
    assert len(lines) >= 2, result.output
    assert re.match(r"replay: \d+/30 events read \(\d+%\) in \ds .*; would publish \d+",
                    lines[-1]), lines
    assert "would publish 30 of 30 events" in result.output


def test_global_options_are_taken_after_the_command_too():
    assert hoist_global_options(["status", "--run-dir", "R", "-o", "json"]) == \
        ["--run-dir", "R", "status", "-o", "json"]
    assert hoist_global_options(["weights", "list", "--prefix=x", "--debug", "-b", "h:1"]) == \
        ["--prefix=x", "--debug", "-b", "h:1", "weights", "list"]
    # Before the command they stay; after a `--` nothing moves.
    assert hoist_global_options(["-b", "h:1", "role", "trainer", "--", "--prefix", "y"]) == \
        ["-b", "h:1", "role", "trainer", "--", "--prefix", "y"]
    # The real command: --run-dir after `status` is the global option (its check of the
    # directory answers), not "No such option".
    env = {**os.environ, "TAPIOCA_HOME": "/nonexistent-tapioca-home"}
    proc = subprocess.run([TAPIOCA, "status", "--run-dir", "/nonexistent/run"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_CONFIG, proc.stderr  # a usage error (schemas/errors.py)
    assert proc.stderr.strip() == ("error: --run-dir /nonexistent/run is not a directory (a "
                                   "run's directory is runs/EXPERIMENT/TRIAL)"), proc.stderr


def test_weights_list_shows_the_newest_and_those_on_disk_unless_all():
    rows = [{"version": v, "on_disk": v in (3, 4)} for v in range(50)]
    assert [r["version"] for r in shown_versions(rows, 10, False)] == [3, 4] + list(range(40, 50))
    assert [r["version"] for r in shown_versions(rows, 0, False)] == [3, 4]
    assert shown_versions(rows, 10, True) == rows


def test_compact_numbers_and_durations():
    assert [compact(v) for v in (0, 7, 0.5, 12.3, 950, 1234, 56789, 234567, 1234567, None)] == \
        ["0", "7", "0.5", "12", "950", "1.2k", "57k", "235k", "1.2M", "-"]
    assert [duration(s) for s in (None, 0.4, 59, 61, 3599, 3600, 7325)] == \
        ["-", "0s", "59s", "1m01s", "59m59s", "1h00m", "2h02m"]


def test_train_offline_shows_progress_and_says_a_finished_run_is_complete(tmp_path):
    from tapioca.schemas import SampleEvent, SampleSequence

    writer = ArchiveWriter(tmp_path / "archive", roll_bytes=1 << 30, roll_interval_s=3600)
    for i in range(3):
        seqs = [SampleSequence(traj_id=f"g{i}:{k}", output_ids=[5, 6], behav_logprobs=[-3.0, -3.0],
                               output_versions=[0, 0], reward=float(k), advantage=2.0 * k - 1.0)
                for k in range(2)]
        event = SampleEvent(group_id=f"g{i}", prompt_id=f"p{i}", prompt_ids=[3, 4, 5],
                            sequences=seqs, min_version=0, max_version=0, run_id="arch.run")
        writer.add(Source("p.samples.v1", 0, i, key=f"g{i}", timestamp_ms=1000 + i), event,
                   encode_event(event))
    writer.flush_all()
    args = ["--prefix", "p", "train-offline", "--from-archive", str(tmp_path / "archive"),
            "--no-publish", "--trial", "off", f"run_dir={tmp_path / 'runs'}",
            "total_train_steps=2", "train_dataset.prompts_per_step=1", "actor.torch_threads=1"]
    env = {"TAPIOCA_PROGRESS_EVERY_S": "0.000001", "TAPIOCA_BOOTSTRAP": ""}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    # 3 groups in the archive, 1 a step, total_train_steps 2: the bar's total is 2.
    lines = [line for line in result.output.splitlines() if line.startswith("train-offline: ")]
    assert any(line.startswith("train-offline: 2/2 steps (100%)") and "groups read" in line
               for line in lines), result.output
    assert "offline: 2 steps from 2 groups" in result.output
    again = CliRunner().invoke(app, args, env=env)
    assert again.exit_code == 0, (again.output, again.exception)
    assert "train-offline: already complete: trial off" in again.output, again.output
    assert "is at version 2 of total_train_steps=2; nothing to train" in again.output
