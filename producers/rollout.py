"""The rollout worker: prompt groups in, one trajectory per completion out.

Consumes ``prompts.v1`` (consumer group: each group goes to one worker) and
``weights.v1`` (broadcast: every worker follows every version; the trainer's counts are
on ``progress.v1``, which a worker does not read).
Emits ``TrajectoryEvent`` on ``trajectories.v1``, keyed by ``group_id``;
``traj_id`` is ``{group_id}:{sample_index}``, so a redelivered prompt produces the
same identities and downstream de-duplication absorbs it. Each completion draws from a
sampling seed derived from the run's seed and its ``traj_id``, recorded on its trajectory
(``sampling_seed``; what `tapioca regenerate` replays, docs/provenance.md).

Generation runs asynchronously in the inference engine; the loop keeps polling.
A new version on ``weights.v1`` is fetched over the event's transport, verified
(weights/) and loaded between decode steps: in-flight sequences continue and
their later tokens carry the new version. Which weights event is loaded, refused or
dead-lettered is decided in weights/follow.py (shared with the agent proxy):
versions only go forward (weights/versions.py), so an event older than the loaded
version is dead-lettered, never loaded, and so is another claim of the loaded version.
Newer events are candidates, the highest loaded first: one that cannot be loaded (file
missing, checksum wrong) is retried with backoff by the bus, then dead-lettered, and the
next candidate is tried; the worker keeps the version it has meanwhile and goes on. A prompt
that can never be generated (token ids outside the vocabulary, too long, no samples) is
dead-lettered at once. A prompt is
not started before the worker has loaded the version the feeder admitted it under
(``admitted_at_version``): the head gate's bound assumes it, and without it a prompt
that overtakes its weights event is generated one version too old and later rejected as
over-stale. A prompt's offset is committed only after all its trajectories are delivered.

Routed experts (``rollout.return_routed_experts``, or ``actor.moe.router_replay`` R3): the
engine's routes of each completion ride on its trajectory (``routed_experts``, the compact
encoding of :mod:`tapioca.schemas.routes`), inline up to
``rollout.routed_experts_inline_max_bytes`` and otherwise in the run's blob store, written
before the trajectory is published. A completion the engine returns without routes goes
out without them (the trainer's ``actor.moe.router_replay_missing`` decides).

Fleet control: paused, the engine is paused too (the runner hands the worker no events
and no ticks, so nothing is published); draining, no waiting prompt is started and the
worker is drained once no generation is in flight (waiting prompts stay uncommitted,
so another member or a restart generates them).

Images (docs/vlm.md): a prompt's ``images`` (references by sha256) are fetched from the
image store and processed for the engine by ``images`` (runtime/builders.py); the
trajectories carry the same references. A prompt whose images cannot be used (a blob
missing from the store, corrupt bytes, placeholders that do not match them, or any image
for a model without a vision tower) is dead-lettered at once, like an impossible prompt.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from ..bus.dedup import SeenSet
from ..bus.role import DeadLetter, Role, Source
from ..config.sections import RolloutSection
from ..engines.base import GenRequest, GenResult, InferenceEngine, RequestImages, SamplingParams
from ..engines.sampling import request_seed
from ..schemas.envelope import Event
from ..schemas.errors import BadEventError, TapiocaError
from ..schemas.events import MetricsEvent, PromptEvent, TrajectoryEvent, WeightsEvent
from ..weights.follow import WeightsFollow

LoadWeights = Callable[[WeightsEvent], Any]
# A prompt's image references -> what the engine takes (runtime/builders.py).
PrepareImages = Callable[[list], RequestImages]


@dataclass
class _Group:
    prompt: PromptEvent
    source: Source
    # Empty while the prompt waits for the weights it was admitted under.
    futures: list[concurrent.futures.Future] = field(default_factory=list)
    published: set[int] = field(default_factory=set)
    # Wall-clock facts for the trajectories' timings (ops/timeline.py): when the group
    # went to the engine, and the weights switch it was generated after.
    submit_timings: dict[str, float] = field(default_factory=dict)


@dataclass
class RolloutState:
    # The following of weights.v1 (weights/follow.py): the loaded version and
    # the candidates, the first loaded on the next tick.
    weights: WeightsFollow
    inflight: dict[str, _Group] = field(default_factory=dict)
    seen_groups: SeenSet = field(default_factory=lambda: SeenSet(1_000_000))
    trajectories: int = 0
    tokens: int = 0
    window_start: float = field(default_factory=time.time)
    window_tokens: int = 0
    groups_done: int = 0
    draining: bool = False
    # version -> wall clock when its weights event arrived; the last switch's facts.
    weights_seen_at: dict[int, float] = field(default_factory=dict)
    last_switch: dict[str, float] = field(default_factory=dict)

    @property
    def loaded_version(self) -> int:
        return self.weights.loaded_version

    @property
    def candidates(self) -> list[tuple[WeightsEvent, Source | None]]:
        return self.weights.candidates

    @property
    def pending_weights(self) -> WeightsEvent | None:
        """The weights event the next tick loads (None: none newer than the loaded one)."""
        return self.weights.head


class RolloutWorker(Role[RolloutState]):
    name = "rollout"
    group_inputs = ("prompts",)
    broadcast_inputs = ("weights",)
    # The newest weights event is loaded at start; replaying every older version from
    # the broadcast topic would load files the trainer has long deleted.
    recover_from = ("weights",)

    def __init__(
        self,
        section: RolloutSection,
        *,
        engine: InferenceEngine,
        load_weights: LoadWeights,
        decode: Callable[[list[int]], str],
        member_id: str = "rollout",
        metrics_every_s: float = 10.0,
        images: PrepareImages | None = None,
    ) -> None:
        """``section``: the sampling defaults (``gconfig``; a prompt's ``sampling``
        overrides them). ``engine`` and ``load_weights`` (fetch, verify, load a weights
        event) come from runtime/builders.py; ``decode`` turns output ids into text.
        ``images``: a prompt's image references -> the engine's images (None: the model
        reads no images, and a prompt with some is dead-lettered)."""
        self.engine = engine
        self.prepare_images = images
        self.load_weights = load_weights
        self.sampling = SamplingParams.from_generation(section.gconfig)
        self.seed = section.seed
        self.decode = decode
        self.member_id = member_id
        self.metrics_every_s = metrics_every_s
        self.record_routes = section.record_routes
        self.routes_inline_max_bytes = section.rollout.routed_experts_inline_max_bytes
        self.blobs = None
        if section.record_routes and section.run_dir:
            from ..media.store import run_blob_store

            self.blobs = run_blob_store(section.run_dir)

    def init_state(self) -> RolloutState:
        return RolloutState(WeightsFollow("this rollout worker", loaded_version=self.engine.version))

    def recover(self, state: RolloutState, latest: list[Event]) -> None:
        state.weights.recover(latest)  # the newest version is loaded on the first tick

    # ------------------------------------------------------------------ events

    def handle(self, event: Event, state: RolloutState, source: Source) -> Iterable[Event]:
        if isinstance(event, WeightsEvent):
            if state.weights.replayed(event):
                return ()
            state.weights_seen_at.setdefault(event.version, time.time())
            return state.weights.offer(event, source)
        assert isinstance(event, PromptEvent)
        if event.group_id in state.seen_groups:
            return ()
        # Reject an impossible prompt now (dead-lettered at once by the bus: no retry
        # makes it possible), not after it has waited for its weights.
        try:
            if event.n_samples < 1:
                raise ValueError(f"n_samples is {event.n_samples}; a group needs >= 1")
            self.engine.validate(self._requests(event)[0])
        except (TapiocaError, TypeError, ValueError) as exc:
            raise BadEventError(f"prompt {event.group_id} cannot be generated: {exc}") from exc
        if event.admitted_at_version > state.loaded_version:
            # Waits for its weights: the next tick loads them (its faults are the weights
            # event's, retried and dead-lettered by the bus, not this prompt's).
            state.seen_groups.first(event.group_id)
            state.inflight[event.group_id] = _Group(event, source)
            return ()
        futures = self._submit(event)
        # Marked seen only once submitted: a submit that raises is retried, then
        # dead-lettered, by the bus; marking it first would swallow the retry.
        state.seen_groups.first(event.group_id)
        state.inflight[event.group_id] = _Group(event, source, futures, submit_timings=self._submitted(state))
        return ()

    @staticmethod
    def _submitted(state: RolloutState) -> dict[str, float]:
        """Timings of a group submitted now: ``submitted_at`` and, when this worker has
        switched weights, that switch (``weights_version``, ``weights_received_at``: the
        event's arrival, ``weights_loaded_at``, ``weights_switch_s``: the load's duration)."""
        return {"submitted_at": time.time(), **state.last_switch}

    def _requests(self, prompt: PromptEvent) -> list[GenRequest]:
        sampling = self._sampling_for(prompt)
        images = None
        if prompt.images:
            if self.prepare_images is None:
                raise ValueError(f"it has {len(prompt.images)} image(s) and this worker's model reads no "
                                 "images; serve a vision-language model (docs/vlm.md)")
            images = self.prepare_images(list(prompt.images))
        # Each completion's sampling seed from the run's seed and its trajectory id: the
        # same on a redelivery, and recorded on the trajectory (sampling_seed).
        return [GenRequest(f"{prompt.group_id}:{i}", list(prompt.prompt_ids),
                           replace(sampling, seed=request_seed(self.seed, f"{prompt.group_id}:{i}")), images)
                for i in range(prompt.n_samples)]

    def _submit(self, prompt: PromptEvent) -> list[concurrent.futures.Future]:
        # Together: the engine prefills the group's shared prompt once.
        return self.engine.submit_all(self._requests(prompt))

    def on_dead_letter(self, state: RolloutState, event: Event, error: BaseException) -> None:
        state.weights.forget(event)  # this worker keeps its version; the next candidate is tried

    def _sampling_for(self, prompt: PromptEvent) -> SamplingParams:
        return self.sampling.with_overrides(prompt.sampling)

    def on_tick(self, state: RolloutState, now: float) -> Iterable[Event | DeadLetter]:
        out: list[Event | DeadLetter] = []
        if state.pending_weights is not None:
            before, t0 = state.loaded_version, time.time()
            out += state.weights.load_head(self.load_weights)
            v = state.loaded_version
            if v != before:
                t1 = time.time()
                state.last_switch = {"weights_version": float(v),
                                     "weights_received_at": state.weights_seen_at.get(v, t0),
                                     "weights_loaded_at": t1, "weights_switch_s": t1 - t0}
                state.weights_seen_at = {k: t for k, t in state.weights_seen_at.items() if k > v}
        for group_id in list(state.inflight):
            group = state.inflight[group_id]
            if not group.futures:
                if state.draining or group.prompt.admitted_at_version > state.loaded_version:
                    continue
                group.futures = self._submit(group.prompt)
                group.submit_timings = self._submitted(state)
            for i, fut in enumerate(group.futures):
                if i in group.published or not fut.done():
                    continue
                out.append(self._trajectory(group.prompt, i, fut.result(), group.submit_timings))
                group.published.add(i)
                state.trajectories += 1
                n_tokens = len(out[-1].output_ids)
                state.tokens += n_tokens
                state.window_tokens += n_tokens
            if len(group.published) == len(group.futures):
                del state.inflight[group_id]
                state.groups_done += 1
        if now - state.window_start >= self.metrics_every_s:
            out.append(MetricsEvent(source=self.member_id, step=state.trajectories,
                                    policy_version=state.loaded_version, metrics={
                                        "rollout/tokens_per_s": state.window_tokens / (now - state.window_start),
                                        "rollout/inflight_groups": float(len(state.inflight)),
                                        "rollout/trajectories": float(state.trajectories),
                                    }))
            state.window_start, state.window_tokens = now, 0
        return out

    def _trajectory(self, prompt: PromptEvent, index: int, result: GenResult,
                    submit_timings: dict[str, float] | None = None) -> TrajectoryEvent:
        return TrajectoryEvent(
            traj_id=f"{prompt.group_id}:{index}",
            group_id=prompt.group_id,
            prompt_id=prompt.prompt_id,
            sample_index=index,
            group_size=prompt.n_samples,
            prompt_ids=list(prompt.prompt_ids),
            output_ids=list(result.output_ids),
            output_logprobs=[float(x) for x in result.output_logprobs],
            output_versions=list(result.output_versions),
            finish_reason=result.finish_reason,
            output_text=self.decode(result.output_ids),
            task=prompt.task,
            task_data=prompt.task_data,
            group_index=prompt.group_index,
            timings={**(submit_timings or {}), **{k: float(v) for k, v in result.timings.items()}},
            images=list(prompt.images),
            routed_experts=self._routes(result),
            sampling_seed=result.seed,
        )

    def _routes(self, result: GenResult):
        if not self.record_routes or result.routed_experts is None:
            return None
        from ..schemas.routes import encode_routes

        return encode_routes(result.routed_experts, inline_max_bytes=self.routes_inline_max_bytes,
                             store=self.blobs)

    def committable(self, state: RolloutState, topic: str, partition: int, next_offset: int) -> int:
        held = [g.source.offset for g in state.inflight.values()
                if g.source.topic == topic and g.source.partition == partition]
        return min(held) if held else next_offset

    def on_pause(self, state: RolloutState, paused: bool) -> None:
        # No point generating what cannot be published until a resume.
        (self.engine.pause if paused else self.engine.resume)()

    def on_drain(self, state: RolloutState) -> Iterable[Event]:
        state.draining = True
        return ()

    def drained(self, state: RolloutState) -> bool:
        return not any(group.futures for group in state.inflight.values())

    def on_stop(self, state: RolloutState) -> Iterable[Event]:
        # Unfinished groups are not committed: another member (or a restart) redoes them.
        self.engine.shutdown()
        return ()

    def describe(self, state: RolloutState) -> dict[str, Any]:
        # The engine's own health (a server engine's servers_up / servers_down) goes to
        # fleet.v1 with the rest.
        return {**self.engine.describe(), "version": state.loaded_version,
                "weight_load_failures": state.weights.load_failures,
                "inflight": len(state.inflight),
                "generating": sum(1 for g in state.inflight.values() if g.futures),
                "groups_done": state.groups_done, "trajectories": state.trajectories,
                "tokens": state.tokens,
                "weights_dead_lettered": state.weights.dead_lettered}
