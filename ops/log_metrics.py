"""The fleet's Prometheus metrics, derived from the log: the state behind `tapioca metrics
serve` (ops/prometheus.py turns it into prometheus_client families; nothing here knows
the exposition format).

Consumes ``fleet.v1`` (every member's heartbeats: status, policy version, approximate
consumer lag, its process start), ``metrics.v1`` (every member's status rows of
``bus/*`` counters and ``describe()`` numbers; the trainer's step rows, the rollout
workers' windows, the evaluator's held-out scores) and ``dlq.v1`` (dead letters, by
source topic and error type). Keyed by run id and member id. Every update is idempotent
(latest row wins, dead letters de-duplicated by event id, process starts are a set), so
reading a topic twice, from its start or from a tail, changes no number. Emits
:class:`Family` values, one per entry of :data:`METRICS` (the one list of names: the
dashboard's test checks its queries against it).

Hostile input: an event's numbers may be NaN, infinite, negative or absurd, its labels
any string. A gauge shows only a finite value; a counter only a finite, non-negative
one; a histogram bucket only an integer staleness; labels are cut to
:data:`MAX_LABEL_CHARS` and made valid UTF-8; members and dead-letter kinds beyond
:data:`MAX_MEMBERS` / :data:`MAX_DLQ_SERIES` are dropped oldest first / folded into
``other``. A bad event changes nothing else.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..bus.fleet import DEFAULT_INTERVAL_S, STALE_AFTER_INTERVALS
from ..schemas.envelope import ANY_RUN, run_reads
from ..schemas.events import DlqRecord, FleetEvent, MetricsEvent

MAX_LABEL_CHARS = 160
MAX_MEMBERS = 1024
MAX_DLQ_SERIES = 512
MAX_DLQ_IDS = 200_000  # dead letters remembered for de-duplication
STATUSES = ("starting", "running", "paused", "draining", "stopped", "failed", "stale")
# Integer staleness (versions); a histogram's buckets must not change between scrapes.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
LAG_NOTE = ("approximate: from broker watermarks, which Tansu undercounts (docs/kafka-clients.md); "
            "exact on Apache Kafka up to the heartbeat's age")
RUN_ROLE_MEMBER = ("run", "role", "member")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as scraped: counters end in _total
    kind: str  # gauge | counter | histogram
    help: str
    labels: tuple[str, ...] = RUN_ROLE_MEMBER


def _spec(name: str, kind: str, help: str, *extra: str) -> tuple[str, MetricSpec]:
    return name, MetricSpec(name, kind, help, RUN_ROLE_MEMBER + extra)


METRICS: dict[str, MetricSpec] = dict([
    # fleet.v1
    _spec("tapioca_member_up", "gauge", "1 while the member heartbeats on fleet.v1 and is not stopped or failed"),
    _spec("tapioca_member_status", "gauge", "1 for the member's current status (starting, running, paused, "
          "draining, stopped, failed; stale: no heartbeat for 3 intervals)", "status"),
    _spec("tapioca_member_heartbeat_age_seconds", "gauge", "Seconds since the member's last heartbeat on fleet.v1"),
    _spec("tapioca_member_restarts_total", "counter", "Process restarts of the member: distinct process starts "
          "in its heartbeats on fleet.v1, minus one (counted over what the exporter read)"),
    _spec("tapioca_policy_version", "gauge", "The policy version the member has (trainer: published; rollout, "
          "proxy, evaluator: loaded), from fleet.v1 and metrics.v1"),
    _spec("tapioca_consumer_lag_records", "gauge", "Records of a topic the member's consumer group has not read "
          f"yet, summed over its partitions; {LAG_NOTE}", "topic"),
    # metrics.v1: every member's status row
    _spec("tapioca_events_consumed_total", "counter", "Events the member consumed (its process's count, metrics.v1)"),
    _spec("tapioca_events_handled_total", "counter", "Events the member's role handled (metrics.v1)"),
    _spec("tapioca_events_produced_total", "counter", "Events the member's role produced (metrics.v1)"),
    _spec("tapioca_head_gate_open_slots", "gauge", "Groups the head gate (feeder, proxy) may still admit now: "
          "(eta + trained steps + 1) * B - (admitted - freed)"),
    _spec("tapioca_groups_trained_total", "counter", "Groups the trainer trained (its checkpointed count)"),
    _spec("tapioca_groups_rejected_total", "counter", "Groups the trainer rejected, by reason: stale (past the "
          "staleness bound), dropped (given up by the advantage processor), dead_lettered (bad samples, "
          "non-finite steps)", "reason"),
    _spec("tapioca_rollout_tokens_total", "counter", "Tokens the rollout worker generated (its process's count)"),
    _spec("tapioca_proxy_sessions_open", "gauge", "Agent sessions open at the proxy"),
    _spec("tapioca_proxy_sessions_total", "counter", "Agent sessions the proxy started"),
    _spec("tapioca_proxy_rate_limited_total", "counter", "Requests the proxy answered 429 (proxy.max_sessions "
          "open, or the head gate closed with proxy.admission reject)"),
    _spec("tapioca_proxy_call_latency_seconds", "histogram", "Seconds of the proxy's completion calls (to the "
          "response's first byte: the whole completion)"),
    # metrics.v1: step rows
    _spec("tapioca_reward_mean", "gauge", "Mean reward of the groups of the trainer's last step"),
    _spec("tapioca_trainer_tokens_per_second", "gauge", "Tokens per second of the trainer's last step"),
    _spec("tapioca_trainer_step_seconds", "gauge", "Seconds of the trainer's last optimizer step"),
    _spec("tapioca_staleness_versions", "histogram", "Staleness of the trained groups (trainer version minus the "
          "group's oldest token version), over the trainer's run"),
    _spec("tapioca_rollout_tokens_per_second", "gauge", "Tokens per second the rollout worker generated over "
          "its last window"),
    _spec("tapioca_eval_score", "gauge", "The evaluator's held-out score of its last evaluated version "
          "(pass@k, avg@k, maj@k, greedy), per subset ('' for all)", "subset", "metric"),
    _spec("tapioca_eval_version", "gauge", "The policy version the evaluator last scored"),
    # dlq.v1
    _spec("tapioca_dead_letters_total", "counter", "Dead letters on dlq.v1, by source topic and error type "
          "(role, member: the consumer that wrote it)", "topic", "reason"),
    # the exporter itself
    ("tapioca_exporter_events_read_total", MetricSpec(
        "tapioca_exporter_events_read_total", "counter", "Records this exporter read, by topic", ("topic",))),
    ("tapioca_exporter_undecodable_total", MetricSpec(
        "tapioca_exporter_undecodable_total", "counter", "Records this exporter could not decode or verify, "
        "by topic", ("topic",))),
])

# producers/evaluator.py's MARKER_KEY (a role module is not imported here for one string).
MARKER_KEY = "evaluator/recovering"
_EVAL_SCORE = re.compile(r"^(pass|avg|maj)@\d+$|^greedy$")
_LATENCY = re.compile(r"/call_latency_le_([0-9.eE+-]+)$")
_REJECTED = {"stale": "trainer/rejected_stale", "dropped": "trainer/rejected_dropped",
             "dead_lettered": "trainer/dead_lettered"}


@dataclass
class Family:
    """The samples of one metric: (label values, value) for gauges and counters;
    (label values, [(upper bound, cumulative count)...], sum) for histograms."""

    spec: MetricSpec
    samples: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    histograms: list[tuple[tuple[str, ...], list[tuple[float, float]], float]] = field(default_factory=list)


def label(value: Any) -> str:
    """A label value from anything an event carries: a str, valid UTF-8, at most
    MAX_LABEL_CHARS."""
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_LABEL_CHARS].encode("utf-8", "replace").decode("utf-8")


def finite(value: Any) -> Optional[float]:
    """A finite float, else None (NaN, infinities, strings, None...)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:  # an int past float's range
        return None
    return out if math.isfinite(out) else None


