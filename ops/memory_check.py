"""The run's memory against the GPUs it will use: the check `tapioca train` makes before
any role starts, the cards `tapioca plan` checks against, and the advice an
out-of-memory step ends with.

Reads the GPUs' free and total memory in a short child process (``torch.cuda.
mem_get_info``; the launcher itself never holds a CUDA context, which would cost the run
its memory for as long as the run lasts) and compares the run's plan
(:mod:`tapioca.runtime.device_memory`) with it. A run that will not fit is refused with
one line (a ConfigError: exit 78) naming the settings that make it fit, unless a smaller
KV cache is all it takes and the engines size theirs (``rollout.kv_cache_tokens`` 0):
then the run starts with the cache that fits beside the trainer's planned peak (vLLM's
``gpu_memory_utilization`` decides the same thing from a fraction the user picks);
``launcher.check_memory=false`` skips the check, ``launcher.device_memory_gib`` replaces
what the devices report. No GPU here (a CPU run, a CPU-only host): no check.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime import device_memory as dm
from ..schemas.errors import ConfigError, DeviceMemoryError

log = logging.getLogger(__name__)

GIB = dm.GIB
# Planned before the cards are known, only to learn which devices the run uses.
_ANY_CARD = 80 * GIB

# A GPU driver's files (NVIDIA; AMD's ROCm, which torch.cuda drives too).
_GPU_DRIVERS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")
_QUERY = """
import json, sys, torch
out = {}
if torch.cuda.is_available():
    for i in json.loads(sys.argv[1]):
        if i < torch.cuda.device_count():
            free, total = torch.cuda.mem_get_info(i)
            out[i] = [free, total, torch.cuda.get_device_name(i)]
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Card:
    free: float
    total: float
    name: str


def device_index(device: str) -> int:
    _, _, index = dm.device_name(device).partition(":")
    return int(index or 0)


def query_cards(devices: list[str], timeout_s: float = 120.0) -> dict[str, Card]:
    """Each CUDA device's free and total memory and name, read by a child process
    (``{}``: no CUDA here, or it could not tell)."""
    if not any(Path(p).exists() for p in _GPU_DRIVERS):
        return {}  # no GPU driver on this host: not worth starting torch to learn it
    indices = sorted({device_index(d) for d in devices})
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY, json.dumps(indices)], capture_output=True,
                              text=True, timeout=timeout_s, check=True)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("could not read the GPUs' memory (%s): the memory check is skipped", exc)
        return {}
    return {d: Card(*found[str(device_index(d))]) for d in devices if str(device_index(d)) in found}


def _engine_card(cards: dict[str, Card], cfg: Any) -> float:
    """The total of the card the engines' KV fraction is of (the rollout's device)."""
    card = cards.get(dm.device_name(cfg.rollout.device)) or next(iter(cards.values()))
    return card.total


