"""What the agent proxy's routes call: engine, tokenizer, sessions, head gate, bus.

Consumes ``weights.v1`` (through :class:`~tapioca.producers.proxy.gate.WeightsFollower`
in a background thread) and the requests the routes of
:mod:`tapioca.producers.proxy.server` hand over; emits the ``TrajectoryEvent`` and
``RewardEvent`` batches of finished session groups (keyed by ``group_id``) with an
:class:`~tapioca.bus.producer.EventProducer`, retrying a batch the broker did not
confirm. Also renders chat messages to token ids and validates sampling fields.

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
from typing import Any, Callable

from ...bus.producer import EventProducer
from ...bus.runner import RoleRunner
from ...bus.settings import BusConfig
from ...config.sections import ProxySection
from ...engines.base import GenRequest, GenResult, InferenceEngine, SamplingParams
from ...schemas.envelope import Event
from ...schemas.errors import BusError, ConfigError, EngineError, SchemaError, TapiocaError
from .gate import PROXY_PRODUCER_PREFIX, HeadGate, WeightsFollower, recover_admitted
from .openai_errors import ApiError, bad_request
from .responses import ResponseText
from .sessions import Session, SessionStore

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
        self.store = SessionStore(ttl_s=p.session_ttl_s, max_sessions=p.max_sessions,
                                  max_tokens_per_session=p.max_tokens_per_session,
                                  run_tag=section.run_id,
                                  decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                  default_mode=p.end_mode, default_discount=p.turn_discount)
        self.member_id = f"{PROXY_PRODUCER_PREFIX}-{secrets.token_hex(4)}"
        self.producer = EventProducer(bus, self.member_id)
        self._pub_lock = threading.Lock()
        self._unpublished: list[Event] = []
        self.runner = RoleRunner(WeightsFollower(self.gate, load_weights, lambda: engine.version),
                                 bus, member_id=self.member_id, group_id=f"{bus.topic_prefix}.proxy")
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.runner_error: BaseException | None = None
        # Called when the weights follower dies: a proxy that can no longer follow the
        # trainer must stop (its role fails visibly) rather than serve stale weights.
        self.on_fatal: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Recover k from the log, follow weights.v1, expire idle sessions."""
        self.gate.admitted = recover_admitted(self.bus)
        self._threads = [threading.Thread(target=self._follow, name="proxy-weights", daemon=True),
                         threading.Thread(target=self._reap_loop, name="proxy-reaper", daemon=True)]
        for t in self._threads:
            t.start()

    def _follow(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:  # surfaced by /health and stop()
            self.runner_error = exc
            log.exception("the weights follower failed; stopping the proxy")
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
        for t in self._threads:
            t.join(30)
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
        consumers de-duplicate whatever a retry sends twice."""
        with self._pub_lock:
            batch, self._unpublished = self._unpublished + list(events), []
            if not batch:
                return True
            sent: list[Event] = []
            for e in batch:
                try:
                    self.producer.publish(e)
                except SchemaError as exc:
                    # Invalid or over bus.max_message_bytes: retrying cannot help. Its
                    # group then times out in the advantage processor (counted rejected).
                    log.error("dropping %s %s: %s", e.TYPE, getattr(e, "traj_id", ""), exc)
                    continue
                sent.append(e)
            try:
                self.producer.flush()
                return True
            except BusError as exc:
                self._unpublished = sent
                log.warning("%d event(s) not delivered yet, will retry: %s", len(sent), exc)
                return False

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
            try:
                images = await asyncio.to_thread(self.request_images, list(image_refs))
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
