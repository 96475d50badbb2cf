"""`tapioca proxy`: serve the OpenAI-compatible agent proxy of a run.

Builds the proxy from the run's config (the same model directory, generation defaults
and head-gate parameters the rollout workers use) and serves it until Ctrl-C.
"""

from __future__ import annotations

import secrets
from typing import Optional

import typer

from .cli_context import G, console

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()


def build_proxy_service(cfg, *, member: int = 0):
    """A :class:`~tapioca.producers.proxy.ProxyService` for ``cfg`` (a TrainConfig)."""
    import os

    from tapioca.config.sections import proxy_section
    from tapioca.engines.base import SamplingParams
    from tapioca.models.tokenizer import load_tokenizer
    from tapioca.ops.role_builders import build_engine
    from tapioca.producers.proxy import ProxyService
    from tapioca.schemas.errors import ConfigError

    sec = proxy_section(cfg)
    if not sec.model.path:
        raise ConfigError("model.path is empty; point it to the run's model directory (e.g. "
                          "runs/<experiment>/<trial>/model) or create one with `tapioca model-init DIR`")
    # The char tokenizer must not be reloaded as Qwen's byte-level one (see load_tokenizer).
    tokenizer = load_tokenizer(sec.model.path)
    # rollout.engine picks the engine here too: the in-process one, or a vLLM / SGLang server.
    bundle = build_engine(sec.model, sec.rollout, seed=sec.seed * 1000 + 500 + member,
                          tokenizer=tokenizer, log_dir=os.path.join(cfg.run_path, "logs"),
                          member=member, name="proxy")
    engine, load_weights = bundle.engine, bundle.load_weights
    g = sec.gconfig
    sampling = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                              max_new_tokens=g.max_new_tokens, stop_strings=tuple(g.stop))

    p = sec.proxy
    return ProxyService(
        engine=engine, tokenizer=tokenizer, bus=cfg.bus, load_weights=load_weights, sampling=sampling,
        api_key=p.admin_key(), served_model_name=p.served_model_name, default_group_size=g.n_samples,
        max_head_offpolicyness=sec.max_head_offpolicyness, prompts_per_step=sec.prompts_per_step,
        max_tokens_per_request=p.max_tokens_per_request,
        max_tokens_per_session=p.max_tokens_per_session, max_request_bytes=p.max_request_bytes,
        session_ttl_s=p.session_ttl_s, max_sessions=p.max_sessions, end_mode=p.end_mode,
        turn_discount=p.turn_discount, run_tag=sec.run_id,
        max_context_tokens=bundle.max_context_tokens)


@app.command("proxy", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def proxy(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file of the run."),
) -> None:
    """Serve a run's OpenAI-compatible agent proxy (agents set base_url to it).

    Extra arguments are dotted overrides, e.g. proxy.port=8001 proxy.api_key=KEY."""
    from transformers.utils import logging as hf_logging

    from ..bus.admin import ensure_topics
    from ..config.loader import load_config
    from ..config.schema import TrainConfig, name_trial
    from ..producers.proxy import ProxyServer
    from . import broker_state

    hf_logging.disable_progress_bar()
    cfg = load_config(TrainConfig, config, list(ctx.args))
    name_trial(cfg)  # an example YAML's empty trial_name: a new run, as `tapioca train` names it
    cfg.bus.bootstrap_servers = broker_state.resolve_bootstrap(G.bootstrap, cfg.bus.bootstrap_servers)
    if cfg.bus.run_id == "default":
        cfg.bus.run_id = cfg.run_id
    if not cfg.proxy.admin_key():
        cfg.proxy.api_key = f"tpa-{secrets.token_urlsafe(24)}"
        console.print(f"admin key (proxy.api_key): {cfg.proxy.api_key}")
    ensure_topics(cfg.bus)
    server = ProxyServer(build_proxy_service(cfg), cfg.proxy.host, cfg.proxy.port)
    console.print(f"proxy of run {cfg.run_id} on {server.base_url} (model {cfg.proxy.served_model_name}, "
                  f"broker {cfg.bus.bootstrap_servers})")
    server.serve()
