"""What `tapioca train` prints when its stdout is a pipe (a log file, nohup, Slurm, CI),
across one trial's life: the real command (its own embedded broker, every role its own
process, the tiny model) run three times on the same trial.

1. Progress lines (step N/total, ETA) while it trains; Ctrl-C (SIGINT) prints the steps
   done, the last checkpoint and the command that resumes the trial.
2. That command resumes it ("resuming trial T from step S"); `tapioca drain trainer
   --run-dir R` (the global option after the command) stops it, and the closing line says
   "stopped at step S of N" rather than done, with a non-zero exit status.
3. Run again with total_train_steps at its checkpoint, it says the trial is already
   complete and trains nothing.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

TAPIOCA = str(Path(sys.executable).parent / "tapioca")
OVERRIDES = ["trial_name=t0", "total_train_steps=100000", "train_dataset.prompts_per_step=2",
             "gconfig.n_samples=2", "gconfig.max_new_tokens=3", "launcher.log_every_steps=1",
             "actor.checkpoint_every_steps=1"]


class Train:
    """`tapioca train` as a subprocess with its stdout on a pipe, read line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        # Ctrl-C as on a terminal: a shell without job control starts background commands
        # with SIGINT ignored, and the child would inherit that (a CI script run with `&`).
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, *, at_least: int | None = None,
                 timeout_s: float = 240) -> re.Match:
        """The first line matching ``pattern`` (whose group 1 is >= ``at_least``)."""
        def found() -> re.Match | None:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m and (at_least is None or int(m.group(1)) >= at_least):
                    return m
            return None

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (m := found()):
                return m
            if self.proc.poll() is not None:
                self._reader.join(5)
                if (m := found()):
                    return m
                pytest.fail(f"tapioca train exited ({self.proc.returncode}) without "
                            f"{pattern!r}:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.2)
        pytest.fail(f"no {pattern!r} within {timeout_s} s:\n" + "\n".join(self.lines[-30:]))

    def finish(self, timeout_s: float = 240) -> str:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tapioca train still running {timeout_s} s later:\n" + "\n".join(self.lines[-40:]))
        self._reader.join(10)
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def test_train_off_a_terminal_interrupt_resume_drain_and_complete(tmp_path, fast_join):
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "80"}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    run_dir = tmp_path / "runs"
    runs: list[Train] = []
    try:
        # 1. Progress lines, then Ctrl-C.
        first = Train([TAPIOCA, "train", f"run_dir={run_dir}", *OVERRIDES, *fast_join], env)
        runs.append(first)
        # Lines come every supervision turn at most, so steps may jump: any step >= 2.
        first.wait_for(r"\] step (\d+)/100000 \| ETA \d\S* \| reward ", at_least=2)
        first.proc.send_signal(signal.SIGINT)
        out = first.finish()
        assert first.proc.returncode == 130, out
        m = re.search(r"^interrupted \(Ctrl-C\): stopped at step (\d+) of 100000, \d+ in this session; "
                      r"last checkpoint (\S+) \(step (\d+)\)\. Resume: (.+)$", out, re.M)
        assert m, out
        done, ckpt, resume = int(m.group(1)), Path(m.group(2)), m.group(4)
        assert done >= 2 and int(m.group(3)) == done and ckpt.is_file()
        assert ckpt == run_dir / "demo" / "t0" / "checkpoints" / "trainer.safetensors"
        args = shlex.split(resume)
        assert args[:2] == ["tapioca", "train"] and args[-1] == "trial_name=t0", resume

        # 2. The printed command resumes the trial; a drain stops it early.
        second = Train([TAPIOCA, *args[1:]], env)
        runs.append(second)
        second.wait_for(rf"^resuming trial t0 from step {done} of 100000 \(")
        second.wait_for(r"\] step (\d+)/100000 ", at_least=done + 1)
        drain = subprocess.run([TAPIOCA, "drain", "trainer", "--run-dir", str(run_dir / "demo/t0"),
                                "--timeout", "60"], env=env, capture_output=True, text=True,
                               timeout=120)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        out = second.finish()
        assert second.proc.returncode == 1, out  # stopped before total_train_steps: not 0
        m = re.search(r"^stopped at step (\d+) of 100000: the trainer exited before total_train_steps "
                      r"\(drained by `tapioca drain trainer`, or sent SIGTERM\); last "
                      rf"checkpoint {re.escape(str(ckpt))} \(step \d+\)\..*Resume: ", out, re.M)
        assert m, out
        drained_at = int(m.group(1))
        assert drained_at > done

        # 3. Nothing left to train.
        third = Train([TAPIOCA, *args[1:], f"total_train_steps={drained_at}"], env)
        runs.append(third)
        out = third.finish(timeout_s=240)
        assert third.proc.returncode == 0, out
        assert re.search(rf"^trial t0 is already complete: its checkpoint \(\S+\) is at step "
                         rf"{drained_at} of total_train_steps={drained_at}; nothing to train", out,
                         re.M), out
        assert re.search(r"^done: nothing to train: trial t0 was already complete", out, re.M), out
        # The drained trainer wrote no final/: this run's trainer found itself done and wrote it.
        assert (run_dir / "demo/t0/final").is_dir()
        # 4. Asked again, it says so before a broker or any role starts (no "run ...: ... (broker" line).
        fourth = Train([TAPIOCA, *args[1:], f"total_train_steps={drained_at}"], env)
        runs.append(fourth)
        out = fourth.finish(timeout_s=120)
        assert fourth.proc.returncode == 0, out
        assert re.search(r"^done: nothing to train: trial t0 was already complete", out, re.M), out
        assert not re.search(r"^run \S+: .*\(broker ", out, re.M), out
    finally:
        for run in runs:
            run.kill()
