"""The trainer: training samples in, new policy versions out.

Consumes ``samples.v1`` (consumer group; one trainer member). Emits, keyed by ``run_id``:
``WeightsEvent`` on ``weights.v1`` (the bytes of each new version, and again only when a
durable file for a version is ready, or at start), ``ProgressEvent`` on ``progress.v1``
(the version, the trained and rejected groups, the head gate's counts: with every new
version, whenever the rejected groups change, and at start), and ``MetricsEvent`` on
``metrics.v1``.

- B groups (``train_dataset.prompts_per_step``) make one step; version v = steps done,
  and rollbacks (versions that republish earlier weights); the run is done when the
  trained steps (``TrainerProgress.trained_steps``) reach ``total_train_steps`` (an
  operator's rollback to the last version ends it too, :meth:`Trainer.on_control`).
- Tail gate: a group whose staleness ``v - min(output_versions)`` exceeds eta
  (``rollout.max_head_offpolicyness``) is not trained. It stays in the log, is counted
  (``trainer/rejected_stale``), and its slot is freed at the feeder by the next progress
  event, which names it (``rejected_group_ids``).
- De-duplication by ``group_id`` against the groups trained or rejected so far, which
  the checkpoint records; offsets are committed only up to what the last checkpoint
  covers (and never past a buffered, untrained group), so a restart resumes exactly.
- Tail gate at training time too: the buffer is gated again before every step (a
  rollback bumps the version while groups wait), so no group trains beyond eta.
- Online mode (``agent.mode: online``, docs/online.md): a group past eta is a real
  user's session whose reward may have come hours late. It trains with decoupled PPO's
  behaviour-weight correction while its staleness is at most
  ``actor.late_reward_max_offpolicyness`` (``trainer/trained_late``); beyond, or with
  that unset (the default), it is rejected and dead-lettered with the reason
  (``trainer/dead_lettered_stale``).
- A sample no step could use safely is dead-lettered (``BadEventError``), counted
  (``trainer/dead_lettered``) and its group rejected (its head-gate slot freed), and
  the trainer goes on (:mod:`tapioca.trainers.sample_checks`): token ids outside the
  vocabulary, numbers beyond float32-safe bounds, versions newer than the trainer's
  (negative staleness; except offline, with the gate off, where the versions are the
  online trainer's), a sample made for another advantage config
  (``SampleEvent.estimator``, ``adv_norm`` or ``reward_norm``; also counted as
  ``trainer/dead_lettered_config`` and logged as an error: it would train silently wrong
  advantages). With ``actor.moe.router_replay`` R3, routed experts that do not fit the model
  (an expert id out of range, another layer count or top-k, another token count) too; a
  sequence without its routes is dead-lettered with ``actor.moe.router_replay_missing``
  reject, else routed live and counted (``trainer/routes_missing``). Routes kept in the
  run's blob store are read at arrival (``sample_checks.check_routes``).
- A step whose loss or gradient norm is not finite is not applied: the optimizer step is
  skipped (``trainer/skipped_steps``), the batch's groups are dead-lettered and rejected,
  and the version does not move. A step that runs out of device memory stops the
  trainer with ``DeviceMemoryError`` (exit 71, not restarted), nothing committed.
- Token-level parts (:mod:`tapioca.trainers.token_advantages`): GAE with a critic,
  KL to a reference in the reward, batch-level normalisation, on-policy distillation.
  The critic trains after the policy on the same batch and is checkpointed with it
  (``checkpoints/critic_v<version>.safetensors``, written before
  ``trainer.safetensors``, so the file of the checkpointed version always exists).
- Checkpoints are safetensors + JSON (trainers/checkpoint.py): nothing is unpickled.
  Each records the bus run id whose log its offsets belong to; resumed on another log
  (a new broker lifetime), the offsets are dropped and the head-gate counts restart.
- A step computes, writes the version's weights file, writes the checkpoint, and only
  then commits the version, the trained groups, the buffer and the offsets, and sends
  the weights and progress events (:meth:`Trainer._write_version`). A write that fails (a full disk:
  ``StorageError``, ``No space left on device writing <path>``) changes none of them and
  stops the trainer (not retried); the launcher prints the reason. A version is
  re-announced only with its own file (weights/publisher.py).
- At start the trainer reads the highest version on ``weights.v1``: a checkpoint below
  it publishes its weights above it, as a rollback does (:meth:`Trainer.recover`).
- A finished run (``total_train_steps`` or ``stop_at_reward``) leaves ``final/``, a
  Hugging Face directory of the trained policy (trainers/final_model.py).

This module handles the events; the parts are in their own modules: the state
(trainers/trainer_state.py), the sample checks and the staleness bound
(trainers/admission.py), a step's work and metrics (trainers/batch_step.py), what a
version publishes, full weights or a LoRA adapter, as one payload object
(trainers/publishing.py), the checkpoints (trainers/checkpointing.py) and an operator's
rollback (trainers/rollback.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Iterable

from ..bus.role import DeadLetter, Role, Source
from ..config.sections import TrainerSection
from ..schemas.envelope import Event
from ..schemas.errors import BadEventError, FatalRoleError, storage_error
from ..schemas.events import MetricsEvent, ProgressEvent, SampleEvent, WeightsEvent
from ..weights.files import WEIGHTS_DIR
from .admission import Admission
from .batch_step import dead_letter_skipped, step_metrics, train_batch
from .checkpointing import TrainerCheckpoints
from .critic import Critic
from .metrics_sink import MetricsSink
from .offline import OFFLINE_ETA
from .ppo_actor import PPOActor
from .publishing import policy_payload
from .reference import FrozenLogprobModel
from .rollback import restore_version
from .token_advantages import TokenAdvantages
from .trainer_state import TrainerState

__all__ = ["Trainer", "TrainerState", "read_metrics"]

log = logging.getLogger(__name__)


class Trainer(Role[TrainerState]):
    name = "trainer"
    group_inputs = ("samples",)
    recover_from = ("weights",)  # the log's highest version (recover)

    def __init__(self, section: TrainerSection, *, actor: PPOActor, critic: Critic | None = None,
                 reference: FrozenLogprobModel | None = None,
                 teacher: FrozenLogprobModel | None = None, member_id: str = "trainer") -> None:
        """``section``: the run's trainer settings. ``actor``: the policy (PPOActor, or the
        sharded actor); ``critic`` / ``reference`` / ``teacher``: the models the token-level
        advantages need (``advantage.estimator`` gae / ``actor.kl_ctl`` > 0 /
        ``distill.kd_weight`` > 0), built by runtime/builders.py ``build_token_models``
        before the checkpoint is loaded (so a copied reference is the initial policy)."""
        self.actor = actor
        self.cfg = section
        self.member_id = member_id
        self.run_dir = Path(section.run_dir)
        self.token_adv = TokenAdvantages(section, pad_token_id=actor.pad_token_id,
                                         device=actor.device, critic=critic,
                                         reference=reference, teacher=teacher)
        self.critic = critic
        self.sink = MetricsSink(self.run_dir / "metrics", section.stats_logger,
                                config=dataclasses.asdict(section))
        self.checkpoints = TrainerCheckpoints(self.run_dir, actor=actor, critic=critic)
        # What a version publishes, full weights or a LoRA adapter (trainers/publishing.py).
        self.payload = policy_payload(section, actor, weights_dir=self.run_dir / WEIGHTS_DIR,
                                      name=member_id)
        # The sample checks and the tail gate's bound (trainers/admission.py).
        self.admission = Admission(section, actor)
        # Stale-token masking (actor.max_token_version_gap; algorithms/stale_tokens.py).
        # Offline the recorded versions count another trainer's steps: no gap to measure.
        self._stale_gap = (section.actor.max_token_version_gap
                           if section.max_head_offpolicyness < OFFLINE_ETA else None)

    # ------------------------------------------------------------------ start

    def init_state(self) -> TrainerState:
        state, _ = self.checkpoints.resume(self.cfg.bus_run_id)  # trainers/checkpointing.py
        # At start: the current version's bytes and progress (a restart names its last
        # rejections again, and the log may have lost the events of its last step).
        state.announce_progress = state.announce_weights = True
        state.done = state.progress.trained_steps >= self.cfg.total_train_steps
        return state

    def recover(self, state: TrainerState, latest: list[Event]) -> None:
        """Resume above the log's highest version. A checkpoint below it (the newest
        versions were published but never checkpointed: ``actor.checkpoint_every_steps`` >
        1 and a crash, or a checkpoint restored from a copy) must neither publish those
        versions again with other weights nor wait on samples made by newer weights (the
        rollout workers refuse an older version, ``check_trainable`` a sample newer than
        the trainer: the run would stall for good). As a rollback does, the checkpoint's
        weights are published as the version above the highest (``rollback_of`` = the
        checkpoint's version; the versions skipped count as rollbacks, so the head gate
        still counts the steps this model trained), and checkpointed. The lost steps'
        groups are read again: no offset was committed past the checkpoint."""
        p = state.progress
        highest = max((e.version for e in latest if isinstance(e, WeightsEvent)), default=-1)
        if highest <= p.version:
            return
        log.warning("the checkpoint is at version %d but version %d is on %s (published, then "
                    "lost before a checkpoint): publishing the checkpoint's weights as version %d",
                    p.version, highest, "weights.v1", highest + 1)
        new = state.draft()
        new.progress.version = highest + 1
        new.progress.rollbacks += highest + 1 - p.version
        new.progress.last_group_ids = []
        weights, progress = self._write_version(state, new, f"resuming above version {highest}",
                                                checkpoint=True, regate=True)
        weights.rollback_of = p.version
        state.pending += [weights, progress]  # published on the first tick (or with the first step)
        # The republished versions are no trained steps: a trainer restarted without a
        # checkpoint trains on to total_train_steps (issue 37: it used to finish here).
        state.done = state.progress.trained_steps >= self.cfg.total_train_steps

    def _progress(self, state: TrainerState) -> ProgressEvent:
        """The state's version, the groups that made it, the rejections not yet named,
        and the head gate's counts."""
        p = state.progress
        return ProgressEvent(version=p.version, group_ids=list(p.last_group_ids),
                             groups_rejected=len(state.rejected), rollbacks=p.rollbacks,
                             rejected_group_ids=state.take_unannounced(),
                             base_steps=p.base_steps, base_rejected=p.base_rejected)

    # ------------------------------------------------------------------ events

    def handle(self, event: Event, state: TrainerState, source: Source) -> Iterable[Event]:
        assert isinstance(event, SampleEvent)
        state.handled_to[(source.topic, source.partition)] = source.offset + 1
        gid = event.group_id
        new = not (gid in state.trained or gid in state.rejected
                   or any(s.group_id == gid for s, _ in state.buffer))
        try:
            routes_missing = self._admit(event, state)
        except BadEventError:
            # Dead-lettered by the bus; a new group is also rejected, which frees its
            # head-gate slot (if the feeder admitted it) and names it on the log.
            state.dead_lettered += 1
            if new:
                state.reject(gid)
            raise
        if not new:
            state.duplicates += 1
            return ()
        state.routes_missing += routes_missing
        if event.dropped_reason:  # given up upstream; nothing to train
            state.reject(gid)
            state.rejected_dropped += 1
            return ()
        stale = self.admission.too_stale(event, state.progress.version)
        if stale is not None:
            state.reject(gid)
            state.rejected_stale += 1
            return self._stale_letters(state, [(event, source)], stale)
        state.buffer.append((event, source))
        if len(state.buffer) < self.cfg.prompts_per_step or state.done:
            return ()
        return self._step(state)

    def _admit(self, event: SampleEvent, state: TrainerState) -> int:
        """Raise BadEventError for a sample this trainer must not train (sample_checks);
        the number of its sequences that will route live for want of their routes (R3)."""
        try:
            self.admission.made_for(event)
        except BadEventError as exc:  # another advantage config: trains silently wrong
            state.dead_lettered_config += 1
            log.error("dead-lettered (%d so far): %s", state.dead_lettered_config, exc)
            raise
        return 0 if event.dropped_reason else self.admission.trainable(event, state.progress.version)

    def _gate_buffer(self, state: TrainerState) -> None:
        """The tail gate over the groups waiting in the buffer, at the current version:
        a rollback (or any version change) while a group waits can push it over eta, and
        the guarantee (docs/design.md#3-policy-versions-and-the-staleness-window)
        is about the step that trains it, not its arrival."""
        keep, late = [], []
        for sample, src in state.buffer:
            if self.admission.too_stale(sample, state.progress.version) is not None:
                state.reject(sample.group_id)
                state.rejected_stale += 1
                late.append((sample, src))
            else:
                keep.append((sample, src))
        state.buffer = keep
        state.pending += self._stale_letters(state, late, "the version moved while it waited")

    def _stale_letters(self, state: TrainerState, stale: list[tuple[SampleEvent, Source]],
                       why: str) -> list[DeadLetter]:
        """Online mode: a group past the bound is a real user's session: dead-lettered
        with the reason (a batch run only counts it, ``trainer/rejected_stale``)."""
        if not self.cfg.online:
            return []
        out = []
        for sample, src in stale:
            reason = self.admission.too_stale(sample, state.progress.version) or why
            state.dead_lettered_stale += 1
            log.warning("dead-lettered: %s", reason)
            out.append(DeadLetter(sample, BadEventError(reason), src))
        return out

    # ------------------------------------------------------------------ step

    def _step(self, state: TrainerState) -> list[Event | DeadLetter]:
        self._gate_buffer(state)
        if len(state.buffer) < self.cfg.prompts_per_step:
            return []  # the gate took some: wait for more (their rejection is announced)
        batch = state.buffer[: self.cfg.prompts_per_step]
        samples = [s for s, _ in batch]
        v_before = state.progress.version
        work = train_batch(samples, version=v_before, actor=self.actor, critic=self.critic,
                           token_adv=self.token_adv, stale_gap=self._stale_gap,
                           release_memory=self.cfg.release_memory_after_step)
        result = work.result
        # Only a finished step consumes the batch (applied, or skipped as not finite); its
        # outcome goes into a draft of the state, committed once it is written.
        step = state.draft()
        step.buffer = step.buffer[self.cfg.prompts_per_step:]
        dead = dead_letter_skipped(step, batch, result, v_before)
        if not result.applied_minibatches:  # nothing to write: no new version
            state.commit(step)
            return dead + [MetricsEvent(source=self.member_id, step=v_before,
                                        policy_version=v_before, metrics={
                                            "trainer/skipped_steps": float(state.skipped_steps),
                                            "trainer/dead_lettered": float(state.dead_lettered)})]
        samples = [s for s in samples if s.group_id not in result.skipped_group_ids]
        for s in samples:
            step.staleness_hist[v_before - s.min_version] += 1
            step.trained_late += v_before - s.min_version > self.cfg.max_head_offpolicyness
        p = step.progress
        p.version += 1
        if not samples:
            # Some minibatch applied, but every group sat in a skipped one: a version that
            # trained no group, which the head gate must not count as a step (a rollback's
            # accounting; only with actor.ppo_n_minibatches > 1).
            p.rollbacks += 1
        group_ids = [s.group_id for s in samples]
        step.trained.update(group_ids)
        p.last_group_ids = group_ids
        rewards = [seq.reward for s in samples for seq in s.sequences]
        step.last_reward = sum(rewards) / max(len(rewards), 1)
        weights, progress = self._write_version(state, step, f"training step {p.version}")
        p = state.progress
        metrics = step_metrics(state, samples, v_before, work, routes=self.admission.moe_shape is not None)
        self.sink.write(p.version, metrics)
        if p.trained_steps >= self.cfg.total_train_steps or (
                self.cfg.stop_at_reward is not None and state.last_reward >= self.cfg.stop_at_reward):
            state.done = True
        # The step's progress event names the rejections so far; more came only if some
        # of this batch was dead-lettered (announced on the next tick).
        state.announce_progress = bool(state.unannounced)
        return state.take_pending() + dead + [
            weights, progress, MetricsEvent(source=self.member_id, step=p.version, policy_version=p.version,
                                  metrics=metrics)]

    # ------------------------------------------------------------------ publish

    def _write_version(self, state: TrainerState, new: TrainerState, what: str, *,
                       checkpoint: bool | None = None,
                       regate: bool = False) -> tuple[WeightsEvent, ProgressEvent]:
        """Make ``new`` (a draft of ``state`` with the next version, its
        ``last_group_ids`` set) the state: its weights file first, then (when due:
        ``actor.checkpoint_every_steps``, the last step, or ``checkpoint``) the checkpoint
        that covers it, and only then the commit of the version, the trained groups, the
        buffer and the offsets; the weights and progress events go out after that (the
        checkpoint records the rejections the progress event names, which a restart names
        again). A write that fails leaves ``state`` as it was and is fatal: the model in
        memory took a step no file holds, so the role stops (StorageError, with its
        one-line reason, for a full or failing disk) instead of being retried, which would
        see the batch's groups as trained. ``regate``: the tail gate again after the version
        moved (a rollback)."""
        v = new.progress.version
        if checkpoint is None:
            checkpoint = (v % self.cfg.actor.checkpoint_every_steps == 0
                          or v >= self.cfg.total_train_steps)
        try:
            weights = self.payload.publish(new)
            progress = self._progress(new)
            if regate:  # its rejections are named by the next progress event
                self._gate_buffer(new)
            if checkpoint:
                self.checkpoints.save(new)
        except FatalRoleError:
            raise
        except Exception as exc:
            raise storage_error(exc) or FatalRoleError(
                f"{what}: writing version {v} failed: {type(exc).__name__}: {exc}") from exc
        state.commit(new)
        return weights, progress

    def on_tick(self, state: TrainerState, now: float) -> Iterable[Event]:
        state.note_files(self.payload.out.poll())
        if state.pending:  # instead of the announcements at start; they name the rejections so far
            state.announce_weights = False
            state.announce_progress = bool(state.unannounced)
            return state.take_pending()
        out: list[Event] = []
        # weights.v1 hears of a version already published only at start or when one of
        # its durable files is ready; progress.v1 of every change in the rejections.
        if state.announce_weights or state.files_to_announce:
            state.announce_weights = False
            out.append(self.payload.announce(state))
        if state.announce_progress:
            state.announce_progress = False
            out.append(self._progress(state))
        return out

    def committable(self, state: TrainerState, topic: str, partition: int, next_offset: int) -> int:
        # Both bounds: what the last checkpoint covers (a restart resumes from there), and
        # what this process has handled (a resumed trainer that has not read up to its
        # checkpoint yet commits no further than it read).
        return min(next_offset, state.progress.offsets.get(f"{topic}:{partition}", 0))

    def finished(self, state: TrainerState) -> bool:
        return state.done

    def on_stop(self, state: TrainerState) -> Iterable[Event]:
        # A clean stop (SIGTERM, done, stop_at_reward) leaves no published version
        # uncovered by a checkpoint, whatever actor.checkpoint_every_steps says. The
        # checkpoint comes first: finishing the publisher waits for file writes (up to
        # minutes) and may fail, and neither may cost the trained steps. It loses
        # nothing: the final file's path / checksum matter on resume only for the file
        # transport, where the publish itself wrote them. A version whose checkpoint is
        # on disk already (the last step's, written by _write_version) is not written
        # again: the weights and optimizer are the same, and groups gated or read since
        # are read and gated again after a restart (their offsets were not committed). A
        # second write would need the disk for two (43 GB each at 3B, atomic rewrite).
        version = state.progress.version
        if state.progress.weights_path and version > 0 and self.checkpoints.saved_version != version:
            self.checkpoints.save(state)
        if state.done and state.progress.version > 0 and self.cfg.model.path:
            # The run's result in final/: a Hugging Face directory, or a LoRA run's PEFT
            # adapter (trainers/final_model.py; `tapioca lora-merge` merges it into its base).
            self.payload.write_final(self.run_dir)
        try:
            # The final version gets its durable file (offline use) before the last event.
            state.note_files(self.payload.out.finish(state.progress.version))
            out: list[Event] = [self.payload.announce(state)] if state.files_to_announce else []
            return out + ([self._progress(state)] if state.unannounced else [])
        finally:
            try:
                self.payload.out.close()
            finally:
                self.sink.close()

    def on_control(self, command, state: TrainerState) -> tuple[bool, str, list[Event]]:
        """Operator commands beyond pause / resume / drain (bus/fleet.py). ``rollback``
        (args ``version``, ``sha256``; sent by `tapioca weights rollback`): load that
        version's weights (trainers/rollback.py: checksum verified; the actor's Adam state
        reset, the critic restored from its checkpoint of that version or its optimizer
        state reset) and publish them as the NEW version v+1 with ``rollback_of`` set, so
        versions stay monotonic and the staleness rules hold; then checkpoint. Old files
        are deleted after ``weights.keep_versions`` versions."""
        if command.command != "rollback":
            return super().on_control(command, state)
        target, note = restore_version(command.args, current=state.progress.version, actor=self.actor,
                                       payload=self.payload, checkpoints=self.checkpoints,
                                       keep_versions=self.cfg.weights.keep_versions)
        if target is None:
            return False, note, []
        new = state.draft()
        new.progress.version += 1
        new.progress.rollbacks += 1  # a version that trained no batch: the head gate must not count it
        new.progress.last_group_ids = []
        # The version moves with no step: waiting groups may be over eta now (regate).
        weights, progress = self._write_version(state, new, f"rollback to version {target}",
                                                checkpoint=True, regate=True)
        weights.rollback_of = target
        p = state.progress
        # The rollback's version counts like a step, so it can reach the step budget.
        if p.version >= self.cfg.total_train_steps:
            state.done = True
        return (True, f"version {p.version} published with the weights of version {target}{note}",
                [*state.take_pending(), weights, progress])

    def describe(self, state: TrainerState) -> dict[str, Any]:
        return {"version": state.progress.version, "buffered": len(state.buffer),
                "groups_consumed": len(state.trained) + len(state.rejected) + len(state.buffer),
                # Of this bus run id's log: the launcher's count of what a lost log dropped.
                "groups_done_on_log": len(state.trained) + len(state.rejected)
                - state.progress.base_groups,
                "groups_trained": len(state.trained),
                "rejected_stale": state.rejected_stale, "rejected_dropped": state.rejected_dropped,
                "reward": state.last_reward,
                "dead_lettered": state.dead_lettered, "skipped_steps": state.skipped_steps}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
