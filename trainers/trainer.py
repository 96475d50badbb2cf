"""The trainer: training samples in, new policy versions out.

Consumes ``samples.v1`` (consumer group; one trainer member). Emits ``WeightsEvent``
on ``weights.v1`` (keyed by ``run_id``) after every step, and ``MetricsEvent`` on
``metrics.v1``.

- B groups (``train_dataset.prompts_per_step``) make one step; version v = steps done.
- Tail gate: a group whose staleness ``v - min(output_versions)`` exceeds eta
  (``rollout.max_head_offpolicyness``) is not trained. It stays in the log, is counted
  (``trainer/rejected_stale``), and its slot is freed at the feeder by re-announcing
  the current version with the new ``groups_rejected`` count.
- De-duplication by ``group_id`` against the groups trained or rejected so far, which
  the checkpoint records; offsets are committed only up to what the last checkpoint
  covers (and never past a buffered, untrained group), so a restart resumes exactly.
- A sample made for another advantage config (``SampleEvent.estimator``, ``adv_norm``
  or ``reward_norm`` differing from this trainer's ``advantage`` section) stops the trainer
  with a FatalRoleError, uncommitted: it would train silently wrong advantages.
- Token-level parts (:mod:`tapioca.trainers.token_advantages`): GAE with a critic,
  KL to a reference in the reward, batch-level normalisation, on-policy distillation.
  The critic trains after the policy on the same batch and is checkpointed with it
  (``checkpoints/critic_v<version>.pt``, written before ``trainer.pt``, so the file of
  the checkpointed version always exists).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from tapioca.bus.role import Role, Source
from tapioca.config.algorithms import reward_norm_spec
from tapioca.config.sections import TrainerSection
from tapioca.models.weight_files import save_weights
from tapioca.schemas.envelope import Event
from tapioca.schemas.errors import FatalRoleError
from tapioca.schemas.events import MetricsEvent, SampleEvent, WeightsEvent
from tapioca.trainers.batching import flatten_groups
from tapioca.trainers.checkpoint import TrainerProgress
from tapioca.trainers.critic import Critic
from tapioca.trainers.metrics_sink import MetricsSink
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.reference import FrozenLogprobModel
from tapioca.trainers.token_advantages import TokenAdvantages

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
    announce_rejections: bool = False
    unannounced: list[str] = field(default_factory=list)
    done: bool = False
    last_reward: float = 0.0


class Trainer(Role[TrainerState]):
    name = "trainer"
    group_inputs = ("samples",)

    def __init__(self, actor: PPOActor, section: TrainerSection, *, member_id: str = "trainer",
                 keep_weight_versions: int = 8, critic: Critic | None = None,
                 reference: FrozenLogprobModel | None = None,
                 teacher: FrozenLogprobModel | None = None) -> None:
        self.actor = actor
        self.cfg = section
        self.member_id = member_id
        self.run_dir = Path(section.run_dir)
        self.ckpt_path = self.run_dir / "checkpoints" / "trainer.pt"
        self.keep_weight_versions = keep_weight_versions
        # Built before init_state loads a checkpoint: a reference copied from the policy
        # is the initial policy.
        self.token_adv = TokenAdvantages.from_section(section, actor, critic=critic,
                                                      reference=reference, teacher=teacher)
        self.critic = self.token_adv.critic
        self.sink = MetricsSink(self.run_dir / "metrics")
        self._norm_spec = section.advantage.norm().spec()
        self._reward_norm_spec = reward_norm_spec(section.advantage.reward_norm)

    # ------------------------------------------------------------------ start

    def init_state(self) -> TrainerState:
        progress = self.actor.load_checkpoint(self.ckpt_path)
        resumed = progress is not None
        if progress is None:
            progress = TrainerProgress()
        elif self.critic is not None:
            self._load_critic(progress.version)
        state = TrainerState(progress, set(progress.trained_groups), set(progress.rejected_groups))
        for key, off in progress.offsets.items():
            topic, _, part = key.rpartition(":")
            state.handled_to[(topic, int(part))] = off
        state.unannounced = list(dict.fromkeys(progress.last_rejected_ids
                                               + progress.unannounced_rejections))
        state.announce_rejections = True  # announce the current version at start
        state.done = progress.version >= self.cfg.total_train_steps
        self._resumed = resumed
        return state

    def _publish_weights(self, state: TrainerState, group_ids: list[str]) -> WeightsEvent:
        p = state.progress
        path = self.run_dir / "weights" / f"v{p.version:06d}.safetensors"
        dtype = getattr(torch, self.cfg.model.dtype)
        sha, size = save_weights(self.actor.full_state_dict(), path, dtype=dtype)
        p.weights_path, p.weights_sha256 = str(path.resolve()), sha
        old = self.run_dir / "weights" / f"v{p.version - self.keep_weight_versions:06d}.safetensors"
        if self.keep_weight_versions > 0 and p.version >= self.keep_weight_versions:
            old.unlink(missing_ok=True)
        return WeightsEvent(version=p.version, path=p.weights_path, sha256=sha, num_bytes=size,
                            step=p.version, group_ids=group_ids,
                            groups_rejected=len(state.rejected), rollbacks=p.rollbacks,
                            rejected_group_ids=self._take_unannounced(state, p))

    def _announce(self, state: TrainerState) -> WeightsEvent:
        p = state.progress
        if not p.weights_path or not Path(p.weights_path).exists():
            return self._publish_weights(state, [])
        return WeightsEvent(version=p.version, path=p.weights_path, sha256=p.weights_sha256,
                            step=p.version, group_ids=list(p.last_group_ids),
                            groups_rejected=len(state.rejected), rollbacks=p.rollbacks,
                            rejected_group_ids=self._take_unannounced(state, p))

    @staticmethod
    def _take_unannounced(state: TrainerState, p: TrainerProgress) -> list[str]:
        taken, state.unannounced = state.unannounced, []
        p.last_rejected_ids = taken
        return taken

    # ------------------------------------------------------------------ events

    def handle(self, event: Event, state: TrainerState, source: Source) -> Iterable[Event]:
        assert isinstance(event, SampleEvent)
        self._check_made_for_me(event)
        state.handled_to[(source.topic, source.partition)] = source.offset + 1
        gid = event.group_id
        if gid in state.trained or gid in state.rejected or any(
                s.group_id == gid for s, _ in state.buffer):
            state.duplicates += 1
            return ()
        if event.dropped_reason:  # given up upstream; nothing to train
            state.rejected.add(gid)
            state.unannounced.append(gid)
            state.rejected_dropped += 1
            state.announce_rejections = True
            return ()
        staleness = state.progress.version - event.min_version
        if staleness > self.cfg.max_head_offpolicyness:
            state.rejected.add(gid)
            state.unannounced.append(gid)
            state.rejected_stale += 1
            state.announce_rejections = True
            return ()
        state.buffer.append((event, source))
        if len(state.buffer) < self.cfg.prompts_per_step or state.done:
            return ()
        return self._step(state)

    def _check_made_for_me(self, event: SampleEvent) -> None:
        """Samples normalised for another advantage config would train silently wrong
        (e.g. gae samples carry advantage 0, left to the trainer's GAE; a group-level
        processor with a batch-level trainer normalises twice): stop, uncommitted."""
        own = self.cfg.advantage.estimator
        if event.estimator != own:
            raise FatalRoleError(
                f"group {event.group_id} was made by an advantage processor with "
                f"advantage.estimator {event.estimator}, but this trainer's estimator is "
                f"{own}: the advantages mean something else here. Give the advantage "
                "processor and the trainer the same advantage section and restart them")
        if event.adv_norm and event.adv_norm != self._norm_spec:
            raise FatalRoleError(
                f"group {event.group_id} was normalised as '{event.adv_norm}' by the advantage "
                f"processor, but this trainer's advantage config gives '{self._norm_spec}' "
                "(advantage.adv_norm, or the estimator preset with advantage.eps / "
                "std_unbiased). Give both roles the same advantage section and restart them")
        if event.reward_norm and event.reward_norm != self._reward_norm_spec:
            raise FatalRoleError(
                f"group {event.group_id} had its rewards normalised as '{event.reward_norm}' "
                "by the advantage processor, but this trainer's advantage.reward_norm gives "
                f"'{self._reward_norm_spec}': its advantages (and GAE rewards) are on another "
                "scale. Give both roles the same advantage.reward_norm and restart them")

    def _step(self, state: TrainerState) -> list[Event]:
        batch = state.buffer[: self.cfg.prompts_per_step]
        samples = [s for s, _ in batch]
        v_before = state.progress.version
        t0 = time.perf_counter()
        try:
            items = flatten_groups(samples)
            token_metrics = self.token_adv.compute(items) if self.token_adv.active else {}
            result = self.actor.train_step(items, policy_version=state.progress.version)
            if self.critic is not None:
                token_metrics.update(self.critic.train_step(items))
        except Exception as exc:
            # Retrying the triggering event would lose the rest of the batch; a failed
            # step (OOM, bad loss config) needs a person: stop with the cause, uncommitted.
            raise FatalRoleError(f"training step {v_before + 1} failed: {type(exc).__name__}: "
                                 f"{exc}") from exc
        # Only a successful step consumes the batch.
        state.buffer = state.buffer[self.cfg.prompts_per_step:]
        for s in samples:
            state.staleness_hist[v_before - s.min_version] += 1
        p = state.progress
        p.version += 1
        group_ids = [s.group_id for s in samples]
        state.trained.update(group_ids)
        p.last_group_ids = group_ids
        rewards = [seq.reward for s in samples for seq in s.sequences]
        state.last_reward = sum(rewards) / max(len(rewards), 1)
        weights = self._publish_weights(state, group_ids)
        if p.version % self.cfg.actor.checkpoint_every_steps == 0 or p.version >= self.cfg.total_train_steps:
            self._checkpoint(state)
        metrics = dict(result.metrics)
        metrics.update(token_metrics)
        metrics.update({
            "reward/mean": state.last_reward,
            "reward/max": max(rewards, default=0.0),
            "trainer/staleness_mean": sum(v_before - s.min_version for s in samples) / len(samples),
            "trainer/staleness_max": float(max(v_before - s.min_version for s in samples)),
            "trainer/rejected_stale": float(state.rejected_stale),
            "trainer/rejected_dropped": float(state.rejected_dropped),
            "trainer/duplicates": float(state.duplicates),
            "trainer/step_wall_s": time.perf_counter() - t0,
            "trainer/mean_output_tokens": sum(len(q.output_ids) for s in samples for q in s.sequences)
            / max(len(rewards), 1),
        })
        for lag, count in sorted(state.staleness_hist.items()):
            metrics[f"trainer/staleness_hist/{lag}"] = float(count)
        self.sink.write(p.version, metrics)
        if p.version >= self.cfg.total_train_steps or (
                self.cfg.stop_at_reward is not None and state.last_reward >= self.cfg.stop_at_reward):
            state.done = True
        state.announce_rejections = False
        return [weights, MetricsEvent(source=self.member_id, step=p.version,
                                      policy_version=p.version, metrics=metrics)]

    def _checkpoint(self, state: TrainerState) -> None:
        p = state.progress
        p.trained_groups = sorted(state.trained)
        p.rejected_groups = sorted(state.rejected)
        p.unannounced_rejections = list(state.unannounced)
        offsets = dict(state.handled_to)
        for _, src in state.buffer:  # buffered groups must be read again after a restart
            key = (src.topic, src.partition)
            offsets[key] = min(offsets.get(key, src.offset), src.offset)
        p.offsets = {f"{t}:{part}": off for (t, part), off in offsets.items()}
        if self.critic is not None:
            # Before trainer.pt: whichever version trainer.pt names, its critic file exists.
            path = self._critic_path(p.version)
            tmp = path.with_suffix(".tmp")
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.critic.state_dict(), tmp)
            os.replace(tmp, path)
        self.actor.save_checkpoint(self.ckpt_path, p)
        if self.critic is not None:
            for old in path.parent.glob("critic_v*.pt"):
                if old != path:
                    old.unlink(missing_ok=True)

    def _critic_path(self, version: int) -> Path:
        return self.ckpt_path.parent / f"critic_v{version:06d}.pt"

    def _load_critic(self, version: int) -> None:
        path = self._critic_path(version)
        if not path.exists():
            # E.g. a GRPO run resumed with estimator gae: the critic starts fresh.
            log.warning("no critic checkpoint %s for version %d; the critic starts from its "
                        "initial weights", path, version)
            return
        self.critic.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    def on_tick(self, state: TrainerState, now: float) -> Iterable[Event]:
        if state.announce_rejections:
            state.announce_rejections = False
            return (self._announce(state),)
        return ()

    def committable(self, state: TrainerState, topic: str, partition: int, next_offset: int) -> int:
        return state.progress.offsets.get(f"{topic}:{partition}", 0)

    def finished(self, state: TrainerState) -> bool:
        return state.done

    def on_stop(self, state: TrainerState) -> Iterable[Event]:
        # A clean stop (SIGTERM, done, stop_at_reward) leaves no published version
        # uncovered by a checkpoint, whatever actor.checkpoint_every_steps says.
        final = [self._announce(state)] if state.unannounced else []
        if state.progress.weights_path and state.progress.version > 0:
            self._checkpoint(state)
        self.sink.close()
        return final

    def on_control(self, command, state: TrainerState) -> tuple[bool, str, list[Event]]:
        """Operator commands beyond pause / resume / drain (bus/fleet.py). ``rollback``
        (args ``version``, ``sha256``; sent by `tapioca weights rollback`): load that
        version's weights file (checksum verified) and publish it as the NEW version v+1
        with ``rollback_of`` set, so versions stay monotonic and the staleness rules hold;
        then checkpoint. Old files are deleted after ``keep_weight_versions`` versions.
        The actor's Adam state is reset; the critic (GAE) is restored from its checkpoint
        of that version when one exists, else keeps its weights with a fresh optimizer
        state (a warning says so; see :meth:`_rollback_critic`)."""
        from tapioca.models.weight_files import load_verified

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
        path = self.run_dir / "weights" / f"v{target:06d}.safetensors"
        if not path.exists():
            return False, (f"the weights file of version {target} ({path}) is gone: the trainer "
                           f"keeps only the last keep_weight_versions={self.keep_weight_versions} "
                           "versions; roll back to a newer one"), []
        tensors = load_verified(path, sha256)  # a mismatch is a TapiocaError: ack ok=False
        own = self.actor.full_state_dict()
        wrong = [k for k, t in tensors.items() if k not in own or own[k].shape != t.shape]
        if wrong:
            return False, (f"version {target}'s file does not fit the model ({len(wrong)} "
                           f"tensors, e.g. {wrong[0]}); was the model changed?"), []
        self.actor.load_full_state_dict(tensors)
        # Adam's moments belong to the abandoned later versions and would push the restored
        # weights back toward them; the rolled-back policy starts them afresh.
        self.actor.optimizer.state.clear()
        critic_note = self._rollback_critic(target, p.version) if self.critic is not None else ""
        p.version += 1
        p.rollbacks += 1  # a version that trained no batch: the head gate must not count it
        p.last_group_ids = []
        weights = self._publish_weights(state, [])
        weights.rollback_of = target
        self._checkpoint(state)
        # The rollback's version counts like a step, so it can reach the step budget.
        if p.version >= self.cfg.total_train_steps:
            state.done = True
        return (True, f"version {p.version} published with the weights of version {target}"
                f"{critic_note}", [weights])

    def _rollback_critic(self, target: int, current: int) -> str:
        """Bring the critic back to ``target`` with the policy: its checkpoint of that
        version if one is on disk (only the newest is kept, so usually only when
        ``checkpoint_every_steps`` > 1 left later versions unsaved), else keep its
        weights but reset its Adam moments, which belong to the abandoned versions."""
        path = self._critic_path(target)
        if path.exists():
            self.critic.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
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
                "rejected_stale": state.rejected_stale, "reward": state.last_reward}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
