"""Where an RL step's time goes, from the events' own timestamps: one row per step.

Consumes a run's events (from its archive, ``<run dir>/archive`` with
``archive.enabled: true``, or straight from its topics): ``weights.v1`` (each version's
publish, ``produced_at``), the groups each version trained (``progress.v1``'s progress
events where the tree has them, else the weights events' ``group_ids``), ``metrics.v1`` (the trainer's
``trainer/batch_ready_at``, ``trainer/token_advantages_s``, ``actor/step_time_s``),
``trajectories.v1`` (``produced_at``; ``timings``: ``submitted_at``, ``queued_s``,
``generate_s`` and the weights switch the group was generated after:
``weights_version``, ``weights_received_at``, ``weights_loaded_at``), ``rewards.v1`` and
``samples.v1`` (``produced_at``), indexed by :class:`~tapioca.ops.lifecycle.RunLog`: the
one derivation of these timestamps, which the trajectory traces (ops/traces.py) read
too. Emits :class:`StepTimeline` rows (seconds) and a text table. Keyed by the policy
version a step made. Nothing is written anywhere.

For the step that made version ``v`` from groups generated under version ``u``
(``u = v - 1`` at eta 0), the critical path of its last group, in order:

=================  ================================================================
publish            the trainer publishing version ``u``: its weights event's produced_at
                   - (batch complete + token advantages + actor step) of the step
                   that made it (with GAE the critic's step is in it too; a due
                   checkpoint is written after the event: it shows in the next
                   trainer wait)
weights hop        ``u``'s weights event produced -> received by the rollout worker
switch             received -> loaded into the engine (the tick it waits for + the load)
prompt wait        loaded -> the step's first group submitted (the feeder's admission
                   and the prompt's hop at eta 0; negative: generated before the switch)
generation         first submit -> last trajectory published
reward             last trajectory -> last reward (the scorer's hop + its work)
advantage          last reward -> last sample (the processor's hop + its work)
sample hop         last sample (or, if later, the end of the trainer's previous step:
                   a sample that waited for a busy trainer was queued, not hopping)
                   -> the trainer's batch complete
trainer wait       ``v - 1``'s weights event -> the batch complete (the trainer idle)
step               batch complete -> ``v``'s weights event (advantages, train, publish)
cycle              ``v - 1``'s weights event -> ``v``'s
=================  ================================================================

At eta > 0 the stages overlap (groups are generated while earlier steps train):
generation is then the span of the step's groups, not a share of its cycle.

``hops_s`` sums the stages that are event hops (weights hop, prompt wait when > 0,
reward, advantage, sample hop): an upper bound of the bus's share of a step, since each
includes its consumer's own work and poll cadence. Clocks: every timestamp is a
``time.time()`` of the process that wrote it; one host here, so one clock.

    python -m tapioca.ops.timeline RUN_DIR/archive
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from ..schemas.envelope import Event
from .lifecycle import RunLog

STAGES = ("publish_s", "weights_hop_s", "switch_s", "prompt_wait_s", "generation_s", "reward_s",
          "advantage_s", "sample_hop_s", "trainer_wait_s", "step_s", "cycle_s")


@dataclass
class StepTimeline:
    version: int
    generated_under: int | None
    publish_s: float | None
    weights_hop_s: float | None
    switch_s: float | None
    prompt_wait_s: float | None
    generation_s: float | None
    reward_s: float | None
    advantage_s: float | None
    sample_hop_s: float | None
    trainer_wait_s: float | None
    step_s: float | None
    train_s: float | None  # actor/step_time_s, inside step_s
    cycle_s: float | None

    @property
    def hops_s(self) -> float | None:
        parts = [self.weights_hop_s, self.reward_s, self.advantage_s, self.sample_hop_s]
        if any(p is None for p in parts):
            return None
        return sum(parts) + max(self.prompt_wait_s or 0.0, 0.0)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _publish_s(metrics: dict[str, float] | None, published_at: float | None) -> float | None:
    """The publish of the version a step made: from its work's end to its weights event."""
    if metrics is None or published_at is None or "actor/step_time_s" not in metrics:
        return None
    done = metrics["trainer/batch_ready_at"] + metrics.get("trainer/token_advantages_s", 0.0) \
        + metrics["actor/step_time_s"]
    return published_at - done


def step_timelines(events: Iterable[Event]) -> list[StepTimeline]:
    """One :class:`StepTimeline` per training step found in ``events`` (any order)."""
    return timelines_of(RunLog.of(events))


