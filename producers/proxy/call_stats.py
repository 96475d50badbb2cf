"""The proxy's HTTP numbers for its status row on ``metrics.v1``: how long its
completion calls took (a histogram of cumulative counts, as Prometheus keeps them) and
how many requests it answered 429 (``proxy.max_sessions`` open, or the head gate closed
with ``proxy.admission: reject``).

Consumes the ASGI traffic of the proxy's app (:class:`CallStatsMiddleware`, a pure ASGI
middleware: it neither buffers a body nor touches ``receive``); emits nothing itself: the
sessions member's ``describe`` (producers/proxy/delayed_rewards.py) carries
:meth:`CallStats.counts`, so `tapioca metrics serve` reads them from the log
(ops/log_metrics.py: ``tapioca_proxy_call_latency_seconds``,
``tapioca_proxy_rate_limited_total``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

# Upper bounds (seconds) of the latency histogram's buckets: a call generates a whole
# completion (from tens of milliseconds on a small model to minutes for a long one).
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# The routes whose latency is a model call's.
CALL_PATHS = ("/v1/chat/completions", "/v1/completions")
LATENCY_PREFIX = "call_latency_le_"


class CallStats:
    """Counters of one proxy process (they restart at 0 with it, as Prometheus counters do)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = 0
        self.latency_sum_s = 0.0
        self.buckets = [0] * len(LATENCY_BUCKETS_S)  # calls at most that long (cumulative)
        self.rate_limited = 0

    def observe_call(self, seconds: float) -> None:
        with self._lock:
            self.calls += 1
            self.latency_sum_s += seconds
            for i, bound in enumerate(LATENCY_BUCKETS_S):
                if seconds <= bound:
                    self.buckets[i] += 1

    def observe_status(self, status: int) -> None:
        if status == 429:
            with self._lock:
                self.rate_limited += 1

    def counts(self) -> dict[str, float]:
        """``rate_limited``, ``calls``, ``call_latency_sum_s`` and one
        ``call_latency_le_<bound>`` per bucket (calls that took at most <bound> s)."""
        with self._lock:
            out: dict[str, float] = {"rate_limited": self.rate_limited, "calls": self.calls,
                                     "call_latency_sum_s": round(self.latency_sum_s, 6)}
            for bound, n in zip(LATENCY_BUCKETS_S, self.buckets):
                out[f"{LATENCY_PREFIX}{bound:g}"] = n
            return out


class CallStatsMiddleware:
    """Times the completion routes (to the response's first byte: the proxy answers once
    the engine delivered the whole completion, streamed or not) and counts 429s."""

    def __init__(self, app: Any, stats: CallStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        timed = scope.get("path") in CALL_PATHS
        started = time.monotonic()

        async def send_and_count(message: dict) -> None:
            if message.get("type") == "http.response.start":
                status = int(message.get("status", 0))
                self.stats.observe_status(status)
                if timed and status < 400:
                    self.stats.observe_call(time.monotonic() - started)
            await send(message)

        await self.app(scope, receive, send_and_count)
