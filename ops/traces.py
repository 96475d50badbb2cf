"""One OpenTelemetry trace per trajectory, from the timestamps its events already carry.

Consumes :class:`~tapioca.ops.lifecycle.TrajectoryTimes` (ops/lifecycle.py: the one
derivation of a trajectory's timestamps from the log, which the step timeline reads
too); emits spans through an OpenTelemetry SDK ``TracerProvider`` (OTLP/HTTP for
`tapioca traces export`, any exporter for tests). Keyed by ``traj_id``: the trace id is
:func:`trace_id_of` it (the first 16 bytes of its SHA-256), so the trace of any log
record that names a trajectory can be found without an index, and exporting one twice
gives the same ids (the span ids are derived too), which backends de-duplicate.

The spans of one trajectory, children of a root span ``trajectory``, in order:

==============  ==================================================================
prompt          its prompt published (prompts.v1) -> the rollout worker submitted it
                (queued on the log, and for the weights it was admitted under)
generation      submitted -> its trajectory event published (``queued_s``,
                ``generate_s`` from the engine as attributes)
reward          trajectory -> its first reward event (the scorer's hop and work)
advantage       reward -> its group's sample event (waiting for the group's other
                rewards, then the processor's work)
sample          sample -> the trainer's batch complete (the hop and the wait for a
                busy trainer), or -> the progress event that rejected the group
                (an error status with the reason)
train           batch complete -> the weights event of the version it was trained
                into (``tapioca.policy_version``: trained in version v)
==============  ==================================================================

A stage whose two ends are not both on the log is left out (the proxy's trajectories
have no prompt event; a group still waiting has no train span yet). Clocks: each
timestamp is the writing process's ``time.time()``; a span whose end comes before its
start (clocks of two hosts) is shown with zero length.

OpenTelemetry is an optional extra (``pip install 'tapioca-rl[otel]'``): imported only
here, only when traces are made.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..schemas.errors import ConfigError
from .lifecycle import TrajectoryTimes

OTEL_HINT = ("OpenTelemetry is not installed: pip install 'tapioca-rl[otel]' (opentelemetry-sdk "
             "and opentelemetry-exporter-otlp-proto-http)")
SERVICE_NAME = "tapioca"
STAGES = ("prompt", "generation", "reward", "advantage", "sample", "train")


def trace_id_of(traj_id: str) -> int:
    """The 128-bit trace id of a trajectory: the first 16 bytes of SHA-256(traj_id)."""
    return int.from_bytes(hashlib.sha256(traj_id.encode()).digest()[:16], "big") or 1


def trace_id_hex(traj_id: str) -> str:
    """The trace id as tracing backends show it (32 hex digits)."""
    return f"{trace_id_of(traj_id):032x}"


def span_id_of(traj_id: str, name: str) -> int:
    """A span's 64-bit id, derived from its trajectory and its name."""
    return int.from_bytes(hashlib.sha256(f"{traj_id}/{name}".encode()).digest()[:8], "big") or 1


@dataclass(frozen=True)
class SpanSpec:
    """One span of a trajectory's trace: times in epoch seconds."""

    name: str
    start: float
    end: float
    attributes: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


def _span(name: str, start: Optional[float], end: Optional[float], error: Optional[str] = None,
          **attributes: Any) -> Optional[SpanSpec]:
    if start is None or end is None:
        return None
    attrs = {f"tapioca.{k}": v for k, v in attributes.items() if v is not None}
    return SpanSpec(name, start, max(start, end), attrs, error)


def trajectory_spans(t: TrajectoryTimes) -> list[SpanSpec]:
    """The root span, then the stage spans in order (see the module docstring)."""
    start_gen = t.submitted_at
    if start_gen is None and t.generate_s is not None:  # the proxy: its engine's own times
        start_gen = t.published_at - t.generate_s - (t.queued_s or 0.0)
    rejected = t.rejected_at is not None and t.trained_version is None
    stages = [
        _span("prompt", t.prompt_at, t.submitted_at),
        _span("generation", start_gen, t.published_at, queued_s=t.queued_s, generate_s=t.generate_s,
              output_tokens=t.output_tokens, finish_reason=t.finish_reason or None,
              min_policy_version=t.min_version, max_policy_version=t.max_version,
              weights_version=t.weights_version),
        _span("reward", t.published_at, t.reward_at, reward=t.reward, scorer=t.scorer),
        _span("advantage", t.reward_at, t.sample_at, advantage=t.advantage,
              dropped_reason=t.dropped_reason or None),
        (_span("sample", t.sample_at, t.rejected_at,
               error=f"group rejected by the trainer{': ' + t.dropped_reason if t.dropped_reason else ''}")
         if rejected else _span("sample", t.sample_at, t.batch_ready_at)),
        _span("train", t.batch_ready_at, t.version_at, policy_version=t.trained_version,
              staleness_versions=t.staleness),
    ]
    spans = [s for s in stages if s is not None]
    times = [x for s in spans for x in (s.start, s.end)] or [t.published_at]
    root = SpanSpec("trajectory", min(times), max(times), {
        k: v for k, v in {
            "tapioca.traj_id": t.traj_id, "tapioca.group_id": t.group_id,
            "tapioca.run_id": t.run_id, "tapioca.trained_version": t.trained_version,
            "tapioca.rejected": rejected}.items() if v is not None},
        "rejected by the trainer" if rejected else None)
    return [root] + spans