def check_at_start(cfg: Any) -> Any:
    """``cfg`` as the run will use it, checked against what the GPUs it uses have free.
    A run whose plan exceeds that is refused (ConfigError, one line) naming the settings
    that make it fit, unless only the engines' auto-sized KV cache is in the way: then
    ``cfg`` comes back with ``rollout.kv_cache_tokens`` set to what the other parts'
    planned peaks leave (runtime/device_memory.py ``fit_kv_cache``; config.yaml records
    it). ``cfg`` unchanged when it fits, when the check is off or when there is no GPU."""
    lc = cfg.launcher
    if not lc.check_memory or (cfg.scheduler.type == "ray" and cfg.scheduler.ray_address):
        return cfg  # off; or the roles run on a Ray cluster's hosts, not this one
    if not (dm.on_gpu(cfg.actor.device) or dm.on_gpu(cfg.rollout.device)):
        return cfg  # nothing on a GPU
    try:
        shape = dm.run_shape(cfg)
    except ConfigError as exc:
        log.warning("the memory check is skipped: %s", exc)
        return cfg
    devices = list(dm.plan_run(cfg, shape, card_bytes=_ANY_CARD).devices)
    if not devices:
        return cfg  # nothing on a GPU
    if lc.device_memory_gib > 0:
        budget = lc.device_memory_gib * GIB
        budgets, card_bytes = {d: budget for d in devices}, budget
        has = f"is given {lc.device_memory_gib:g} GiB (launcher.device_memory_gib)"
        said = {d: has for d in devices}
    else:
        cards = query_cards(devices)
        if not cards:
            return cfg  # no CUDA here: the roles will say so
        budgets = {d: c.free for d, c in cards.items()}
        card_bytes = _engine_card(cards, cfg)
        said = {d: f"has {c.free / GIB:.1f} GiB free of {c.total / GIB:.1f} ({c.name})" for d, c in cards.items()}
    plan = dm.plan_run(cfg, shape, card_bytes=card_bytes)
    over = plan.over(budgets)
    fitted = dm.fit_kv_cache(cfg, shape, budgets, card_bytes=card_bytes) if over else None
    if fitted is not None:
        cfg, tokens = fitted
        need = plan.devices[dm.device_name(cfg.rollout.device)]
        kv_now = sum(p.bytes for p in need.parts if p.what.startswith("KV cache"))
        log.warning("memory plan: %s needs %.1f GiB with the KV cache the rollout asks for (%.1f GiB) and %s; "
                    "the engines' KV cache is sized to %s tokens instead, what the other parts leave "
                    "(fewer rows decode at once; rollout.kv_cache_tokens or a smaller actor.mb_max_tokens "
                    "sets it yourself)", need.device, need.total / GIB, kv_now / GIB, said[need.device],
                    f"{tokens:,}")
        plan, over = dm.plan_run(cfg, shape, card_bytes=card_bytes), []
    if not over:
        log.info("memory plan: %s", "; ".join(f"{d.device} {d.total / GIB:.1f} GiB of {budgets[n] / GIB:.1f}"
                                             for n, d in plan.devices.items() if n in budgets))
        return cfg
    needs = "; ".join(f"{d.device} needs {d.total / GIB:.1f} GiB ({d.summary()}) and {said[d.device]}"
                      for d, _ in over)
    advice = dm.advice_line(cfg, shape, budgets, card_bytes=card_bytes)
    raise ConfigError(f"the run will not fit: {needs}; {advice} (every part: `tapioca plan` with this "
                      "config; launcher.check_memory=false skips this check)")


_TRIED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB)")


def with_oom_advice(err: DeviceMemoryError, cfg: Any) -> DeviceMemoryError:
    """``err`` (the trainer's step ran out of memory) with what the plan says about its
    GPU and the settings that lower it by at least the allocation that failed (else by
    15%): the same advice as at start, for a plan that fitted on paper."""
    try:
        import torch

        device = dm.device_name(cfg.actor.device)
        if not dm.on_gpu(device) or not torch.cuda.is_available():
            return err
        total = float(torch.cuda.mem_get_info(device_index(device))[1])
        shape = dm.run_shape(cfg)
        plan = dm.plan_run(cfg, shape, card_bytes=total)
        planned = plan.devices[device]
        m = _TRIED.search(str(err))
        tried = float(m.group(1)) * {"GiB": GIB, "MiB": 2**20, "KiB": 2**10}[m.group(2)] if m else 0.0
        room = min(total, planned.total)
        budget = room - tried if tried else 0.85 * room
        advice = dm.advice_line(cfg, shape, {device: budget}, card_bytes=total)
    except Exception as exc:  # the advice must never hide the error itself
        log.warning("no memory advice: %s: %s", type(exc).__name__, exc)
        return err
    return DeviceMemoryError(f"{err} The plan puts {device} at {planned.total / GIB:.1f} GiB of "
                             f"{total / GIB:.1f} ({planned.summary()}); {advice or 'lower actor.mb_max_tokens'}")
