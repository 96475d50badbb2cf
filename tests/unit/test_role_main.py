"""`tapioca role`'s process entry (ops/role_main.py): a config with no trial is refused
before anything is built, since each process would otherwise name a run of its own."""

from __future__ import annotations

from pathlib import Path

from tapioca.ops.launcher import EXIT_NO_RESTART
from tapioca.ops.role_main import run_role_process

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_config_without_a_trial_is_refused_with_what_to_do(capsys):
    rc = run_role_process("feeder", str(EXAMPLES / "demo_cpu.yaml"), [])  # its trial_name is ""
    assert rc == EXIT_NO_RESTART  # the launcher does not restart it: no restart can fix it
    err = capsys.readouterr().err
    assert "names no trial" in err and "trial_name=NAME" in err and "config.yaml" in err
