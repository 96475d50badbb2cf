"""An operator's rollback, as the trainer role carries it out (`tapioca weights rollback`).

Consumes the ``rollback`` control command's args (``version``, ``sha256`` of that
version's weights file; bus/fleet.py) at the trainer's current version; loads that
version's file (checksum verified: a mismatch is a TapiocaError, the command's ack says
so) into the actor through the run's payload (trainers/publishing.py: full weights or the
adapter), restarts the actor's Adam state, and brings the critic (GAE) back to that
version (:func:`rollback_critic`). Emits nothing itself: the trainer publishes the
restored weights as the NEW version v+1 with ``rollback_of`` set, so versions stay
monotonic and the staleness rules hold, and checkpoints it (trainers/trainer.py
``Trainer.on_control``). A command that cannot be carried out changes nothing and is
refused with what to do instead.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ..weights.payload import load_verified
from .checkpoint import load_state
from .checkpointing import TrainerCheckpoints
from .publishing import FullWeights

log = logging.getLogger(__name__)


def restore_version(args: Mapping[str, Any], *, current: int, actor, payload: FullWeights,
                    checkpoints: TrainerCheckpoints, keep_versions: int) -> tuple[int | None, str]:
    """Load the weights of the version ``args`` names into ``actor`` (and the critic of
    ``checkpoints``): ``(that version, a note on the critic)``, or ``(None, why not)``
    with the model untouched. ``keep_versions``: how many versions' files the trainer
    keeps (the way out when the file is gone)."""
    try:
        target = int(args["version"])
        sha256 = str(args["sha256"])
    except (KeyError, TypeError, ValueError):
        return None, "rollback needs args version (int) and sha256 (of its weights file)"
    if not 0 <= target < current:
        return None, (f"cannot roll back to version {target}: the current version is "
                      f"{current}; pick an earlier one (`tapioca weights list`)")
    path = payload.path(target)
    if not path.exists():
        kept = (f"keeps only the last weights.keep_versions={keep_versions} versions" if keep_versions > 0
                else "keeps every version's file (weights.keep_versions=0), so it was deleted by hand or never "
                     "written (weights.file_every_versions)")
        return None, (f"the weights file of version {target} ({path}) is gone: the trainer {kept}; "
                      "roll back to a newer one")
    tensors = load_verified(path, sha256)  # a mismatch is a TapiocaError: ack ok=False
    wrong = payload.misfit(tensors)  # a LoRA run: the adapter, its versions' contents
    if wrong:
        return None, (f"version {target}'s file does not fit the model ({len(wrong)} "
                      f"tensors, e.g. {wrong[0]}); was the model changed?")
    payload.restore(tensors)
    # Adam's moments belong to the abandoned later versions and would push the restored
    # weights back toward them; the rolled-back policy starts them afresh.
    actor.optimizer.state.clear()
    note = rollback_critic(checkpoints, target, current) if checkpoints.critic is not None else ""
    return target, note


def rollback_critic(checkpoints: TrainerCheckpoints, target: int, current: int) -> str:
    """Bring the critic back to ``target`` with the policy: its checkpoint of that
    version if one is on disk (only the newest is kept, so usually only when
    ``checkpoint_every_steps`` > 1 left later versions unsaved), else keep its
    weights but reset its Adam moments, which belong to the abandoned versions.
    Returns the note the command's answer carries."""
    critic = checkpoints.critic
    path = checkpoints.critic_path(target)
    if path.exists():
        load_state(path, model=critic.model, optimizer=critic.optimizer)
        return f"; critic restored from {path.name}"
    critic.optimizer.state.clear()
    log.warning("rollback to version %d: no critic checkpoint of that version (%s); the "
                "critic keeps the weights it learned on versions %d..%d (now abandoned) "
                "and restarts its optimizer state", target, path, target + 1, current)
    return (f"; no critic checkpoint of version {target}: the critic keeps its weights "
            "(learned on the abandoned versions), its optimizer state is reset")
