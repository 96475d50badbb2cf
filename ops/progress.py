"""Progress of the long one-process commands (`tapioca replay`, `train-offline`, `sft`,
`dpo`, `rm`, `distill`): a rich progress bar on a terminal; off one (a log file, nohup,
Slurm, CI), where a bar would be noise or nothing, a line every
``$TAPIOCA_PROGRESS_EVERY_S`` seconds (default 10).

The commands' loops (bus/replay.py, trainers/offline.py, trainers/supervised/loop.py) take
a plain callback and know nothing of this module; the commands pass
:meth:`CommandProgress.update`, which is cheap enough to call once per event.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .render import duration

EVERY_ENV = "TAPIOCA_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 10.0


def every_s() -> float:
    """The line interval off a terminal: ``$TAPIOCA_PROGRESS_EVERY_S`` or 10 s."""
    from ..schemas.errors import ConfigError

    raw = os.environ.get(EVERY_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_EVERY_S
    except ValueError:
        raise ConfigError(f"{EVERY_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ConfigError(f"{EVERY_ENV}={raw!r} must be > 0 seconds")
    return value


class CommandProgress:
    """``with CommandProgress("replay", "events", console=c) as p: p.update(n, total)``."""

    def __init__(self, what: str, unit: str, *, console: Console, total: int | None = None,
                 bar: bool | None = None, every: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.unit, self.total = what, unit, total
        self.console = console
        self.bar = console.is_terminal if bar is None else bar
        self.every = every_s() if every is None else every
        self._clock = clock
        self.started = clock()
        self._last_line = self.started
        self._progress: Progress | None = None
        self._task = None
        self.done = 0
        self.info = ""
        self._first: tuple[float, int] | None = None  # the first update: the rate's origin

    def __enter__(self) -> "CommandProgress":
        if self.bar:
            self._progress = Progress(
                TextColumn(f"{self.what}"), BarColumn(), MofNCompleteColumn(),
                TextColumn(self.unit), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task(self.what, total=self.total, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, info=self.info)
            self._progress.stop()

    def update(self, done: int, total: int | None = None, info: str = "") -> None:
        """``done`` of ``total`` (None: unchanged) units so far, ``info`` a few words."""
        self.done, self.info = done, info
        if self._first is None:
            self._first = (self._clock(), done)
        if total is not None:
            self.total = total
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=self.total, info=info)
            return
        now = self._clock()
        if now - self._last_line >= self.every:
            self._last_line = now
            self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)

    def line(self) -> str:
        now = self._clock()
        elapsed = now - self.started
        # From the first update: a resumed run's steps before it do not count.
        t0, d0 = self._first or (now, self.done)
        rate = (self.done - d0) / (now - t0) if now > t0 else 0.0
        of = f"/{self.total:,}" if self.total else ""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = ""
        if self.total and rate > 0:
            eta = f", ETA {duration(max(self.total - self.done, 0) / rate)}"
        info = f"; {self.info}" if self.info else ""
        speed = f" ({rate:,.1f}/s{eta})" if rate > 0 else ""
        return f"{self.what}: {self.done:,}{of} {self.unit}{pct} in {duration(elapsed)}{speed}{info}"
