"""Administering the log from the CLI: `tapioca broker up|down|status` (the embedded
broker), `tapioca topics create|list|describe`, `tapioca tail`, `tapioca lag`,
`tapioca keygen` (the run's signing key), `tapioca schemas export|check` and
`tapioca checkpoint migrate`.

``app`` holds the top-level commands and ``broker_app``, ``topics_app``, ``schemas_app``,
``checkpoint_app`` the command groups; ops/cli.py adds them to `tapioca`.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from ..schemas.errors import TapiocaError
from . import broker_state
from .cli_context import OUTPUT_HELP, bus_config, check_output, console, emit_json

app = typer.Typer()
broker_app = typer.Typer(no_args_is_help=True, help="The embedded (Tansu) broker.")
topics_app = typer.Typer(no_args_is_help=True, help="Create and inspect Tapioca topics.")
schemas_app = typer.Typer(no_args_is_help=True, help="Event JSON Schemas.")
checkpoint_app = typer.Typer(no_args_is_help=True, help="Trainer checkpoints.")


# ---------------------------------------------------------------------- broker


@broker_app.command("up")
def broker_up(
    port: int = typer.Option(broker_state.DEFAULT_PORT, help="Loopback port to listen on."),
    storage: str = typer.Option("memory://tansu/", help="Tansu storage engine URL."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Start the embedded broker in the background."""
    check_output(output)
    state = broker_state.broker_up(port, storage)
    if output == "json":
        emit_json(state)
    else:
        verb = "already up" if state.get("already_running") else "up"
        console.print(f"broker {verb} at [bold]{state['bootstrap']}[/] (pid {state['pid']}, "
                      f"{state['storage']}); log: {state['log']}")


@broker_app.command("down")
def broker_down() -> None:
    """Stop the embedded broker started by `tapioca broker up`."""
    state = broker_state.broker_down()
    if state is None:
        console.print("no embedded broker is running")
    else:
        console.print(f"broker at {state['bootstrap']} stopped")


@broker_app.command("status")
def broker_status(output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP)) -> None:
    """Is the embedded broker running, and does it answer?"""
    check_output(output)
    status = broker_state.broker_status()
    if output == "json":
        emit_json(status)
    elif not status["running"]:
        console.print("no embedded broker is running (`tapioca broker up` starts one)")
    else:
        console.print(f"running at {status['bootstrap']} (pid {status['pid']}), "
                      f"answering: {status['answering']}")
    if not status["running"]:
        raise typer.Exit(3)


# ---------------------------------------------------------------------- keys


@app.command("keygen")
def keygen(path: str = typer.Argument(..., help="Where to write the key (e.g. "
                                      "runs/compose/secrets/bus.key).")) -> None:
    """Create a signing key for control commands and weights events (a 0600 file; an
    existing key is kept). Name it in the run's config as bus.signing_key_path."""
    from ..bus.signing import create_key_file

    key = create_key_file(path)
    console.print(f"signing key {key.key_id} at {path} (bus.signing_key_path={path})")


# ---------------------------------------------------------------------- checkpoints


@checkpoint_app.command("migrate")
def checkpoint_migrate(run_dir: str = typer.Argument(..., help="The run directory "
                                                     "(runs/EXPERIMENT/TRIAL).")) -> None:
    """Convert a run's old pickle checkpoints (checkpoints/*.pt) to safetensors + JSON.
    They are read with torch.load(weights_only=True), which refuses code; the .pt files
    are kept (delete them once the run resumes)."""
    from pathlib import Path

    from ..trainers.checkpoint import migrate_legacy

    olds = sorted((Path(run_dir) / "checkpoints").glob("*.pt"))
    if not olds:
        raise TapiocaError(f"no old checkpoints (*.pt) in {Path(run_dir) / 'checkpoints'}")
    for old in olds:
        console.print(f"{old} -> {migrate_legacy(old)}")


# ---------------------------------------------------------------------- topics


