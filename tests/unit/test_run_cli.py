"""`tapioca config show` (the resolved config, nothing started) and the launcher's run
record (ops/run_record.py), which `tapioca runs` and `tapioca train --resume` read. The
CLI runs as the installed console script. No broker. (`tapioca runs` on runs the trainer
made: tests/unit/test_run_outputs.py; `train --resume` after a real `tapioca train`:
tests/integration/test_cli.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import yaml

from tapioca.config.loader import load_config, to_yaml
from tapioca.config.schema import TrainConfig
from tapioca.ops import run_record

TAPIOCA = str(Path(sys.executable).parent / "tapioca")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([TAPIOCA, *args], capture_output=True, text=True, timeout=120, env=env)


def test_config_show_prints_the_resolved_config_and_runs_nothing(tmp_path):
    done = cli("config", "show", "--config", str(EXAMPLES / "demo_cpu.yaml"), "actor.optimizer.lr=1e-3",
               f"run_dir={tmp_path / 'runs'}")
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)
    assert shown["actor"]["optimizer"]["lr"] == 1e-3  # the override
    assert shown["gconfig"]["n_samples"] == 16  # the file
    assert shown["actor"]["eps_clip"] == 0.2 and shown["launcher"]["max_restarts"] == 5  # defaults
    # The same config the loader gives a run, and nothing was created.
    expected = load_config(TrainConfig, EXAMPLES / "demo_cpu.yaml",
                           ["actor.optimizer.lr=1e-3", f"run_dir={tmp_path / 'runs'}"])
    assert {k: v for k, v in shown.items() if k != "bus"} == \
        {k: v for k, v in yaml.safe_load(to_yaml(expected)).items() if k != "bus"}
    assert not (tmp_path / "runs").exists()
    dpo = cli("config", "show", "--kind", "dpo", "-o", "json", "beta=0.5")
    assert dpo.returncode == 0 and orjson.loads(dpo.stdout)["beta"] == 0.5


def test_config_show_of_a_bad_key_is_one_line_and_exit_78():
    done = cli("config", "show", "actor.eps_clipp=1")
    assert done.returncode == 78  # a config error (schemas/errors.py EXIT_CONFIG)
    assert done.stderr.strip().splitlines() == [
        "error: config key 'actor.eps_clipp': Key 'eps_clipp' not in 'ActorConfig'. Did you mean "
        "one of: 'eps_clip', 'eps_clip_higher', 'c_clip'?"]


def test_a_run_record_is_running_only_while_its_launcher_lives(tmp_path):
    run_record.write_start(tmp_path, bootstrap="127.0.0.1:1", own_broker=True, bus_run_id="x.t")
    record = run_record.read_record(tmp_path)
    assert record["pid"] == os.getpid() and record["own_broker"] is True
    assert run_record.running(record)
    # The same pid in a record written before this process started: a reused pid.
    assert not run_record.running({**record, "started_at": time.time() - 10 ** 7})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not run_record.running({**record, "pid": dead.pid})
    run_record.write_end(tmp_path, "interrupted")
    ended = run_record.read_record(tmp_path)
    assert ended["outcome"] == "interrupted" and not run_record.running(ended)


def _trial(root: Path, name: str, row: dict) -> Path:
    run = root / "exp" / name
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "metrics.jsonl").write_text(orjson.dumps(row).decode() + "\n")
    return run


def test_runs_never_cuts_a_trial_name_and_lists_an_offline_run_as_offline_rl(tmp_path):
    """Issue 38: at 80 columns a long trial name was cut with an ellipsis, but `tapioca
    train --resume` needs all of it; columns are dropped first, and a name wider than
    the terminal wraps. A `tapioca train-offline` run (the RL trainer's rows, no
    launcher's config.yaml) was listed as supervised."""
    import io

    from rich.console import Console

    from tapioca.ops.run_cli import find_runs, run_info, runs_table

    rl_row = {"step": 3, "reward/mean": 0.5, "trainer/staleness_mean": 0.0}
    long = "grpo-qwen2.5-1.5b-gsm8k-lr1e-6-kl0.001-eta4-20260101-101010"  # 58 characters
    _trial(tmp_path, long, rl_row)
    _trial(tmp_path, "sft-1", {"step": 2, "sft/loss": 1.0})
    infos = [run_info(p, tmp_path) for p in find_runs(tmp_path)]
    assert {i["run"]: i["kind"] for i in infos} == {f"exp/{long}": "offline-rl", "exp/sft-1": "sft"}

    def shown(items, width: int) -> list[str]:
        console = Console(width=width, file=io.StringIO(), color_system=None)
        console.print(runs_table(items, "runs", console))
        lines = console.file.getvalue().splitlines()
        assert all(len(line) <= width for line in lines) and not any("…" in x for x in lines)
        return lines

    lines = shown(infos, 80)
    assert any(f"exp/{long}" in line for line in lines)  # whole, on one line
    assert any("state" in line for line in lines)  # others dropped, the state kept
    assert any("offline-rl" in line for line in shown(infos, 200))  # all columns when they fit
    # Wider than the terminal: wrapped, every character shown
    longer = {**infos[0], "run": "exp/" + long * 2}
    text = "".join(line.strip("│ ").split("│")[0].strip() for line in shown([longer], 80)[4:-1])
    assert "exp/" + long * 2 in text
