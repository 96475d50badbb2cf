"""The head gate: how many groups may be admitted ahead of the trainer
(docs/design.md#3-policy-versions-and-the-staleness-window).

Pure arithmetic shared by the two producers of groups, the prompt feeder and the agent
proxy; both read the trainer's weights events and count what they admitted.

AReaL's rule admits group k while ``k < (eta + v + 1) * B``. Two Tapioca refinements:

* groups the trainer rejected (over-stale, filtered, dropped) free their slots, as
  AReaL's rejected rollouts do, else a long run stalls (``freed``);
* ``v`` counts trained steps, not versions: a rollback publishes version v+1 without
  consuming a batch, and counting it would let one extra batch in flight for the rest of
  the run -- its oldest groups then always pass eta and are rejected (seen: a third of
  all groups after one rollback). Weights events carry ``rollbacks`` for this.
"""

from __future__ import annotations


def log_counts(rollbacks: int, rejected: int, base_steps: int = 0,
               base_rejected: int = 0) -> tuple[int, int]:
    """(rollbacks, freed) for :func:`head_gate_capacity` from a weights event's counts,
    counting only what happened on the current log: a run resumed on a broker that lost
    its log numbers its groups from 0 again, so the steps and rejections made before
    (``base_steps``, ``base_rejected``) must not open the gate. Returned as extra
    "rollbacks" so that ``version - rollbacks`` is the steps trained on this log."""
    return rollbacks + base_steps, rejected - base_rejected


def head_gate_capacity(admitted: int, version: int, eta: int, prompts_per_step: int, *,
                       freed: int = 0, rollbacks: int = 0) -> int:
    """Groups that may still be admitted: ``(eta + (version - rollbacks) + 1) * B``
    minus the groups admitted and not freed. Negative when over (after a restart)."""
    trained_steps = version - rollbacks
    return (eta + trained_steps + 1) * prompts_per_step - (admitted - freed)
