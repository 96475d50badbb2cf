"""YAML files plus dotted ``key=value`` overrides into typed config dataclasses.

``load_config(TrainConfig, "examples/demo_cpu.yaml", ["actor.optimizer.lr=1e-3"])``:
the dataclass defaults, then the file, then the overrides (OmegaConf merges them with
type checks); unknown keys and wrong types become a :class:`ConfigError` naming
the key.

Renamed keys (:data:`RENAMED_KEYS`, e.g. ``actor.lr`` -> ``actor.optimizer.lr``,
``actor.weight_transport`` -> ``weights.transport``, ``actor.use_lora`` ->
``actor.lora.enabled``, ``actor.router_replay`` -> ``actor.moe.router_replay``) are still
read for one release, in a file and on the command line: each is moved to its new key
with a one-line warning naming it. A layer that sets both the old and the new key is refused.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..schemas.errors import ConfigError

T = TypeVar("T")
log = logging.getLogger(__name__)

# Old dotted key -> its new key (a tuple: a list value spread over the keys, in order).
# Read for one release, with a warning; then the old keys go (unknown keys are errors).
RENAMED_KEYS: dict[str, str | tuple[str, ...]] = {
    # actor.optimizer (config/optimizer.py, AReaL's names)
    "actor.lr": "actor.optimizer.lr",
    "actor.weight_decay": "actor.optimizer.weight_decay",
    "actor.adam_betas": ("actor.optimizer.beta1", "actor.optimizer.beta2"),
    "actor.max_grad_norm": "actor.optimizer.gradient_clipping",
    # weights (config/weights.py)
    "actor.weight_transport": "weights.transport",
    "actor.weight_bucket_bytes": "weights.bucket_bytes",
    "actor.weight_buffer_slots": "weights.buffer_slots",
    "actor.weight_file_every_versions": "weights.file_every_versions",
    "actor.weight_nccl_host": "weights.nccl_host",
    "actor.weight_nccl_port": "weights.nccl_port",
    "actor.weight_nccl_backend": "weights.nccl_backend",
    "actor.weight_transfer_timeout_s": "weights.transfer_timeout_s",
    # actor.lora (config/lora.py; AReaL's flat names)
    "actor.use_lora": "actor.lora.enabled",
    "actor.peft_type": "actor.lora.peft_type",
    "actor.lora_rank": "actor.lora.rank",
    "actor.lora_alpha": "actor.lora.alpha",
    "actor.target_modules": "actor.lora.target_modules",
    # actor.moe (config/moe.py)
    "actor.moe_router_dtype": "actor.moe.router_dtype",
    "actor.moe_aux_loss_coeff": "actor.moe.aux_loss_coeff",
    "actor.moe_z_loss_coeff": "actor.moe.z_loss_coeff",
    "actor.freeze_moe_router": "actor.moe.freeze_router",
    "actor.router_replay": "actor.moe.router_replay",
    "actor.router_replay_missing": "actor.moe.router_replay_missing",
}
_ABSENT = object()


def load_config(cls: type[T], path: str | Path | None = None,
                overrides: Sequence[str] = ()) -> T:
    try:
        base = OmegaConf.structured(cls)
        layers = [base]
        warned: set[str] = set()
        if path:
            p = Path(path)
            if not p.exists():
                raise ConfigError(f"config file {p} does not exist")
            raw = yaml.safe_load(p.read_text()) or {}
            layers.append(OmegaConf.create(_renamed(raw, base, f"in {p}", warned)))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        if overrides:
            dotted = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=False)
            layers.append(OmegaConf.create(_renamed(dotted, base, "on the command line", warned)))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None


def _get(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = tree.get(part)
        if not isinstance(child, dict):
            child = tree[part] = {}
        tree = child
    tree[leaf] = value


def _renamed(layer: Any, base, where: str, warned: set[str]) -> Any:
    """``layer`` (a file's or the command line's nested keys) with the old keys of
    :data:`RENAMED_KEYS` moved to their new keys, where the config has the new key (an
    old key a config never had stays, and is refused as unknown by the merge)."""
    if not isinstance(layer, dict):
        return layer
    moved: list[str] = []  # warned once per layer (an old run's config.yaml has many)
    for old, new in RENAMED_KEYS.items():
        value = _get(layer, old)
        news = (new,) if isinstance(new, str) else new
        if value is _ABSENT or OmegaConf.select(base, news[0], default=_ABSENT) is _ABSENT:
            continue
        both = [n for n in news if _get(layer, n) is not _ABSENT]
        if both:
            raise ConfigError(f"the config {where} sets both {old} (deprecated) and {both[0]}: "
                              f"remove {old}")
        if len(news) > 1:
            if not isinstance(value, (list, tuple)) or len(value) != len(news):
                raise ConfigError(f"{old} ({where}) must be a list of {len(news)} values "
                                  f"({', '.join(news)}); better, set {' and '.join(news)}")
            for key, item in zip(news, value):
                _set(layer, key, item)
        else:
            _set(layer, news[0], value)
        parent, _, leaf = old.rpartition(".")
        del _get(layer, parent)[leaf]
        if old not in warned:
            warned.add(old)
            moved.append(f"{old}: use {' and '.join(news)}")
    if moved:
        log.warning("deprecated config keys %s (read as the new ones; they go after this release): %s",
                    where, "; ".join(moved))
    return layer


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).split("\n")[0]
    if key:
        return f"config key {key!r}: {msg}"
    return f"config error: {msg}"


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(asdict(cfg), sort_keys=False)

