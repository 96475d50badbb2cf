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
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from tapioca.bus.role import Role, Source
from tapioca.config.sections import TrainerSection
from tapioca.models.weight_files import save_weights
from tapioca.schemas.envelope import Event
from tapioca.schemas.errors import FatalRoleError
from tapioca.schemas.events import MetricsEvent, SampleEvent, WeightsEvent
from tapioca.trainers.batching import flatten_groups
from tapioca.trainers.checkpoint import TrainerProgress, load_checkpoint, save_checkpoint
from tapioca.trainers.metrics_sink import MetricsSink
from tapioca.trainers.ppo_actor import PPOActor


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
                 keep_weight_versions: int = 8) -> None:
        self.actor = actor
        self.cfg = section
        self.member_id = member_id
        self.run_dir = Path(section.run_dir)
        self.ckpt_path = self.run_dir / "checkpoints" / "trainer.pt"
        self.keep_weight_versions = keep_weight_versions
        self.sink = MetricsSink(self.run_dir / "metrics")

    # ------------------------------------------------------------------ start

    def init_state(self) -> TrainerState:
        progress = load_checkpoint(self.ckpt_path, self.actor.model, self.actor.optimizer)
        resumed = progress is not None
        if progress is None:
            progress = TrainerProgress()
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
        sha, size = save_weights({k: v.to(dtype) for k, v in self.actor.model.state_dict().items()}, path)
        p.weights_path, p.weights_sha256 = str(path.resolve()), sha
        old = self.run_dir / "weights" / f"v{p.version - self.keep_weight_versions:06d}.safetensors"
        if self.keep_weight_versions > 0 and p.version >= self.keep_weight_versions:
            old.unlink(missing_ok=True)
        return WeightsEvent(version=p.version, path=p.weights_path, sha256=sha, num_bytes=size,
                            step=p.version, group_ids=group_ids,
                            groups_rejected=len(state.rejected),
                            rejected_group_ids=self._take_unannounced(state, p))

    def _announce(self, state: TrainerState) -> WeightsEvent:
        p = state.progress
        if not p.weights_path or not Path(p.weights_path).exists():
            return self._publish_weights(state, [])
        return WeightsEvent(version=p.version, path=p.weights_path, sha256=p.weights_sha256,
                            step=p.version, group_ids=list(p.last_group_ids),
                            groups_rejected=len(state.rejected),
                            rejected_group_ids=self._take_unannounced(state, p))

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

    def _step(self, state: TrainerState) -> list[Event]:
        batch = state.buffer[: self.cfg.prompts_per_step]
        samples = [s for s, _ in batch]
        v_before = state.progress.version
        t0 = time.perf_counter()
        try:
            result = self.actor.train_step(flatten_groups(samples))
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
        save_checkpoint(self.ckpt_path, self.actor.model, self.actor.optimizer, p)

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

    def describe(self, state: TrainerState) -> dict[str, Any]:
        return {"version": state.progress.version, "buffered": len(state.buffer),
                "groups_consumed": len(state.trained) + len(state.rejected) + len(state.buffer),
                "rejected_stale": state.rejected_stale, "reward": state.last_reward}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
