"""What a run of `tapioca train` is made of, before any process starts: its directory
and model (:func:`prepare_run`), its roles and their command lines, the proxy's port
and admin key in agent mode, and its bus run id (one per broker lifetime,
:func:`resolve_bus_run_id`; docs/design-choices.md). Used by the launcher
(ops/launcher.py)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tapioca.bus.signing import SECRETS_DIR, write_secret_file
from tapioca.config.schema import TrainConfig, name_trial, next_bus_run_id

log = logging.getLogger(__name__)

PROXY_KEY_FILE_NAME = "proxy-admin.key"


def prepare_run(cfg: TrainConfig) -> Path:
    """Resolve the run directory and the model; write the resolved config there."""
    name_trial(cfg)
    cfg.run_dir = str(Path(cfg.run_dir).resolve())
    run_dir = Path(cfg.run_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.model.path:
        from transformers.utils import logging as hf_logging

        from tapioca.models.factory import create_tiny_checkpoint

        hf_logging.disable_progress_bar()
        task = "synthetic" if cfg.train_dataset.type == "synthetic" else "gsm8k"
        m = cfg.model
        cfg.model.path = str(create_tiny_checkpoint(
            run_dir / "model", task=task, arch=m.arch, hidden_size=m.hidden_size,
            num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size, seed=m.init_seed,
            tie_word_embeddings=m.tie_word_embeddings).resolve())
    cfg.bus.run_id = cfg.run_id
    return run_dir


def role_counts(cfg: TrainConfig) -> list[tuple[str, int]]:
    # reward.scorer none: rewards come from an external service, no built-in scorer.
    reward = 0 if cfg.reward.scorer == "none" else cfg.reward.workers
    archiver = 1 if cfg.archive.enabled else 0
    counts = [("archiver", archiver), ("trainer", 1), ("advantage", 1), ("reward", reward),
              ("rollout", cfg.rollout.workers), ("feeder", 1)]
    if cfg.agent.enabled:
        # Agent mode: the proxy generates and publishes trajectories + session rewards;
        # agent runners play the dataset's prompts through it (no feeder/rollout/reward).
        counts = [("archiver", archiver), ("trainer", 1), ("advantage", 1), ("proxy", 1),
                  ("agent", cfg.agent.workers)]
    return [(role, n) for role, n in counts if n > 0]


def run_on_log(cfg: TrainConfig, bus_run_id: str) -> bool:
    """Whether the broker holds the log of ``bus_run_id``: its trainer's weights events
    (the weights topic is compacted by run id, so its latest event always stays)."""
    from tapioca.bus.reader import TopicReader
    from tapioca.schemas.events import WeightsEvent

    with TopicReader(cfg.bus, "weights") as reader:
        return any(isinstance(r.event, WeightsEvent) and r.event.run_id == bus_run_id
                   for r in reader.records(idle_s=0.3, timeout_s=60))


def resolve_bus_run_id(cfg: TrainConfig) -> str:
    """The run id this run uses on the bus: ``cfg.run_id`` for a new run; for a resumed
    one, the bus run id of its checkpoint if the broker still holds that log, else the
    next one (``demo.t0@2``): the old log is gone, and with it the group numbering."""
    from tapioca.trainers.checkpoint import SUFFIX, read_progress

    progress = read_progress(Path(cfg.run_path) / "checkpoints" / f"trainer{SUFFIX}")
    if progress is None or progress.version == 0:
        return cfg.run_id
    last = progress.bus_run_id or cfg.run_id
    if run_on_log(cfg, last):
        return last
    new = next_bus_run_id(last)
    log.warning("the broker does not hold the log of run id %s (checkpoint at version %d): "
                "resuming as bus run id %s", last, progress.version, new)
    return new


def role_command(role: str, member: int, config_path: Path) -> list[str]:
    """The command line of one child process."""
    if role == "proxy":
        return [sys.executable, "-m", "tapioca.ops.cli", "proxy", "--config", str(config_path)]
    if role == "agent":
        return [sys.executable, "-m", "tapioca.agents.runner", "--config", str(config_path),
                "--member", str(member)]
    return [sys.executable, "-m", "tapioca.ops.role_main", role, "--config", str(config_path),
            "--member", str(member)]


def resolve_proxy_endpoint(cfg: TrainConfig) -> None:
    """Agent mode: fix the proxy's port and admin key before the config is written, so
    the proxy and the agent runners read the same ones (port 0 / an empty key would
    otherwise be chosen by the proxy alone). The key goes to a 0600 file in the run's
    secrets directory, and only its path into config.yaml."""
    import secrets
    import socket

    if not cfg.proxy.api_key and not cfg.proxy.api_key_file:
        path = Path(cfg.run_path) / SECRETS_DIR / PROXY_KEY_FILE_NAME
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_secret_file(path, "tapioca-admin-" + secrets.token_hex(16) + "\n")
        cfg.proxy.api_key_file = str(path)
    if cfg.proxy.port == 0:
        with socket.socket() as s:
            s.bind((cfg.proxy.host, 0))
            cfg.proxy.port = s.getsockname()[1]


def last_member_warning(role: str, config_path: Path) -> str:
    """What to tell the user when the last live member of ``role`` exited cleanly (a
    drain): on stderr, since the CLI logs only warnings and the run does not stop."""
    if role == "archiver":
        return (f"warning: no archiver member left: the run goes on but is no longer "
                f"archived; start one with `tapioca role archiver --config {config_path}`\n")
    if role == "agent":
        start = f"python -m tapioca.agents.runner --config {config_path}"
    elif role == "proxy":
        start = f"tapioca proxy --config {config_path}"
    else:
        start = f"tapioca role {role} --config {config_path}"
    return (f"warning: no {role} member left: the run cannot progress; start one with "
            f"`{start}` or stop the run (Ctrl-C)\n")
