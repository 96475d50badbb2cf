"""examples/observability/ cannot be run here (no docker daemon, no Grafana), so this
checks what can be checked without them: the dashboard's queries name only metrics the
exporter exposes (ops/log_metrics.py METRICS) and cover what the issue asks a dashboard
to show; the compose file parses, includes the root one, and its `tapioca` commands
exist with the options they are given; Prometheus scrapes the metrics service's port;
Grafana's provisioning names the dashboard's datasource and folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from tapioca.ops.log_metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "observability"
DASHBOARD = HERE / "grafana" / "dashboards" / "tapioca.json"


def exposed_names() -> set[str]:
    """Every sample name the exporter can expose: histograms as _bucket, _sum, _count."""
    names = set()
    for spec in METRICS.values():
        if spec.kind == "histogram":
            names |= {f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
        else:
            names.add(spec.name)
    return names


def queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"]]
    return exprs


def test_the_dashboards_queries_name_metrics_the_exporter_exposes():
    exposed = exposed_names()
    used = {name for q in queries() for name in re.findall(r"\btapioca_[a-z0-9_]+", q)}
    assert used and used <= exposed, sorted(used - exposed)
    # What the issue asks the dashboard to show: reward, staleness, lag, throughput, dead
    # letters, restarts (and more).
    for wanted in ("tapioca_reward_mean", "tapioca_staleness_versions_bucket", "tapioca_consumer_lag_records",
                   "tapioca_rollout_tokens_per_second", "tapioca_trainer_tokens_per_second",
                   "tapioca_dead_letters_total", "tapioca_member_restarts_total", "tapioca_eval_score",
                   "tapioca_head_gate_open_slots", "tapioca_proxy_call_latency_seconds_bucket"):
        assert wanted in used, wanted
    # Counters are read as rates, never as raw totals.
    for q in queries():
        for name in re.findall(r"\btapioca_[a-z0-9_]+_total\b", q):
            assert re.search(rf"(rate|increase)\({name}\b", q), q


def test_the_dashboard_is_grafana_json_over_the_provisioned_datasource():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    datasources = yaml.safe_load((HERE / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == source["uid"], p["title"]
            assert all('run=~"$run"' in t["expr"] for t in p["targets"]), p["title"]
    providers = yaml.safe_load((HERE / "grafana/provisioning/dashboards/tapioca.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_the_compose_file_parses_and_runs_existing_commands():
    from tapioca.ops.cli import app, hoist_global_options

    compose = yaml.safe_load((HERE / "docker-compose.yml").read_text())
    (included,) = compose["include"]
    assert (HERE / included).resolve() == ROOT / "docker-compose.yml"
    root_services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    services = compose["services"]
    assert {"metrics", "prometheus", "grafana"} <= set(services) and "kafka" in root_services
    runner = CliRunner()
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}) or {}:
            assert dep in services or dep in root_services, (name, dep)
        for mapping in svc.get("ports", []):
            assert str(mapping).startswith("127.0.0.1:"), (name, mapping)
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source != "../../runs":  # the roles' shared run directory, made by the run
                assert (HERE / source).exists(), (name, volume)
        cmd = svc.get("command")
        if not cmd or cmd[0] != "tapioca":
            continue
        result = runner.invoke(app, hoist_global_options([*cmd[1:], "--help"]))
        assert result.exit_code == 0, f"service {name}: {cmd}: {result.output}"
    # Prometheus scrapes the metrics service where it listens.
    metrics_cmd = services["metrics"]["command"]
    port = metrics_cmd[metrics_cmd.index("--port") + 1]
    assert metrics_cmd[metrics_cmd.index("--host") + 1] == "0.0.0.0"
    prometheus = yaml.safe_load((HERE / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"metrics:{port}"]
