"""`tapioca proxy`: serve the OpenAI-compatible agent proxy of a run.

Builds the proxy from the run's config (the same model directory, generation defaults
and head-gate parameters the rollout workers use; tapioca.runtime.builders) and serves it
until Ctrl-C.
"""

from __future__ import annotations

import secrets
from typing import Optional

import typer

from .cli_context import EXTRA_ARGS, G, console

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
