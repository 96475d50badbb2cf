"""`tapioca`: the one command for everything a person does with a Tapioca fleet.

This module is the root only: the global options, and the composition of the command
modules, each of which owns its commands (a Typer app of its own) and imports the shared
pieces from ops/cli_context.py, never this module.

Global options: ``--bootstrap-server`` (or ``$TAPIOCA_BOOTSTRAP``; else the broker of
``tapioca broker up``), ``--prefix`` (topic prefix, default ``tapioca``), and
``--run-dir`` (a run's directory: its config.yaml gives the broker, prefix and security
settings unless the flags do, and its ``secrets/bus.key`` signs commands) or
``--key-file`` (the signing key alone; or ``$TAPIOCA_SIGNING_KEY_FILE``). Errors are one
line on stderr and a non-zero exit (78 for a config or usage error, else 1), never a
stack trace (``--debug`` shows it).

Global options go before the command or anywhere after it, as kafka's tools and kubectl
take them (``tapioca status --run-dir R`` = ``tapioca --run-dir R status``):
:func:`hoist_global_options` moves them to the front before the parser sees them.
Everything after a ``--`` stays where it is.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

import typer

from ..schemas.errors import TapiocaError
from . import (
    admin_cli,
    commands,
    eval_cli,
    fleet_cli,
    lora_cli,
    metrics_cli,
    plan_cli,
    plot,
    proxy_cli,
    regenerate_cli,
    replay_cli,
    run_cli,
    supervised_cli,
    traces_cli,
)
from .cli_context import G

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Tapioca: asynchronous RL for LLMs over Kafka.")
# Each module's top-level commands, in the order `tapioca --help` lists them, then the
# command groups (Typer lists a group's commands before its sub-groups).
for _module in (admin_cli, commands, run_cli, eval_cli, regenerate_cli, plot, fleet_cli, supervised_cli, plan_cli,
                proxy_cli, replay_cli, lora_cli):
    app.add_typer(_module.app)
for _name, _group in (("broker", admin_cli.broker_app), ("topics", admin_cli.topics_app),
                      ("schemas", admin_cli.schemas_app),
                      ("checkpoint", admin_cli.checkpoint_app),
                      ("weights", fleet_cli.weights_app), ("dlq", fleet_cli.dlq_app),
                      ("config", run_cli.config_app), ("metrics", metrics_cli.metrics_app),
                      ("traces", traces_cli.traces_app)):
    app.add_typer(_group, name=_name)


@app.callback()
def _main(
    bootstrap_server: Optional[str] = typer.Option(
        None, "--bootstrap-server", "-b", help="Kafka bootstrap servers (HOST:PORT).",
        envvar="TAPIOCA_BOOTSTRAP"),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Topic prefix (default: the "
                                         "--run-dir config's, else tapioca)."),
    run_dir: Optional[str] = typer.Option(
        None, "--run-dir", help="A run's directory (runs/EXPERIMENT/TRIAL): its config.yaml's "
        "bus settings and its secrets/bus.key (which signs control commands)."),
    key_file: Optional[str] = typer.Option(
        None, "--key-file", envvar="TAPIOCA_SIGNING_KEY_FILE",
        help="The run's signing key file (default: RUN_DIR/secrets/bus.key)."),
    debug: bool = typer.Option(False, "--debug", help="Show stack traces."),
) -> None:
    G.bootstrap = bootstrap_server
    G.prefix = prefix
    G.debug = debug
    G.run_dir = run_dir
    G.key_file = key_file
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


# The root callback's options: those that take a value, and the flags.
GLOBAL_VALUE_OPTIONS = ("--bootstrap-server", "-b", "--prefix", "--run-dir", "--key-file")
GLOBAL_FLAGS = ("--debug",)


def _global_width(args: list[str], i: int) -> int:
    """How many arguments the global option at ``args[i]`` spans (0: not one)."""
    arg = args[i]
    if arg in GLOBAL_FLAGS:
        return 1
    if arg in GLOBAL_VALUE_OPTIONS:
        return 2 if i + 1 < len(args) else 1  # a missing value: the parser says so
    if arg.startswith("--") and arg.split("=", 1)[0] in GLOBAL_VALUE_OPTIONS and "=" in arg:
        return 1
    return 0


def hoist_global_options(args: list[str]) -> list[str]:
    """``args`` with the global options that follow the command moved before it."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--":
            rest += args[i:]
            break
        width = _global_width(args, i)
        if width:
            front += args[i:i + width]
            i += width
        else:
            rest.append(args[i])
            i += 1
    return front + rest


def main() -> None:
    try:
        app(args=hoist_global_options(sys.argv[1:]))
    except TapiocaError as exc:
        if G.debug:
            raise
        sys.stderr.write(f"error: {exc}\n")
        # 78 (EXIT_CONFIG) for a config or usage error: `tapioca proxy` as a role of
        # `tapioca train` is then not restarted, and its line is what the launcher says.
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
