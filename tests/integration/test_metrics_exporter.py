"""`tapioca metrics serve`'s server (ops/prometheus.py) against the real embedded broker:
it follows fleet.v1, metrics.v1 and dlq.v1 and serves what it derived over HTTP, parsed
here with prometheus_client's parser. Hostile records on the bus (not JSON, a NaN, an
absurd number) are counted as undecodable or shown as they are, and the endpoint keeps
answering; a dead letter is counted by topic and reason; a taken port is a one-line
config error (exit 78)."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tapioca.bus.dlq import dead_letter
from tapioca.bus.producer import EventProducer
from tapioca.bus.role import Source
from tapioca.ops.prometheus import MetricsServer
from tapioca.schemas.errors import SchemaError
from tapioca.schemas.events import FleetEvent, MetricsEvent

pytestmark = pytest.mark.integration

TAPIOCA = str(Path(sys.executable).parent / "tapioca")
RUN = "demo.t0"


def scrape(url: str) -> dict[str, list]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_the_endpoint_serves_the_log_and_survives_hostile_records(bus_cfg, wait_until):
    metrics_topic = bus_cfg.topic_prefix + ".metrics.v1"
    with EventProducer(bus_cfg, "trainer-0") as producer:
        producer.publish(FleetEvent(member_id="trainer-0", role="trainer", policy_version=3, run_id=RUN,
                                    lag={"samples/0": 2}, detail={"interval_s": 3600.0, "started_at": 1.0,
                                                                  "describe": {"version": 3}}))
        producer.publish(MetricsEvent(source="trainer", step=3, policy_version=3, run_id=RUN,
                                      metrics={"reward/mean": 1e308, "trainer/staleness_hist/1": 4.0}))
        producer.publish(MetricsEvent(source="trainer-0", step=9, run_id="another.run",
                                      metrics={"bus/handled": 5.0}))
        producer.publish_raw(metrics_topic, b"k", b"\xff not json")
        producer.publish_raw(metrics_topic, b"k", b'{"type": "metrics", "source": "x", "step": 1, '
                                                  b'"metrics": {"reward/mean": NaN}}')
        record, headers = dead_letter(b"{}", Source(f"{bus_cfg.topic_prefix}.trajectories.v1", 0, 7, "g"),
                                      SchemaError("bad"), consumer_group="g", attempts=1)
        record.run_id = RUN
        producer.publish(record, headers=headers)
        producer.flush()
    server = MetricsServer(bus_cfg, host="127.0.0.1", port=0, run_id=RUN).start()
    try:
        def served():
            s = scrape(server.url)
            return s if s.get("tapioca_dead_letters_total") and s.get("tapioca_exporter_undecodable_total") \
                and s.get("tapioca_staleness_versions_count") and s.get("tapioca_member_up") else None

        wait_until(lambda: served() is not None, timeout_s=30, what="the log's numbers on /metrics")
        s = served()
        one = {name: {tuple(sorted(ls.items())): v for ls, v in rows} for name, rows in s.items()}
        ids = (("member", "trainer-0"), ("role", "trainer"), ("run", RUN))
        assert one["tapioca_policy_version"] == {ids: 3.0}
        assert one["tapioca_reward_mean"] == {ids: 1e308}  # absurd, finite: shown as it is
        assert one["tapioca_consumer_lag_records"] == {tuple(sorted(ids + (("topic", "samples"),))): 2.0}
        assert one["tapioca_staleness_versions_count"] == {ids: 4.0}
        assert "tapioca_events_handled_total" not in one  # another run's row
        (labels, n), = s["tapioca_dead_letters_total"]
        assert n == 1 and labels["topic"] == "trajectories" and labels["reason"] == "SchemaError"
        assert one["tapioca_exporter_undecodable_total"] == {(("topic", "metrics"),): 2.0}
    finally:
        server.stop()


def test_a_taken_port_is_a_one_line_config_error(bus_cfg):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([TAPIOCA, "--bootstrap-server", bus_cfg.bootstrap_servers, "--prefix",
                              bus_cfg.topic_prefix, "metrics", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 78, out.stdout + out.stderr
    assert out.stderr.startswith(f"error: cannot serve metrics on 127.0.0.1:{port}") and \
        "--port" in out.stderr and out.stderr.count("\n") == 1