# ---------------------------------------------------------------------- OpenTelemetry


def _otel():
    try:
        from opentelemetry import context, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
        from opentelemetry.trace import Status, StatusCode
    except ImportError:
        raise ConfigError(OTEL_HINT) from None
    return (context, trace, Resource, TracerProvider, BatchSpanProcessor, SimpleSpanProcessor,
            IdGenerator, RandomIdGenerator, Status, StatusCode)


def otlp_exporter(endpoint: str):
    """An OTLP/HTTP span exporter to ``endpoint`` (``http://HOST:4318``; ``/v1/traces``
    is added unless the URL names a path)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(OTEL_HINT) from None
    from urllib.parse import urlparse

    url = endpoint if urlparse(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=url)


class TrajectoryTracer:
    """Turns trajectories into OpenTelemetry traces with derived ids. ``exporter``: an
    SDK SpanExporter (an OTLP one, or an in-memory one in tests); ``batch``: a
    BatchSpanProcessor (for a network exporter) rather than a synchronous one."""

    def __init__(self, exporter: Any, *, batch: bool = True, run_id: str = "") -> None:
        (self._context, self._trace, Resource, TracerProvider, Batch, Simple, IdGenerator,
         RandomIdGenerator, self._Status, self._StatusCode) = _otel()
        random_ids = RandomIdGenerator()

        class DerivedIds(IdGenerator):
            """The next span's ids, set by :meth:`TrajectoryTracer.export` before it
            starts the span (random when unset)."""

            trace_id: Optional[int] = None
            span_id: Optional[int] = None

            def generate_trace_id(self) -> int:
                return self.trace_id or random_ids.generate_trace_id()

            def generate_span_id(self) -> int:
                return self.span_id or random_ids.generate_span_id()

        self._ids = DerivedIds()
        self.failed_spans = 0  # spans the exporter could not deliver (e.g. no collector)
        exporter = self._counting(exporter)
        attributes = {"service.name": SERVICE_NAME}
        if run_id:
            attributes["tapioca.run_id"] = run_id
        self.provider = TracerProvider(resource=Resource.create(attributes), id_generator=self._ids)
        self.provider.add_span_processor(Batch(exporter) if batch else Simple(exporter))
        self._tracer = self.provider.get_tracer("tapioca.ops.traces")
        self._lock = threading.Lock()  # the ids are set per span: one trajectory at a time
        self.exported = 0
        self._shut = False

    def _counting(self, exporter: Any) -> Any:
        """``exporter``, counting the spans it failed to deliver (the SDK's processors
        only log that): `traces export` says so instead of claiming success."""
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        tracer = self

        class Counting(SpanExporter):
            def export(self, spans):
                result = exporter.export(spans)
                if result != SpanExportResult.SUCCESS:
                    tracer.failed_spans += len(spans)
                return result

            def shutdown(self) -> None:
                exporter.shutdown()

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return exporter.force_flush(timeout_millis)

        return Counting()

    @staticmethod
    def _ns(t: float) -> int:
        return int(round(t * 1e9))

    def export(self, t: TrajectoryTimes) -> None:
        """The trace of one trajectory (its spans as far as the log has them)."""
        specs = trajectory_spans(t)
        with self._lock:
            root_spec, stages = specs[0], specs[1:]
            self._ids.trace_id = trace_id_of(t.traj_id)
            self._ids.span_id = span_id_of(t.traj_id, root_spec.name)
            # An empty context: the root has no parent, whatever span is current here.
            root = self._tracer.start_span(root_spec.name, context=self._context.Context(),
                                           start_time=self._ns(root_spec.start),
                                           attributes=root_spec.attributes)
            parent = self._trace.set_span_in_context(root)
            for spec in stages:
                self._ids.span_id = span_id_of(t.traj_id, spec.name)
                span = self._tracer.start_span(spec.name, context=parent,
                                               start_time=self._ns(spec.start),
                                               attributes=spec.attributes)
                self._end(span, spec)
            self._end(root, root_spec)
            self._ids.trace_id = self._ids.span_id = None
            self.exported += 1

    def _end(self, span: Any, spec: SpanSpec) -> None:
        if spec.error:
            span.set_status(self._Status(self._StatusCode.ERROR, spec.error))
        span.end(end_time=self._ns(spec.end))

    def export_all(self, trajectories: Iterable[TrajectoryTimes]) -> int:
        n = 0
        for t in trajectories:
            self.export(t)
            n += 1
        return n

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter (once; later calls do nothing)."""
        if self._shut:
            return
        self._shut = True
        self.provider.force_flush()
        self.provider.shutdown()
