"""What `tapioca train` prints about a run (ops/commands.py drives it): the start line of
a resumed trial, the live view while it runs, and the closing line.

Consumes the rows the launcher reads on ``metrics.v1`` (ops/launcher.py ``on_metrics``):
the trainer's step rows (``reward/mean``, tokens/s, staleness), the rollout workers'
windows, and every member's status row (``bus/*`` counters plus the role's ``describe``
numbers, keyed by member id); and the supervisor's ``health()`` (restarts, alarms,
notices). Emits nothing on the bus.

- On a terminal, a live table that fits 80 columns: step N/total and an ETA from the
  recent step rate, the mean reward of the last 20 steps, tokens/s, backlogs, staleness.
- Off a terminal (a log file, nohup, Slurm, CI, tee), where a live table would show
  nothing until the end: one line every ``launcher.log_every_steps`` trainer steps or
  ``launcher.log_every_s`` seconds, whichever comes first, and each supervisor notice
  (a restart, a recovered broker) when it happens.
- Both say "waiting for rewards from SCORER" (the scorers ``advantage.reward_weights``
  names, else the built-in one) while the advantage processor holds complete groups
  that wait for their rewards (its ``waiting_for_rewards``), which otherwise looks like
  a run that does nothing.
- Online mode (``agent.mode: online``), where waiting for rewards is the normal state:
  the sessions the proxy served, the ended ones whose reward is pending, and the groups
  trained, in place of the generation rate and the backlogs (no feeder, no rollout).
- Backlogs are sums of the members' counters. The rollout worker's and the advantage
  processor's counters live in the process (the feeder recovers its count from the log,
  the trainer from its checkpoint), so a restarted member starts them at 0: the view
  adds what the member's previous process had counted (:class:`MemberCounters`).
- The closing line says whether the trial finished or "stopped at step S of N" and why
  (drained or a SIGTERM to the trainer, a role that failed for good: restarts exhausted,
  out of memory; Ctrl-C), with the steps trained (not the version: rollbacks republish
  earlier weights), the last checkpoint and the command that resumes it; the exit
  status is 0 only for a finished trial (:func:`ending`). A resumed trial's view starts at
  the checkpoint's step, and its closing line counts the steps this invocation trained,
  then where the trial stands ("18 steps trained in 64 s (370 of 370 in all)").
"""

from __future__ import annotations

import json
import shlex
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Group
from rich.text import Text

from .eval_cli import held_out_cell, held_out_change
from .render import compact, duration, narrow_table, number_column

# Counters kept in memory since the member's process started (see the module docstring).
PROCESS_COUNTERS = ("rollout/groups_done", "advantage/emitted", "advantage/dropped")
# Counters that only grow within one process: one that went down means a new process.
_MONOTONE = ("bus/consumed", "bus/handled", "bus/produced") + PROCESS_COUNTERS
# A member's status row older than this no longer counts for gauges (status rows come
# every second; a drained member's last one stays behind).
GAUGE_FRESH_S = 10.0
# Trainer steps the step rate (and so the ETA) is measured over.
RATE_WINDOW_STEPS = 20


class MemberCounters:
    """Every member's latest status row, with process counters carried across restarts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.latest: dict[str, dict[str, Any]] = {}
        self._seen_at: dict[str, float] = {}
        self._base: dict[str, dict[str, float]] = {}
        self._clock = clock

    def observe(self, member: str, row: dict[str, Any]) -> None:
        prev = self.latest.get(member)
        if prev is not None and any(row.get(k, 0.0) < prev.get(k, 0.0) for k in _MONOTONE):
            base = self._base.setdefault(member, {})
            for key in PROCESS_COUNTERS:
                base[key] = base.get(key, 0.0) + prev.get(key, 0.0)
        self.latest[member] = row
        self._seen_at[member] = self._clock()

    def total(self, key: str) -> float:
        """A counter summed over every member ever seen, across their restarts."""
        return sum(row.get(key, 0.0) + self._base.get(m, {}).get(key, 0.0)
                   for m, row in self.latest.items())

    def gauge(self, key: str) -> float:
        """A gauge summed over the members heard from in the last GAUGE_FRESH_S."""
        now = self._clock()
        return sum(row.get(key, 0.0) for m, row in self.latest.items()
                   if now - self._seen_at[m] <= GAUGE_FRESH_S)

    def has(self, key: str) -> bool:
        return any(key in row for row in self.latest.values())


def _fmt(value: Any, spec: str) -> str:
    return spec.format(value) if isinstance(value, (int, float)) else "-"


def _masked(trainer: dict[str, Any]) -> str:
    """The staleness cell's tail with stale-token masking on (actor.max_token_version_gap):
    the step's share of tokens masked, and of minibatches left empty when any was."""
    ratio = trainer.get("actor/stale_masked_ratio")
    if not isinstance(ratio, (int, float)):
        return ""
    empty = trainer.get("actor/stale_empty_minibatch_fraction") or 0.0
    return f" m{ratio:.0%}" + (f" e{empty:.0%}" if empty else "")