def timelines_of(log: RunLog) -> list[StepTimeline]:
    """The steps of an indexed run (ops/lifecycle.py: the trajectories' timestamps the
    traces read too)."""
    rows = []
    for v in sorted(log.weights_at):
        published, m, groups = log.weights_at[v], log.trainer_steps.get(v), log.trained.get(v)
        if m is None or not groups:
            continue
        ts = [t for g in groups for t in log.group_trajectories(g)]
        under = max((t.weights_version for t in ts if t.weights_version is not None), default=None)
        switch = next((t for t in ts if t.weights_version == under), None) if under is not None else None
        prev, used = log.weights_at.get(v - 1), log.weights_at.get(under) if under is not None else None
        submitted = [t.submitted_at for t in ts if t.submitted_at is not None]
        first_submit = min(submitted) if submitted else None
        last_traj = max((t.published_at for t in ts), default=None)
        reward_ts = [t.reward_at for t in ts if t.reward_at is not None]
        last_reward = max(reward_ts) if len(reward_ts) == len(ts) and ts else None
        sample_ts = [log.samples[g].produced_at for g in groups if g in log.samples]
        last_sample = max(sample_ts) if len(sample_ts) == len(groups) else None
        ready = m.get("trainer/batch_ready_at")
        received = switch.weights_received_at if switch else None
        loaded = switch.weights_loaded_at if switch else None
        rows.append(StepTimeline(
            version=v, generated_under=under, publish_s=_publish_s(log.trainer_steps.get(under), used),
            weights_hop_s=_diff(received, used),
            switch_s=_diff(loaded, received),
            prompt_wait_s=_diff(first_submit, loaded),
            generation_s=_diff(last_traj, first_submit),
            reward_s=_diff(last_reward, last_traj),
            advantage_s=_diff(last_sample, last_reward),
            # From when the trainer could take the last sample: its publish, or the end of the
            # trainer's previous step when it was still busy (eta > 0: then it was queued).
            sample_hop_s=_diff(ready, None if last_sample is None else max(last_sample, prev)
                               if prev is not None else last_sample),
            trainer_wait_s=_diff(ready, prev),
            step_s=_diff(published, ready),
            train_s=m.get("actor/step_time_s"),
            cycle_s=_diff(published, prev)))
    return rows


def summarize(rows: list[StepTimeline], *, skip: int = 2) -> dict[str, float | None]:
    """Medians of every stage over the steps after the first ``skip`` (start-up and
    warm-up); ``hops_share``: the median of each step's hops over its cycle (the bus's
    share of a synchronous step, an upper bound); ``trainer_idle_share``: of its trainer
    wait over its cycle (what the rest of the loop costs the trainer, at any eta)."""
    steady = rows[skip:] if len(rows) > skip else rows
    out: dict[str, float | None] = {}
    for name in STAGES + ("train_s", "hops_s"):
        vals = [getattr(r, name) for r in steady if getattr(r, name) is not None]
        out[name] = statistics.median(vals) if vals else None
    shares = [r.hops_s / r.cycle_s for r in steady if r.hops_s is not None and r.cycle_s]
    out["hops_share"] = statistics.median(shares) if shares else None
    # At eta > 0 the hops overlap training; what costs is the trainer not training.
    idle = [r.trainer_wait_s / r.cycle_s for r in steady if r.trainer_wait_s is not None and r.cycle_s]
    out["trainer_idle_share"] = statistics.median(idle) if idle else None
    out["steps"] = float(len(steady))
    return out


def format_table(rows: list[StepTimeline]) -> str:
    """The rows as a fixed-width text table (milliseconds)."""
    cols = ["version", "under"] + [n[:-2] for n in STAGES] + ["train", "hops"]
    cells = [cols]
    for r in rows:
        vals = [getattr(r, n) for n in STAGES] + [r.train_s, r.hops_s]
        cells.append([str(r.version), "-" if r.generated_under is None else str(r.generated_under)]
                     + ["-" if x is None else f"{1000 * x:.0f}" for x in vals])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(ms; see tapioca.ops.timeline for what each stage spans)"


def events_from_archive(path: str | Path) -> list[Event]:
    """The events of an archive directory (``bus/archive.py``)."""
    from ..bus.archive import iter_events

    return [e for _, e in iter_events(path)]


def events_from_topics(cfg, names: Iterable[str] = ("weights", "progress", "metrics", "trajectories",
                                                     "rewards", "samples")) -> list[Event]:
    """The events of a running (or finished, still up) broker's topics (those of
    ``names`` the registry knows)."""
    from ..bus.reader import read_events
    from ..schemas.errors import SchemaError
    from ..schemas.registry import topic

    known = []
    for name in names:
        try:
            topic(name)
        except SchemaError:
            continue  # e.g. progress.v1 on a tree before it
        known.append(name)
    return [e for name in known for e in read_events(cfg, name)]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m tapioca.ops.timeline ARCHIVE_DIR (a run's archive: "
                         "archive.enabled=true)")
    rows = step_timelines(events_from_archive(args[0]))
    if not rows:
        raise SystemExit(f"{args[0]}: no training step with its metrics and weights events found")
    print(format_table(rows))
    summary = summarize(rows)
    print("median after 2 steps:", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})


def as_dicts(rows: list[StepTimeline]) -> list[dict]:
    """Rows as JSON-ready dicts (with ``hops_s``)."""
    return [dict(asdict(r), hops_s=r.hops_s) for r in rows]


if __name__ == "__main__":
    main()
