"""`tapioca traces show TRAJ_ID` and `tapioca traces export`: one OpenTelemetry trace
per trajectory, from the timestamps its events carry (ops/traces.py, ops/lifecycle.py;
docs/fleet.md).

Reads ``prompts.v1``, ``trajectories.v1``, ``rewards.v1``, ``samples.v1``,
``progress.v1``, ``weights.v1`` and ``metrics.v1`` of the broker and prefix the global
options name (``--run-dir``: that run's events only), or a run's archive
(``--archive``); `export` sends the traces over OTLP/HTTP (the otel extra), `show`
prints one. ``--follow`` exports each group's trajectories once the trainer's verdict
on the group (trained into a version, or rejected) is on the log, until Ctrl-C or
SIGTERM: what `tapioca train` starts when ``observability.otlp_endpoint`` is set.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import typer

from ..schemas.errors import TapiocaError
from .cli_context import OUTPUT_HELP, G, bus_config, check_output, console, emit_json, run_dir_run_id

# This module's command group; ops/cli.py adds it to `tapioca` as `traces`.
traces_app = typer.Typer(no_args_is_help=True, help="OpenTelemetry traces of trajectories, from the log.")

TRACE_TOPICS = ("prompts", "trajectories", "rewards", "samples", "progress", "weights", "metrics")
# A group is exported this long after its verdict was first read: the topics are read by
# separate readers, and the group's other events may still be on their way.
SETTLE_S = 3.0
DEFAULT_OTLP_ENDPOINT = "http://127.0.0.1:4318"
ARCHIVE_HELP = "A run's archive directory (archive.enabled) instead of the broker's topics."


def _run_log(archive: Optional[str]):
    from .lifecycle import RunLog
    from .timeline import events_from_archive, events_from_topics

    run_id = run_dir_run_id()
    events = events_from_archive(archive) if archive else events_from_topics(bus_config(), TRACE_TOPICS)
    return RunLog.of(events, run_id=run_id)


def _endpoint(endpoint: Optional[str]) -> str:
    from .metrics_cli import run_observability

    return (endpoint or run_observability(G.run_dir).otlp_endpoint
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_OTLP_ENDPOINT)


@traces_app.command("show")
def show(
    traj_id: str = typer.Argument(..., help="A trajectory id (group_id:sample_index), as events and "
                                  "`tapioca tail` show it."),
    archive: Optional[str] = typer.Option(None, "--archive", help=ARCHIVE_HELP),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """One trajectory's trace: its trace id (what a tracing backend finds it by) and its
    spans (prompt, generation, reward, advantage, sample, train), as far as the log has
    them."""
    from .render import narrow_table, number_column
    from .traces import trace_id_hex, trajectory_spans

    check_output(output)
    t = _run_log(archive).trajectory(traj_id)
    if t is None:
        raise TapiocaError(f"no trajectory {traj_id!r} on the log (ids are group_id:sample_index, e.g. "
                           "from `tapioca tail trajectories`; --run-dir / --prefix name the run)")
    spans = trajectory_spans(t)
    t0 = spans[0].start
    if output == "json":
        emit_json({"traj_id": traj_id, "trace_id": trace_id_hex(traj_id), "done": t.done,
                   "spans": [{"name": s.name, "start": s.start, "end": s.end, "attributes": s.attributes,
                              "error": s.error} for s in spans]})
        return
    table = narrow_table(f"trace {trace_id_hex(traj_id)} of {traj_id}")
    table.add_column("span")
    for col in ("at ms", "ms"):
        number_column(table, col)
    table.add_column("attributes", overflow="fold")
    for s in spans:
        attrs = ", ".join(f"{k.removeprefix('tapioca.')}={v:.4g}" if isinstance(v, float) else
                          f"{k.removeprefix('tapioca.')}={v}" for k, v in s.attributes.items())
        table.add_row(s.name, f"{1000 * (s.start - t0):.0f}", f"{1000 * (s.end - s.start):.0f}",
                      attrs + (f" [red]{s.error}[/]" if s.error else ""))
    if not t.done:
        table.caption = "its group has no verdict yet (not trained or rejected): later spans are missing"
    console.print(table)


@traces_app.command("export")
def export(
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="OTLP/HTTP endpoint (default: the run's "
                                           "observability.otlp_endpoint, $OTEL_EXPORTER_OTLP_ENDPOINT, "
                                           f"else {DEFAULT_OTLP_ENDPOINT})."),
    archive: Optional[str] = typer.Option(None, "--archive", help=ARCHIVE_HELP),
    traj: list[str] = typer.Option([], "--traj", help="Only this trajectory (repeatable); default: every "
                                   "trajectory whose group the trainer trained or rejected."),
    follow: bool = typer.Option(False, "--follow", help="Keep reading the topics and export each group "
                                "once the trainer's verdict on it is on the log."),
) -> None:
    """Export trajectories' traces over OTLP/HTTP (trace id: the first 16 bytes of
    SHA-256 of the traj_id; `tapioca traces show` prints it)."""
    from .traces import TrajectoryTracer, otlp_exporter

    url = _endpoint(endpoint)
    tracer = TrajectoryTracer(otlp_exporter(url), run_id=run_dir_run_id() if G.run_dir else "")
    try:
        if follow:
            if archive or traj:
                raise typer.BadParameter("--follow reads the topics as they grow: leave out --archive and --traj")
            _follow(tracer, url)
            return
        log = _run_log(archive)
        chosen = [log.trajectory(t) for t in traj] if traj else [t for t in log.trajectories() if t.done]
        missing = [t for t, found in zip(traj, chosen) if found is None]
        if missing:
            raise TapiocaError(f"no trajectory {', '.join(missing)} on the log")
        n = tracer.export_all(chosen)
        tracer.shutdown()
        if tracer.failed_spans:
            raise TapiocaError(f"{url} did not accept {tracer.failed_spans} span(s) of {n} trace(s): is an "
                               "OTLP/HTTP collector listening there (Jaeger, the OpenTelemetry Collector: "
                               "port 4318)? pass --endpoint")
        console.print(f"exported {n} trace(s) to {url}", markup=False, highlight=False)
    finally:
        tracer.shutdown()


def _follow(tracer, url: str) -> None:
    from .lifecycle import RunLog
    from .log_follow import LogFollower

    lock = threading.Lock()
    log = RunLog(run_id=run_dir_run_id())
    exported: set[str] = set()
    verdict_seen: dict[str, float] = {}

    def on_record(_topic: str, record) -> None:
        event = record.event
        if event is None or getattr(event, "group_id", None) in exported:
            return  # a late redelivery of an exported group: its trace is out
        with lock:
            log.add(event)

    follower = LogFollower(bus_config(), {name: None for name in TRACE_TOPICS}, on_record).start()
    console.print(f"exporting each trained or rejected trajectory's trace to {url}; Ctrl-C stops",
                  markup=False, highlight=False, soft_wrap=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(1.0):
            now = time.monotonic()
            with lock:
                ready = []
                for group_id in list(log.trajs):
                    ts = log.group_trajectories(group_id)
                    if not ts or not all(t.done for t in ts):
                        continue
                    if now - verdict_seen.setdefault(group_id, now) >= SETTLE_S:
                        ready.append(ts)
                        log.forget(group_id)
                        exported.add(group_id)
                        verdict_seen.pop(group_id, None)
            for ts in ready:
                tracer.export_all(ts)
            if ready:
                failed = tracer.failed_spans
                tracer.provider.force_flush()
                if tracer.failed_spans > failed:  # said once per failing turn; the SDK retried
                    console.print(f"warning: {url} did not accept {tracer.failed_spans - failed} span(s) "
                                  "(is the collector up?)", markup=False, highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        pass
    finally:
        follower.stop()
