"""YAML files plus dotted ``key=value`` overrides into typed config dataclasses.

``load_config(TrainConfig, "examples/demo_cpu.yaml", ["actor.lr=1e-3"])``: the
dataclass defaults, then the file, then the overrides (OmegaConf merges them with
type checks); unknown keys and wrong types become a :class:`ConfigError` naming
the key.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..schemas.errors import ConfigError

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None = None,
                overrides: Sequence[str] = ()) -> T:
    try:
        base = OmegaConf.structured(cls)
        layers = [base]
        if path:
            p = Path(path)
            if not p.exists():
                raise ConfigError(f"config file {p} does not exist")
            layers.append(OmegaConf.create(yaml.safe_load(p.read_text()) or {}))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"overrides must look like key=value, got {bad}")
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).split("\n")[0]
    if key:
        return f"config key {key!r}: {msg}"
    return f"config error: {msg}"


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(asdict(cfg), sort_keys=False)

