"""The group advantage processor: trajectories + rewards in, training samples out.

Consumes ``trajectories.v1`` and ``rewards.v1`` in one consumer group. Both are keyed
by ``group_id`` with equal partition counts, so a group's events arrive on the same
partition number of both topics and one member sees the whole group.
Emits one ``SampleEvent`` per complete group on ``samples.v1`` keyed by ``group_id``.

Per trajectory, in this order (AReaL's): the reward (one source, or the weighted sum
of several), plus DAPO's overlong penalty, then ``reward_bias`` / ``reward_scaling`` /
``reward_clip``; per group, ``advantage.reward_norm`` if set (AReaL's: the shaped
rewards normalised within the group), then the ``group`` levels of the advantage
normalisation (estimator preset or ``advantage.adv_norm``) on those rewards.
``SampleSequence.reward`` is the shaped reward (never normalised: metrics, archive
filters and rejection-sampling SFT read it), ``SampleSequence.norm_reward`` the
reward after ``reward_norm`` (None without it; the trainer's GAE uses it), and
``SampleSequence.advantage`` the group-level result; ``batch`` levels (and GAE for
``estimator: gae``, whose advantages leave here as 0) are the trainer's.
``SampleEvent.adv_norm`` / ``reward_norm`` name both normalisations, so a trainer
configured otherwise refuses the group. A trajectory's routed experts (MoE routing
replay) go onto its sequence as they came (inline, or the blob's name).
With ``dynamic_sampling`` a group whose shaped rewards are all equal is emitted with
``dropped_reason`` ``"filtered: zero reward variance (all 1.0)"`` and its sequences
(advantages 0): it stays in the log with its reason, the trainer counts it as
rejected, the feeder's head gate frees its slot and the batch keeps filling.

## Late, duplicate and missing rewards

This is the contract an external reward service can rely on (``RewardEvent`` on
``rewards.v1``, keyed by ``group_id``, one event per ``(traj_id, scorer)``):

* **Sources.** Without ``advantage.reward_weights`` the first reward of a trajectory
  from any scorer is used; when rewards from two different scorers are seen, a warning
  is logged once per extra scorer and counted (``mixed_scorers``): set weights when
  more than one source may publish. With weights (``{scorer: weight}``, keyed by
  ``RewardEvent.scorer``) the reward is ``sum_s weight_s * reward_s`` and a group is
  complete only when every weighted source has scored every trajectory. Rewards from
  scorers without a weight are ignored and counted (``ignored_rewards``).
* **Duplicates.** Idempotent by ``(traj_id, scorer)`` (by ``traj_id`` alone without
  weights): the first reward wins; later ones, redeliveries included, change nothing
  and are counted (``duplicate_rewards``).
* **Late rewards.** A reward for a group already emitted or filtered is ignored and
  counted (``late_rewards``). A sample is never revised. A reward for a group already
  *dropped* (its reward or group timeout passed, e.g. an online user's thumbs-up after
  ``advantage.reward_timeout_s``) came too late to train: it is dead-lettered with the
  group's drop reason (counted ``late_rewards`` too). (The processor remembers the last
  million group ids, in memory; a reward later than that, or one re-read after a
  restart, opens a fragment that ``group_timeout_s`` drops and the trainer ignores as
  already seen.)
* **Delayed rewards** (online mode, docs/online.md): a group waits for its rewards as
  long as the timeouts allow (hours are fine: ``advantage.reward_timeout_s: 21600``).
  Its waiting state is only "trajectories seen, rewards missing", held back by the
  commit floor, so a restarted processor rebuilds it by reading the log again; its
  timers then count from the restart (a restart lengthens a wait, never shortens it).
  ``SampleEvent.reward_delay_s`` says how late the rewards came (the reward's
  ``produced_at`` minus the last trajectory's).
* **Missing rewards.** ``advantage.reward_timeout_s`` after a group's trajectories
  are all present, rewards still missing are handled by ``advantage.missing_reward``:
  ``drop`` emits the group with ``dropped_reason`` ``"reward timeout after 30 s:
  missing judge for 2 of 4 trajectories"`` (the trainer counts it as rejected);
  ``zero`` counts each missing weighted source (or missing reward, without weights)
  as 0.0 and emits the group for training (counted as ``zero_filled``). Without a
  reward timeout, and for groups whose trajectories never all arrive,
  ``advantage.group_timeout_s`` after the group's first event drops it.
* **Pauses.** Time while the member is paused (``tapioca pause advantage``) does not
  count towards either timeout: on resume every pending group's timers move forward
  by the paused time, since its remaining events are still waiting in Kafka.
* **Bad values.** A NaN or infinite reward fails event validation, and a reward beyond
  +-1e9 (``algorithms/limits.py``: its square would overflow float32 downstream; a
  reward of 1.5e308 overflowed the group statistics) is refused here; either way it goes
  to the dead-letter topic with the reason, and the group then waits for the reward
  timeout. A group whose shaped rewards still overflow cannot be built: the event that
  completed it is dead-lettered and the reward timeout drops the group with the reason.

## Keys, commits and restarts

State is only "groups seen but not yet complete". Offsets are committed only up to
the oldest event of an incomplete group, so after a crash the state is rebuilt by
reading the log again; a group that completes twice is emitted twice with the same
``group_id`` and the trainer de-duplicates it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..algorithms.advantages import (
    normalize_group,
    normalize_rewards,
    shape_reward,
)
from ..algorithms.errors import AlgorithmInputError
from ..algorithms.limits import MAX_ABS_REWARD
from ..algorithms.reward_shaping import overlong_penalty, weighted_reward
from ..bus.dedup import SeenSet
from ..bus.role import Role, Source
from ..config.algorithms import reward_norm_spec
from ..config.sections import AdvantageSection
from ..schemas.envelope import ANY_RUN, Event
from ..schemas.errors import BadEventError
from ..schemas.events import RewardEvent, SampleEvent, SampleSequence, TrajectoryEvent

log = logging.getLogger(__name__)

_ANY = ""  # the scorer key of rewards when no weights are configured
# A complete group without its rewards this long is worth a warning (scorers answer in
# well under a second on the synthetic task; math-verify in a few); repeated at most
# this often while it lasts.
REWARD_WAIT_WARN_S = 30.0
REWARD_WAIT_WARN_EVERY_S = 60.0


@dataclass
class _PendingGroup:
    first_seen: float
    group_size: int = 0  # known once a trajectory arrives (rewards may come first)
    trajectories: dict[str, TrajectoryEvent] = field(default_factory=dict)
    # (traj_id, scorer) -> reward; scorer is _ANY without weights.
    rewards: dict[tuple[str, str], float] = field(default_factory=dict)
    # When the last trajectory arrived: the reward timeout runs from here.
    all_present_at: float | None = None
    # Earliest offset of this group's events per (topic, partition): the commit floor.
    first_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    # Producers' clocks (produced_at): the last trajectory, and each reward's.
    last_traj_at: float = 0.0
    reward_at: dict[tuple[str, str], float] = field(default_factory=dict)

    def trajectories_complete(self) -> bool:
        return self.group_size > 0 and len(self.trajectories) >= self.group_size

    def missing(self, sources: tuple[str, ...]) -> dict[str, int]:
        """Per source: how many present trajectories it has not scored."""
        out = {}
        for s in sources:
            n = sum((t, s) not in self.rewards for t in self.trajectories)
            if n:
                out[s] = n
        return out


@dataclass
class AdvantageState:
    pending: dict[str, _PendingGroup] = field(default_factory=dict)
    emitted: SeenSet = field(default_factory=SeenSet)
    # Groups emitted with dropped_reason (timeouts, not filters) -> the reason: a reward
    # for one of them is dead-lettered with it. Bounded like ``emitted``.
    dropped: "OrderedDict[str, str]" = field(default_factory=OrderedDict)
    groups_emitted: int = 0
    groups_dropped: int = 0
    groups_filtered: int = 0
    groups_zero_filled: int = 0
    duplicate_rewards: int = 0
    late_rewards: int = 0
    ignored_rewards: int = 0
    # Without weights: the scorers seen, and rewards from any but the first of them.
    scorers_seen: list[str] = field(default_factory=list)
    mixed_scorers: int = 0
    # Clock reading when the member was paused (None while running).
    paused_at: float | None = None
    # Complete groups still missing rewards after REWARD_WAIT_WARN_S (last tick's count).
    waiting_for_rewards: int = 0
    warned_at: float | None = None


class AdvantageProcessor(Role[AdvantageState]):
    name = "advantage"
    group_inputs = ("trajectories", "rewards")
    # A reward or trajectory that names no run is dead-lettered in a named run (an
    # outside service forgot to copy the run_id), not dropped as foreign.
    attributed_inputs = ("trajectories", "rewards")

    def __init__(self, section: AdvantageSection, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``section``: the ``advantage`` config (validated there: estimator, norms,
        shaping, sources, timeouts) and the generation limit of the overlong penalty.
        ``clock``: the timeouts' clock (tests pass a fake one)."""
        a = section.advantage
        norm = a.norm()  # the estimator's preset, or adv_norm
        # Keyword arguments of normalize_group; its spec is carried on every SampleEvent,
        # so the trainer checks the group was normalised as its own config says.
        self.norm = norm.as_kwargs()
        self.norm_spec = norm.spec()
        # reward_norm (keyword arguments of normalize_rewards): None = off; both levels
        # none is the same as off.
        rn = a.reward_norm
        off = rn is None or (rn.mean_level == "none" and rn.std_level == "none")
        self.reward_norm = None if off else rn.as_kwargs()
        self.reward_norm_spec = reward_norm_spec(rn)
        self.estimator = a.estimator
        self.reward_bias = a.reward_bias
        self.reward_scaling = a.reward_scaling
        self.reward_clip = a.reward_clip
        self.dynamic_sampling = a.dynamic_sampling
        self.overlong = ((section.max_new_tokens, a.overlong_tokens, a.overlong_penalty_factor)
                         if a.overlong_reward_penalty else None)
        self.reward_weights = dict(a.reward_weights)
        # The reward sources a trajectory needs before its group is complete.
        self.sources: tuple[str, ...] = tuple(sorted(self.reward_weights)) or (_ANY,)
        self.reward_timeout_s = a.reward_timeout_s
        self.missing_reward = a.missing_reward
        self.group_timeout_s = a.group_timeout_s
        self._clock = clock
        for warning in a.singleton_warnings(section.n_samples):
            log.warning("%s", warning)

    def init_state(self) -> AdvantageState:
        return AdvantageState()

    def handle(self, event: Event, state: AdvantageState, source: Source) -> Iterable[Event]:
        if not isinstance(event, (TrajectoryEvent, RewardEvent)):
            return ()
        group_id = event.group_id
        is_reward = isinstance(event, RewardEvent)
        if group_id in state.emitted:
            if is_reward:
                state.late_rewards += 1
                why = state.dropped.get(group_id)
                if why is not None:
                    raise BadEventError(
                        f"reward for trajectory {event.traj_id} came after its group "
                        f"{group_id} was dropped ({why}): too late to train; raise "
                        "advantage.reward_timeout_s (and group_timeout_s) to wait longer")
            return ()
        if is_reward and abs(event.reward) > MAX_ABS_REWARD:
            raise BadEventError(
                f"reward {event.reward:g} for trajectory {event.traj_id} (scorer "
                f"{event.scorer!r}) is beyond +-{MAX_ABS_REWARD:g}, which overflows the training "
                "math; scale rewards in the reward function")
        if is_reward and self.reward_weights and event.scorer not in self.reward_weights:
            state.ignored_rewards += 1
            return ()
        if is_reward and not self.reward_weights:
            self._note_scorer(state, event.scorer)
        # Trajectories and rewards travel on different topics: either may come first.
        group = state.pending.get(group_id)
        if group is None:
            group = state.pending[group_id] = _PendingGroup(first_seen=self._clock())
        if isinstance(event, TrajectoryEvent):
            group.group_size = event.group_size
            group.trajectories.setdefault(event.traj_id, event)
            group.last_traj_at = max(group.last_traj_at, event.produced_at)
            if group.all_present_at is None and group.trajectories_complete():
                group.all_present_at = self._clock()
        else:
            key = (event.traj_id, event.scorer if self.reward_weights else _ANY)
            if key in group.rewards:
                state.duplicate_rewards += 1
            else:
                group.rewards[key] = event.reward
                group.reward_at[key] = event.produced_at
        group.first_offsets.setdefault((source.topic, source.partition), source.offset)
        if not group.trajectories_complete() or group.missing(self.sources):
            return ()
        # Built before the group leaves state: if shaping raises, the event is dead-
        # lettered and the group stays pending; the reward timeout then drops it with
        # the reason (_on_reward_timeout).
        try:
            sample = self._sample(group)
        except AlgorithmInputError as exc:
            raise BadEventError(f"group {group_id} cannot be built: {exc}") from exc
        self._finish(state, group_id, sample)
        return (sample,)

    def _note_scorer(self, state: AdvantageState, scorer: str) -> None:
        """Without weights, "first reward wins" races the sources against each other (a
        leftover external service against the built-in scorer): say so once per scorer."""
        seen = state.scorers_seen
        if not seen:
            seen.append(scorer)
            return
        if scorer == seen[0]:
            return
        state.mixed_scorers += 1
        if scorer not in seen:
            seen.append(scorer)
            log.warning("rewards from scorers %s reach this run without advantage.reward_weights:"
                        " the first reward of each trajectory wins, whichever source sent it; set"
                        " advantage.reward_weights (e.g. {%s: 1.0}) or stop the extra source",
                        ", ".join(repr(s) for s in seen), seen[0])

    # ----------------------------------------------------------------------- building

    def _raw_reward(self, group: _PendingGroup, traj_id: str, fill_missing: bool) -> float:
        if not self.reward_weights:
            if fill_missing:
                return group.rewards.get((traj_id, _ANY), 0.0)
            return group.rewards[(traj_id, _ANY)]
        scores = {s: group.rewards[(traj_id, s)] for s in self.sources
                  if (traj_id, s) in group.rewards}
        if fill_missing:
            scores = {s: scores.get(s, 0.0) for s in self.sources}
        return weighted_reward(scores, self.reward_weights)

    def _sample(self, group: _PendingGroup, fill_missing: bool = False) -> SampleEvent:
        try:
            return self._build(group, fill_missing)
        except AlgorithmInputError:
            raise
        except ArithmeticError as exc:  # e.g. an overflow in the group statistics
            raise AlgorithmInputError(f"{type(exc).__name__}: {exc}") from exc

    def _build(self, group: _PendingGroup, fill_missing: bool) -> SampleEvent:
        trajs = sorted(group.trajectories.values(), key=lambda t: t.sample_index)
        raw = [self._raw_reward(group, t.traj_id, fill_missing) for t in trajs]
        if self.overlong is not None:
            max_new, tail, factor = self.overlong
            # Response length as AReaL counts it: the trained (loss-mask) tokens.
            raw = [r + overlong_penalty(sum(t.loss_mask) if t.loss_mask else len(t.output_ids),
                                        max_new_tokens=max_new, overlong_tokens=tail,
                                        overlong_penalty_factor=factor)
                   for r, t in zip(raw, trajs)]
        shaped = [shape_reward(r, bias=self.reward_bias, scale=self.reward_scaling,
                               clip=self.reward_clip) for r in raw]
        # On the shaped rewards: reward_norm maps equal rewards to equal values, so the
        # decision is the same, and the reason can show the reward as scored.
        filtered = self.dynamic_sampling and max(shaped) == min(shaped)
        normed = normalize_rewards(shaped, **self.reward_norm) if self.reward_norm else shaped
        if filtered or self.estimator == "gae":
            advantages = [0.0] * len(shaped)
        else:
            # Trained tokens per sample: the weights of adv_norm.group_unit token (AReaL's).
            counts = [sum(t.loss_mask) if t.loss_mask else len(t.output_ids) for t in trajs]
            advantages = normalize_group(normed, **self.norm, token_counts=counts)
        norm_rewards = normed if self.reward_norm else [None] * len(shaped)
        if not all(math.isfinite(x) for x in (*shaped, *normed, *advantages)):
            raise AlgorithmInputError(
                f"shaped rewards {shaped} give non-finite normalised rewards or advantages")
        versions = [v for t in trajs for v in t.output_versions] or [0]
        first = trajs[0]
        return SampleEvent(
            group_id=first.group_id,
            prompt_id=first.prompt_id,
            prompt_ids=list(first.prompt_ids),
            sequences=[
                SampleSequence(traj_id=t.traj_id, output_ids=t.output_ids,
                               behav_logprobs=t.output_logprobs, output_versions=t.output_versions,
                               reward=r, advantage=a, loss_mask=t.loss_mask,
                               finish_reason=t.finish_reason,
                               turn_boundaries=list(t.turn_boundaries), norm_reward=nr,
                               images=list(t.images), routed_experts=t.routed_experts)
                for t, r, a, nr in zip(trajs, shaped, advantages, norm_rewards)
            ],
            group_index=first.group_index,
            min_version=min(versions),
            max_version=max(versions),
            estimator=self.estimator, adv_norm=self.norm_spec,
            reward_norm=self.reward_norm_spec,
            task=first.task,
            run_id=first.run_id,
            dropped_reason=(f"filtered: zero reward variance (all {round(shaped[0], 6)!r})"
                            if filtered else ""),
            reward_delay_s=max([0.0] + [t - group.last_traj_at for t in group.reward_at.values()]),
        )

    def _finish(self, state: AdvantageState, group_id: str, sample: SampleEvent) -> None:
        del state.pending[group_id]
        state.emitted.first(group_id)
        if sample.dropped_reason.startswith("filtered:"):
            state.groups_filtered += 1
        elif sample.dropped_reason:
            state.groups_dropped += 1
            state.dropped[group_id] = sample.dropped_reason
            if len(state.dropped) > state.emitted.capacity:
                state.dropped.popitem(last=False)
        else:
            state.groups_emitted += 1

    def _dropped(self, gid: str, group: _PendingGroup, reason: str) -> SampleEvent:
        first = next(iter(group.trajectories.values()), None)
        return SampleEvent(
            group_id=gid, prompt_id=first.prompt_id if first else "",
            prompt_ids=list(first.prompt_ids) if first else [], sequences=[],
            group_index=first.group_index if first else 0, estimator=self.estimator,
            adv_norm=self.norm_spec, reward_norm=self.reward_norm_spec,
            task=first.task if first else "",
            run_id=first.run_id if first else ANY_RUN, dropped_reason=reason)

    # ----------------------------------------------------------------------- timeouts

    def _on_reward_timeout(self, state: AdvantageState, gid: str,
                           group: _PendingGroup) -> SampleEvent:
        n = len(group.trajectories)
        missing = group.missing(self.sources)
        # Nothing missing: a complete group whose building failed (and was dead-lettered)
        # in handle(); it is retried once here and dropped with the reason if it fails.
        if self.missing_reward == "zero" or not missing:
            try:
                sample = self._sample(group, fill_missing=True)
            except AlgorithmInputError as exc:  # a bad shaping config: drop, say why
                return self._dropped(gid, group, f"reward timeout: cannot build the group: {exc}")
            state.groups_zero_filled += bool(missing)
            return sample
        what = ", ".join(f"{s} for {k} of {n} trajectories" for s, k in missing.items())
        if not self.reward_weights:
            what = f"rewards for {missing[_ANY]} of {n} trajectories"
        return self._dropped(gid, group, f"reward timeout after {self.reward_timeout_s:g} s: "
                                         f"missing {what}")

    def _warn_if_rewards_stall(self, state: AdvantageState, mono: float) -> None:
        """A dead reward service (or a scorer name no service publishes) otherwise
        shows only as a run that stops training until group_timeout_s drops it all."""
        waiting = [g for g in state.pending.values() if g.all_present_at is not None
                   and mono - g.all_present_at >= REWARD_WAIT_WARN_S and g.missing(self.sources)]
        state.waiting_for_rewards = len(waiting)
        if not waiting or (state.warned_at is not None
                           and mono - state.warned_at < REWARD_WAIT_WARN_EVERY_S):
            return
        state.warned_at = mono
        missing: dict[str, int] = {}
        for g in waiting:
            for source, n in g.missing(self.sources).items():
                missing[source] = missing.get(source, 0) + n
        named = ", ".join(f"{n} from {'any scorer' if s == _ANY else repr(s)}"
                          for s, n in sorted(missing.items()))
        then = (f"advantage.reward_timeout_s={self.reward_timeout_s:g} s then applies "
                f"missing_reward={self.missing_reward}" if self.reward_timeout_s is not None
                else f"they are dropped after advantage.group_timeout_s="
                     f"{self.group_timeout_s:g} s (set advantage.reward_timeout_s to act sooner)")
        log.warning("%d complete group(s) have waited over %.0f s for rewards (missing: %s): "
                    "is the reward scorer or your reward service running, publishing to this "
                    "run's rewards topic under the scorer names in advantage.reward_weights? "
                    "%s", len(waiting), REWARD_WAIT_WARN_S, named, then)

    def on_tick(self, state: AdvantageState, now: float) -> Iterable[Event]:
        mono = self._clock()
        self._warn_if_rewards_stall(state, mono)
        out = []
        for gid, group in list(state.pending.items()):
            if (self.reward_timeout_s is not None and group.all_present_at is not None
                    and mono - group.all_present_at >= self.reward_timeout_s):
                sample = self._on_reward_timeout(state, gid, group)
            elif mono - group.first_seen > self.group_timeout_s:
                sample = self._dropped(gid, group, (
                    f"timeout after {self.group_timeout_s:.0f} s: "
                    f"{len(group.trajectories)} of {group.group_size or '?'} "
                    f"trajectories, {len(group.rewards)} rewards"))
            else:
                continue
            self._finish(state, gid, sample)
            out.append(sample)
        return out

    def on_pause(self, state: AdvantageState, paused: bool) -> None:
        # Paused, the group's remaining events wait in Kafka: that time must not count
        # towards its timeouts, else the first tick after a resume ends groups whose
        # events were never read.
        now = self._clock()
        if paused:
            if state.paused_at is None:
                state.paused_at = now
            return
        if state.paused_at is None:
            return
        shift, state.paused_at = now - state.paused_at, None
        for group in state.pending.values():
            group.first_seen += shift
            if group.all_present_at is not None:
                group.all_present_at += shift

    def committable(self, state: AdvantageState, topic: str, partition: int, next_offset: int) -> int:
        floors = [g.first_offsets[(topic, partition)] for g in state.pending.values()
                  if (topic, partition) in g.first_offsets]
        return min(floors + [next_offset])

    def on_revoke(self, state: AdvantageState, partitions: list[tuple[str, int]]) -> None:
        # The new owner rebuilds these groups from the committed offsets.
        revoked = set(partitions)
        for gid in [g for g, grp in state.pending.items() if revoked & set(grp.first_offsets)]:
            del state.pending[gid]

    def describe(self, state: AdvantageState) -> dict[str, Any]:
        return {"pending_groups": len(state.pending), "emitted": state.groups_emitted,
                "dropped": state.groups_dropped, "filtered": state.groups_filtered,
                "zero_filled": state.groups_zero_filled,
                "duplicate_rewards": state.duplicate_rewards,
                "late_rewards": state.late_rewards, "ignored_rewards": state.ignored_rewards,
                "mixed_scorers": state.mixed_scorers,
                "waiting_for_rewards": state.waiting_for_rewards}