class TrainView:
    """The live view of one `tapioca train`: fed metrics rows, asked for a table (on a
    terminal) or for the lines to print now (off one)."""

    def __init__(self, cfg, *, resumed_at: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``resumed_at``: the version of the checkpoint a resumed trial starts from (what
        the step cell says until the trainer's first step)."""
        self.total_steps = cfg.total_train_steps
        self.resumed_at = resumed_at
        self.log_every_steps = cfg.launcher.log_every_steps
        self.log_every_s = cfg.launcher.log_every_s
        self.rewards_topic = f"{cfg.bus.topic_prefix}.rewards.v1"
        weights = sorted(cfg.advantage.reward_weights)
        self.scorers = (", ".join(weights) if weights
                        else "a reward service (reward.scorer=none)" if cfg.reward.scorer == "none"
                        else f"the reward scorer (reward.scorer={cfg.reward.scorer})")
        self.online = cfg.agent.online
        self._clock = clock
        self.started = clock()
        self.latest: dict[str, dict[str, Any]] = {}  # role -> its latest step row
        self.counters = MemberCounters(clock)
        self.rewards: list[float] = []
        self._steps: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW_STEPS + 1)
        self._logged_at = self.started
        self._logged_step: int | None = None
        self._notices_seen: set[str] = set()

    # ---------------------------------------------------------------- input

    def observe(self, row: dict[str, Any]) -> None:
        if "bus/handled" in row:
            self.counters.observe(row["source"], row)
            return
        role = row["source"].split("-")[0]
        self.latest[role] = row
        if role == "trainer" and "reward/mean" in row:
            self.rewards.append(row["reward/mean"])
            self._steps.append((self._clock(), int(row["step"])))

    # ---------------------------------------------------------------- numbers

    @property
    def step(self) -> int | None:
        return self._steps[-1][1] if self._steps else None

    def eta_s(self) -> float | None:
        """Seconds to total_train_steps at the rate of the last RATE_WINDOW_STEPS steps."""
        if len(self._steps) < 2:
            return None
        (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return max(self.total_steps - s1, 0) * (t1 - t0) / (s1 - s0)

    def backlogs(self) -> tuple[float, float] | None:
        """(prompt groups admitted but not yet generated, sample groups emitted but not yet
        consumed by the trainer)."""
        c = self.counters
        if not c.has("feeder/groups"):
            return None
        prompts = c.total("feeder/groups") - c.total("rollout/groups_done")
        samples = (c.total("advantage/emitted") + c.total("advantage/dropped")
                   - c.total("trainer/groups_consumed"))
        return max(prompts, 0.0), max(samples, 0.0)

    def sessions(self) -> tuple[float, float, float]:
        """Online mode: (sessions served, ended ones waiting for a reward, groups trained)."""
        c = self.counters
        return (c.total("proxy-sessions/served"), c.gauge("proxy-sessions/rewards_pending"),
                c.gauge("trainer/groups_trained"))

    def waiting_note(self) -> str | None:
        """Said while complete groups wait for their rewards (not online: there that is
        the normal state, shown as the pending count)."""
        n = self.counters.gauge("advantage/waiting_for_rewards")
        if n <= 0 or self.online:
            return None
        return (f"waiting for rewards from {self.scorers}: {n:.0f} complete group(s) wait for "
                f"theirs (is it running, publishing to {self.rewards_topic}?)")

    def _reward(self) -> float | None:
        window = self.rewards[-20:]
        return sum(window) / len(window) if window else None

    def _cells(self) -> dict[str, str]:
        t, r = self.latest.get("trainer", {}), self.latest.get("rollout", {})
        backlog = self.backlogs()
        served, pending, trained = self.sessions()
        traffic = ({"sessions": compact(served), "rewards pending": compact(pending),
                    "trained": compact(trained)} if self.online else
                   {"tok/s gen": compact(r.get("rollout/tokens_per_s")),
                    "backlog p/s": f"{backlog[0]:.0f}/{backlog[1]:.0f}" if backlog else "-"})
        cells = {
            "step": f"{self.step if self.step is not None else self.resumed_at}/{self.total_steps}",
            "ETA": "-" if self.online else duration(self.eta_s()),  # a service: no end
            "reward": _fmt(self._reward(), "{:.3f}"),
            "tok/s train": compact(t.get("actor/tokens_per_s")),
            **traffic,
            "stale avg/max": f"{_fmt(t.get('trainer/staleness_mean'), '{:.2f}')}/"
                             f"{_fmt(t.get('trainer/staleness_max'), '{:.0f}')}{_masked(t)}",
            "rej": _fmt(t.get("trainer/rejected_stale"), "{:.0f}"),
            "s/step": _fmt(t.get("actor/step_time_s"), "{:.2f}"),
        }
        held_out = held_out_cell(self.latest.get("evaluator", {}))  # producers/evaluator.py
        return {**cells, "held-out": held_out} if held_out else cells

    # ---------------------------------------------------------------- on a terminal

    def table(self, health: dict | None = None) -> Group:
        """The table, then the notes under it (as wide as the terminal, not the table)."""
        table = narrow_table(f"tapioca — {self._clock() - self.started:,.0f} s")
        cells = self._cells()
        for header in cells:  # a header of two words takes two lines: numbers stay whole
            number_column(table, header.replace(" ", "\n"))
        table.add_row(*cells.values())
        legend = ("sessions: served by the proxy; rewards pending: ended, not yet rewarded"
                  if self.online else "backlog: prompt/sample groups")
        masked = ("; stale m: tokens masked past actor.max_token_version_gap, e: empty minibatches"
                  if "actor/stale_masked_ratio" in self.latest.get("trainer", {}) else "")
        lines = [Text(f"reward: mean of the last 20 steps; {legend}; "
                      f"rej: over the staleness bound{masked}", style="dim")]
        note = self.waiting_note()
        if note:
            lines.append(Text(note, style="yellow"))
        supervision = supervision_caption(health)
        if supervision:
            lines.append(Text.from_markup(supervision))
        return Group(table, *lines)

    # ---------------------------------------------------------------- off a terminal

    def line(self, health: dict | None = None) -> str:
        c = self._cells()
        parts = [f"[{self._clock() - self.started:,.0f} s] step {c['step']}"]
        sessions = ([f"sessions {c['sessions']}", f"rewards pending {c['rewards pending']}",
                     f"trained {c['trained']}"] if self.online else [])
        if self.step is None:
            parts += ["no step yet", *sessions]
        else:
            traffic = ([f"tok/s train {c['tok/s train']}", *sessions] if self.online else
                       [f"tok/s train {c['tok/s train']} gen {c['tok/s gen']}",
                        f"backlog {c['backlog p/s']}"])
            parts += [f"ETA {c['ETA']}", f"reward {c['reward']}", *traffic,
                      f"staleness {c['stale avg/max']}", f"rejected {c['rej']}",
                      f"{c['s/step']} s/step"]
            if "held-out" in c:
                parts.append(f"held-out pass@1 {c['held-out']}")
        note = self.waiting_note()
        if note:
            parts.append(note)
        parts += [f"ALARM {a}" for a in (health or {}).get("alarms", [])]
        return " | ".join(parts)

    def lines_due(self, health: dict | None = None) -> list[str]:
        """What line mode prints now: new supervisor notices, and the progress line when
        log_every_steps steps or log_every_s seconds have passed since the last one."""
        out = []
        for notice in (health or {}).get("notices", []):
            if notice not in self._notices_seen:
                self._notices_seen.add(notice)
                out.append(f"notice: {notice}")
        now, step = self._clock(), self.step
        stepped = step is not None and (self._logged_step is None
                                        or step - self._logged_step >= self.log_every_steps)
        if stepped or now - self._logged_at >= self.log_every_s:
            out.append(self.line(health))
            self._logged_at, self._logged_step = now, step
        return out

    def lines_at_end(self) -> list[str]:
        """Line mode's last progress line, unless the last one printed is up to date."""
        return [self.line()] if self.step is not None and self.step != self._logged_step else []


def supervision_caption(health: dict | None) -> str | None:
    """Restarts, pending restarts, alarms (red) and the latest notices of the launcher's
    supervisor (Launcher.health), or None when there is nothing to say."""
    if not health:
        return None
    lines = [f"[bold red]ALARM[/] {a}" for a in health.get("alarms", [])]
    restarts = health.get("restarts") or {}
    if restarts or health.get("pending"):
        text = "restarts: " + (", ".join(f"{m} x{n}" for m, n in sorted(restarts.items())) or "-")
        if health.get("pending"):
            text += f" (restarting: {', '.join(health['pending'])})"
        lines.append(f"[yellow]{text}[/]")
    lines += [f"[dim]{n}[/]" for n in health.get("notices", [])]
    return "\n".join(lines) or None


# ---------------------------------------------------------------------- start and end


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    version: int
    # Versions that republished earlier weights instead of a trained step (a trainer
    # restarted without a checkpoint, `tapioca weights rollback`): ProgressEvent.rollbacks.
    rollbacks: int = 0

    @property
    def trained(self) -> int:
        """Steps the checkpointed model was trained (its version less the rollbacks)."""
        return max(self.version - self.rollbacks, 0)


def trainer_checkpoint(run_path: str | Path) -> Checkpoint | None:
    """The trial's trainer checkpoint (the single-process file, else the sharded
    trainer's record) and the steps it holds; None before the first one."""
    from ..trainers.checkpoint import SUFFIX, read_progress
    from ..trainers.sharded_checkpoint import progress_path

    single = Path(run_path) / "checkpoints" / f"trainer{SUFFIX}"
    progress = read_progress(single)
    if progress is not None:
        return Checkpoint(single, progress.version, progress.rollbacks)
    sharded = progress_path(single)
    try:
        record = json.loads(sharded.read_text())
        return Checkpoint(sharded, int(record["progress"]["version"]),
                          int(record["progress"].get("rollbacks", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_command(config: str | None, overrides: list[str], trial: str, *,
                   bootstrap: str | None = None, demo_config: str | None = None) -> str:
    """The command that resumes this trial: the one that started it, naming the trial
    (a config with an empty trial_name makes a new one each time)."""
    args = ["tapioca"] + (["--bootstrap-server", bootstrap] if bootstrap else [])
    if config is not None and config == demo_config:
        args.append("demo")
    else:
        args += ["train"] + (["--config", config] if config else [])
    args += [o for o in overrides if not o.startswith("trial_name=")] + [f"trial_name={trial}"]
    return shlex.join(args)


def start_line(cfg, ckpt: Checkpoint | None) -> str | None:
    """Said when the trial has a checkpoint: it resumes (or has nothing left to do)."""
    if ckpt is None or ckpt.version == 0:
        return None
    if ckpt.trained >= cfg.total_train_steps:
        return (f"trial {cfg.trial_name} is already complete: its checkpoint ({ckpt.path}) is at "
                f"step {ckpt.trained} of total_train_steps={cfg.total_train_steps}; nothing to "
                "train (raise total_train_steps to go on, or start a new trial_name)")
    bus = "" if cfg.bus.run_id == cfg.run_id else f" (on bus run id {cfg.bus.run_id})"
    return (f"resuming trial {cfg.trial_name} from step {ckpt.trained} of "
            f"{cfg.total_train_steps} ({ckpt.path}){bus}")


# `tapioca train`'s exit status when the run stopped before total_train_steps (drained,
# or its versions include rollbacks); a role that failed for good exits with its error's
# code (1, EXIT_OOM 71, EXIT_STORAGE 74, EXIT_CONFIG 78), Ctrl-C with 130.
EXIT_STOPPED_EARLY = 1
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Ending:
    line: str
    exit_code: int


def closing_line(summary, cfg, ckpt: Checkpoint | None, *, resume: str,
                 interrupted: bool = False, failure: str | None = None) -> str:
    """The last line of `tapioca train`: what ran, and how it ended (:func:`ending`)."""
    return ending(summary, cfg, ckpt, resume=resume, interrupted=interrupted, failure=failure).line


def ending(summary, cfg, ckpt: Checkpoint | None, *, resume: str, interrupted: bool = False,
           failure: str | None = None) -> Ending:
    """The closing line and the exit status: 0 only when the trial trained its
    ``total_train_steps`` (or reached ``stop_at_reward``). A run that stopped before says
    "stopped at step S of N" and why: ``failure`` (a role failed for good: restarts
    exhausted, out of memory), Ctrl-C, a drain, or versions that were rollbacks. S counts
    the steps the checkpoint's model was trained, not its version number."""
    total = cfg.total_train_steps
    # The checkpoint is the truth; without one here (none yet, or the run directory is
    # on another host of a Ray cluster), the last step the metrics showed.
    done = ckpt.trained if ckpt is not None else summary.steps if summary is not None else 0
    if ckpt is None:
        where = "no checkpoint yet"
    elif ckpt.rollbacks:
        where = (f"last checkpoint {ckpt.path} (version {ckpt.version}: {ckpt.trained} steps trained, "
                 f"{ckpt.rollbacks} versions republished earlier weights)")
    else:
        where = f"last checkpoint {ckpt.path} (step {ckpt.version})"
    supervision = summary.supervision_line() if summary is not None else ""
    supervision = f" ({supervision})" if supervision else ""
    trained_now = len(summary.rewards) if summary is not None else 0
    if interrupted:
        session = f", {trained_now} in this session" if trained_now else ""
        return Ending(f"interrupted (Ctrl-C): stopped at step {done} of {total}{session}; {where}"
                      f"{supervision}. Resume: {resume}", EXIT_INTERRUPTED)
    means = summary.window_means() if summary is not None else None
    if means is None and done >= total and failure is None:
        return Ending(f"done: nothing to train: trial {cfg.trial_name} was already complete "
                      f"(step {done} of {total}, {where})", 0)
    if means is None:
        what = f"no training step completed ({summary.run_dir if summary else cfg.run_path}){supervision}"
    else:
        first, last, w = means
        steps = f"{w} steps" if w > 1 else "step"
        # A resumed trial: this invocation's steps, then where the trial stands in all.
        in_all = f" ({done} of {total} in all)" if done > trained_now else ""
        what = (f"{trained_now} step{'' if trained_now == 1 else 's'} trained in {summary.wall_s:.0f} s"
                f"{in_all}; "
                f"mean reward {first:.3f} over the first {steps} -> {last:.3f} over the last {steps}"
                f"{held_out_change(summary.held_out)}{supervision}. "
                f"Metrics: {summary.run_dir}/metrics/metrics.jsonl")
    if failure is not None:
        return Ending(f"stopped at step {done} of {total}: {failure}; {where}. {what}. Resume: {resume}",
                      EXIT_STOPPED_EARLY)
    if done >= total:
        return Ending(f"done: {what}", 0)
    last_reward = summary.rewards[max(summary.rewards)] if summary.rewards else None
    if cfg.stop_at_reward is not None and last_reward is not None \
            and last_reward >= cfg.stop_at_reward:
        return Ending(f"done (stop_at_reward={cfg.stop_at_reward:g} reached at step {done}): {what}", 0)
    if ckpt is not None and ckpt.version >= total:
        # The trainer finished by version, but some versions were not trained steps.
        return Ending(f"stopped at step {done} of {total}: the trainer reached version {ckpt.version}, "
                      f"but {ckpt.rollbacks} of its versions republished earlier weights (a trainer "
                      "restarted without a checkpoint: actor.checkpoint_every_steps; or `tapioca weights "
                      f"rollback`); {where}. {what}. To train the rest: {resume} "
                      f"total_train_steps={ckpt.version + total - done}", EXIT_STOPPED_EARLY)
    return Ending(f"stopped at step {done} of {total}: the trainer exited before total_train_steps "
                  f"(drained by `tapioca drain trainer`, or sent SIGTERM); {where}. {what}. "
                  f"Resume: {resume}", EXIT_STOPPED_EARLY)
