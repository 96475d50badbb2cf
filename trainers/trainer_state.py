"""The trainer role's state between events (trainers/trainer.py), and its small moves.

Holds the progress the checkpoint records (:class:`~tapioca.trainers.checkpoint.TrainerProgress`:
the version, the groups trained and rejected, the offsets), the groups waiting for a
step (each with the ``Source`` it was read from), the counters the metrics report, and
what is due on the log: rejections not yet named by a progress event, durable weights
files not yet announced, and events made before the loop could send them. Consumes and
emits nothing on the bus itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ..bus.role import DeadLetter, Source
from ..schemas.envelope import Event
from ..schemas.events import SampleEvent, WeightsFile
from .checkpoint import TrainerProgress


@dataclass
class TrainerState:
    progress: TrainerProgress
    trained: set[str]
    rejected: set[str]
    buffer: list[tuple[SampleEvent, Source]] = field(default_factory=list)
    # Next offset after the last event handled, per (topic, partition).
    handled_to: dict[tuple[str, int], int] = field(default_factory=dict)
    staleness_hist: Counter = field(default_factory=Counter)
    rejected_stale: int = 0
    rejected_dropped: int = 0
    duplicates: int = 0
    # Samples dead-lettered at arrival (all reasons / another advantage config), and
    # steps not applied because their loss or gradient norm was not finite.
    dead_lettered: int = 0
    dead_lettered_config: int = 0
    skipped_steps: int = 0
    # Due on the next tick: a progress event (at start; the rejected groups changed) and
    # the current version's weights event (at start).
    announce_progress: bool = False
    announce_weights: bool = False
    # Online mode: groups past the staleness bound, dead-lettered with the reason; and
    # groups trained past eta within actor.late_reward_max_offpolicyness.
    dead_lettered_stale: int = 0
    trained_late: int = 0
    # R3: sequences trained without the rollout's routes (actor.moe.router_replay_missing live).
    routes_missing: int = 0
    unannounced: list[str] = field(default_factory=list)
    done: bool = False
    last_reward: float = 0.0
    # Durable weights files finished since the last weights event (WeightsEvent.files).
    files_to_announce: list[WeightsFile] = field(default_factory=list)
    # Events made before the loop could publish them (the version a trainer resumed below
    # the log publishes in ``recover``): sent ahead of the next outputs.
    pending: list[Event | DeadLetter] = field(default_factory=list)

    def draft(self) -> "TrainerState":
        """A copy of everything a step (or a rollback) changes. The step changes the copy,
        writes its weights and checkpoint from it, and only then commits it
        (:meth:`commit`), so a failed write (a full disk) leaves the version, the trained
        groups, the buffer and the offsets as they were."""
        return replace(self, progress=replace(self.progress), trained=set(self.trained),
                       rejected=set(self.rejected), buffer=list(self.buffer),
                       handled_to=dict(self.handled_to), staleness_hist=Counter(self.staleness_hist),
                       unannounced=list(self.unannounced),
                       files_to_announce=list(self.files_to_announce), pending=list(self.pending))

    def commit(self, draft: "TrainerState") -> None:
        self.__dict__.update(draft.__dict__)

    def reject(self, gid: str) -> None:
        """Reject group ``gid``: the next progress event names it (its head-gate slot is freed)."""
        self.rejected.add(gid)
        self.unannounced.append(gid)
        self.announce_progress = True

    def note_files(self, files) -> None:
        """Durable files the background writer finished: announced with the next event."""
        p = self.progress
        for f in files:
            if f.version == p.version:
                p.weights_path, p.weights_sha256 = f.path, f.sha256
            self.files_to_announce.append(WeightsFile(version=f.version, path=f.path,
                                                      sha256=f.sha256, num_bytes=f.num_bytes))

    def take_files(self) -> list[WeightsFile]:
        taken, self.files_to_announce = self.files_to_announce, []
        return taken

    def take_pending(self) -> list[Event | DeadLetter]:
        taken, self.pending = self.pending, []
        return taken

    def take_unannounced(self) -> list[str]:
        """The rejections not named yet; the progress records them as the last named."""
        taken, self.unannounced = self.unannounced, []
        self.progress.last_rejected_ids = taken
        return taken

    def restore_offsets(self) -> None:
        """``handled_to`` from the offsets the checkpoint covers (a restart resumes there)."""
        for key, off in self.progress.offsets.items():
            topic, _, part = key.rpartition(":")
            self.handled_to[(topic, int(part))] = off

    def covered_offsets(self) -> dict[str, int]:
        """The offsets a checkpoint of this state covers: what was handled, but never past
        a buffered group (it must be read again after a restart)."""
        offsets = dict(self.handled_to)
        for _, src in self.buffer:
            key = (src.topic, src.partition)
            offsets[key] = min(offsets.get(key, src.offset), src.offset)
        return {f"{t}:{part}": off for (t, part), off in offsets.items()}
