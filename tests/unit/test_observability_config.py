"""The observability section (config/observability.py) and what `tapioca train` starts
for it (ops/run_setup.py): `tapioca metrics serve` / `tapioca traces export --follow` as
children reading the run's directory, only when asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from tapioca.config.loader import load_config, to_yaml
from tapioca.config.schema import TrainConfig
from tapioca.ops.metrics_cli import run_observability
from tapioca.ops.run_setup import last_member_warning, role_command, role_counts
from tapioca.schemas.errors import ConfigError


def test_off_by_default_and_validated():
    cfg = TrainConfig()
    assert cfg.observability.prometheus_port is None and cfg.observability.otlp_endpoint is None
    assert not {"metrics", "traces"} & {role for role, _ in role_counts(cfg)}
    for bad, says in ((["observability.prometheus_port=70000"], "prometheus_port"),
                      (["observability.otlp_endpoint=localhost:4318"], "OTLP/HTTP URL"),
                      (["observability.prometheus_host="], "prometheus_host")):
        with pytest.raises(ConfigError, match=says):
            load_config(TrainConfig, None, bad)


def test_the_launcher_starts_the_observers_on_the_run_directory(tmp_path):
    cfg = load_config(TrainConfig, None, ["observability.prometheus_port=9464",
                                          "observability.otlp_endpoint=http://127.0.0.1:4318"])
    counts = dict(role_counts(cfg))
    assert counts["metrics"] == 1 and counts["traces"] == 1
    config_path = tmp_path / "runs" / "demo" / "t0" / "config.yaml"
    metrics = role_command("metrics", 0, config_path)
    assert metrics[1:] == ["-m", "tapioca.ops.cli", "--run-dir", str(config_path.parent), "metrics", "serve"]
    assert role_command("traces", 0, config_path)[-3:] == ["traces", "export", "--follow"]
    assert "tapioca --run-dir" in last_member_warning("metrics", config_path)
    # `tapioca metrics serve --run-dir` takes its port and host from the run's config.yaml.
    config_path.parent.mkdir(parents=True)
    config_path.write_text(to_yaml(cfg))
    obs = run_observability(str(config_path.parent))
    assert obs.prometheus_port == 9464 and obs.prometheus_host == "127.0.0.1"
    assert run_observability(None).prometheus_port is None
    assert run_observability(str(Path(tmp_path))).prometheus_port is None  # no config.yaml
