"""The one rule every follower of ``weights.v1`` applies: versions only go forward.

Rollout workers and the agent proxy each follow the trainer's versions (the prompt
feeder and the proxy's gate follow its progress events on ``progress.v1``, whose versions
never go back either). A weights event is *newer* than the version a member follows
(load it), the *same* (a repeat: the trainer repeats a version at start and when a
durable file for it is ready; nothing to load), or *older*: a re-published old event,
which must not roll the fleet back (it did: 26 -> 23). An older one is
refused with :class:`~tapioca.schemas.errors.BadEventError`, so the bus dead-letters it.
A genuine rollback is a new, higher version with ``rollback_of`` set, and passes.
"""

from __future__ import annotations

from ..schemas.errors import BadEventError
from ..schemas.events import WeightsEvent


def is_newer(event: WeightsEvent, followed_version: int, member: str) -> bool:
    """True: a newer version (act on it); False: the same version (a re-announcement).
    Raises BadEventError for an older one."""
    if event.version < followed_version:
        raise BadEventError(
            f"weights version {event.version} is older than version {followed_version} that "
            f"{member} follows: a re-published old weights event (versions never go back; "
            "`tapioca weights rollback` publishes the old weights as a new, higher version)")
    return event.version > followed_version
