"""End to end: benchmarks/learn_async.py --smoke, the time-to-accuracy recipe of issue 27
at CPU size. One child process runs everything the GPU run does (the arith task's length
distribution in Qwen tokens, `tapioca sft` from random init, `tapioca eval` of the warm
start, then `tapioca train` with the evaluator at eta 0, 2 and 8 on the embedded broker)
and the test checks that its JSON and PNG are there and well-formed. It asserts no
accuracy and no speed-up: a tiny model in three steps learns nothing measurable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_learn_async_smoke_writes_its_report(tmp_path):
    out = tmp_path / "learn_async"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learn_async.py"), "--smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "solution length in Qwen tokens median" in proc.stdout

    report = json.loads((out / "learn_async.json").read_text())
    lengths = report["length_qwen_tokens"]
    assert 0 < lengths["median"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"]
    sft = report["sft"]["final"]
    assert sft["steps"] > 0 and 0.0 <= sft["greedy"] <= 1.0 and 0.0 <= sft["pass@1"] <= 1.0

    assert [r["eta"] for r in report["runs"]] == [0, 2, 8]
    for r in report["runs"]:
        assert not r["truncated"] and r["steps"] == report["steps"]
        versions = [p["version"] for p in r["curve"]]
        # eval_before_train scores version 0; the last version is always evaluated
        assert versions[0] == 0 and versions[-1] == report["steps"] and versions == sorted(versions)
        assert all(0.0 <= p["pass@1"] <= 1.0 and p["train_s"] >= 0 and p["wall_s"] > 0 for p in r["curve"])
        assert r["final_pass@1"] == r["curve"][-1]["pass@1"]
        # every trained group is counted once, at a lag no larger than eta
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        assert sum(hist.values()) == report["steps"] * report["rl"]["prompts"]
        assert max(hist) <= r["eta"]
        assert r["rollout_train_k3_kl_mean"] is not None and r["rollout_train_k3_kl_max"] >= 0
    assert (out / "learn_async.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
