"""What every `tapioca` command module shares: the console, the global options of this
invocation (``G``, set by the root callback in ops/cli.py), the bus settings they name
(``bus_config()``) and the output helpers (``emit_json``, ``check_output``).

The command modules (admin_cli, commands, run_cli, eval_cli, plot, fleet_cli, supervised_cli,
plan_cli, proxy_cli, replay_cli, regenerate_cli) import this module and never ops/cli.py, which imports them
and composes them into the one ``tapioca`` command: no import circle.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Optional

import orjson
import typer
from rich.console import Console

from . import broker_state

console = Console()
# Progress of a command whose stdout is one JSON document (-o json) goes here.
err_console = Console(stderr=True)
OUTPUT_HELP = "table (for people) or json (for scripts)"
# Commands that take a run's dotted config overrides after their options.
EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}


class _Globals:
    """The global options (``tapioca --bootstrap-server ... COMMAND``), set by the root
    callback before any command runs."""

    bootstrap: Optional[str] = None
    prefix: Optional[str] = None
    debug: bool = False
    run_dir: Optional[str] = None
    key_file: Optional[str] = None


G = _Globals()


def run_bus_section(run_dir: str) -> dict:
    """The ``bus`` section of a run directory's config.yaml (written by `tapioca train`)."""
    import yaml

    from ..schemas.errors import ConfigError

    path = Path(run_dir) / "config.yaml"
    if not Path(run_dir).is_dir():
        raise ConfigError(f"--run-dir {run_dir} is not a directory (a run's directory is "
                          "runs/EXPERIMENT/TRIAL)")
    if not path.exists():
        return {}
    return dict((yaml.safe_load(path.read_text()) or {}).get("bus") or {})


def bus_config(**overrides):
    """The :class:`BusConfig` the global options name: ``--run-dir``'s bus section, the
    broker of ``--bootstrap-server`` (else the run's, else ``tapioca broker up``'s), the
    ``--prefix`` and the signing key (``--key-file``, else the run's), then ``overrides``."""
    from ..bus.settings import BusConfig
    from ..bus.signing import key_path_of_run

    section = run_bus_section(G.run_dir) if G.run_dir else {}
    for name in ("client_id", "run_id"):
        section.pop(name, None)  # this process's own
    section.update(
        bootstrap_servers=broker_state.resolve_bootstrap(
            G.bootstrap, section.get("bootstrap_servers")),
        topic_prefix=G.prefix or section.get("topic_prefix") or "tapioca")
    if G.key_file:
        section["signing_key_path"] = G.key_file
    elif G.run_dir and not section.get("signing_key_path"):
        default = key_path_of_run(G.run_dir)
        if Path(default).exists():
            section["signing_key_path"] = str(default)
    section.update(overrides)
    return BusConfig(**section)


def run_dir_run_id() -> str:
    """The bus run id of ``--run-dir``'s run (its config.yaml's ``bus.run_id``, which
    `tapioca train` writes), or ANY_RUN without one: `status` and the fleet commands
    narrow the fleet to that run's members (runs before it on the prefix reuse the same
    member ids), and commands carry it, so other runs' members skip them."""
    from ..schemas.envelope import ANY_RUN

    run_id = run_bus_section(G.run_dir).get("run_id") if G.run_dir else None
    return run_id if isinstance(run_id, str) and run_id else ANY_RUN


def emit_json(obj) -> None:
    """One JSON document on its own line of stdout (``-o json``), flushed."""
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")
    sys.stdout.flush()


def check_output(output: str) -> None:
    """``-o/--output`` takes table or json."""
    if output not in ("table", "json"):
        raise typer.BadParameter("--output must be table or json")


@contextlib.contextmanager
def quiet_hugging_face():
    """Around a one-process command that loads or saves models: Hugging Face's progress
    bars ("Loading weights", "Writing model shards") off, as every command has them, and
    the notices the libraries raise about each other's deprecated methods (peft calling
    one transformers 5 renamed) not shown: the command says its own progress, and a user
    can do nothing about those."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"(transformers|peft)(\.|$)")
        yield
