"""`tapioca metrics serve`: the fleet's metrics at ``/metrics`` in Prometheus's text
format, derived from the log.

Consumes ``fleet.v1`` and ``metrics.v1`` (their last :data:`TAIL_RECORDS` records per
partition, then as they come: every number there is a latest value or a cumulative
count) and ``dlq.v1`` (from its start: dead letters are counted) through
:class:`~tapioca.ops.log_follow.LogFollower` into a
:class:`~tapioca.ops.log_metrics.LogMetrics`; a custom prometheus_client collector
turns that state into metric families at each scrape (prometheus_client writes the
exposition format). Labels ``run`` (the bus run id), ``role``, ``member``. Emits nothing
on the bus; serves HTTP only.
"""

from __future__ import annotations

from typing import Iterator, Optional

from ..bus.reader import Record
from ..bus.settings import BusConfig
from ..schemas.envelope import ANY_RUN
from ..schemas.errors import ConfigError
from .log_follow import LogFollower
from .log_metrics import Family, LogMetrics

# fleet.v1 / metrics.v1 records read back at start (per partition): about an hour and a
# half of a ten-member fleet's status rows and heartbeats.
TAIL_RECORDS = 50_000
TOPICS: dict[str, Optional[int]] = {"fleet": TAIL_RECORDS, "metrics": TAIL_RECORDS, "dlq": None}


def prometheus_family(f: Family):
    """One prometheus_client metric family from a :class:`Family`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    spec = f.spec
    if spec.kind == "histogram":
        fam = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
        for labels, buckets, total in f.histograms:
            fam.add_metric(labels, [(floatToGoString(b), n) for b, n in buckets], sum_value=total)
        return fam
    # A counter's family name drops the _total its samples carry (prometheus_client's rule).
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    fam = cls(spec.name, spec.help, labels=spec.labels)
    for labels, value in f.samples:
        fam.add_metric(labels, value)
    return fam


class LogCollector:
    """A prometheus_client collector over a :class:`LogMetrics` (read at each scrape)."""

    def __init__(self, metrics: LogMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list:
        return []  # no collect() at registration: the families are known only from data

    def collect(self) -> Iterator:
        for f in self.metrics.families():
            yield prometheus_family(f)


def _prometheus_client():
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("prometheus_client is not installed: pip install prometheus_client "
                          "(a dependency of tapioca-rl; reinstall it)") from None
    return prometheus_client


class MetricsServer:
    """Follow the topics and serve ``http://host:port/metrics`` (port 0: a free one,
    :attr:`port` says which)."""

    def __init__(self, cfg: BusConfig, *, host: str, port: int, run_id: str = ANY_RUN) -> None:
        self.cfg = cfg
        self.host = host
        self.port = port
        self.metrics = LogMetrics(run_id=run_id)
        self.follower = LogFollower(cfg, TOPICS, self._record)
        self._httpd = None

    def _record(self, topic: str, record: Record) -> None:
        self.metrics.record(topic, record.event)

    def start(self) -> "MetricsServer":
        client = _prometheus_client()
        registry = client.CollectorRegistry(auto_describe=False)
        registry.register(LogCollector(self.metrics))
        try:
            self._httpd, _thread = client.start_http_server(self.port, addr=self.host, registry=registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc} "
                              "(another process has the port? pass --port, or set "
                              "observability.prometheus_port)") from None
        self.port = self._httpd.server_port
        self.follower.start()
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self.follower.stop()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
