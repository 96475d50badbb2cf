"""What a lost log took with it (issue 31 §3): the closing line of `tapioca train` after
the broker lost the run's log says how many in-flight groups and trained steps were
dropped, from the members' status events before the loss and the restarted trainer's
first report; and the trainer's count of the groups it finished on the current log. The
launcher is fed status rows as ``_read_metrics`` would; no broker, no role processes."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from tapioca.config.schema import ModelConfig, TrainConfig
from tapioca.ops.launcher import Launcher, RunSummary

sys.path.insert(0, str(Path(__file__).parent))
from test_role_trainer import make_trainer, sample, src, start  # noqa: E402


def status(**metrics: float) -> dict:
    return {"bus/handled": 1.0, **metrics}


def test_closing_line_counts_the_groups_and_steps_a_lost_log_dropped(tmp_path):
    launcher = Launcher(TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path=str(tmp_path))))
    launcher.summary = RunSummary(tmp_path, log_recoveries=1, bus_run_id="demo.t0@2")
    # Last reports on the old log: 40 groups admitted, 24 trained or rejected (16 in
    # prompts / trajectories / rewards / samples or buffered), the trainer at version 7.
    launcher._observe("feeder-0", 3, status(**{"feeder/groups": 40.0}))
    launcher._observe("trainer-0", 9, status(**{"trainer/version": 7.0,
                                                "trainer/groups_done_on_log": 24.0}))
    launcher._count_dropped()
    launcher._status.clear()  # as _recover_lost_log does
    assert launcher.summary.groups_dropped == 16 and launcher.summary.steps_dropped is None
    # The restarted trainer resumed at its checkpoint, version 6: one step was lost.
    launcher._observe("feeder-0", 0, status(**{"feeder/groups": 0.0}))
    launcher._observe("trainer-0", 0, status(**{"trainer/version": 6.0,
                                                "trainer/groups_done_on_log": 0.0}))
    launcher._observe("trainer-0", 1, status(**{"trainer/version": 8.0}))  # counted once
    assert launcher.summary.steps_dropped == 1
    assert launcher.summary.supervision_line() == (
        "broker lost the log 1x (now bus run id demo.t0@2; dropped with it: 16 in-flight "
        "groups and 1 trained step)")


def test_closing_line_without_status_reports_says_only_what_it_knows(tmp_path):
    s = RunSummary(tmp_path, log_recoveries=2, bus_run_id="demo.t0@3", steps_dropped=0)
    assert s.supervision_line() == ("broker lost the log 2x (now bus run id demo.t0@3; "
                                    "dropped with it: 0 trained steps)")


def test_trainer_counts_the_groups_it_finished_on_the_current_log_only(tmp_path):
    t = make_trainer(tmp_path)
    t.cfg = replace(t.cfg, bus_run_id="demo.t0")
    state = start(t)
    for k in range(2):
        t.handle(sample(f"g{k}"), state, src(k))
    assert t.describe(state)["groups_done_on_log"] == 2
    t.sink.close()
    # Resumed on a new log (the broker lost the old one): its groups are not this log's.
    t2 = make_trainer(tmp_path)
    t2.cfg = replace(t2.cfg, bus_run_id="demo.t0@2")
    s2 = t2.init_state()
    assert t2.describe(s2)["groups_done_on_log"] == 0
    t2.handle(sample("h0", min_version=1), s2, src(0))
    t2.handle(sample("h1", min_version=1), s2, src(1))
    assert t2.describe(s2)["groups_done_on_log"] == 2
    t2.sink.close()
    # ... and a restart on the same log keeps counting from that log's start.
    t3 = make_trainer(tmp_path)
    t3.cfg = replace(t3.cfg, bus_run_id="demo.t0@2")
    assert t3.describe(t3.init_state())["groups_done_on_log"] == 2
    t3.sink.close()
