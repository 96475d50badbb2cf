"""What `tapioca train` shows (ops/train_view.py), fed the rows the launcher reads on
metrics.v1, on a clock the test moves: the table fits 80 columns with every number
whole; step N/total and the ETA; backlogs across a member restart; "waiting for
rewards from SCORER"; line mode off a terminal; the start and closing lines."""

from __future__ import annotations

import io
import shlex
from pathlib import Path

from rich.console import Console

from tapioca.config.schema import AdvantageConfig, LauncherConfig, RewardConfig, TrainConfig
from tapioca.ops.launcher import RunSummary
from tapioca.ops.train_view import (
    EXIT_STOPPED_EARLY,
    Checkpoint,
    TrainView,
    closing_line,
    ending,
    resume_command,
    start_line,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def cfg(**kw) -> TrainConfig:
    return TrainConfig(trial_name="t1", total_train_steps=kw.pop("total_train_steps", 100), **kw)


def trainer_row(step: int, **metrics) -> dict:
    return {"source": "trainer-0", "step": step, "reward/mean": 0.5, **metrics}


def status(member: str, **counters) -> dict:
    return {"source": member, "step": 0, "bus/handled": counters.pop("handled", 1.0),
            "bus/consumed": counters.pop("consumed", 1.0), "bus/produced": 0.0, **counters}


def render(table, width: int = 80) -> str:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(table)
    return console.export_text()


def test_live_table_keeps_every_number_whole_on_80_columns():
    clock = Clock()
    view = TrainView(cfg(total_train_steps=10000), clock=clock)
    # Large but real values: a long run on a GPU box.
    view.observe(status("feeder-0", **{"feeder/groups": 123456.0}))
    view.observe(status("rollout-0", **{"rollout/groups_done": 12345.0}))
    view.observe(status("trainer-0", **{"trainer/groups_consumed": 1000.0}))
    view.observe(status("advantage-0", **{"advantage/emitted": 1500.0}))
    view.observe({"source": "rollout-0", "step": 9, "rollout/tokens_per_s": 234567.0})
    for step in (9998, 9999):
        clock.t += 30.0
        view.observe(trainer_row(step, **{"actor/tokens_per_s": 1234567.0,
                                          "trainer/staleness_mean": 12.25,
                                          "trainer/staleness_max": 16.0,
                                          "trainer/rejected_stale": 123456.0,
                                          "actor/step_time_s": 123.45}))
    text = render(view.table({"restarts": {"rollout-0": 2}, "alarms": [], "notices": []}))
    # Golden cells, by hand: tokens/s 1,234,567 -> 1.2M, 234,567 -> 235k; backlog prompts
    # 123456 - 12345 = 111111, samples 1500 - 1000 = 500; one step per 30 s, 1 step left
    # -> ETA 30s.
    for cell in ("9999/10000", "30s", "0.500", "1.2M", "235k", "111111/500", "12.25/16",
                 "123456", "123.45"):
        assert cell in text, f"{cell!r} cut or missing at 80 columns:\n{text}"
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80
    # Every header whole too.
    for header in ("step", "ETA", "reward", "tok/s", "train", "gen", "backlog", "rej", "s/step"):
        assert header in text, text


def test_eta_comes_from_the_recent_step_rate():
    clock = Clock()
    view = TrainView(cfg(total_train_steps=100), clock=clock)
    assert view.eta_s() is None  # no step yet
    for step in range(1, 6):  # one step every 2 s
        view.observe(trainer_row(step))
        clock.t += 2.0
    # 95 steps left at 0.5 steps/s: 190 s.
    assert view.eta_s() == 190.0
    text = render(view.table())
    assert "5/100" in text and "3m10s" in text, text


def test_backlog_goes_on_counting_after_a_member_restart():
    view = TrainView(cfg())
    view.observe(status("feeder-0", **{"feeder/groups": 10.0}))
    view.observe(status("rollout-0", consumed=6.0, **{"rollout/groups_done": 6.0}))
    view.observe(status("advantage-0", consumed=30.0, **{"advantage/emitted": 5.0}))
    view.observe(status("trainer-0", **{"trainer/groups_consumed": 4.0}))
    assert view.backlogs() == (4.0, 1.0)
    # rollout-0 and advantage-0 crash and come back: their counters start again from 0.
    view.observe(status("rollout-0", consumed=1.0, **{"rollout/groups_done": 1.0}))
    view.observe(status("advantage-0", consumed=2.0, **{"advantage/emitted": 1.0}))
    view.observe(status("trainer-0", **{"trainer/groups_consumed": 5.0}))
    # By hand: generated 6 + 1 = 7 of 10 -> 3 prompt groups waiting; emitted 5 + 1 = 6,
    # consumed 5 -> 1 sample group waiting. (Without the carry: 10 - 1 = 9 and
    # max(1 - 5, 0) = 0, stuck.)
    assert view.backlogs() == (3.0, 1.0)
    # The feeder and trainer counts come from the log / checkpoint: a trainer that lost
    # its buffered groups in a restart reads them again, and nothing is carried.
    view.observe(status("trainer-0", consumed=0.0, **{"trainer/groups_consumed": 4.0}))
    assert view.backlogs() == (3.0, 2.0)


def test_waiting_for_rewards_names_the_scorers_the_weights_expect():
    clock = Clock()
    c = cfg(advantage=AdvantageConfig(reward_weights={"length_penalty": 1.0, "math": 0.5}))
    view = TrainView(c, clock=clock)
    view.observe(status("advantage-0", **{"advantage/waiting_for_rewards": 0.0}))
    assert view.waiting_note() is None
    assert "waiting for rewards" not in render(view.table())
    view.observe(status("advantage-0", **{"advantage/waiting_for_rewards": 3.0}))
    text = render(view.table(), width=200)
    assert "waiting for rewards from length_penalty, math: 3 complete group(s)" in text, text
    assert "tapioca.rewards.v1" in text
    assert "waiting for rewards from length_penalty, math" in view.line()
    # A gauge from a member that went quiet (drained) stops counting.
    clock.t += 60.0
    assert view.waiting_note() is None


def test_waiting_for_rewards_from_the_real_advantage_processors_status():
    """The advantage processor's own describe(), under the names the runner gives its
    numbers on metrics.v1 (``advantage/<key>``, bus/runner.py ``_status``): complete
    groups without their length_penalty rewards for 30 s show in the view."""
    from tapioca.bus.role import Source
    from tapioca.config.sections import advantage_section
    from tapioca.consumers.advantage import AdvantageProcessor
    from tapioca.schemas.events import TrajectoryEvent

    clock = Clock()
    c = cfg(advantage=AdvantageConfig(reward_weights={"length_penalty": 1.0}))
    role = AdvantageProcessor(advantage_section(c), clock=clock)
    state = role.init_state()
    for i in range(2):
        role.handle(TrajectoryEvent(traj_id=f"g:{i}", group_id="g", prompt_id="p", sample_index=i,
                                    group_size=2, prompt_ids=[1], output_ids=[2],
                                    output_logprobs=[-0.5], output_versions=[0]),
                    state, Source("x.trajectories.v1", 0, i))
    view = TrainView(c, clock=clock)

    def report() -> None:
        role.on_tick(state, 0.0)
        view.observe(status("advantage-0", **{f"{role.name}/{k}": float(v)
                                              for k, v in role.describe(state).items()}))

    report()
    assert view.waiting_note() is None  # just completed: rewards usually follow in < 1 s
    clock.t += 31.0
    report()
    assert view.waiting_note().startswith("waiting for rewards from length_penalty: 1 complete")


def test_waiting_for_rewards_without_weights_names_the_built_in_or_external_scorer():
    row = status("advantage-0", **{"advantage/waiting_for_rewards": 1.0})
    view = TrainView(cfg())
    view.observe(row)
    assert "from the reward scorer (reward.scorer=auto)" in view.waiting_note()
    view = TrainView(cfg(reward=RewardConfig(scorer="none")))
    view.observe(row)
    assert "from a reward service (reward.scorer=none)" in view.waiting_note()


def test_line_mode_prints_every_n_steps_or_seconds_and_each_notice_once():
    clock = Clock()
    c = cfg(total_train_steps=50, launcher=LauncherConfig(log_every_steps=5, log_every_s=30.0))
    view = TrainView(c, clock=clock)
    assert view.lines_due() == []
    clock.t += 31.0  # no step yet, but 30 s went by: say so
    (line,) = view.lines_due()
    assert "step 0/50" in line and "no step yet" in line
    printed = []
    for step in range(1, 12):
        clock.t += 1.0
        view.observe(trainer_row(step))
        printed += view.lines_due()
    # The first step, then every 5 steps: 1, 6, 11.
    assert [p.split("step ")[1].split()[0] for p in printed] == ["1/50", "6/50", "11/50"]
    assert "ETA 39s" in printed[-1]  # 39 steps left at 1 step/s
    health = {"notices": ["12:00:00 rollout-0 exited with code 1; restart 1/5 in 1.0 s"],
              "alarms": []}
    assert view.lines_due(health) == ["notice: 12:00:00 rollout-0 exited with code 1; "
                                      "restart 1/5 in 1.0 s"]
    assert view.lines_due(health) == []


def test_resume_command_reruns_the_same_command_on_the_same_trial():
    cmd = resume_command("examples/x.yaml", ["actor.lr=1e-3", "trial_name="], "20261202-1010",
                         bootstrap="127.0.0.1:9092")
    assert shlex.split(cmd) == ["tapioca", "--bootstrap-server", "127.0.0.1:9092", "train",
                                "--config", "examples/x.yaml", "actor.lr=1e-3",
                                "trial_name=20261202-1010"]
    demo = "/x/examples/demo_cpu.yaml"
    assert resume_command(demo, [], "t", demo_config=demo) == "tapioca demo trial_name=t"


def test_a_resumed_trial_says_from_which_step():
    c = cfg(total_train_steps=100)
    assert start_line(c, None) is None
    line = start_line(c, Checkpoint(Path("/r/checkpoints/trainer.safetensors"), 40))
    assert line.startswith("resuming trial t1 from step 40 of 100")
    done = start_line(c, Checkpoint(Path("/r/checkpoints/trainer.safetensors"), 100))
    assert "already complete" in done and "nothing to train" in done


def summary(steps: dict[int, float]) -> RunSummary:
    s = RunSummary(Path("/r"), steps=max(steps, default=0), wall_s=12.0, rewards=dict(steps))
    return s


def test_closing_line_says_finished_drained_or_interrupted():
    c = cfg(total_train_steps=4)
    ckpt = Path("/r/checkpoints/trainer.safetensors")
    finished = ending(summary({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}), c, Checkpoint(ckpt, 4), resume="R")
    assert finished.line.startswith("done: 4 steps trained") and "Resume" not in finished.line
    assert finished.exit_code == 0
    drained = ending(summary({1: 0.1, 2: 0.2}), c, Checkpoint(ckpt, 2), resume="R")
    assert drained.line.startswith("stopped at step 2 of 4: the trainer exited before total_train_steps")
    assert "tapioca drain trainer" in drained.line and str(ckpt) in drained.line
    assert drained.line.endswith("Resume: R") and drained.exit_code == EXIT_STOPPED_EARLY != 0
    interrupted = ending(summary({3: 0.3}), c, Checkpoint(ckpt, 3), resume="R", interrupted=True)
    assert interrupted.line.startswith("interrupted (Ctrl-C): stopped at step 3 of 4, 1 in this session")
    assert f"last checkpoint {ckpt} (step 3)" in interrupted.line
    assert interrupted.line.endswith("Resume: R") and interrupted.exit_code == 130
    early = closing_line(None, c, None, resume="R", interrupted=True)
    assert "stopped at step 0 of 4; no checkpoint yet" in early
    reached = ending(summary({1: 0.1, 2: 0.95}), cfg(total_train_steps=4, stop_at_reward=0.9),
                     Checkpoint(ckpt, 2), resume="R")
    assert reached.line.startswith("done (stop_at_reward=0.9 reached at step 2)") and reached.exit_code == 0
    complete = ending(summary({}), c, Checkpoint(ckpt, 4), resume="R")
    assert complete.line.startswith("done: nothing to train: trial t1 was already complete")
    assert complete.exit_code == 0


def test_a_run_that_stops_early_says_why_and_counts_trained_steps_not_versions():
    """Issue 37: a trainer that ran out of memory at steps 2, 4 and 6 and was restarted
    without a checkpoint republished the initial weights as versions 2, 4 and 6; the run
    said "done: 5 steps" and exited 0. Versions that republish earlier weights are not
    trained steps, and a role that failed for good is said before the resume command."""
    c = cfg(total_train_steps=6)
    ckpt = Path("/r/checkpoints/trainer.safetensors")
    rolled = ending(summary({1: 0.1, 3: 0.2, 5: 0.3}), c, Checkpoint(ckpt, 6, rollbacks=4), resume="R")
    assert rolled.exit_code == EXIT_STOPPED_EARLY
    assert rolled.line.startswith("stopped at step 2 of 6: the trainer reached version 6, but 4 of its "
                                  "versions republished earlier weights")
    assert "(version 6: 2 steps trained, 4 versions republished earlier weights)" in rolled.line
    assert "3 steps trained in 12 s" in rolled.line and "R total_train_steps=10" in rolled.line
    oom = ending(summary({1: 0.1}), c, Checkpoint(ckpt, 1), resume="R",
                 failure="trainer-0: training step 2 ran out of memory: CUDA out of memory.")
    assert oom.line.startswith("stopped at step 1 of 6: trainer-0: training step 2 ran out of memory")
    assert oom.line.endswith("Resume: R") and oom.exit_code != 0
    gone = ending(summary({}), c, None, resume="R", failure="role reward-0 failed and it was restarted 5 "
                  "times within 600 s (launcher.max_restarts=5)")
    assert gone.line.startswith("stopped at step 0 of 6: role reward-0 failed and it was restarted 5 times")
    assert "no checkpoint yet" in gone.line and gone.exit_code != 0


def test_a_resumed_trial_starts_at_its_step_and_counts_the_steps_it_trained(tmp_path):
    """Issue 38: resumed at step 352 of 370, the first line said "step 0/370" and the
    closing line "done: 370 steps" for 18 new steps (on a broker that kept the log, the
    trainer's earlier rows are read back with the new ones)."""
    from tapioca.config.schema import ModelConfig
    from tapioca.ops.launcher import Launcher

    clock = Clock()
    view = TrainView(cfg(total_train_steps=370), resumed_at=352, clock=clock)
    assert view.line().startswith("[0 s] step 352/370 | no step yet")
    assert "352/370" in render(view.table())
    # The launcher reads metrics.v1 from the start: rows up to the checkpoint are counted
    # for neither the closing line nor the view (its rate, its reward window).
    launcher = Launcher(TrainConfig(run_dir=str(tmp_path), model=ModelConfig(path=str(tmp_path))))
    launcher.summary = RunSummary(tmp_path, resumed_version=352)
    seen: list[int] = []
    launcher.on_metrics = lambda row: (seen.append(row["step"]), view.observe(row))
    for step in range(1, 371):
        launcher._observe("trainer-0", step, {"reward/mean": step / 370})
    assert seen == list(range(353, 371)) and sorted(launcher.summary.rewards) == seen
    assert view.line().startswith("[0 s] step 370/370")
    launcher.summary.wall_s = 64.0
    end = ending(launcher.summary, cfg(total_train_steps=370),
                 Checkpoint(Path("/r/checkpoints/trainer.safetensors"), 370), resume="R")
    assert end.line.startswith("done: 18 steps trained in 64 s (370 of 370 in all); mean reward")
    assert end.exit_code == 0
    # A trial that was not resumed says no more than before
    fresh = ending(summary({1: 0.1, 2: 0.2}), cfg(total_train_steps=2),
                   Checkpoint(Path("/r/checkpoints/trainer.safetensors"), 2), resume="R")
    assert fresh.line.startswith("done: 2 steps trained in 12 s; mean reward")


def test_online_mode_shows_sessions_served_rewards_pending_and_trained():
    """Issue 22: in online mode the traffic is the data; the table shows what the proxy
    served and what waits for a reward instead of generation rates and backlogs, and the
    advantage processor's waiting groups are the normal state, not a warning."""
    from tapioca.config.schema import AgentConfig, GenerationConfig, NormConfig

    clock = Clock()
    view = TrainView(cfg(agent=AgentConfig(mode="online"), gconfig=GenerationConfig(n_samples=1),
                         advantage=AdvantageConfig(adv_norm=NormConfig(mean_level="none",
                                                                       std_level="none"))),
                     clock=clock)
    # A proxy that was restarted: its new member counts on from 0.
    view.observe(status("proxy-aaaa-sessions", **{"proxy-sessions/served": 5.0,
                                                   "proxy-sessions/rewards_pending": 4.0}))
    clock.t += 20
    view.observe(status("proxy-bbbb-sessions", **{"proxy-sessions/served": 2.0,
                                                   "proxy-sessions/rewards_pending": 3.0}))
    view.observe(status("trainer-0", **{"trainer/groups_trained": 3.0}))
    view.observe(status("advantage-0", **{"advantage/waiting_for_rewards": 3.0}))
    assert view.sessions() == (7.0, 3.0, 3.0)  # the stale member's pending no longer counts
    assert view.waiting_note() is None
    assert "no step yet | sessions 7 | rewards pending 3 | trained 3" in view.line()
    view.observe(trainer_row(1, **{"actor/tokens_per_s": 100.0}))
    text = render(view.table())
    assert "sessions" in text and "pending" in text and "backlog" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    line = view.line()
    assert "sessions 7 | rewards pending 3 | trained 3" in line and "gen" not in line


def test_the_staleness_cell_shows_masked_tokens_with_stale_token_masking_on():
    view = TrainView(cfg())
    view.observe(trainer_row(3, **{"trainer/staleness_mean": 1.5, "trainer/staleness_max": 2.0}))
    assert view._cells()["stale avg/max"] == "1.50/2"  # off: as before
    view.observe(trainer_row(4, **{"trainer/staleness_mean": 1.5, "trainer/staleness_max": 2.0,
                                   "actor/stale_masked_ratio": 0.125,
                                   "actor/stale_empty_minibatch_fraction": 0.0}))
    assert view._cells()["stale avg/max"] == "1.50/2 m12%"
    view.observe(trainer_row(5, **{"trainer/staleness_mean": 2.0, "trainer/staleness_max": 2.0,
                                   "actor/stale_masked_ratio": 1.0,
                                   "actor/stale_empty_minibatch_fraction": 0.5}))
    cell = view._cells()["stale avg/max"]
    assert cell == "2.00/2 m100% e50%"
    assert f"staleness {cell}" in view.line()
    assert "stale m: tokens masked" in render(view.table())
