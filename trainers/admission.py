"""The trainer's edge: whether a sample may enter the buffer, and whether a waiting group
may still train (the tail gate).

Consumes a :class:`~tapioca.schemas.events.SampleEvent` and the trainer's version; emits
nothing but its verdict. :meth:`Admission.made_for` and :meth:`Admission.trainable`
raise :class:`~tapioca.schemas.errors.BadEventError` for a sample no step could use
safely (trainers/sample_checks.py: another advantage config; token ids outside the
vocabulary, numbers beyond float32-safe bounds, versions newer than the trainer's; images
the policy cannot read; R3 routes that do not fit the model), which the bus dead-letters.
:meth:`Admission.too_stale` says why a group is past the staleness bound
(``rollout.max_head_offpolicyness``, or online ``actor.late_reward_max_offpolicyness``),
at arrival and again before every step. The trainer (trainers/trainer.py) counts,
rejects and dead-letters; the facts checked against (the model's vocabulary, context and
MoE shape, the run's advantage config) are read here once.
"""

from __future__ import annotations

from ..config.algorithms import reward_norm_spec
from ..config.sections import TrainerSection
from ..schemas.errors import BadEventError
from ..schemas.events import SampleEvent
from .offline import OFFLINE_ETA
from .sample_checks import check_made_for, check_routes, check_trainable


class Admission:
    def __init__(self, section: TrainerSection, actor) -> None:
        """``actor``: the policy (its model's vocabulary and context; ``check_images`` of a
        vision-language policy; the packed forward's MoE shape under R3)."""
        self.actor = actor
        self.estimator = section.advantage.estimator
        self.norm_spec = section.advantage.norm().spec()
        self.reward_norm_spec = reward_norm_spec(section.advantage.reward_norm)
        self.eta = section.max_head_offpolicyness
        # Gate off (offline, trainers/offline.py): the recorded versions count the
        # online trainer's steps, so one ahead of this trainer's is no forgery.
        self.recorded_versions = self.eta >= OFFLINE_ETA
        # Online mode (agent.mode online): a late group trains up to this bound.
        self.late_cap = section.actor.late_reward_max_offpolicyness if section.online else None
        model = actor.model
        sizes = [m.num_embeddings if hasattr(m, "num_embeddings") else m.out_features
                 for m in (model.get_input_embeddings(), model.get_output_embeddings())
                 if m is not None]
        self.vocab_size = min(sizes)
        self.max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        # R3: the routes a sample carries are checked against the model (and read from the
        # run's blob store when they are there).
        self.moe_shape = None
        self.routes_missing = section.actor.moe.router_replay_missing
        if section.actor.moe.router_replay == "R3" and getattr(actor, "packed", None) is not None:
            from ..media.store import run_blob_store

            self.moe_shape = actor.packed.moe_shape
            self.blobs = run_blob_store(section.run_dir)

    def made_for(self, event: SampleEvent) -> None:
        """Raise BadEventError for a sample made for another advantage config."""
        check_made_for(event, estimator=self.estimator, norm_spec=self.norm_spec,
                       reward_norm_spec=self.reward_norm_spec)

    def trainable(self, event: SampleEvent, version: int) -> int:
        """Raise BadEventError for a sample this trainer (at ``version``) must not train;
        the number of its sequences that will route live for want of their routes (R3)."""
        check_trainable(event, vocab_size=self.vocab_size, max_positions=self.max_positions,
                        version=version, recorded_versions=self.recorded_versions)
        self._check_images(event)
        if self.moe_shape is not None:
            return check_routes(event, moe_shape=self.moe_shape, missing=self.routes_missing,
                                store=self.blobs)
        return 0

    def _check_images(self, event: SampleEvent) -> None:
        """Images only for a policy that reads them, each usable (trainers/vision_batch.py)."""
        check = getattr(self.actor, "check_images", None)
        if check is not None:
            check(event)
        elif any(s.images for s in event.sequences):
            raise BadEventError(f"group {event.group_id} has images, which this trainer's actor "
                                "does not train on (a vision-language policy needs the single-process "
                                "trainer: fsdp.world_size 1)")

    def too_stale(self, sample: SampleEvent, version: int) -> str | None:
        """Why ``sample`` is past the tail gate at ``version`` (None: it may train). Online
        mode (agent.mode online): up to actor.late_reward_max_offpolicyness versions it
        trains, with decoupled PPO's behaviour-weight correction."""
        staleness, cap = version - sample.min_version, self.late_cap
        bound = self.eta if cap is None else cap
        if staleness <= bound:
            return None
        late = (f" (its rewards came {sample.reward_delay_s:.0f} s after its trajectories)"
                if sample.reward_delay_s >= 1 else "")
        fix = ("raise actor.late_reward_max_offpolicyness" if cap is not None else
               "set actor.late_reward_max_offpolicyness to train such groups with the "
               "decoupled-PPO correction, or raise rollout.max_head_offpolicyness")
        return (f"group {sample.group_id} is {staleness} versions behind the trainer (version "
                f"{version}, its oldest token {sample.min_version}), past the staleness bound "
                f"of {bound}{late}: not trained; {fix}")
