"""One trainer step's work on a full batch, between the trainer's gate and its publish.

Consumes the batch's ``SampleEvent`` groups (with the ``Source`` each was read from) at
the trainer's version: :func:`train_batch` flattens them into sequences, masks the tokens
too many versions behind (``actor.max_token_version_gap``, algorithms/stale_tokens.py),
computes the token-level advantages (trainers/token_advantages.py), and runs the actor's
step and then the critic's; a step that fails stops the trainer (``FatalRoleError``, or
``DeviceMemoryError`` when it ran out of device memory). Emits a :class:`BatchStep`, the
dead letters of groups whose minibatch was skipped as not finite
(:func:`dead_letter_skipped`), and the step's metrics (:func:`step_metrics`: the
``MetricsEvent.metrics`` on ``metrics.v1``, also written to ``metrics/metrics.jsonl``).
The trainer (trainers/trainer.py) versions, writes and publishes the outcome.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..algorithms.stale_tokens import StaleCounts, stale_token_masks
from ..bus.role import DeadLetter, Source
from ..schemas.errors import BadEventError, FatalRoleError, out_of_memory_error
from ..schemas.events import SampleEvent
from .batching import SeqItem, flatten_groups
from .critic import Critic
from .ppo_actor import StepResult
from .token_advantages import TokenAdvantages
from .trainer_state import TrainerState

log = logging.getLogger(__name__)


@dataclass
class BatchStep:
    result: StepResult  # the actor's (actor/* metrics; the minibatches applied or skipped)
    token_metrics: dict[str, float]  # the token-level advantages' and the critic's
    stale: StaleCounts  # the tokens stale-token masking took out of the loss
    t0: float  # the step's start (time.perf_counter)
    ready_at: float  # when the batch was complete (epoch seconds): the step timeline's "trainer wait" ends
    t_adv: float  # the token-level advantages' seconds


def train_batch(samples: list[SampleEvent], *, version: int, actor, critic: Critic | None,
                token_adv: TokenAdvantages, stale_gap: int | None, release_memory: bool) -> BatchStep:
    """Train the actor (then the critic) on ``samples`` at ``version`` (the weights being
    trained). ``stale_gap``: ``actor.max_token_version_gap`` (None: no masking);
    ``release_memory``: empty the device's cache after the step (sleep mode)."""
    t0 = time.perf_counter()
    ready_at = time.time()
    try:
        items = flatten_groups(samples)
        stale = mask_stale_tokens(items, version, stale_gap)
        token_metrics = token_adv.compute(items) if token_adv.active else {}
        t_adv = time.perf_counter() - t0
        result = actor.train_step(items, policy_version=version)
        if critic is not None and result.applied_minibatches:
            token_metrics.update(critic.train_step(items))
    except Exception as exc:
        # Retrying the triggering event would lose the rest of the batch; a failed
        # step (bad loss config) needs a person: stop with the cause, uncommitted. Out
        # of memory has its own exit (EXIT_OOM): no restart, the launcher says what
        # lowers the memory (ops/role_main.py adds the planner's advice).
        oom = out_of_memory_error(exc, f"training step {version + 1} ran out of memory: ")
        if oom is not None:
            raise oom from exc
        raise FatalRoleError(f"training step {version + 1} failed: {type(exc).__name__}: "
                             f"{exc}") from exc
    if release_memory and torch.cuda.is_available():
        # Sleep mode: the engine beside us takes its KV cache back for the next
        # version; what the step cached and freed goes back to the device first.
        torch.cuda.empty_cache()
    return BatchStep(result, token_metrics, stale, t0, ready_at, t_adv)


def mask_stale_tokens(items: list[SeqItem], version: int, max_gap: int | None) -> StaleCounts:
    """Take the tokens more than ``max_gap`` (``actor.max_token_version_gap``) versions
    behind ``version`` (the weights being trained) out of the items' loss masks, before the
    token advantages and the loss see them; they stay in the sequences as context."""
    masks, counts = stale_token_masks([it.versions for it in items], [it.loss_mask for it in items],
                                      version=version, max_gap=max_gap)
    for it, mask in zip(items, masks):
        it.loss_mask = mask
    return counts


def dead_letter_skipped(state: TrainerState, batch: list[tuple[SampleEvent, Source]],
                        result: StepResult, v_before: int) -> list[DeadLetter]:
    """Groups of minibatches whose optimizer step was skipped (loss or gradient norm
    not finite): dead-lettered, with where they were read, and rejected in ``state``."""
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
        state.reject(s.group_id)
    return [DeadLetter(s, error, src) for s, src in bad]


def step_metrics(state: TrainerState, samples: list[SampleEvent], v_before: int, step: BatchStep, *,
                 routes: bool) -> dict[str, float]:
    """The step's metrics once committed: ``samples`` are the groups it trained (the
    skipped minibatches' left out), at ``v_before``; ``routes``: R3 replay is on. Reads
    the state's counters, changes nothing."""
    result = step.result
    rewards = [seq.reward for s in samples for seq in s.sequences]
    metrics = dict(result.metrics)
    metrics.update(step.token_metrics)
    metrics.update(step.stale.metrics(empty_minibatches=result.empty_minibatches,
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
        "trainer/step_wall_s": time.perf_counter() - step.t0,
        # For the step timeline (ops/timeline.py): when the batch was complete (epoch
        # seconds) and the token-level advantages' time (then the actor's step, then
        # the publish: the weights event's produced_at).
        "trainer/batch_ready_at": step.ready_at,
        "trainer/token_advantages_s": step.t_adv,
        "trainer/mean_output_tokens": sum(len(q.output_ids) for s in samples for q in s.sequences)
        / max(len(rewards), 1),
    })
    if routes:
        metrics["trainer/routes_missing"] = float(state.routes_missing)
    for lag, count in sorted(state.staleness_hist.items()):
        metrics[f"trainer/staleness_hist/{lag}"] = float(count)
    return metrics
