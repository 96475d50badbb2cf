"""A CPU demo run watched as a service: `tapioca train` (the demo config, a few tiny
steps, its own embedded broker, every role its own process) with
``observability.prometheus_port`` and ``observability.otlp_endpoint`` set, so the
launcher also starts `tapioca metrics serve` and `tapioca traces export --follow`.

While it trains, /metrics is scraped and parsed with prometheus_client's own parser:
the counters move between two scrapes, the trainer's version climbs, the approximate
lag is >= 0, the held-out score is there. The traces arrive at an OTLP/HTTP receiver in
this test (decoded with opentelemetry-proto): a trained trajectory's trace, its trace id
derived from its traj_id, its spans in order."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TAPIOCA = str(Path(sys.executable).parent / "tapioca")
OVERRIDES = ["trial_name=t0", "total_train_steps=100000", "train_dataset.prompts_per_step=2",
             "gconfig.n_samples=2", "gconfig.max_new_tokens=3", "evaluator.freq_steps=null"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OtlpReceiver:
    """An OTLP/HTTP endpoint (POST /v1/traces, protobuf) that keeps what it receives."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans = self.spans = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest.FromString(body)
                    spans.extend(s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def scrape(url: str) -> dict[str, list]:
    """Sample name -> [(labels, value)] of one scrape, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    """The sum of ``name``'s samples with these labels (None: none)."""
    found = [v for ls, v in samples.get(name, []) if all(ls.get(k) == want for k, want in labels.items())]
    return sum(found) if found else None


def wait_for(what: str, predicate, proc, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tapioca train exited ({proc.returncode}) before {what}")
        try:
            result = predicate()
        except OSError:  # the endpoint is not up yet
            result = None
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout_s} s")


def test_a_demo_run_is_scraped_and_traced_while_it_trains(tmp_path, fast_join):
    from tapioca.ops.traces import STAGES, trace_id_of

    port = _free_port()
    receiver = OtlpReceiver()
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    run_dir = tmp_path / "runs"
    proc = subprocess.Popen(
        [TAPIOCA, "train", "--config", str(ROOT / "examples" / "demo_cpu.yaml"), f"run_dir={run_dir}",
         *OVERRIDES, *fast_join, f"observability.prometheus_port={port}",
         f"observability.otlp_endpoint={receiver.url}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        def trainer_version(samples):
            return value(samples, "tapioca_policy_version", role="trainer") or 0

        def at_version(v: float):
            samples = scrape(url)
            return samples if trainer_version(samples) >= v else None

        first = wait_for("a trainer version >= 1 on /metrics", lambda: at_version(1), proc)
        # Counters move: every role's events, the trainer's groups, the rollout's tokens.
        # (A member's status row comes between its polls: a trainer busy in a few steps
        # publishes its next one after them, so the scrape that shows it may come later.)
        moving = (("tapioca_events_handled_total", {"role": "trainer"}),
                  ("tapioca_events_produced_total", {"role": "rollout"}),
                  ("tapioca_groups_trained_total", {}),
                  ("tapioca_rollout_tokens_total", {}))

        def moved():
            samples = at_version(trainer_version(first) + 2)
            if samples is None:
                return None
            lag_topics = {ls["topic"] for ls, _ in samples.get("tapioca_consumer_lag_records", [])}
            return samples if all((value(samples, name, **ls) or 0) > (value(first, name, **ls) or 0)
                                  for name, ls in moving) and lag_topics >= {"prompts", "samples"} \
                and value(samples, "tapioca_eval_score", metric="pass@1") is not None else None

        later = wait_for("the version climbing, the counters moving, lag and the held-out score", moved, proc)
        # Labelled by run, role and member; one status each.
        members = {ls["member"]: ls for ls, v in later["tapioca_member_up"]}
        assert {"trainer-0", "rollout-0", "feeder-0", "reward-0", "advantage-0"} <= set(members)
        assert all(ls["run"] == "demo.t0" for ls in members.values())
        assert all(v in (0.0, 1.0) for _, v in later["tapioca_member_up"])
        for member in members:
            assert value(later, "tapioca_member_status", member=member) == 1.0, member
        assert any(value(later, "tapioca_member_status", member=m, status="running") == 1.0 for m in members)
        # Lag (approximate) is never negative, per role and topic.
        lags = later.get("tapioca_consumer_lag_records", [])
        assert lags and all(v >= 0 for _, v in lags)
        # Staleness as a histogram; reward, throughput, the head gate, the held-out score.
        assert value(later, "tapioca_staleness_versions_count") >= 2 * 2
        assert value(later, "tapioca_staleness_versions_bucket", le="+Inf") == \
            value(later, "tapioca_staleness_versions_count")
        assert 0.0 <= value(later, "tapioca_reward_mean") <= 1.0
        assert value(later, "tapioca_trainer_tokens_per_second") > 0
        assert value(later, "tapioca_head_gate_open_slots", role="feeder") >= 0
        assert 0.0 <= value(later, "tapioca_eval_score", metric="pass@1") <= 1.0  # eval_before_train
        assert value(later, "tapioca_member_restarts_total", member="trainer-0") == 0

        # Traces: a trained trajectory's trace, found by its traj_id alone.
        def trained_trace():
            by_trace: dict[bytes, list] = {}
            for s in list(receiver.spans):
                by_trace.setdefault(s.trace_id, []).append(s)
            for spans in by_trace.values():
                names = {s.name for s in spans}
                if {"trajectory", "train"} <= names:
                    return spans
            return None

        spans = wait_for("a trained trajectory's trace at the OTLP receiver", trained_trace, proc)
        root = next(s for s in spans if s.name == "trajectory")
        traj_id = next(a.value.string_value for a in root.attributes if a.key == "tapioca.traj_id")
        assert int.from_bytes(root.trace_id, "big") == trace_id_of(traj_id)
        stages = sorted((s for s in spans if s is not root), key=lambda s: (s.start_time_unix_nano, s.name))
        assert [s.name for s in stages] == list(STAGES)
        assert all(s.parent_span_id == root.span_id for s in stages)
        assert all(a.end_time_unix_nano <= b.start_time_unix_nano + 1 for a, b in zip(stages, stages[1:]))
    except BaseException:
        print("".join(output[-60:]))
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        receiver.close()
