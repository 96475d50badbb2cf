"""Which processes a run of `tapioca train` starts: its roles and member counts, their
command lines, and what to say when the last member of a role drains. Used by the
launchers (ops/launcher.py, ops/ray_launcher.py). The run itself (directory, model, bus
run id, proxy endpoint) is resolved by :func:`tapioca.runtime.run.resolve_run`."""

from __future__ import annotations

import sys
from pathlib import Path

from ..config.schema import TrainConfig

# The processes that only read the log to show it: their `tapioca` command (ops/metrics_cli.py,
# ops/traces_cli.py).
OBSERVERS = {"metrics": ("metrics", "serve"), "traces": ("traces", "export", "--follow")}


def role_counts(cfg: TrainConfig) -> list[tuple[str, int]]:
    # reward.scorer none: rewards come from an external service, no built-in scorer.
    reward = 0 if cfg.reward.scorer == "none" else cfg.reward.workers
    archiver = 1 if cfg.archive.enabled else 0
    # The evaluator (producers/evaluator.py) when some evaluator.* trigger is set.
    evaluator = 1 if cfg.evaluator.enabled else 0
    counts = [("archiver", archiver), ("trainer", 1), ("advantage", 1), ("reward", reward),
              ("rollout", cfg.rollout.workers), ("feeder", 1), ("evaluator", evaluator)]
    if cfg.agent.enabled:
        # Agent mode: the proxy generates and publishes trajectories + session rewards;
        # agent runners play the dataset's prompts through it (no feeder/rollout/reward).
        # Online mode: the traffic is the data, so no agent runner plays the dataset.
        agents = 0 if cfg.agent.online else cfg.agent.workers
        counts = [("archiver", archiver), ("trainer", 1), ("advantage", 1), ("proxy", 1),
                  ("agent", agents), ("evaluator", evaluator)]
    # Watching the run (config/observability.py): a Prometheus endpoint, OTLP traces.
    obs = cfg.observability
    counts += [("metrics", 1 if obs.prometheus_port is not None else 0),
               ("traces", 1 if obs.otlp_endpoint is not None else 0)]
    return [(role, n) for role, n in counts if n > 0]


def role_command(role: str, member: int, config_path: Path) -> list[str]:
    """The command line of one child process."""
    if role == "proxy":
        return [sys.executable, "-m", "tapioca.ops.cli", "proxy", "--config", str(config_path)]
    if role == "agent":
        return [sys.executable, "-m", "tapioca.agents.runner", "--config", str(config_path),
                "--member", str(member)]
    if role in OBSERVERS:  # the run's directory gives the broker, run id, port, endpoint
        return [sys.executable, "-m", "tapioca.ops.cli", "--run-dir", str(config_path.parent),
                *OBSERVERS[role]]
    return [sys.executable, "-m", "tapioca.ops.role_main", role, "--config", str(config_path),
            "--member", str(member)]


def last_member_warning(role: str, config_path: Path) -> str:
    """What to tell the user when the last live member of ``role`` exited cleanly (a
    drain): on stderr, since the CLI logs only warnings and the run does not stop."""
    if role == "archiver":
        return (f"warning: no archiver member left: the run goes on but is no longer "
                f"archived; start one with `tapioca role archiver --config {config_path}`\n")
    if role == "evaluator":
        return (f"warning: no evaluator member left: the run goes on without held-out "
                f"evaluation; start one with `tapioca role evaluator --config {config_path}`\n")
    if role in OBSERVERS:
        return (f"warning: the run's `tapioca {' '.join(OBSERVERS[role])}` exited: the run goes on "
                f"without it; start it again with `tapioca --run-dir {config_path.parent} "
                f"{' '.join(OBSERVERS[role])}`\n")
    if role == "agent":
        start = f"python -m tapioca.agents.runner --config {config_path}"
    elif role == "proxy":
        start = f"tapioca proxy --config {config_path}"
    else:
        start = f"tapioca role {role} --config {config_path}"
    return (f"warning: no {role} member left: the run cannot progress; start one with "
            f"`{start}` (it stops when the run ends) or stop the run (Ctrl-C)\n")
