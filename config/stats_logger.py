"""Where a trainer's metrics go besides ``metrics/metrics.jsonl`` and TensorBoard (always
written): Weights & Biases and MLflow, each off by default. AReaL's names
(``stats_logger.wandb.mode``: disabled | online | offline); MLflow, which AReaL lacks, is
switched the same way (``stats_logger.mlflow.enabled``). Neither package is a dependency:
trainers/metrics_sink.py imports one only when it is on and says how to install it when
it is missing. Names left empty default to the run's: project / experiment = the
experiment name, run name = the trial name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schemas.errors import require_config as _require

WANDB_MODES = ("disabled", "online", "offline")


@dataclass(frozen=True, kw_only=True)
class WandBConfig:
    # disabled: no wandb import at all; online: to the W&B server (WANDB_API_KEY or `wandb
    # login`); offline: files under <run dir>/metrics/wandb, uploaded later by `wandb sync`.
    mode: str = "disabled"
    project: str = ""
    entity: str = ""
    name: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)
    notes: str = ""

    def __post_init__(self) -> None:
        _require(self.mode in WANDB_MODES,
                 f"stats_logger.wandb.mode={self.mode!r}: use {', '.join(WANDB_MODES)}")


@dataclass(frozen=True, kw_only=True)
class MLflowConfig:
    enabled: bool = False
    # Empty: $MLFLOW_TRACKING_URI, else MLflow's own default (./mlruns).
    tracking_uri: str = ""
    experiment: str = ""
    run_name: str = ""


@dataclass(frozen=True, kw_only=True)
class StatsLoggerConfig:
    wandb: WandBConfig = field(default_factory=WandBConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
