"""End to end: benchmarks/learn_async.py --smoke, the time-to-accuracy recipe of issues 27
and 42 at CPU size. One child process runs everything the GPU run does (the long task's
length distribution, a random-init model, `tapioca sft` with its held-out evaluations and
stop rule, then `tapioca train` with the evaluator at eta 0 and 4 on the embedded broker,
the report over seeds) and the test checks that its JSON and PNG are there and
well-formed, and that the seed reached every config. It asserts no accuracy and no speed:
a tiny model in three steps learns nothing measurable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_learn_async_smoke_writes_its_report(tmp_path):
    out = tmp_path / "learn_async"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learn_async.py"), "--smoke",
                           "--seed", "3", "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "correct solutions in model tokens" in proc.stdout and "card: " in proc.stdout

    report = json.loads((out / "learn_async.json").read_text())
    assert report["task"] == "longchain" and report["card"]["device"] == "cpu" and report["card"]["name"]
    lengths = report["length_model_tokens"]
    assert 0 < lengths["median"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"]
    # the seed reached the model, the SFT and the GRPO configs
    assert yaml.safe_load((out / "sft_seed3.yaml").read_text())["seed"] == 3
    assert yaml.safe_load((out / "grpo_seed3.yaml").read_text())["seed"] == 3
    (seed,) = report["seeds"]
    sft = seed["sft"]
    assert seed["seed"] == 3 and sft["steps"] > 0 and seed["card"] == report["card"]
    steps = [e["step"] for e in sft["evaluations"]]  # every eval_every-th step and the last
    assert steps[-1] == sft["steps"] and all(s % 15 == 0 for s in steps[:-1])
    assert all(0.0 <= e["greedy"] <= 1.0 and 0.0 <= e["pass@1"] <= 1.0 for e in sft["evaluations"])

    rl = report["settings"]["rl"]
    assert [(r["seed"], r["eta"]) for r in report["runs"]] == [(3, 0), (3, 4)]
    for r in report["runs"]:
        assert not r["truncated"] and r["steps"] == rl["steps"] and r["card"] == report["card"]
        versions = [p["version"] for p in r["curve"]]
        # eval_before_train scores version 0; the last version is always evaluated
        assert versions[0] == 0 and versions[-1] == rl["steps"] and versions == sorted(versions)
        assert all(0.0 <= p["pass@1"] <= 1.0 and p["train_s"] >= 0 and p["wall_s"] > 0 for p in r["curve"])
        assert all(p["pass@1_stderr"] is not None for p in r["curve"])
        # every trained group is counted once, at a lag no larger than eta
        hist = {int(k): v for k, v in r["staleness_hist"].items()}
        assert sum(hist.values()) == rl["steps"] * rl["prompts"] and max(hist) <= r["eta"]
        assert r["rollout_train_k3_kl_max"] >= 0 and r["rollout_train_abs_logprob_diff_max"] >= 0
        assert r["rollout_train_abs_logprob_diff_mean"] is not None

    agg = report["aggregate"]["longchain"]
    assert set(agg["etas"]) == {"0", "4"}
    for a in agg["etas"].values():
        assert a["seeds"] == [3] and len(a["gain_points_per_seed"]) == 1
        for key in ("by_version", "by_train_s"):
            assert len(a[key]["x"]) == len(a[key]["mean"]) == len(a[key]["se"]) > 1
    assert (out / "learn_async_longchain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
