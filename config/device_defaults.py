"""What ``auto`` means on the devices a run uses: the one place where a default depends
on the hardware.

A user who writes ``actor.device: cuda`` gets, without further settings, the trainer and
weight-transport settings the benchmarks measure (docs/trainer-performance.md); the CPU
keeps the exact, portable ones. Every rule is a row of :data:`RULES`, applied once by
:meth:`TrainConfig.__post_init__ <tapioca.config.schema.TrainConfig>` before its checks,
so the ``config.yaml`` a run writes holds the resolved values. A value the user set is
never changed: only the literal ``auto`` (``None`` for a switch) is.

``actor.liger_kernels`` (``null``: on where it runs) is resolved where the model family
is known, by :func:`tapioca.models.fused_ops.liger_by_default`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def on_gpu(device: str) -> bool:
    return str(device).startswith("cuda")


def same_device(a: str, b: str) -> bool:
    """``cuda`` and ``cuda:0`` name one device (the process's current one is 0 here)."""
    def norm(d: str) -> str:
        return "cuda:0" if d == "cuda" else d
    return norm(str(a)) == norm(str(b))


def _one_process_trainer(cfg: Any) -> bool:
    return cfg.fsdp.world_size == 1


def _colocated_gpu(cfg: Any) -> bool:
    """Trainer and in-process engines on GPUs of this host, placed by the local launcher."""
    return (on_gpu(cfg.actor.device) and on_gpu(cfg.rollout.device) and cfg.rollout.engine == "torch"
            and cfg.scheduler.type == "local" and _one_process_trainer(cfg))


def _param_dtype(cfg: Any) -> str:
    # bf16 weights with fp32 masters in AdamW: half the activations of fp32 (the
    # example's 0.5B trainer held 54 GB in fp32), flash varlen attention, liger. FSDP
    # keeps fp32 shards and computes in fsdp.param_dtype instead.
    return "bfloat16" if on_gpu(cfg.actor.device) and _one_process_trainer(cfg) else "float32"


def _transport(cfg: Any) -> str:
    # ipc: one device-to-device copy per version (0.04 s at 0.5B) instead of a
    # safetensors file written, hashed and read (2-5 s); needs one host.
    return "ipc" if _colocated_gpu(cfg) else "file"


def _sleep_mode(cfg: Any) -> bool:
    # The engine gives its KV cache back while it idles (the trainer is stepping) when
    # the two share one GPU; on separate devices there is nothing to give it to.
    return _colocated_gpu(cfg) and cfg.rollout.paged and same_device(cfg.actor.device, cfg.rollout.device)


# (section, field, the value that means "decide for me", rule)
RULES: tuple[tuple[str, str, Any, Callable[[Any], Any]], ...] = (
    ("actor", "param_dtype", "auto", _param_dtype),
    ("weights", "transport", "auto", _transport),
    ("rollout", "enable_sleep_mode", None, _sleep_mode),
)


def resolve_device_defaults(cfg: Any) -> dict[str, Any]:
    """The sections of ``cfg`` (a TrainConfig) with every ``auto`` of :data:`RULES`
    resolved, as ``{section name: new section}`` (only the changed ones)."""
    changed: dict[str, dict[str, Any]] = {}
    for section, name, auto, rule in RULES:
        if getattr(getattr(cfg, section), name) == auto:
            changed.setdefault(section, {})[name] = rule(cfg)
    return {section: dataclasses.replace(getattr(cfg, section), **values)
            for section, values in changed.items()}