def count(value: Any) -> Optional[float]:
    """A counter's value: finite and >= 0, else None."""
    out = finite(value)
    return out if out is not None and out >= 0 else None


def role_of(member_id: str) -> str:
    """A member's role from its id where no heartbeat said it: ``rollout-0`` -> rollout."""
    base, _, index = member_id.rpartition("-")
    return base if base and index.isdigit() else member_id


@dataclass
class _Member:
    run: str
    member: str
    role: str = ""
    seen_at: float = 0.0
    heartbeat: Optional[FleetEvent] = None
    starts: set[float] = field(default_factory=set)
    version: Optional[float] = None
    status_row: Optional[tuple[float, dict[str, Any]]] = None  # (produced_at, metrics)
    step_row: Optional[tuple[float, dict[str, Any]]] = None    # the trainer's, by step
    window_row: Optional[tuple[float, dict[str, Any]]] = None  # the rollout's
    eval_row: Optional[tuple[float, dict[str, Any]]] = None    # (version, metrics)


class LogMetrics:
    """Everything the exporter shows, folded from events (:meth:`observe`, thread-safe)
    and read as :meth:`families`. ``run_id``: only that run's events (ANY_RUN: every
    run's, told apart by the ``run`` label)."""

    def __init__(self, *, run_id: str = ANY_RUN, clock: Callable[[], float] = time.time) -> None:
        self.run_id = run_id
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[tuple[str, str], _Member] = {}
        self._dead: Counter = Counter()
        self._dead_ids: set[str] = set()
        self.read: Counter = Counter()
        self.undecodable: Counter = Counter()

    # ---------------------------------------------------------------- input

    def record(self, topic: str, event: Any) -> None:
        """One record of ``topic`` as read: its event, or None when it did not decode."""
        with self._lock:
            self.read[label(topic)] += 1
            if event is None:
                self.undecodable[label(topic)] += 1
        if event is not None:
            self.observe(event)

    def observe(self, event: Any) -> None:
        if not run_reads(self.run_id, getattr(event, "run_id", ANY_RUN)):
            return
        with self._lock:
            try:
                if isinstance(event, FleetEvent):
                    self._heartbeat(event)
                elif isinstance(event, MetricsEvent):
                    self._metrics(event)
                elif isinstance(event, DlqRecord):
                    self._dead_letter(event)
            except (TypeError, ValueError, AttributeError, OverflowError):
                pass  # a malformed event (fields of the wrong type): it changes nothing

    def _member(self, run: str, member: str, role: str = "") -> _Member:
        key = (label(run), label(member))
        m = self._members.get(key)
        if m is None:
            if len(self._members) >= MAX_MEMBERS:  # forget the one heard from least recently
                del self._members[min(self._members, key=lambda k: self._members[k].seen_at)]
            m = self._members[key] = _Member(*key)
        if role:
            m.role = label(role)
        elif not m.role:
            m.role = label(role_of(member))
        m.seen_at = self._clock()
        return m

    def _heartbeat(self, e: FleetEvent) -> None:
        m = self._member(e.run_id, e.member_id, e.role)
        if m.heartbeat is None or e.produced_at >= m.heartbeat.produced_at:
            m.heartbeat = e
        detail = e.detail if isinstance(e.detail, dict) else {}
        started = finite(detail.get("started_at"))
        if started is not None and len(m.starts) < 10_000:
            m.starts.add(started)
        described = detail.get("describe")
        # Roles without a version (reward, advantage, archiver) heartbeat version 0: not shown.
        if isinstance(described, dict) and ("version" in described or "policy_version" in described):
            self._version(m, e.policy_version)

    def _version(self, m: _Member, version: Any) -> None:
        v = finite(version)
        if v is not None and (m.version is None or v > m.version):
            m.version = v

    def _metrics(self, e: MetricsEvent) -> None:
        if not isinstance(e.metrics, dict):
            return
        # The member that published it (the runner's id, "trainer-0"); the trainer names its
        # step rows by role ("trainer"): the producer id keeps them on one member.
        m = self._member(e.run_id, e.producer_id or e.source)
        rows = e.metrics
        if "bus/handled" in rows:  # the runner's status row (bus/runner.py)
            if m.status_row is None or e.produced_at >= m.status_row[0]:
                m.status_row = (e.produced_at, rows)
            # Its describe() numbers are "<role>/<key>": the role, until a heartbeat says it.
            roles = {k.split("/", 1)[0] for k in rows if isinstance(k, str) and "/" in k and not k.startswith("bus/")}
            if m.heartbeat is None and len(roles) == 1:
                m.role = label(roles.pop())
            return
        if MARKER_KEY in rows:
            return  # the evaluator's bookkeeping marker (producers/evaluator.py), no number
        self._version(m, e.policy_version)
        if "reward/mean" in rows or "actor/tokens_per_s" in rows:
            step = finite(e.step) or 0.0
            if m.step_row is None or step >= m.step_row[0]:
                m.step_row = (step, rows)
        if "rollout/tokens_per_s" in rows:
            if m.window_row is None or e.produced_at >= m.window_row[0]:
                m.window_row = (e.produced_at, rows)
        if any(isinstance(k, str) and k.startswith("eval/") and _EVAL_SCORE.match(k.rsplit("/", 1)[-1])
               for k in rows):
            version = finite(e.policy_version) or finite(e.step) or 0.0
            if m.eval_row is None or version >= m.eval_row[0]:
                m.eval_row = (version, rows)

    def _dead_letter(self, e: DlqRecord) -> None:
        if e.event_id in self._dead_ids:
            return  # a dead letter written twice (at-least-once) is one
        if len(self._dead_ids) >= MAX_DLQ_IDS:
            self._dead_ids.clear()
        self._dead_ids.add(e.event_id)
        topic = str(e.source_topic)
        parts = topic.split(".")
        # tapioca.trajectories.v1 -> trajectories: the dashboards' topic names.
        short = parts[-2] if len(parts) >= 3 and parts[-1].startswith("v") else topic
        key = (label(e.run_id), label(role_of(e.producer_id) if e.producer_id else ""),
               label(e.producer_id), label(short), label(e.error_type))
        if key not in self._dead and len(self._dead) >= MAX_DLQ_SERIES:
            key = key[:3] + ("other", "other")
        self._dead[key] += 1

    # ---------------------------------------------------------------- output

    def families(self) -> list[Family]:
        """Every metric of :data:`METRICS` with its samples now."""
        with self._lock:
            out = {name: Family(spec) for name, spec in METRICS.items()}
            now = self._clock()
            for m in self._members.values():
                staged = {name: Family(spec) for name, spec in METRICS.items()}
                try:
                    self._member_samples(m, now, staged)
                except (TypeError, ValueError, AttributeError, OverflowError):
                    continue  # a member whose events hold nonsense is left out, not the scrape
                for name, f in staged.items():
                    out[name].samples += f.samples
                    out[name].histograms += f.histograms
            for key, n in self._dead.items():
                out["tapioca_dead_letters_total"].samples.append((key, float(n)))
            for topic, n in self.read.items():
                out["tapioca_exporter_events_read_total"].samples.append(((topic,), float(n)))
            for topic, n in self.undecodable.items():
                out["tapioca_exporter_undecodable_total"].samples.append(((topic,), float(n)))
            return list(out.values())

    def _member_samples(self, m: _Member, now: float, out: dict[str, Family]) -> None:
        ids = (m.run, m.role, m.member)

        def put(name: str, value: Optional[float], *extra: str) -> None:
            if value is not None:
                out[name].samples.append((ids + tuple(label(x) for x in extra), value))

        if m.heartbeat is not None:
            hb = m.heartbeat
            age = finite(now - hb.produced_at) if finite(hb.produced_at) is not None else None
            detail = hb.detail if isinstance(hb.detail, dict) else {}
            interval = count(detail.get("interval_s")) or DEFAULT_INTERVAL_S
            ended = hb.status in ("stopped", "failed")
            # bus/fleet.py MemberView's rule, on numbers that may be anything.
            stale = not ended and (age is None or age > STALE_AFTER_INTERVALS * interval)
            status = "stale" if stale else label(hb.status)
            put("tapioca_member_up", 0.0 if stale or ended else 1.0)
            for s in STATUSES:
                put("tapioca_member_status", 1.0 if s == status else 0.0, s)
            put("tapioca_member_heartbeat_age_seconds", None if age is None else max(age, 0.0))
            put("tapioca_member_restarts_total", float(max(len(m.starts) - 1, 0)))
            lag: dict[str, float] = {}
            for where, n in (m.heartbeat.lag or {}).items():
                records = count(n)
                if records is not None:
                    topic = str(where).rsplit("/", 1)[0]
                    lag[topic] = lag.get(topic, 0.0) + records
            for topic, n in sorted(lag.items())[:64]:
                put("tapioca_consumer_lag_records", n, topic)
        put("tapioca_policy_version", m.version)
        if m.status_row is not None:
            self._status_samples(m.status_row[1], put)
        if m.step_row is not None:
            row = m.step_row[1]
            put("tapioca_reward_mean", finite(row.get("reward/mean")))
            put("tapioca_trainer_tokens_per_second", count(row.get("actor/tokens_per_s")))
            put("tapioca_trainer_step_seconds", count(row.get("actor/step_time_s")))
            hist = staleness_histogram(row)
            if hist is not None:
                out["tapioca_staleness_versions"].histograms.append((ids, *hist))
        if m.window_row is not None:
            put("tapioca_rollout_tokens_per_second", count(m.window_row[1].get("rollout/tokens_per_s")))
        if m.eval_row is not None:
            version, row = m.eval_row
            put("tapioca_eval_version", version)
            for key, value in sorted(row.items())[:256]:
                if not isinstance(key, str) or not key.startswith("eval/"):
                    continue
                subset, _, metric = key[len("eval/"):].rpartition("/")
                if _EVAL_SCORE.match(metric):
                    put("tapioca_eval_score", finite(value), subset, metric)
        if m.status_row is not None:
            hist = latency_histogram(m.status_row[1])
            if hist is not None:
                out["tapioca_proxy_call_latency_seconds"].histograms.append((ids, *hist))

    @staticmethod
    def _status_samples(row: dict[str, Any], put: Callable[..., None]) -> None:
        put("tapioca_events_consumed_total", count(row.get("bus/consumed")))
        put("tapioca_events_handled_total", count(row.get("bus/handled")))
        put("tapioca_events_produced_total", count(row.get("bus/produced")))
        for key in ("feeder/open_slots", "proxy-weights/open_slots"):
            put("tapioca_head_gate_open_slots", finite(row.get(key)))
        put("tapioca_groups_trained_total", count(row.get("trainer/groups_trained")))
        if "trainer/groups_trained" in row:
            for reason, key in _REJECTED.items():
                put("tapioca_groups_rejected_total", count(row.get(key, 0.0)), reason)
        put("tapioca_rollout_tokens_total", count(row.get("rollout/tokens")))
        put("tapioca_proxy_sessions_open", count(row.get("proxy-sessions/open")))
        put("tapioca_proxy_sessions_total", count(row.get("proxy-sessions/served")))
        put("tapioca_proxy_rate_limited_total", count(row.get("proxy-sessions/rate_limited")))


