"""Watching a run as a service: a Prometheus scrape endpoint and OpenTelemetry traces,
both derived from the log (ops/prometheus.py, ops/traces.py; docs/fleet.md). Off by
default; `tapioca metrics serve` and `tapioca traces export` run them by hand for any
run, whatever this section says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..schemas.errors import require_config as _require

# OpenTelemetry's Prometheus exporter's default port: the one a Prometheus user tries first.
DEFAULT_PROMETHEUS_PORT = 9464


@dataclass(frozen=True, kw_only=True)
class ObservabilityConfig:
    # Set: `tapioca train` starts `tapioca metrics serve` as one more supervised process,
    # serving /metrics on this port (Prometheus's text format). null: no endpoint.
    prometheus_port: Optional[int] = None
    # The address it listens on: loopback by default (a scrape from another host, or from
    # a Prometheus in a container, needs 0.0.0.0). The metrics hold no secret, but
    # they name hosts, members and the run.
    prometheus_host: str = "127.0.0.1"
    # Set (an OTLP/HTTP endpoint, e.g. http://127.0.0.1:4318): `tapioca train` starts
    # `tapioca traces export --follow`, one trace per trajectory once its group is
    # trained or rejected. Needs the otel extra (pip install 'tapioca-rl[otel]'). null: none.
    otlp_endpoint: Optional[str] = None

    def __post_init__(self) -> None:
        if self.prometheus_port is not None:
            _require(0 < self.prometheus_port < 65536,
                     f"observability.prometheus_port={self.prometheus_port}: a TCP port "
                     f"(1..65535, e.g. {DEFAULT_PROMETHEUS_PORT}), or null for no endpoint")
        _require(bool(self.prometheus_host), "observability.prometheus_host must name an address "
                 "(127.0.0.1, or 0.0.0.0 for every interface)")
        if self.otlp_endpoint is not None:
            _require(self.otlp_endpoint.startswith(("http://", "https://")),
                     f"observability.otlp_endpoint={self.otlp_endpoint!r}: an OTLP/HTTP URL "
                     "(http://HOST:4318), or null for no traces")