@topics_app.command("create")
def topics_create(
    partitions: list[str] = typer.Option(
        [], "--partitions", "-p", help="Override a topic's partitions: NAME=N (repeatable)."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Create every registry topic that does not exist yet (idempotent)."""
    from ..bus.admin import ensure_topics

    check_output(output)
    overrides = {}
    for item in partitions:
        name, _, n = item.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise typer.BadParameter(f"--partitions expects NAME=N with N >= 1, got {item!r}")
        overrides[name] = int(n)
    cfg = bus_config()
    created = ensure_topics(cfg, partitions=overrides)
    if output == "json":
        emit_json({"created": created})
    elif created:
        console.print("created " + ", ".join(created))
    else:
        console.print("all topics already exist")


@topics_app.command("list")
def topics_list(output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP)) -> None:
    """List the cluster's topics."""
    from ..bus.admin import list_topics

    check_output(output)
    topics = list_topics(bus_config())
    if output == "json":
        emit_json([{"name": t.name, "partitions": t.partitions} for t in topics])
        return
    table = Table("topic", "partitions")
    for t in topics:
        table.add_row(t.name, str(t.partitions))
    console.print(table)


@topics_app.command("describe")
def topics_describe(
    name: str = typer.Argument(..., help="Full topic name or registry name (e.g. prompts)."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Partitions, offsets and config of one topic."""
    from ..bus.admin import describe_topic
    from ..bus.reader import _full_name

    check_output(output)
    cfg = bus_config()
    info = describe_topic(cfg, _full_name(cfg, name))
    if output == "json":
        emit_json(info)
        return
    table = Table("partition", "low", "high (approx.)", "leader", title=info["name"])
    for p in info["partitions"]:
        table.add_row(str(p["partition"]), str(p["low"]), str(p["high"]), str(p["leader"]))
    console.print(table)
    for k, v in sorted(info["config"].items()):
        console.print(f"  {k} = {v}")


# ---------------------------------------------------------------------- tail / lag


@app.command("tail")
def tail(
    name: str = typer.Argument(..., help="Topic, e.g. tapioca.prompts.v1 or prompts."),
    n: int = typer.Option(10, "-n", help="How many of the latest events to show first."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Print a topic's latest events, decoded."""
    from ..bus.admin import admin_client
    from ..bus.reader import TopicReader
    from .render import record_json, record_row, records_table

    check_output(output)
    if n < 0:
        raise typer.BadParameter("-n must be >= 0")
    cfg = bus_config()
    admin_client(cfg)  # one-line error when no broker answers (TopicReader raises raw Kafka errors)
    with TopicReader(cfg, name, tail=n) as reader:
        backlog = list(reader.records(idle_s=0.5))
        backlog.sort(key=lambda r: (r.source.timestamp_ms, r.source.partition, r.source.offset))
        backlog = backlog[-n:] if n else []
        if output == "json":
            for r in backlog:
                emit_json(record_json(r))
        else:
            console.print(records_table(reader.topic, backlog))
        if follow:
            try:
                for r in reader.records(follow=True):
                    if output == "json":
                        emit_json(record_json(r))
                    else:
                        console.print(record_row(r))
            except KeyboardInterrupt:
                pass


@app.command("lag")
def lag(
    group: list[str] = typer.Option([], "--group", "-g", help="Only these consumer groups."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Consumer lag per group and partition (committed vs end offset)."""
    from ..bus.admin import consumer_lag

    check_output(output)
    rows = consumer_lag(bus_config(), groups=group or None)
    if output == "json":
        emit_json([r.__dict__ for r in rows])
        return
    table = Table("group", "topic", "partition", "committed", "end", "lag",
                  caption="end offsets come from broker watermarks: approximate on brokers "
                          "that report them wrong (e.g. Tansu)")
    for r in rows:
        table.add_row(r.group, r.topic, str(r.partition), str(r.committed), str(r.end), str(r.lag))
    console.print(table)


# ---------------------------------------------------------------------- schemas


@schemas_app.command("export")
def schemas_export(directory: Optional[str] = typer.Option(None, help="Target directory.")) -> None:
    """Write one JSON Schema per event (default: the package's schemas/json/)."""
    from pathlib import Path

    from ..schemas.jsonschema import JSON_DIR, export

    for path in export(Path(directory) if directory else JSON_DIR):
        console.print(str(path))


@schemas_app.command("check")
def schemas_check() -> None:
    """Fail when the current event classes break the exported schemas."""
    from ..schemas.jsonschema import all_schemas, compatibility_problems, load_exported

    committed = load_exported()
    problems = []
    for name, schema in all_schemas().items():
        if name in committed:
            problems += [f"{name}: {p}" for p in compatibility_problems(committed[name], schema)]
    for name in set(committed) - set(all_schemas()):
        problems.append(f"{name}: event type removed")
    for p in problems:
        console.print(f"[red]incompatible[/] {p}")
    if problems:
        raise typer.Exit(1)
    console.print("schemas are backward compatible")
