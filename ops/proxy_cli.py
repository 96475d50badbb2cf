"""`tapioca proxy`: serve the OpenAI-compatible agent proxy of a run; `tapioca reward`:
reward one of its ended sessions.

Builds the proxy from the run's config (the same model directory, generation defaults
and head-gate parameters the rollout workers use; tapioca.runtime.builders) and serves it
until Ctrl-C. `tapioca reward SESSION_ID VALUE` sends the signed ``reward`` control
command to the run's live proxy (producers/proxy/delayed_rewards.py) and prints its
answer.
"""

from __future__ import annotations

import secrets
from typing import Optional

import typer

from .cli_context import EXTRA_ARGS, OUTPUT_HELP, G, bus_config, check_output, console
from .fleet_cli import TIMEOUT_HELP

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()


@app.command("proxy", context_settings=EXTRA_ARGS)
def proxy(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file of the run."),
) -> None:
    """Serve a run's OpenAI-compatible agent proxy (agents set base_url to it).

    Extra arguments are dotted overrides, e.g. proxy.port=8001 proxy.api_key=KEY."""
    from transformers.utils import logging as hf_logging

    from ..bus.admin import ensure_topics
    from ..config.loader import load_config
    from ..config.schema import TrainConfig
    from ..producers.proxy import ProxyServer
    from ..runtime.builders import build_proxy_service
    from ..runtime.run import resolve_run
    from . import broker_state

    hf_logging.disable_progress_bar()
    cfg = load_config(TrainConfig, config, list(ctx.args))
    # An example YAML's empty trial_name: a new run, as `tapioca train` names it; the
    # proxy publishes under this run's id unless bus.run_id names one.
    cfg = resolve_run(cfg, claim_run=True, bootstrap=broker_state.resolve_bootstrap(
        G.bootstrap, cfg.bus.bootstrap_servers))
    if not cfg.proxy.admin_key():
        cfg = resolve_run(cfg, values={"proxy.api_key": f"tpa-{secrets.token_urlsafe(24)}"})
        console.print(f"admin key (proxy.api_key): {cfg.proxy.api_key}")
    ensure_topics(cfg.bus)
    server = ProxyServer(build_proxy_service(cfg), cfg.proxy.host, cfg.proxy.port)
    console.print(f"proxy of run {cfg.run_id} on {server.base_url} (model {cfg.proxy.served_model_name}, "
                  f"broker {cfg.bus.bootstrap_servers})")
    server.serve()


@app.command("reward", context_settings={"ignore_unknown_options": True})  # VALUE may be -1
def reward(
    session_id: str = typer.Argument(..., help="The session (sess-..., from POST /v1/sessions)."),
    value: float = typer.Argument(..., help="The reward: a finite number within +-1e9."),
    timeout: float = typer.Option(10.0, "--timeout", help=TIMEOUT_HELP),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Reward an ended agent session (online mode: seconds to days after its end).

    Sends the signed ``reward`` command (the run's key, as pause / drain are) to the run's
    proxy, which publishes the session's RewardEvents; the same as ``POST
    /v1/sessions/SESSION_ID/reward`` with the admin key. Refused with the proxy's reason:
    an unknown or expired session, a second reward, a value that is not finite."""
    import math

    from ..bus.fleet import ControlError, read_fleet
    from .fleet_cli import _command

    check_output(output)
    if not math.isfinite(value):
        raise typer.BadParameter(f"the reward must be a finite number, not {value}")
    live = [m for m in read_fleet(bus_config()) if m.event.role == "proxy-sessions" and m.live]
    if not live:
        raise ControlError("no proxy of this run is running (no live proxy-sessions member in "
                           "`tapioca status`): start the run (`tapioca train` with agent.mode "
                           "online), check --run-dir / --prefix, or POST the reward to "
                           "/v1/sessions/SESSION_ID/reward")
    newest = max(live, key=lambda m: m.event.produced_at)
    _command("reward", newest.event.member_id, args={"session_id": session_id, "reward": value},
             timeout_s=timeout, output=output, members=[newest])
