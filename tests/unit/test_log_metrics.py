"""The fleet's Prometheus metrics from hand-made events (ops/log_metrics.py), rendered by
prometheus_client through the exporter's collector (ops/prometheus.py) and read back
with prometheus_client's parser: what each metric is derived from, that reading an
event twice changes nothing, and that hostile events (NaN, infinities, absurd numbers,
wrong types, odd labels) break neither the scrape nor the other metrics."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tapioca.ops.log_metrics import METRICS, LogMetrics
from tapioca.ops.prometheus import LogCollector
from tapioca.schemas.events import DlqRecord, FleetEvent, MetricsEvent

RUN = "demo.t0"
NOW = 10_000.0


def scrape(metrics: LogMetrics) -> dict[str, list[tuple[dict, float]]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LogCollector(metrics))
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples, name, **labels):
    found = [v for ls, v in samples.get(name, []) if all(ls.get(k) == want for k, want in labels.items())]
    assert len(found) == 1, (name, labels, samples.get(name))
    return found[0]


def heartbeat(member, role, *, at, started, version=0, status="running", lag=None, describe=None):
    return FleetEvent(member_id=member, role=role, status=status, policy_version=version, lag=lag or {},
                      detail={"interval_s": 2.0, "started_at": started,
                              "describe": describe if describe is not None else {"version": version}},
                      produced_at=at, run_id=RUN, producer_id=member)


def status_row(member, at, **counters):
    metrics = {"bus/consumed": 10.0, "bus/handled": 9.0, "bus/produced": 8.0, **counters}
    return MetricsEvent(source=member, step=9, metrics=metrics, produced_at=at, run_id=RUN, producer_id=member)


def fleet_events():
    return [
        # The trainer: restarted once (two process starts), its lag on samples.v1 over two partitions.
        heartbeat("trainer-0", "trainer", at=NOW - 30, started=NOW - 100, version=3),
        heartbeat("trainer-0", "trainer", at=NOW - 1, started=NOW - 20, version=5,
                  lag={"samples/0": 3, "samples/1": 4}),
        heartbeat("rollout-0", "rollout", at=NOW - 1, started=NOW - 100, version=4, lag={"prompts/2": 1}),
        heartbeat("reward-0", "reward", at=NOW - 1, started=NOW - 100, describe={"scored": 3}),
        heartbeat("feeder-0", "feeder", at=NOW - 60, started=NOW - 100),  # silent for 60 s: stale
        heartbeat("rollout-1", "rollout", at=NOW - 2, started=NOW - 100, status="paused"),
        status_row("trainer-0", NOW - 1, **{"trainer/groups_trained": 12.0, "trainer/rejected_stale": 2.0,
                                            "trainer/dead_lettered": 1.0}),
        status_row("feeder-0", NOW - 61, **{"feeder/open_slots": 6.0}),
        status_row("rollout-0", NOW - 1, **{"rollout/tokens": 640.0}),
        # The trainer names its step rows "trainer"; its runner published them as trainer-0.
        MetricsEvent(source="trainer", step=6, policy_version=6, run_id=RUN, producer_id="trainer-0",
                     produced_at=NOW - 1, metrics={
                         "reward/mean": 0.75, "actor/tokens_per_s": 900.0, "actor/step_time_s": 0.5,
                         "trainer/staleness_hist/0": 5.0, "trainer/staleness_hist/1": 4.0,
                         "trainer/staleness_hist/3": 3.0}),
        MetricsEvent(source="trainer", step=5, policy_version=5, run_id=RUN, producer_id="trainer-0",
                     produced_at=NOW - 2, metrics={"reward/mean": 0.25}),  # an older step, read late
        MetricsEvent(source="rollout-0", step=40, policy_version=4, run_id=RUN, producer_id="rollout-0",
                     metrics={"rollout/tokens_per_s": 120.0}),
        MetricsEvent(source="evaluator-0", step=4, policy_version=4, run_id=RUN, producer_id="evaluator-0",
                     metrics={"eval/pass@1": 0.5, "eval/greedy": 0.625, "eval/wall_s": 3.0,
                              "eval/gsm/pass@1": 0.25, "eval/prompts": 16.0}),
        # The proxy's sessions member: latency histogram and 429s (producers/proxy/call_stats.py).
        MetricsEvent(source="proxy-ab12-sessions", step=3, run_id=RUN, producer_id="proxy-ab12-sessions",
                     produced_at=NOW - 1, metrics={
                         "bus/handled": 0.0, "proxy-sessions/open": 2.0, "proxy-sessions/served": 7.0,
                         "proxy-sessions/rate_limited": 3.0, "proxy-sessions/calls": 5.0,
                         "proxy-sessions/call_latency_sum_s": 4.5, "proxy-sessions/call_latency_le_0.5": 2.0,
                         "proxy-sessions/call_latency_le_1": 4.0, "proxy-sessions/call_latency_le_10": 5.0}),
        # Dead letters: one written twice (at-least-once) counts once.
        *[DlqRecord(event_id=eid, source_topic="tapioca.trajectories.v1", source_partition=0, source_offset=i,
                    error="bad", error_type="SchemaError", run_id=RUN, producer_id="reward-0")
          for i, eid in enumerate(("d1", "d2", "d1"))],
        # Another run's member on the same prefix: not this run's.
        heartbeat("trainer-0", "trainer", at=NOW - 1, started=NOW - 5, version=99).__class__(
            member_id="trainer-0", role="trainer", policy_version=99, produced_at=NOW - 1, run_id="other.t9"),
    ]


def test_every_metric_from_its_events():
    metrics = LogMetrics(run_id=RUN, clock=lambda: NOW)
    for e in fleet_events():
        metrics.observe(e)
    s = scrape(metrics)
    assert value(s, "tapioca_member_restarts_total", member="trainer-0") == 1
    assert value(s, "tapioca_member_restarts_total", member="rollout-0") == 0
    assert value(s, "tapioca_member_up", member="trainer-0") == 1
    assert value(s, "tapioca_member_up", member="feeder-0") == 0  # stale: 60 s > 3 x 2 s
    assert value(s, "tapioca_member_status", member="feeder-0", status="stale") == 1
    assert value(s, "tapioca_member_status", member="rollout-1", status="paused") == 1
    assert value(s, "tapioca_member_status", member="rollout-1", status="running") == 0
    assert value(s, "tapioca_member_heartbeat_age_seconds", member="feeder-0") == 60
    # The version: the step row's 6 beats the heartbeat's 5; no version for a role without one.
    assert value(s, "tapioca_policy_version", member="trainer-0", role="trainer", run=RUN) == 6
    assert value(s, "tapioca_policy_version", member="rollout-0") == 4
    assert not [ls for ls, _ in s["tapioca_policy_version"] if ls["member"] in ("reward-0", "trainer")]
    # Lag per role and topic: the partitions summed.
    assert value(s, "tapioca_consumer_lag_records", member="trainer-0", topic="samples") == 7
    assert value(s, "tapioca_consumer_lag_records", role="rollout", topic="prompts") == 1
    assert value(s, "tapioca_events_consumed_total", member="trainer-0") == 10
    assert value(s, "tapioca_head_gate_open_slots", member="feeder-0") == 6
    assert value(s, "tapioca_groups_trained_total", member="trainer-0") == 12
    assert value(s, "tapioca_groups_rejected_total", reason="stale") == 2
    assert value(s, "tapioca_groups_rejected_total", reason="dropped") == 0
    assert value(s, "tapioca_groups_rejected_total", reason="dead_lettered") == 1
    assert value(s, "tapioca_rollout_tokens_total") == 640
    assert value(s, "tapioca_rollout_tokens_per_second") == 120
    # The trainer's latest step (6), whatever order the rows were read in.
    assert value(s, "tapioca_reward_mean", member="trainer-0") == 0.75
    assert value(s, "tapioca_trainer_tokens_per_second") == 900
    assert value(s, "tapioca_trainer_step_seconds") == 0.5
    # Staleness: 5 groups at 0, 4 at 1, 3 at 3 versions -> cumulative buckets; sum 0 + 4 + 9.
    assert value(s, "tapioca_staleness_versions_bucket", le="0.0") == 5
    assert value(s, "tapioca_staleness_versions_bucket", le="2.0") == 9
    assert value(s, "tapioca_staleness_versions_bucket", le="3.0") == 12
    assert value(s, "tapioca_staleness_versions_bucket", le="+Inf") == 12
    assert value(s, "tapioca_staleness_versions_sum") == 13
    assert value(s, "tapioca_eval_score", metric="pass@1", subset="") == 0.5
    assert value(s, "tapioca_eval_score", metric="pass@1", subset="gsm") == 0.25
    assert value(s, "tapioca_eval_score", metric="greedy") == 0.625
    assert not [ls for ls, _ in s["tapioca_eval_score"] if ls["metric"] in ("wall_s", "prompts")]
    assert value(s, "tapioca_eval_version") == 4
    assert value(s, "tapioca_proxy_sessions_open") == 2
    assert value(s, "tapioca_proxy_sessions_total") == 7
    assert value(s, "tapioca_proxy_rate_limited_total", role="proxy-sessions") == 3
    assert value(s, "tapioca_proxy_call_latency_seconds_bucket", le="1.0") == 4
    assert value(s, "tapioca_proxy_call_latency_seconds_bucket", le="+Inf") == 5
    assert value(s, "tapioca_proxy_call_latency_seconds_sum") == 4.5
    assert value(s, "tapioca_dead_letters_total", topic="trajectories", reason="SchemaError",
                 role="reward", member="reward-0") == 2
    # Nothing of the other run.
    assert all(ls.get("run") == RUN for name, rows in s.items() for ls, _ in rows if "run" in ls)


def test_reading_every_event_twice_changes_no_number():
    once, twice = LogMetrics(run_id=RUN, clock=lambda: NOW), LogMetrics(run_id=RUN, clock=lambda: NOW)
    for e in fleet_events():
        once.observe(e)
    for e in fleet_events() + fleet_events()[::-1]:
        twice.observe(e)
    assert scrape(once) == scrape(twice)


def test_every_exposed_name_is_declared_with_units_and_total_for_counters():
    metrics = LogMetrics(run_id=RUN, clock=lambda: NOW)
    for e in fleet_events():
        metrics.observe(e)
    metrics.record("dlq", None)
    declared = set(METRICS)
    for name in scrape(metrics):
        base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        assert base in declared or name in declared, name
    for spec in METRICS.values():
        assert spec.name.startswith("tapioca_")
        assert (spec.kind == "counter") == spec.name.endswith("_total"), spec.name
        if "lag" in spec.name:
            assert "approximate" in spec.help and "Tansu" in spec.help


def test_hostile_numbers_and_labels_do_not_break_the_exporter():
    metrics = LogMetrics(clock=lambda: NOW)  # every run: the hostile ones name odd runs too
    for e in fleet_events():
        metrics.observe(e)
    nasty = "x\"\n\\{}" + "\ud800" + "é" * 500  # quotes, newline, a lone surrogate, 500 characters
    hostile = [
        MetricsEvent(source="trainer", step=7, policy_version=7, run_id=RUN, producer_id="trainer-0",
                     metrics={"reward/mean": math.nan, "actor/tokens_per_s": math.inf,
                              "actor/step_time_s": -1.0, "trainer/staleness_hist/0": math.nan,
                              "trainer/staleness_hist/x": 3.0, "trainer/staleness_hist/-1": 3.0,
                              "trainer/staleness_hist/99999999999": 1.0, "trainer/staleness_hist/2": 1e308,
                              "trainer/staleness_hist/1": 10 ** 400}),
        status_row("rollout-0", NOW, **{"rollout/tokens": -5.0, "bus/consumed": math.inf,
                                        "feeder/open_slots": "many"}),
        MetricsEvent(source=nasty, step=1, run_id=nasty, producer_id=nasty,
                     metrics={"bus/handled": 1e308, "bus/consumed": 1e308, "eval/pass@1": math.nan}),
        MetricsEvent(source="proxy-ab12-sessions", step=4, run_id=RUN, producer_id="proxy-ab12-sessions",
                     produced_at=NOW, metrics={
                         "bus/handled": 1.0, "proxy-sessions/calls": 3.0,
                         "proxy-sessions/call_latency_le_nan": 1.0, "proxy-sessions/call_latency_le_1": 9.0,
                         "proxy-sessions/call_latency_le_0.5": math.inf, "proxy-sessions/call_latency_sum_s": -3}),
        FleetEvent(member_id="rollout-9", role=nasty, policy_version=10 ** 30, lag={"prompts/0": -4, "x": "y"},
                   detail={"interval_s": "abc", "started_at": math.nan, "describe": {"version": 1}},
                   produced_at=math.nan, run_id=RUN),
        FleetEvent(member_id="rollout-8", role="rollout", detail="not a dict", lag="not a dict",
                   produced_at=NOW, run_id=RUN),
        MetricsEvent(source="x", step=1, metrics="not a dict", run_id=RUN),
        DlqRecord(source_topic=nasty, source_partition=0, source_offset=0, error="", error_type=nasty,
                  run_id=RUN, producer_id=nasty),
    ]
    for e in hostile:
        metrics.observe(e)
    metrics.record("metrics", None)  # an undecodable record
    s = scrape(metrics)  # renders and parses
    # The trainer's newest row wins; its non-finite (and negative) numbers are left out,
    # its absurd finite ones shown as they are, its unusable staleness keys skipped.
    for name in ("tapioca_reward_mean", "tapioca_trainer_tokens_per_second", "tapioca_trainer_step_seconds"):
        assert not [ls for ls, _ in s.get(name, []) if ls["member"] == "trainer-0"], name
    assert value(s, "tapioca_policy_version", member="trainer-0", run=RUN) == 7
    assert value(s, "tapioca_staleness_versions_bucket", le="1.0", member="trainer-0") == 0
    assert value(s, "tapioca_staleness_versions_bucket", le="2.0", member="trainer-0") == 1e308
    for name, rows in s.items():
        for labels, v in rows:
            assert not math.isnan(v), (name, labels)
            if name.endswith(("_total", "_bucket", "_count")):
                assert v >= 0 and math.isfinite(v), (name, labels, v)
            assert all(len(x) <= 200 for x in labels.values()), name
    # Buckets stay cumulative and end at the count.
    for hist in ("tapioca_staleness_versions", "tapioca_proxy_call_latency_seconds"):
        for member in {ls["member"] for ls, _ in s.get(f"{hist}_bucket", [])}:
            counts = [v for ls, v in s[f"{hist}_bucket"] if ls["member"] == member]
            assert counts == sorted(counts), (hist, counts)
            assert counts[-1] == value(s, f"{hist}_count", member=member)
    assert value(s, "tapioca_proxy_call_latency_seconds_bucket", le="+Inf", member="proxy-ab12-sessions") == 3
    assert value(s, "tapioca_events_handled_total", run=next(
        ls["run"] for ls, _ in s["tapioca_events_handled_total"] if ls["run"].startswith("x"))) == 1e308
    assert value(s, "tapioca_exporter_undecodable_total", topic="metrics") == 1
    # The healthy members are all still there, with their numbers.
    assert value(s, "tapioca_groups_trained_total", member="trainer-0") == 12
    assert value(s, "tapioca_dead_letters_total", topic="trajectories", reason="SchemaError", run=RUN) == 2


def test_the_evaluator_marker_key_is_the_evaluators():
    pytest.importorskip("torch")
    from tapioca.ops.log_metrics import MARKER_KEY
    from tapioca.producers.evaluator import MARKER_KEY as evaluators

    assert MARKER_KEY == evaluators
