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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import torch

from ..algorithms.stale_tokens import StaleCounts, stale_token_masks
from ..bus.role import DeadLetter, Role, Source
from ..config.algorithms import reward_norm_spec
from ..config.sections import TrainerSection
from ..schemas.envelope import Event
from ..schemas.errors import BadEventError, FatalRoleError, out_of_memory_error, storage_error
from ..schemas.events import (
    MetricsEvent,
    ProgressEvent,
    SampleEvent,
    WeightsAdapter,
    WeightsEvent,
    WeightsFile,
)
from ..weights import WeightPublisher
from ..weights.files import WEIGHTS_DIR
from ..weights.payload import version_path
from .batching import flatten_groups
from .checkpoint import (
    SUFFIX,
    TrainerProgress,
    load_state,
    refuse_legacy,
    save_state,
)
from .critic import Critic
from .final_model import FINAL_DIR, write_final_adapter, write_final_model
from .metrics_sink import MetricsSink
from .offline import OFFLINE_ETA
from .ppo_actor import PPOActor
from .reference import FrozenLogprobModel
from .sample_checks import check_made_for, check_routes, check_trainable
from .token_advantages import TokenAdvantages

log = logging.getLogger(__name__)


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


class Trainer(Role[TrainerState]):
    name = "trainer"
    group_inputs = ("samples",)
    recover_from = ("weights",)  # the log's highest version (recover)

    def __init__(self, section: TrainerSection, *, actor: PPOActor, critic: Critic | None = None,
                 reference: FrozenLogprobModel | None = None,
                 teacher: FrozenLogprobModel | None = None, member_id: str = "trainer",
                 keep_weight_versions: int = 8) -> None:
        """``section``: the run's trainer settings. ``actor``: the policy (PPOActor, or the
        sharded actor); ``critic`` / ``reference`` / ``teacher``: the models the token-level
        advantages need (``advantage.estimator`` gae / ``actor.kl_ctl`` > 0 /
        ``distill.kd_weight`` > 0), built by runtime/builders.py ``build_token_models``
        before the checkpoint is loaded (so a copied reference is the initial policy)."""
        self.actor = actor
        self.cfg = section
        self.member_id = member_id
        self.run_dir = Path(section.run_dir)
        self.ckpt_path = self.run_dir / "checkpoints" / f"trainer{SUFFIX}"
        self.keep_weight_versions = keep_weight_versions
        self.token_adv = TokenAdvantages(section, pad_token_id=actor.pad_token_id,
                                         device=actor.device, critic=critic,
                                         reference=reference, teacher=teacher)
        self.critic = critic
        self.sink = MetricsSink(self.run_dir / "metrics", section.stats_logger,
                                config=dataclasses.asdict(section))
        self.weights_dir = self.run_dir / WEIGHTS_DIR
        self._norm_spec = section.advantage.norm().spec()
        # actor.lora.enabled: every version is the adapter (docs/lora.md), a PEFT adapter
        # directory when it has a file, for the base model.path names (its identity).
        self.lora = section.lora
        self._lora_name = self.lora.name if self.lora is not None else ""
        adapter_files = None
        if self.lora is not None:
            from ..models.lora import adapter_config, adapter_config_bytes
            from ..weights.base_id import base_identity
            from ..weights.durable import AdapterFiles

            self._adapter_doc = adapter_config(rank=self.lora.rank, alpha=self.lora.alpha,
                                               targets=actor.lora_targets,
                                               base_model_path=section.model.path)
            adapter_files = AdapterFiles(self.lora.name, adapter_config_bytes(self._adapter_doc))
            self._base_id = base_identity(section.model.path)
        # How versions reach the engines (the weights section; docs/weight-sync.md).
        self.weights_out = WeightPublisher.from_config(
            section.weights, self.weights_dir, device=section.actor.device,
            publish_dtype=getattr(torch, section.model.dtype),
            keep_versions=keep_weight_versions, name=member_id, adapter=adapter_files)
        self._reward_norm_spec = reward_norm_spec(section.advantage.reward_norm)
        # Stale-token masking (actor.max_token_version_gap; algorithms/stale_tokens.py).
        # Offline the recorded versions count another trainer's steps: no gap to measure.
        self._stale_gap = (section.actor.max_token_version_gap
                           if section.max_head_offpolicyness < OFFLINE_ETA else None)
        # The facts a sample is checked against (sample_checks.py).
        model = actor.model
        sizes = [m.num_embeddings if hasattr(m, "num_embeddings") else m.out_features
                 for m in (model.get_input_embeddings(), model.get_output_embeddings())
                 if m is not None]
        self._vocab_size = min(sizes)
        self._max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        # R3: the routes a sample carries are checked against the model (and read from the
        # run's blob store when they are there).
        self._moe_shape = None
        if section.actor.moe.router_replay == "R3" and getattr(actor, "packed", None) is not None:
            from ..media.store import run_blob_store

            self._moe_shape = actor.packed.moe_shape
            self._blobs = run_blob_store(section.run_dir)

    # ------------------------------------------------------------------ start

    def init_state(self) -> TrainerState:
        progress = self.actor.load_checkpoint(self.ckpt_path)
        resumed = progress is not None
        if progress is None:
            progress = TrainerProgress()
        elif self.critic is not None:
            self._load_critic(progress.version)
        state = TrainerState(progress, set(progress.trained_groups), set(progress.rejected_groups))
        self._adopt_log(progress, state, resumed)
        for key, off in progress.offsets.items():
            topic, _, part = key.rpartition(":")
            state.handled_to[(topic, int(part))] = off
        state.unannounced = list(dict.fromkeys(progress.last_rejected_ids
                                               + progress.unannounced_rejections))
        # At start: the current version's bytes and progress (a restart names its last
        # rejections again, and the log may have lost the events of its last step).
        state.announce_progress = state.announce_weights = True
        state.done = progress.trained_steps >= self.cfg.total_train_steps
        self._resumed = resumed
        return state

    def _adopt_log(self, progress: TrainerProgress, state: TrainerState, resumed: bool) -> None:
        """A checkpoint made on another log (its bus run id differs: the broker lost the
        run's log and the launcher gave the run a new id, config/schema.py) resumes its
        model, optimizer and version, but its offsets belong to the old log's partitions:
        they are dropped, and the head gate counts from here (ProgressEvent.base_*)."""
        own = self.cfg.bus_run_id
        if not own:
            return
        from ..config.schema import split_bus_run_id

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

    def _publish_weights(self, state: TrainerState) -> WeightsEvent:
        """The bytes of the state's version, published over the transport."""
        p = state.progress
        # file: written (sha256) before the event; ipc / nccl: the file, if this version
        # gets one, is written in the background after the event (on_tick polls for it).
        fields = self.weights_out.publish(self.actor.publish_state_dict(), p.version)
        path = version_path(self.weights_dir, p.version, self._lora_name)
        p.weights_path, p.weights_sha256 = fields["path"] or str(path.resolve()), fields["sha256"]
        return WeightsEvent(version=p.version, **fields, files=self._take_files(state),
                            adapter=self._adapter(p.version))

    def _adapter(self, version: int) -> WeightsAdapter | None:
        """What a LoRA version's event says of its adapter (None: full weights)."""
        if self.lora is None:
            return None
        from ..weights.adapter_files import adapter_name

        return WeightsAdapter(name=adapter_name(self.lora.name, version), peft_type=self.lora.peft_type,
                              rank=self.lora.rank, alpha=float(self.lora.alpha),
                              target_modules=list(self.actor.lora_targets), base_id=self._base_id)

    def _announce(self, state: TrainerState) -> WeightsEvent:
        """The current version's bytes again (at start; with the durable files finished)."""
        p = state.progress
        fields = self.weights_out.announcement(p.version, p.weights_path, p.weights_sha256)
        if fields is None:  # its file is gone, or a restarted trainer's buffers are empty
            return self._publish_weights(state)
        return WeightsEvent(version=p.version, **fields, files=self._take_files(state),
                            adapter=self._adapter(p.version))

    def _progress(self, state: TrainerState) -> ProgressEvent:
        """The state's version, the groups that made it, the rejections not yet named,
        and the head gate's counts."""
        p = state.progress
        return ProgressEvent(version=p.version, group_ids=list(p.last_group_ids),
                             groups_rejected=len(state.rejected), rollbacks=p.rollbacks,
                             rejected_group_ids=self._take_unannounced(state, p),
                             base_steps=p.base_steps, base_rejected=p.base_rejected)

    @staticmethod
    def _take_files(state: TrainerState) -> list[WeightsFile]:
        taken, state.files_to_announce = state.files_to_announce, []
        return taken

    def _note_files(self, state: TrainerState, files) -> None:
        """Durable files the background writer finished: announced with the next event."""
        p = state.progress
        for f in files:
            if f.version == p.version:
                p.weights_path, p.weights_sha256 = f.path, f.sha256
            state.files_to_announce.append(WeightsFile(version=f.version, path=f.path,
                                                       sha256=f.sha256, num_bytes=f.num_bytes))

    @staticmethod
    def _take_unannounced(state: TrainerState, p: TrainerProgress) -> list[str]:
        taken, state.unannounced = state.unannounced, []
        p.last_rejected_ids = taken
        return taken

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
                self._reject(state, gid)
            raise
        if not new:
            state.duplicates += 1
            return ()
        state.routes_missing += routes_missing
        if event.dropped_reason:  # given up upstream; nothing to train
            self._reject(state, gid)
            state.rejected_dropped += 1
            return ()
        stale = self._too_stale(event, state.progress.version)
        if stale is not None:
            self._reject(state, gid)
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
            check_made_for(event, estimator=self.cfg.advantage.estimator,
                           norm_spec=self._norm_spec, reward_norm_spec=self._reward_norm_spec)
        except BadEventError as exc:
            state.dead_lettered_config += 1
            log.error("dead-lettered (%d so far): %s", state.dead_lettered_config, exc)
            raise
        if not event.dropped_reason:
            # Gate off (offline, trainers/offline.py): the recorded versions count the
            # online trainer's steps, so one ahead of this trainer's is no forgery.
            check_trainable(event, vocab_size=self._vocab_size, max_positions=self._max_positions,
                            version=state.progress.version,
                            recorded_versions=self.cfg.max_head_offpolicyness >= OFFLINE_ETA)
            self._check_images(event)
            if self._moe_shape is not None:
                return check_routes(event, moe_shape=self._moe_shape,
                                    missing=self.cfg.actor.moe.router_replay_missing, store=self._blobs)
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

    @staticmethod
    def _reject(state: TrainerState, gid: str) -> None:
        state.rejected.add(gid)
        state.unannounced.append(gid)
        state.announce_progress = True

    def _gate_buffer(self, state: TrainerState) -> None:
        """The tail gate over the groups waiting in the buffer, at the current version:
        a rollback (or any version change) while a group waits can push it over eta, and
        the guarantee (docs/design.md#3-policy-versions-and-the-staleness-window)
        is about the step that trains it, not its arrival."""
        keep, late = [], []
        for sample, src in state.buffer:
            if self._too_stale(sample, state.progress.version) is not None:
                self._reject(state, sample.group_id)
                state.rejected_stale += 1
                late.append((sample, src))
            else:
                keep.append((sample, src))
        state.buffer = keep
        state.pending += self._stale_letters(state, late, "the version moved while it waited")

    def _too_stale(self, sample: SampleEvent, version: int) -> str | None:
        """Why ``sample`` is past the tail gate at ``version`` (None: it may train). Online
        mode (agent.mode online): up to actor.late_reward_max_offpolicyness versions it
        trains, with decoupled PPO's behaviour-weight correction."""
        staleness, eta = version - sample.min_version, self.cfg.max_head_offpolicyness
        cap = self.cfg.actor.late_reward_max_offpolicyness if self.cfg.online else None
        bound = eta if cap is None else cap
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

    def _stale_letters(self, state: TrainerState, stale: list[tuple[SampleEvent, Source]],
                       why: str) -> list[DeadLetter]:
        """Online mode: a group past the bound is a real user's session: dead-lettered
        with the reason (a batch run only counts it, ``trainer/rejected_stale``)."""
        if not self.cfg.online:
            return []
        out = []
        for sample, src in stale:
            reason = self._too_stale(sample, state.progress.version) or why
            state.dead_lettered_stale += 1
            log.warning("dead-lettered: %s", reason)
            out.append(DeadLetter(sample, BadEventError(reason), src))
        return out

    def _step(self, state: TrainerState) -> list[Event | DeadLetter]:
        self._gate_buffer(state)
        if len(state.buffer) < self.cfg.prompts_per_step:
            return []  # the gate took some: wait for more (their rejection is announced)
        batch = state.buffer[: self.cfg.prompts_per_step]
        samples = [s for s, _ in batch]
        v_before = state.progress.version
        t0 = time.perf_counter()
        ready_at = time.time()  # the batch is complete: the step timeline's "trainer wait" ends
        try:
            items = flatten_groups(samples)
            stale = self._mask_stale_tokens(items, state.progress.version)
            token_metrics = self.token_adv.compute(items) if self.token_adv.active else {}
            t_adv = time.perf_counter() - t0
            result = self.actor.train_step(items, policy_version=state.progress.version)
            if self.critic is not None and result.applied_minibatches:
                token_metrics.update(self.critic.train_step(items))
        except Exception as exc:
            # Retrying the triggering event would lose the rest of the batch; a failed
            # step (bad loss config) needs a person: stop with the cause, uncommitted. Out
            # of memory has its own exit (EXIT_OOM): no restart, the launcher says what
            # lowers the memory (ops/role_main.py adds the planner's advice).
            oom = out_of_memory_error(exc, f"training step {v_before + 1} ran out of memory: ")
            if oom is not None:
                raise oom from exc
            raise FatalRoleError(f"training step {v_before + 1} failed: {type(exc).__name__}: "
                                 f"{exc}") from exc
        if self.cfg.release_memory_after_step and torch.cuda.is_available():
            # Sleep mode: the engine beside us takes its KV cache back for the next
            # version; what the step cached and freed goes back to the device first.
            torch.cuda.empty_cache()
        # Only a finished step consumes the batch (applied, or skipped as not finite); its
        # outcome goes into a draft of the state, committed once it is written.
        step = state.draft()
        step.buffer = step.buffer[self.cfg.prompts_per_step:]
        dead = self._dead_letter_skipped(step, batch, result, v_before)
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
        metrics = dict(result.metrics)
        metrics.update(token_metrics)
        metrics.update(stale.metrics(empty_minibatches=result.empty_minibatches,
                                     minibatches=result.applied_minibatches + result.skipped_minibatches))
        lags = [v_before - s.min_version for s in samples]
        metrics.update({
            "reward/mean": state.last_reward,
            "reward/max": max(rewards, default=0.0),
            "trainer/staleness_mean": sum(lags) / max(len(lags), 1),
            "trainer/staleness_max": float(max(lags, default=0)),
            "trainer/rejected_stale": float(state.rejected_stale),
            "trainer/rejected_dropped": float(state.rejected_dropped),
            "trainer/duplicates": float(state.duplicates),
            "trainer/dead_lettered": float(state.dead_lettered),
            "trainer/dead_lettered_config": float(state.dead_lettered_config),
            "trainer/skipped_steps": float(state.skipped_steps),
            "trainer/dead_lettered_stale": float(state.dead_lettered_stale),
            "trainer/trained_late": float(state.trained_late),
            "trainer/step_wall_s": time.perf_counter() - t0,
            # For the step timeline (ops/timeline.py): when the batch was complete (epoch
            # seconds) and the token-level advantages' time (then the actor's step, then
            # the publish: the weights event's produced_at).
            "trainer/batch_ready_at": ready_at,
            "trainer/token_advantages_s": t_adv,
            "trainer/mean_output_tokens": sum(len(q.output_ids) for s in samples for q in s.sequences)
            / max(len(rewards), 1),
        })
        if self._moe_shape is not None:
            metrics["trainer/routes_missing"] = float(state.routes_missing)
        for lag, count in sorted(state.staleness_hist.items()):
            metrics[f"trainer/staleness_hist/{lag}"] = float(count)
        self.sink.write(p.version, metrics)
        if p.trained_steps >= self.cfg.total_train_steps or (
                self.cfg.stop_at_reward is not None and state.last_reward >= self.cfg.stop_at_reward):
            state.done = True
        # The step's progress event names the rejections so far; more came only if some
        # of this batch was dead-lettered (announced on the next tick).
        state.announce_progress = bool(state.unannounced)
        return self._take_pending(state) + dead + [
            weights, progress, MetricsEvent(source=self.member_id, step=p.version, policy_version=p.version,
                                  metrics=metrics)]

    def _mask_stale_tokens(self, items: list, version: int) -> StaleCounts:
        """Take the tokens more than ``actor.max_token_version_gap`` versions behind
        ``version`` (the weights being trained) out of the items' loss masks, before the
        token advantages and the loss see them; they stay in the sequences as context."""
        masks, counts = stale_token_masks([it.versions for it in items], [it.loss_mask for it in items],
                                          version=version, max_gap=self._stale_gap)
        for it, mask in zip(items, masks):
            it.loss_mask = mask
        return counts

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
            weights = self._publish_weights(new)
            progress = self._progress(new)
            if regate:  # its rejections are named by the next progress event
                self._gate_buffer(new)
            if checkpoint:
                self._checkpoint(new)
        except FatalRoleError:
            raise
        except Exception as exc:
            raise storage_error(exc) or FatalRoleError(
                f"{what}: writing version {v} failed: {type(exc).__name__}: {exc}") from exc
        state.commit(new)
        return weights, progress

    @staticmethod
    def _take_pending(state: TrainerState) -> list[Event | DeadLetter]:
        taken, state.pending = state.pending, []
        return taken

    def _dead_letter_skipped(self, state: TrainerState, batch: list[tuple[SampleEvent, Source]],
                             result: Any, v_before: int) -> list[DeadLetter]:
        """Groups of minibatches whose optimizer step was skipped (loss or gradient norm
        not finite): dead-lettered, with where they were read, and rejected."""
        if not result.skipped_minibatches:
            return []
        if not result.applied_minibatches:
            state.skipped_steps += 1
        bad = [(s, src) for s, src in batch if s.group_id in result.skipped_group_ids]
        error = BadEventError(
            f"training step at version {v_before}: the loss or gradient norm was not finite, so "
            f"the optimizer step of {result.skipped_minibatches} minibatch(es) was skipped; its "
            f"{len(bad)} group(s) are dead-lettered (one or more carry values that overflow "
            "the loss: check behaviour logprobs and advantages)")
        log.error("%s", error)
        for s, _ in bad:
            state.dead_lettered += 1
            self._reject(state, s.group_id)
        return [DeadLetter(s, error, src) for s, src in bad]

    def _checkpoint(self, state: TrainerState) -> None:
        """Save the state's progress with the groups and offsets it covers. The state's
        progress takes the new offsets, which ``committable`` lets the bus commit, only once
        the file is saved: an offset is never committed past what a saved checkpoint
        covers (a save that fails, e.g. on a full disk, raises and changes nothing)."""
        offsets = dict(state.handled_to)
        for _, src in state.buffer:  # buffered groups must be read again after a restart
            key = (src.topic, src.partition)
            offsets[key] = min(offsets.get(key, src.offset), src.offset)
        p = replace(state.progress, trained_groups=sorted(state.trained),
                    rejected_groups=sorted(state.rejected),
                    unannounced_rejections=list(state.unannounced),
                    offsets={f"{t}:{part}": off for (t, part), off in offsets.items()})
        if self.critic is not None:
            # Before the trainer checkpoint: whichever version it names, its critic file exists.
            path = self._critic_path(p.version)
            save_state(path, model=self.critic.model, optimizer=self.critic.optimizer)
        self.actor.save_checkpoint(self.ckpt_path, p)
        state.progress = p
        if self.critic is not None:
            for old in path.parent.glob(f"critic_v*{SUFFIX}"):
                if old != path:
                    old.unlink(missing_ok=True)

    def _critic_path(self, version: int) -> Path:
        return self.ckpt_path.parent / f"critic_v{version:06d}{SUFFIX}"

    def _load_critic(self, version: int) -> None:
        path = self._critic_path(version)
        refuse_legacy(path)  # an old pickle is never loaded (trainers/checkpoint.py)
        if not path.exists():
            # E.g. a GRPO run resumed with estimator gae: the critic starts fresh.
            log.warning("no critic checkpoint %s for version %d; the critic starts from its "
                        "initial weights", path, version)
            return
        load_state(path, model=self.critic.model, optimizer=self.critic.optimizer)

    def on_tick(self, state: TrainerState, now: float) -> Iterable[Event]:
        self._note_files(state, self.weights_out.poll())
        if state.pending:  # instead of the announcements at start; they name the rejections so far
            state.announce_weights = False
            state.announce_progress = bool(state.unannounced)
            return self._take_pending(state)
        out: list[Event] = []
        # weights.v1 hears of a version already published only at start or when one of
        # its durable files is ready; progress.v1 of every change in the rejections.
        if state.announce_weights or state.files_to_announce:
            state.announce_weights = False
            out.append(self._announce(state))
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
        # transport, where the publish itself wrote them.
        if state.progress.weights_path and state.progress.version > 0:
            self._checkpoint(state)
        if state.done and state.progress.version > 0 and self.cfg.model.path:
            # The run's result as a Hugging Face directory, or a LoRA run's PEFT adapter
            # (trainers/final_model.py; `tapioca lora-merge` merges it into its base).
            dtype = getattr(torch, self.cfg.model.dtype)
            if self.lora is not None:
                write_final_adapter(self.actor.publish_state_dict(), self._adapter_doc,
                                    self.run_dir / FINAL_DIR, dtype=dtype)
            else:
                write_final_model(self.cfg.model.path, self.actor.full_state_dict(),
                                  self.run_dir / FINAL_DIR, dtype=dtype)
        try:
            # The final version gets its durable file (offline use) before the last event.
            self._note_files(state, self.weights_out.finish(state.progress.version))
            out: list[Event] = [self._announce(state)] if state.files_to_announce else []
            return out + ([self._progress(state)] if state.unannounced else [])
        finally:
            try:
                self.weights_out.close()
            finally:
                self.sink.close()

    def on_control(self, command, state: TrainerState) -> tuple[bool, str, list[Event]]:
        """Operator commands beyond pause / resume / drain (bus/fleet.py). ``rollback``
        (args ``version``, ``sha256``; sent by `tapioca weights rollback`): load that
        version's weights file (checksum verified) and publish it as the NEW version v+1
        with ``rollback_of`` set, so versions stay monotonic and the staleness rules hold;
        then checkpoint. Old files are deleted after ``keep_weight_versions`` versions.
        The actor's Adam state is reset; the critic (GAE) is restored from its checkpoint
        of that version when one exists, else keeps its weights with a fresh optimizer
        state (a warning says so; see :meth:`_rollback_critic`)."""
        from ..weights.payload import load_verified

        if command.command != "rollback":
            return super().on_control(command, state)
        try:
            target = int(command.args["version"])
            sha256 = str(command.args["sha256"])
        except (KeyError, TypeError, ValueError):
            return False, "rollback needs args version (int) and sha256 (of its weights file)", []
        p = state.progress
        if not 0 <= target < p.version:
            return False, (f"cannot roll back to version {target}: the current version is "
                           f"{p.version}; pick an earlier one (`tapioca weights list`)"), []
        path = version_path(self.weights_dir, target, self._lora_name)
        if not path.exists():
            return False, (f"the weights file of version {target} ({path}) is gone: the trainer "
                           f"keeps only the last keep_weight_versions={self.keep_weight_versions} "
                           "versions; roll back to a newer one"), []
        tensors = load_verified(path, sha256)  # a mismatch is a TapiocaError: ack ok=False
        own = self.actor.publish_state_dict()  # a LoRA run: the adapter, its versions' contents
        wrong = [k for k, t in tensors.items() if k not in own or own[k].shape != t.shape]
        if wrong or (self.lora is not None and set(own) != set(tensors)):
            wrong = wrong or sorted(set(own) ^ set(tensors))
            return False, (f"version {target}'s file does not fit the model ({len(wrong)} "
                           f"tensors, e.g. {wrong[0]}); was the model changed?"), []
        self.actor.load_publish_state_dict(tensors)
        # Adam's moments belong to the abandoned later versions and would push the restored
        # weights back toward them; the rolled-back policy starts them afresh.
        self.actor.optimizer.state.clear()
        critic_note = self._rollback_critic(target, p.version) if self.critic is not None else ""
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
        return (True, f"version {p.version} published with the weights of version {target}"
                f"{critic_note}", [*self._take_pending(state), weights, progress])

    def _rollback_critic(self, target: int, current: int) -> str:
        """Bring the critic back to ``target`` with the policy: its checkpoint of that
        version if one is on disk (only the newest is kept, so usually only when
        ``checkpoint_every_steps`` > 1 left later versions unsaved), else keep its
        weights but reset its Adam moments, which belong to the abandoned versions."""
        path = self._critic_path(target)
        if path.exists():
            load_state(path, model=self.critic.model, optimizer=self.critic.optimizer)
            return f"; critic restored from {path.name}"
        self.critic.optimizer.state.clear()
        log.warning("rollback to version %d: no critic checkpoint of that version (%s); the "
                    "critic keeps the weights it learned on versions %d..%d (now abandoned) "
                    "and restarts its optimizer state", target, path, target + 1, current)
        return (f"; no critic checkpoint of version {target}: the critic keeps its weights "
                "(learned on the abandoned versions), its optimizer state is reset")

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
