"""The run's files against its run directory's free disk: the check `tapioca train` makes
before any role starts (beside the memory check, ops/memory_check.py).

Compares :func:`tapioca.runtime.disk_plan.plan_disk` (the checkpoint, its copy while it is
rewritten, the durable weights files, final/) with what the run directory's file system
has free, counting what a resumed run has there already. A run that would fill the disk
is refused with one line (a ConfigError: exit 78) naming the settings that write less:
without it a 3B run trained for 19 steps on a 64 GB disk and stopped writing its second
43 GB checkpoint (benchmarks/RESULTS.md, issue 37). ``launcher.check_disk=false`` skips it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from ..runtime import device_memory as dm
from ..runtime import disk_plan as dp
from ..schemas.errors import ConfigError

log = logging.getLogger(__name__)
GIB = dp.GIB


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _already_there(run_dir: Path) -> float:
    """Bytes of the run's own checkpoint and weights files a resumed run finds (they are
    part of the plan, and already counted as used)."""
    total = 0.0
    for pattern in ("**/*.safetensors", "**/*.tmp"):
        for f in run_dir.glob(pattern):
            try:
                total += f.stat().st_size
            except OSError:
                continue
    return total


def check_disk_at_start(cfg: Any) -> None:
    """Refuse ``cfg`` (ConfigError, one line) when the files it writes will not fit the run
    directory's free disk; nothing when they do, when the check is off or the model's
    shape cannot be read."""
    if not cfg.launcher.check_disk or (cfg.scheduler.type == "ray" and cfg.scheduler.ray_address):
        return  # off; or the trainer runs on a Ray cluster's host, whose disk this is not
    try:
        shape = dm.run_shape(cfg)
    except ConfigError as exc:
        log.warning("the disk check is skipped: %s", exc)
        return
    run_dir = Path(cfg.run_path)
    ckpts = run_dir / "checkpoints"  # the trainer's file, or the sharded trainer's folder
    resumed = any(ckpts.glob("trainer*.safetensors")) or (ckpts / "sharded").is_dir()
    plan = dp.plan_disk(cfg, shape, resumed=resumed)
    free = shutil.disk_usage(_existing(run_dir)).free
    need = plan.total - (_already_there(run_dir) if run_dir.exists() else 0.0)
    if need <= free:
        log.info("disk plan: %s needs %.1f GiB more (%s); %.1f GiB free", run_dir, max(need, 0) / GIB,
                 plan.summary(), free / GIB)
        return
    tips = dp.advice(cfg, plan)
    raise ConfigError(
        f"the run's files will not fit its disk: {run_dir} needs {need / GIB:.1f} GiB more ({plan.summary()}; "
        f"a checkpoint is {plan.checkpoint / GIB:.1f} GiB) and has {free / GIB:.1f} GiB free; free disk or "
        f"put run_dir on a larger one{'; or ' + tips if tips else ''} (every part: `tapioca plan`; "
        "launcher.check_disk=false skips this check)")
