"""The trainer role's checkpoints: when a state is saved, what a resumed trainer reads back.

The file format is trainers/checkpoint.py's (safetensors + JSON, nothing unpickled); this
module is the trainer's use of it. Consumes a :class:`TrainerState` and writes
``checkpoints/trainer.safetensors`` through the actor (whole, sharded by the FSDP actor,
or only the trainable adapter of a LoRA run) with the progress: the version, the groups
trained and rejected, the rejections a restart names again, and the offsets the state
covers (never past a buffered group). With a critic (``advantage.estimator`` gae) its
``checkpoints/critic_v<version>.safetensors`` is written first, so the file of the
checkpointed version always exists, and only the newest is kept.

At start, :meth:`TrainerCheckpoints.resume` loads the checkpoint (the actor's weights and
optimizer, the critic's of that version) into a new state; a checkpoint made on another
log (:func:`adopt_log`) keeps the model and drops the offsets. Emits nothing on the bus.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from .checkpoint import SUFFIX, TrainerProgress, load_state, refuse_legacy, save_state
from .critic import Critic
from .trainer_state import TrainerState

log = logging.getLogger(__name__)


class TrainerCheckpoints:
    def __init__(self, run_dir: Path, *, actor, critic: Critic | None = None) -> None:
        """``actor``: the policy (its ``save_checkpoint`` / ``load_checkpoint``);
        ``critic``: GAE's value model, checkpointed beside it (None: no critic)."""
        self.path = Path(run_dir) / "checkpoints" / f"trainer{SUFFIX}"
        self.actor = actor
        self.critic = critic
        # The version the checkpoint on disk holds (saved or resumed; None: none yet): a
        # stop right after a step's checkpoint does not write the same weights again.
        self.saved_version: int | None = None

    def resume(self, bus_run_id: str) -> tuple[TrainerState, bool]:
        """The state at start, and whether a checkpoint was loaded (``bus_run_id``: this
        run's log, :func:`adopt_log`)."""
        progress = self.actor.load_checkpoint(self.path)
        resumed = progress is not None
        self.saved_version = progress.version if resumed else None
        if progress is None:
            progress = TrainerProgress()
        elif self.critic is not None:
            self.load_critic(progress.version)
        state = TrainerState(progress, set(progress.trained_groups), set(progress.rejected_groups))
        adopt_log(state, bus_run_id, resumed)
        state.restore_offsets()
        state.unannounced = list(dict.fromkeys(progress.last_rejected_ids + progress.unannounced_rejections))
        return state, resumed

    def save(self, state: TrainerState) -> None:
        """Save the state's progress with the groups and offsets it covers. The state's
        progress takes the new offsets, which the trainer's ``committable`` lets the bus
        commit, only once the file is saved: an offset is never committed past what a saved
        checkpoint covers (a save that fails, e.g. on a full disk, raises and changes nothing)."""
        p = replace(state.progress, trained_groups=sorted(state.trained),
                    rejected_groups=sorted(state.rejected),
                    unannounced_rejections=list(state.unannounced),
                    offsets=state.covered_offsets())
        if self.critic is not None:
            # Before the trainer checkpoint: whichever version it names, its critic file exists.
            path = self.critic_path(p.version)
            save_state(path, model=self.critic.model, optimizer=self.critic.optimizer)
        self.actor.save_checkpoint(self.path, p)
        state.progress = p
        self.saved_version = p.version
        if self.critic is not None:
            for old in path.parent.glob(f"critic_v*{SUFFIX}"):
                if old != path:
                    old.unlink(missing_ok=True)

    def critic_path(self, version: int) -> Path:
        return self.path.parent / f"critic_v{version:06d}{SUFFIX}"

    def load_critic(self, version: int) -> None:
        """The critic's weights and optimizer of ``version``, if saved (else it starts fresh)."""
        path = self.critic_path(version)
        refuse_legacy(path)  # an old pickle is never loaded (trainers/checkpoint.py)
        if not path.exists():
            # E.g. a GRPO run resumed with estimator gae: the critic starts fresh.
            log.warning("no critic checkpoint %s for version %d; the critic starts from its "
                        "initial weights", path, version)
            return
        load_state(path, model=self.critic.model, optimizer=self.critic.optimizer)


def adopt_log(state: TrainerState, own: str, resumed: bool) -> None:
    """A checkpoint made on another log (its bus run id differs from ``own``: the broker
    lost the run's log and the launcher gave the run a new id, config/schema.py) resumes
    its model, optimizer and version, but its offsets belong to the old log's partitions:
    they are dropped, and the head gate counts from here (ProgressEvent.base_*)."""
    if not own:
        return
    from ..config.schema import split_bus_run_id

    progress = state.progress
    before = progress.bus_run_id or split_bus_run_id(own)[0]
    if resumed and before != own:
        log.warning("checkpoint of version %d was made on the log of run id %s; this log is "
                    "%s: its offsets are dropped, the model and its trained groups are kept",
                    progress.version, before, own)
        progress.offsets = {}
        progress.base_steps = progress.version - progress.rollbacks
        progress.base_rejected = len(state.rejected)
        progress.base_groups = len(state.trained) + len(state.rejected)
    progress.bus_run_id = own
