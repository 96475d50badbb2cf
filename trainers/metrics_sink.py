"""Local metric sinks of the trainers: a JSONL file and TensorBoard event files (the
`tensorboard` package is a dependency; without it only JSONL is written), plus Weights &
Biases and MLflow when ``stats_logger`` turns them on (config/stats_logger.py; off by
default). The same numbers also go to ``metrics.v1``.

W&B and MLflow are imported only when switched on; a missing package is a
:class:`ConfigError` saying how to install it (the role then exits 78 and the launcher
says so in one line). A resumed trial logs into the same W&B run (its id is the run id)
and the same MLflow run (its id is kept in ``metrics/mlflow_run_id``).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from ..config.stats_logger import MLflowConfig, StatsLoggerConfig, WandBConfig
from ..schemas.errors import ConfigError, storage_error

log = logging.getLogger(__name__)


class MetricsSink:
    """``write(step, metrics)`` to every sink on; ``loggers`` None: JSONL + TensorBoard.
    ``experiment`` / ``trial`` name the remote runs (default: the run directory's last two
    parts, ``runs/EXPERIMENT/TRIAL/metrics``); ``config`` is recorded with them."""

    def __init__(self, directory: str | Path, loggers: StatsLoggerConfig | None = None, *,
                 experiment: str = "", trial: str = "", config: dict[str, Any] | None = None
                 ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        run = self.dir.resolve().parent
        names = dict(experiment=experiment or run.parent.name, trial=trial or run.name,
                     directory=self.dir, config=config or {})
        # The remote ones first: a missing package must fail before any file is opened.
        self._remote: list[Any] = []
        if loggers is not None and loggers.wandb.mode != "disabled":
            self._remote.append(WandbSink(loggers.wandb, **names))
        if loggers is not None and loggers.mlflow.enabled:
            self._remote.append(MLflowSink(loggers.mlflow, **names))
        self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        except Exception as exc:  # tensorboard is optional
            log.info("TensorBoard logging off (%s); metrics still go to JSONL", exc)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        try:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        except OSError as exc:  # a full disk stops the trainer with the file it could not write
            raise storage_error(exc, self._jsonl.name) or exc
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        for sink in self._remote:
            sink.log(step, metrics)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._remote:
            sink.close()
        self._remote = []


def _import(package: str, switch: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"{switch} needs the {package} package, which is not installed here: "
                          f"pip install {package} (or turn it off: {switch.split('=')[0]}="
                          f"{'disabled' if 'wandb' in switch else 'false'})") from None


class WandbSink:
    """Metrics to one W&B run: ``wandb.init`` once, ``run.log(metrics, step=step)`` per
    step, ``run.finish()`` at the end."""

    def __init__(self, cfg: WandBConfig, *, experiment: str, trial: str, directory: Path,
                 config: dict[str, Any]) -> None:
        wandb = _import("wandb", f"stats_logger.wandb.mode={cfg.mode}")
        # W&B run ids allow letters, digits, "-" and "_": the run id, so a resumed trial
        # goes on in the same W&B run (resume="allow").
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{experiment}-{trial}")[:64]
        self.run = wandb.init(project=cfg.project or experiment, entity=cfg.entity or None,
                              name=cfg.name or trial, group=cfg.group or None,
                              tags=list(cfg.tags) or None, notes=cfg.notes or None,
                              mode=cfg.mode, dir=str(directory), id=run_id, resume="allow",
                              config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


# MLflow metric names: letters, digits, "_", "-", ".", " ", "/" (others are refused).
_MLFLOW_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")
MLFLOW_RUN_ID_FILE = "mlflow_run_id"


class MLflowSink:
    """Metrics to one MLflow run (an ``MlflowClient``, no global active run): created
    once, its id kept beside metrics.jsonl so a resumed trial logs into it again."""

    def __init__(self, cfg: MLflowConfig, *, experiment: str, trial: str, directory: Path,
                 config: dict[str, Any]) -> None:
        mlflow = _import("mlflow", "stats_logger.mlflow.enabled=true")
        self._metric = mlflow.entities.Metric
        self.client = mlflow.tracking.MlflowClient(tracking_uri=cfg.tracking_uri or None)
        id_file = directory / MLFLOW_RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            name = cfg.experiment or experiment
            found = self.client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id,
                                            run_name=cfg.run_name or trial).info.run_id
            id_file.write_text(run_id + "\n")
            self.client.log_dict(run_id, config, "config.json")
        self.run_id = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(_MLFLOW_UNSAFE.sub("_", k), float(v), now, step)
                 for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
