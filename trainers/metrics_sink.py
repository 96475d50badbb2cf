"""Local metric sinks of the trainer: a JSONL file and TensorBoard event files (the
`tensorboard` package is a dependency; without it only JSONL is written). The same
numbers also go to ``metrics.v1``."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ..schemas.errors import storage_error

log = logging.getLogger(__name__)


class MetricsSink:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
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

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
