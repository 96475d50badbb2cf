"""The trainers' metric sinks (trainers/metrics_sink.py): off by default, W&B and MLflow
import nothing; switched on without the package, a one-line ConfigError says how to
install it; switched on, each adapter makes the calls of its package's API.

The W&B and MLflow packages are not installed here (nor dependencies), so the adapter
tests put FAKE `wandb` / `mlflow` modules in ``sys.modules``: they record the calls and
check nothing of the real services. This is the only place fakes stand in for them;
what the tests show is the adapter's use of the documented API (``wandb.init`` /
``run.log(metrics, step=)`` / ``run.finish``; ``MlflowClient`` ``create_run`` /
``log_batch`` / ``set_terminated``), not that a real server accepts it."""

from __future__ import annotations

import json
import sys
import types

import pytest

from tapioca.config.stats_logger import MLflowConfig, StatsLoggerConfig, WandBConfig
from tapioca.schemas.errors import EXIT_CONFIG, ConfigError
from tapioca.trainers.metrics_sink import MLFLOW_RUN_ID_FILE, MetricsSink


def _metrics_dir(tmp_path):
    return tmp_path / "runs" / "demo" / "t1" / "metrics"


def test_off_by_default_imports_neither_package(tmp_path, monkeypatch):
    # None in sys.modules makes any import of them raise ImportError.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    sink = MetricsSink(_metrics_dir(tmp_path), StatsLoggerConfig())
    sink.write(1, {"reward/mean": 0.5})
    sink.close()
    rows = [json.loads(line) for line in (_metrics_dir(tmp_path) / "metrics.jsonl").open()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.5)]


@pytest.mark.parametrize("loggers, package, install", [
    (StatsLoggerConfig(wandb=WandBConfig(mode="online")), "wandb", "pip install wandb"),
    (StatsLoggerConfig(mlflow=MLflowConfig(enabled=True)), "mlflow", "pip install mlflow"),
])
def test_switched_on_without_the_package_is_a_config_error_saying_how_to_install_it(
        tmp_path, monkeypatch, loggers, package, install):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError) as err:
        MetricsSink(_metrics_dir(tmp_path), loggers)
    message = str(err.value)
    assert "\n" not in message and install in message and "stats_logger." in message
    assert err.value.exit_code == EXIT_CONFIG  # the trainer role exits 78: not restarted
    assert not (_metrics_dir(tmp_path) / "metrics.jsonl").exists()  # failed before any file


def test_the_wandb_adapter_logs_every_step_into_one_resumable_run(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")  # FAKE wandb: records calls only
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    loggers = StatsLoggerConfig(wandb=WandBConfig(mode="offline", tags=["grpo"]))
    sink = MetricsSink(_metrics_dir(tmp_path), loggers, config={"actor": {"lr": 1e-3}})
    sink.write(1, {"reward/mean": 0.25})
    sink.write(2, {"reward/mean": 0.75})
    sink.close()
    init = calls[0][1]
    # Names default to the run's: project = experiment, name = trial; the id is the run
    # id, so a resumed trial continues the same W&B run.
    assert {k: init[k] for k in ("project", "name", "mode", "id", "resume", "tags", "config",
                                 "dir")} == {
        "project": "demo", "name": "t1", "mode": "offline", "id": "demo-t1", "resume": "allow",
        "tags": ["grpo"], "config": {"actor": {"lr": 1e-3}}, "dir": str(_metrics_dir(tmp_path))}
    assert calls[1:] == [("log", {"reward/mean": 0.25}, 1), ("log", {"reward/mean": 0.75}, 2),
                         ("finish",)]


def test_the_mlflow_adapter_logs_batches_and_resumes_its_run(tmp_path, monkeypatch):
    calls = []

    class Client:  # FAKE MlflowClient: records calls only
        def __init__(self, tracking_uri=None):
            calls.append(("client", tracking_uri))

        def get_experiment_by_name(self, name):
            calls.append(("get_experiment_by_name", name))
            return None

        def create_experiment(self, name):
            calls.append(("create_experiment", name))
            return "7"

        def create_run(self, experiment_id, run_name):
            calls.append(("create_run", experiment_id, run_name))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r42"))

        def log_dict(self, run_id, dictionary, artifact_file):
            calls.append(("log_dict", run_id, artifact_file))

        def log_batch(self, run_id, metrics):
            calls.append(("log_batch", run_id, [(m.key, m.value, m.step) for m in metrics]))

        def set_terminated(self, run_id):
            calls.append(("set_terminated", run_id))

    class Metric:
        def __init__(self, key, value, timestamp, step):
            self.key, self.value, self.timestamp, self.step = key, value, timestamp, step

    fake = types.ModuleType("mlflow")
    fake.tracking = types.SimpleNamespace(MlflowClient=Client)
    fake.entities = types.SimpleNamespace(Metric=Metric)
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    loggers = StatsLoggerConfig(mlflow=MLflowConfig(enabled=True, tracking_uri="file:/x"))
    sink = MetricsSink(_metrics_dir(tmp_path), loggers)
    sink.write(3, {"reward/mean": 0.5, "trainer/staleness_hist/0": 4.0, "odd:key": 1.0})
    sink.close()
    assert calls == [
        ("client", "file:/x"), ("get_experiment_by_name", "demo"), ("create_experiment", "demo"),
        ("create_run", "7", "t1"), ("log_dict", "r42", "config.json"),
        # ":" is not allowed in an MLflow metric name.
        ("log_batch", "r42", [("reward/mean", 0.5, 3), ("trainer/staleness_hist/0", 4.0, 3),
                              ("odd_key", 1.0, 3)]),
        ("set_terminated", "r42")]
    assert (_metrics_dir(tmp_path) / MLFLOW_RUN_ID_FILE).read_text().strip() == "r42"
    calls.clear()
    again = MetricsSink(_metrics_dir(tmp_path), loggers)  # a resumed trial: the same run
    again.write(4, {"reward/mean": 0.6})
    again.close()
    assert [c[0] for c in calls] == ["client", "log_batch", "set_terminated"]
    assert calls[1] == ("log_batch", "r42", [("reward/mean", 0.6, 4)])