def staleness_histogram(row: dict[str, Any]) -> Optional[tuple[list[tuple[float, float]], float]]:
    """The trainer's ``trainer/staleness_hist/<versions>`` counts as cumulative buckets
    over :data:`STALENESS_BUCKETS` (+Inf last) and their sum; None without any."""
    counts: dict[int, float] = {}
    for key, value in row.items():
        if not isinstance(key, str) or not key.startswith("trainer/staleness_hist/"):
            continue
        lag, n = key.rsplit("/", 1)[-1], count(value)
        if n is None or not lag.isdigit() or len(lag) > 9:  # versions are integers >= 0
            continue
        counts[int(lag)] = counts.get(int(lag), 0.0) + n
    if not counts:
        return None
    buckets = [(float(b), sum(n for lag, n in counts.items() if lag <= b)) for b in STALENESS_BUCKETS]
    buckets.append((math.inf, sum(counts.values())))
    total = sum(lag * n for lag, n in counts.items())
    return buckets, total if math.isfinite(total) else 0.0


def latency_histogram(row: dict[str, Any]) -> Optional[tuple[list[tuple[float, float]], float]]:
    """The proxy's ``<role>/call_latency_le_<s>`` counts (producers/proxy/call_stats.py)
    as cumulative buckets (+Inf: every call) and their sum; None without any."""
    buckets: list[tuple[float, float]] = []
    calls = total = None
    for key, value in row.items():
        if not isinstance(key, str):
            continue
        if key.endswith("/calls"):
            calls = count(value)
        elif key.endswith("/call_latency_sum_s"):
            total = count(value)
        elif (match := _LATENCY.search(key)) is not None:
            bound, n = finite(_number(match.group(1))), count(value)
            if bound is not None and bound > 0 and n is not None:
                buckets.append((bound, n))
    if not buckets or calls is None:
        return None
    buckets.sort()
    # Cumulative counts never go down along the bounds, nor past the total.
    running, fixed = 0.0, []
    for bound, n in buckets[:64]:
        running = min(max(running, n), calls)
        fixed.append((bound, running))
    fixed.append((math.inf, calls))
    return fixed, total or 0.0


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None
