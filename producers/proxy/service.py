"""What the agent proxy's routes call: engine, tokenizer, sessions, head gate, bus.

Consumes ``weights.v1`` and ``progress.v1`` (through
:class:`~tapioca.producers.proxy.gate.WeightsFollower` in a background thread) and the requests the routes of
:mod:`tapioca.producers.proxy.server` hand over; emits the ``TrajectoryEvent`` and
``RewardEvent`` batches of finished session groups (keyed by ``group_id``) with an
:class:`~tapioca.bus.producer.EventProducer`, retrying a batch the broker did not
confirm. Also renders chat messages to token ids and validates sampling fields.

Online mode (``agent.mode: online``, docs/online.md): sessions ended without a reward
publish their trajectories with none, to wait on the log; a reward after the end
(:mod:`tapioca.producers.proxy.delayed_rewards`) is published here. Admission: while the
head gate is closed a session start waits, gets 429 with ``Retry-After``, or is served
untrained (``proxy.admission``). A group that cannot be published (an event over
``bus.max_message_bytes``) is dead-lettered whole, with the reason, and its gate slot
freed; ``end`` says why.

Token limits: ``proxy.max_tokens_per_request`` bounds one call's prompt tokens +
n x max_tokens; ``proxy.max_tokens_per_session`` bounds the sum over a session's calls
of prompt tokens + generated tokens (each call's ``usage.total_tokens``), so a
multi-turn agent that re-sends a growing conversation uses it up, not only what the
model wrote.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from typing import Any, Callable

import orjson

from ...bus.dlq import dead_letter
from ...bus.producer import EventProducer
from ...bus.role import Source
from ...bus.runner import RoleRunner
from ...bus.settings import BusConfig
from ...config.sections import ProxySection
from ...engines.base import GenRequest, GenResult, InferenceEngine, SamplingParams
from ...media.images import AdmittedImages, ImageBusyError
from ...schemas.envelope import Event, encode_event
from ...schemas.errors import BusError, ConfigError, EngineError, SchemaError, TapiocaError
from ...schemas.events import TrajectoryEvent
from ...schemas.registry import topic_for
from .call_stats import CallStats
from .delayed_rewards import (
    EndedSession,
    EndedSessions,
    RewardCommands,
    SessionLog,
    check_reward,
    delayed_reward_events,
    reward_window_s,
)
from .gate import PROXY_PRODUCER_PREFIX, HeadGate, WeightsFollower, recover_admitted
from .images import busy as busy_images
from .openai_errors import ApiError, bad_request
from .responses import ResponseText
from .sessions import Ended, Session, SessionStore

log = logging.getLogger(__name__)

MAX_N = 64
MAX_STOP = 4


class ProxyService:
    """Everything behind the HTTP routes: engine, tokenizer, sessions, gate, bus.

    ``sampling`` holds the run's defaults (``gconfig``) for fields a request leaves out;
    ``load_weights(event)`` loads a weights event into ``engine`` (checksum-verified);
    ``max_context_tokens`` is the model's context (max_position_embeddings), None if
    unknown: a call past it is refused as ``context_length_exceeded``.
    """

    def __init__(self, section: ProxySection, *, engine: InferenceEngine, tokenizer: Any,
                 bus: BusConfig, load_weights: Callable[[Any], Any],
                 max_context_tokens: int | None = None, vision: Any = None,
                 images: Callable[[list], Any] | None = None) -> None:
        """``section``: the ``proxy`` settings (admin key, limits, sessions), the sampling
        defaults and group size (``gconfig``), the head gate's eta and B, the run id its
        group ids carry. ``engine`` / ``load_weights`` / ``tokenizer``: from
        runtime/builders.py; ``bus``: the run's. ``vision`` / ``images`` (a VL model's,
        runtime/builders.py ``vision_prompts`` / ``request_images``): image parts are
        stored and placeholders expanded / refs become the engine's images
        (producers/proxy/images.py); None: the model reads no images."""
        self.vision = vision
        self.request_images = images
        p, g = section.proxy, section.gconfig
        api_key = p.admin_key()
        if not api_key:
            raise ConfigError("the proxy needs an admin key (proxy.api_key)")
        self.engine = engine
        self.tokenizer = tokenizer
        self.bus = bus
        self.sampling = SamplingParams.from_generation(g)
        self.api_key = api_key
        self.served_model_name = p.served_model_name
        self.default_group_size = g.n_samples
        self.max_tokens_per_request = p.max_tokens_per_request
        self.max_request_bytes = p.max_request_bytes
        self.header_timeout_s = p.header_timeout_s
        self.keep_alive_timeout_s = p.keep_alive_timeout_s
        self.max_connections = p.max_connections
        self.session_ttl_s = p.session_ttl_s
        self.max_context_tokens = max_context_tokens
        self.text = ResponseText(tokenizer)
        self.template = getattr(tokenizer, "chat_template", None) or ""
        self.template_has_tools = "tools" in self.template
        self.gate = HeadGate(section.max_head_offpolicyness, section.prompts_per_step)
        self.online = section.online
        self.admission = section.admission
        self.retry_after_s = p.retry_after_s
        self.store = SessionStore(ttl_s=p.session_ttl_s, max_sessions=p.max_sessions,
                                  max_tokens_per_session=p.max_tokens_per_session,
                                  run_tag=section.run_id,
                                  decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                  default_mode=p.end_mode, default_discount=p.turn_discount,
                                  defer_unset_rewards=section.online)
        self.member_id = f"{PROXY_PRODUCER_PREFIX}-{secrets.token_hex(4)}"
        self.producer = EventProducer(bus, self.member_id)
        self._pub_lock = threading.Lock()
        self._unpublished: list[Event] = []
        self.runner = RoleRunner(WeightsFollower(self.gate, load_weights, lambda: engine.version),
                                 bus, member_id=self.member_id, group_id=f"{bus.topic_prefix}.proxy")
        # Ended sessions, for rewards after the end: followed from the log in online mode.
        self.ended = EndedSessions(reward_window_s(section.advantage))
        self.session_log = (SessionLog(bus, self.ended, PROXY_PRODUCER_PREFIX)
                            if section.online else None)
        self.sessions_runner = RoleRunner(
            RewardCommands(lambda sid, value: self.reward_after_end(sid, value, None),
                           self.session_counts),
            bus, member_id=f"{self.member_id}-sessions",
            group_id=f"{bus.topic_prefix}.proxy-sessions")
        # Groups that could not be published (group id -> why), and other counts.
        self.undeliverable: dict[str, str] = {}
        self.refused_starts = 0
        self.dead_lettered = 0
        # Call latency and 429s (the HTTP app's middleware counts them), in the status row.
        self.calls = CallStats()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.runner_error: BaseException | None = None
        # Called when the weights follower dies: a proxy that can no longer follow the
        # trainer must stop (its role fails visibly) rather than serve stale weights.
        self.on_fatal: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Recover k from the log, follow weights.v1, expire idle sessions; online: read
        the ended sessions back from the log before serving, then follow it."""
        self.gate.admitted = recover_admitted(self.bus)
        if self.session_log is not None:
            self.session_log.catch_up()
            self.session_log.start()
        self._threads = [threading.Thread(target=self._follow, args=(self.runner,),
                                          name="proxy-weights", daemon=True),
                         threading.Thread(target=self._follow, args=(self.sessions_runner,),
                                          name="proxy-sessions", daemon=True),
                         threading.Thread(target=self._reap_loop, name="proxy-reaper", daemon=True)]
        for t in self._threads:
            t.start()

    def _follow(self, runner: RoleRunner) -> None:
        try:
            runner.run()
        except BaseException as exc:  # surfaced by /health and stop()
            self.runner_error = exc
            log.exception("%s failed; stopping the proxy", runner.member_id)
            self.on_fatal()

    def _reap_loop(self) -> None:
        interval = min(1.0, self.session_ttl_s / 4)
        while not self._stop.wait(interval):
            events, empty = self.store.reap()
            for _ in range(empty):
                self.gate.abandon()
            self.publish(events)

    def stop(self) -> None:
        self._stop.set()
        self.runner.stop()
        self.sessions_runner.stop()
        for t in self._threads:
            t.join(30)
        if self.session_log is not None:
            self.session_log.stop()
        try:
            if not self.publish([]):
                log.error("%d event(s) could not be delivered before the proxy stopped",
                          len(self._unpublished))
            self.producer.close()
        finally:
            self.engine.shutdown()
        if self.runner_error is not None:
            raise self.runner_error

    def publish(self, events: list[Event]) -> bool:
        """Publish ``events`` (and any earlier batch that failed); False when the broker
        did not confirm them: they are kept and retried by the reaper every second, and
        consumers de-duplicate whatever a retry sends twice. A group with an event that
        cannot be encoded (invalid, or over bus.max_message_bytes: no retry helps) is
        dead-lettered whole instead (:meth:`_undeliverable`)."""
        with self._pub_lock:
            batch = self._unpublished + self._undeliverable(list(events))
            self._unpublished = []
            if not batch:
                return True
            sent: list[Event] = []
            for e in batch:
                self.producer.publish(e)  # encodable: checked by _undeliverable
                sent.append(e)
            try:
                self.producer.flush()
                return True
            except BusError as exc:
                self._unpublished = sent
                log.warning("%d event(s) not delivered yet, will retry: %s", len(sent), exc)
                return False

    def _undeliverable(self, events: list[Event]) -> list[Event]:
        """``events`` less the groups that cannot go on the log: each of their events is
        dead-lettered (dlq.v1, with the reason and the payload), the group's gate slot
        freed and its reason kept for ``end`` (``undeliverable``)."""
        bad: dict[str, str] = {}
        for e in events:
            try:
                encode_event(e, max_bytes=self.bus.max_message_bytes)
            except SchemaError as exc:
                bad.setdefault(e.group_id, f"{e.TYPE} {getattr(e, 'traj_id', '')}: {exc}")
        if not bad:
            return events
        for e in events:
            if e.group_id not in bad:
                continue
            error = SchemaError(f"group {e.group_id} cannot be published, so it is not trained "
                                f"({bad[e.group_id]})")
            try:
                raw = orjson.dumps(e)
            except orjson.JSONEncodeError:
                raw = repr(e).encode()
            source = Source(self.bus.topic(topic_for(e)), -1, -1, key=e.group_id)
            # The letter must fit on the bus itself: a too-large event's payload is cut
            # to a third of the limit (base64 adds a third), else left out.
            for payload in (raw[: self.bus.max_message_bytes // 3], b""):
                record, headers = dead_letter(payload, source, error,
                                              consumer_group=self.member_id)
                record.payload_truncated = len(payload) < len(raw)
                try:
                    self.producer.publish(record, headers=headers)
                    break
                except SchemaError:
                    continue
            self.dead_lettered += 1
        unpublished = {e.group_id for e in events if isinstance(e, TrajectoryEvent)}
        for gid, why in bad.items():
            log.error("group %s dead-lettered, not trained: %s", gid, why)
            self.undeliverable[gid] = why
            if len(self.undeliverable) > 10_000:
                self.undeliverable.pop(next(iter(self.undeliverable)))
            if gid in unpublished:  # the trainer will never see it: free its slot here
                self.gate.abandon()
        return [e for e in events if e.group_id not in bad]

    # ------------------------------------------------------------------ sessions

    async def finish(self, session: Session, ended: Ended) -> dict[str, Any]:
        """Publish what ``end`` (or a fixed key's next start) finished; the reply's
        ``published`` / ``reward_pending`` / ``reason``."""
        if ended.abandoned:
            self.gate.abandon()
        published = bool(ended.events) and await asyncio.to_thread(self.publish, ended.events)
        reason = self.undeliverable.get(ended.group.group_id, "") or ended.reason
        group_ended = ended.group.group_id in self.store.finished_groups
        pending = not reason and any(r is None for r in ended.rewards)
        self.ended.record(session.session_id, EndedSession(
            ended.group.group_id, {t: p.reward_factor for t, p in zip(ended.traj_ids, session.pieces)},
            time.time(), rewarded=not pending or not ended.traj_ids, refusal=reason and f"takes no "
            f"reward: {reason}", refusal_code="not_for_training" if ended.group.untrained
            else "nothing_to_reward", api_key=session.api_key))
        return {"session_id": session.session_id, "group_id": ended.group.group_id,
                "traj_ids": ended.traj_ids, "rewards": ended.rewards,
                "published": published and not reason, "group_ended": group_ended,
                "reward_pending": pending, "reason": reason}

    def reward_after_end(self, session_id: str, value: Any, key: str | None) -> dict[str, Any]:
        """A session reward for an ended session (``key``: the caller's, None for the
        admin key or a signed command): with its group if that is not published yet,
        else as events of its own (:mod:`.delayed_rewards`)."""
        reward = check_reward(value)
        local = self.store.reward_ended(session_id, reward, key)
        if local is not None:
            session, traj_ids = local
            self.ended.mark_rewarded(session_id)
            return {"session_id": session_id, "group_id": session.group.group_id,
                    "traj_ids": traj_ids, "reward": reward, "published": False}
        entry = self.ended.claim(session_id, key)
        events = delayed_reward_events(entry.group_id, entry.factors, reward, session_id,
                                       entry.ended_at)
        if not self.publish(list(events)):
            self.ended.release(session_id)
            raise ApiError(503, "the broker did not confirm the reward; retry",
                           code="reward_not_delivered")
        return {"session_id": session_id, "group_id": entry.group_id,
                "traj_ids": [e.traj_id for e in events], "reward": reward, "published": True}

    def session_counts(self) -> dict[str, int]:
        """Sessions served, open, with a call generating, not for training, refused at the
        gate; ended ones rewarded or waiting for a reward (the live table's numbers); the
        calls' latency histogram and the 429s (producers/proxy/call_stats.py), which the
        sessions member's status row carries to `tapioca metrics serve`."""
        sessions = list(self.store.sessions.values())
        return {"served": self.store.started,
                "open": sum(1 for s in sessions if s.state == "open"),
                "generating": sum(s.in_flight for s in sessions),
                "untrained": self.store.untrained_sessions, "refused": self.refused_starts,
                "dead_lettered": self.dead_lettered, **self.ended.counts(), **self.calls.counts()}

    # ------------------------------------------------------------------ requests

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        if self.template:
            kwargs = {"tools": tools} if tools and self.template_has_tools else {}
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          tokenize=False, **kwargs)
            except Exception as exc:  # jinja errors: the messages do not fit the template
                raise bad_request(f"the chat template cannot render these messages: {exc}",
                                  "messages") from None
        else:
            text = "\n".join(m["content"] for m in messages)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def sampling_from(self, body: dict[str, Any]) -> tuple[SamplingParams, int]:
        n = int_field(body, "n", 1, 1, MAX_N)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = self.sampling.max_new_tokens if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise bad_request("max_tokens must be an integer >= 1", "max_tokens")
        temperature = float_field(body, "temperature", self.sampling.temperature, 0.0, 2.0)
        top_p = float_field(body, "top_p", self.sampling.top_p, 0.0, 1.0)
        if top_p <= 0:
            raise bad_request("top_p must be in (0, 1]", "top_p")
        top_k = int_field(body, "top_k", self.sampling.top_k, 0, 1 << 30)
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if (not isinstance(stops, list) or len(stops) > MAX_STOP
                or not all(isinstance(s, str) and s for s in stops)):
            raise bad_request(f"stop must be a non-empty string or a list of up to {MAX_STOP}", "stop")
        stops = list(self.sampling.stop_strings) + [s for s in stops if s not in self.sampling.stop_strings]
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_tokens, stop_token_ids=self.sampling.stop_token_ids,
                              stop_strings=tuple(stops)), n

    async def generate(self, session: Session, call_id: str, prompt_ids: list[int],
                       sampling: SamplingParams, n: int, image_refs: list | None = None) -> list[GenResult]:
        """Generate ``n`` choices of one call; engine request ids are ``{call_id}:{i}``
        (``call_id`` is random per call, so ids never repeat across calls or sessions)."""
        budget = len(prompt_ids) + n * sampling.max_new_tokens
        if budget > self.max_tokens_per_request:
            raise bad_request(
                f"prompt ({len(prompt_ids)} tokens) + n x max_tokens ({n} x {sampling.max_new_tokens}) "
                f"= {budget} exceeds proxy.max_tokens_per_request={self.max_tokens_per_request}; "
                "shorten the conversation or lower max_tokens / n", "max_tokens",
                code="request_token_limit")
        context = len(prompt_ids) + sampling.max_new_tokens
        if self.max_context_tokens is not None and context > self.max_context_tokens:
            raise bad_request(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_new_tokens}) = {context} "
                f"exceeds the model's context of {self.max_context_tokens} tokens; shorten the "
                "conversation or lower max_tokens", "messages", code="context_length_exceeded")
        images = None
        if image_refs:
            # Admitted, not yet stored (proxy/images.py): their bytes come with them.
            given = image_refs.blobs if isinstance(image_refs, AdmittedImages) else None
            try:
                images = await asyncio.to_thread(self.request_images, list(image_refs), given)
            except ImageBusyError as exc:
                raise busy_images(exc) from None
            except TapiocaError as exc:  # e.g. a blob that is not in the store
                raise bad_request(str(exc), "messages", code="invalid_image") from None
        requests = [GenRequest(f"{call_id}:{i}", list(prompt_ids), sampling, images) for i in range(n)]
        try:
            self.engine.validate(requests[0])
        except EngineError as exc:  # e.g. token ids the model does not have
            raise bad_request(str(exc), "messages", code="invalid_prompt") from None
        reserved = budget
        self.store.begin_call(session, reserved)
        results: list[GenResult] | None = None
        try:
            if isinstance(image_refs, AdmittedImages) and not image_refs.committed:
                # Accepted: only now are its images stored (a refused request stores nothing).
                await asyncio.to_thread(image_refs.commit)
            futures = self.engine.submit_all(requests)  # n choices: one prompt prefill
            results = list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except EngineError as exc:
            if self._stop.is_set():  # the engine is being shut down with the proxy
                raise ApiError(503, "the proxy is shutting down; retry against a running proxy",
                               code="shutting_down") from None
            raise ApiError(500, f"generation failed: {exc}", code="engine_error") from None
        finally:
            # Also on cancellation (the client went away): the reservation never leaks.
            used = len(prompt_ids) + sum(len(r.output_ids) for r in results) if results is not None else 0
            self.store.end_call(session, reserved - used)
        if any(r.finish_reason == "abort" for r in results):
            raise ApiError(503, "the proxy is shutting down; retry against a running proxy",
                           code="shutting_down")
        return results


# ---------------------------------------------------------------------- request fields


def int_field(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad_request(f"{key} must be an integer in [{lo}, {hi}]", key)
    return v


def float_field(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad_request(f"{key} must be a number in [{lo}, {hi}]", key)
    return float(v)
