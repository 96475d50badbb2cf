"""`tapioca metrics serve`: a Prometheus endpoint for a fleet, derived from the log
(ops/prometheus.py; the metric list is ops/log_metrics.py ``METRICS``; docs/fleet.md).

Reads ``fleet.v1``, ``metrics.v1`` and ``dlq.v1`` of the broker and prefix the global
options name; with ``--run-dir``, only that run's events, and the run's
``observability.prometheus_port`` / ``prometheus_host`` unless ``--port`` / ``--host``
say otherwise (which is how `tapioca train` starts it when that port is set). Serves
until Ctrl-C or SIGTERM, then exits 0.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from .cli_context import G, bus_config, console, run_dir_run_id

# This module's command group; ops/cli.py adds it to `tapioca` as `metrics`.
metrics_app = typer.Typer(no_args_is_help=True, help="Prometheus metrics of a fleet, derived from the log.")


def run_observability(run_dir: Optional[str]):
    """The ``observability`` section of a run directory's config.yaml (defaults without one)."""
    import yaml

    from ..config.observability import ObservabilityConfig

    path = Path(run_dir) / "config.yaml" if run_dir else None
    section = {}
    if path is not None and path.exists():
        section = dict((yaml.safe_load(path.read_text()) or {}).get("observability") or {})
    return ObservabilityConfig(**section)


@metrics_app.command("serve")
def serve(
    port: Optional[int] = typer.Option(None, "--port", help="TCP port of /metrics (default: the run's "
                                       "observability.prometheus_port, else 9464; 0: any free one)."),
    host: Optional[str] = typer.Option(None, "--host", help="Address to listen on (default: the run's "
                                       "observability.prometheus_host, 127.0.0.1; 0.0.0.0: every "
                                       "interface, e.g. for a Prometheus in a container)."),
) -> None:
    """Serve the fleet's metrics at http://HOST:PORT/metrics (Prometheus text format):
    member status and restarts, policy versions, approximate consumer lag, throughput,
    reward, staleness, trained and rejected groups, dead letters, the head gates' open
    slots, held-out scores, the proxy's sessions; all from fleet.v1, metrics.v1 and
    dlq.v1. Labels: run, role, member."""
    from ..config.observability import DEFAULT_PROMETHEUS_PORT
    from .prometheus import MetricsServer

    obs = run_observability(G.run_dir)
    chosen_port = port if port is not None else obs.prometheus_port or DEFAULT_PROMETHEUS_PORT
    if not 0 <= chosen_port < 65536:
        raise typer.BadParameter(f"--port {chosen_port} is not a TCP port")
    cfg = bus_config()
    run_id = run_dir_run_id()
    server = MetricsServer(cfg, host=host or obs.prometheus_host, port=chosen_port, run_id=run_id).start()
    what = f"run {run_id}" if G.run_dir else f"every run on prefix {cfg.topic_prefix}"
    console.print(f"serving {server.url} ({what}; broker {cfg.bootstrap_servers}); Ctrl-C stops it",
                  markup=False, highlight=False, soft_wrap=True)
    done = threading.Event()
    # `tapioca train` stops its children with SIGTERM; docker with SIGTERM too.
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
