"""benchmarks/learn_async_report.py (the numbers of issue 42's report, by hand) and
benchmarks/learn_async.py --describe (the long task's length distribution, CPU, seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import learn_async  # noqa: E402
from learn_async_report import aggregate, first_crossing, interp, mean_curve, smooth, table  # noqa: E402


def run(seed: int, eta: int, points: list[tuple[int, float, float]], per_step: float, se: float = 0.0) -> dict:
    return {"workload": "longchain", "seed": seed, "eta": eta, "train_s_per_step": per_step,
            "curve": [{"version": v, "train_s": t, "pass@1": p, "pass@1_stderr": se} for v, t, p in points]}


def test_smooth_interp_and_first_crossing():
    assert smooth([0.2, 0.3, 0.4]) == pytest.approx([0.25, 0.3, 0.35])  # fewer points at the ends
    assert smooth([1.0, 2.0], window=1) == [1.0, 2.0]
    assert interp([0, 10], [0.0, 1.0], 2.5) == 0.25 and interp([0, 10], [0.0, 1.0], 11) is None
    assert first_crossing([0, 10, 20], [0.1, 0.3, 0.5], 0.4) == pytest.approx(15.0)
    assert first_crossing([0, 10], [0.5, 0.6], 0.4) == 0 and first_crossing([0, 10], [0.1, 0.2], 0.4) is None


def test_aggregate_by_hand():
    runs = [
        # eta 0: smoothed (window 3) 0.25, 0.30, 0.35 and 0.20, 0.2667, 0.30 at 0, 10, 20 s
        run(0, 0, [(0, 0, 0.2), (1, 10, 0.3), (2, 20, 0.4)], 10.0),
        run(1, 0, [(0, 0, 0.2), (1, 10, 0.2), (2, 20, 0.4)], 10.0),
        # eta 4: smoothed 0.25, 0.3333, 0.40 and 0.30, 0.3333, 0.40 at 0, 5, 10 s
        run(0, 4, [(0, 0, 0.2), (2, 5, 0.3), (4, 10, 0.5)], 2.5),
        run(1, 4, [(0, 0, 0.2), (2, 5, 0.4), (4, 10, 0.4)], 2.5),
    ]
    agg = aggregate(runs)["longchain"]
    sync, fast = agg["etas"]["0"], agg["etas"]["4"]
    # finals 0.35, 0.30: mean 0.325, se = sd(0.35, 0.30) / sqrt(2) = 0.035355 / 1.41421 = 0.025
    assert sync["final_pass@1_smoothed"] == {"mean": 0.325, "se": 0.025, "per_seed": [0.35, 0.3]}
    assert sync["gain_points_per_seed"] == [15.0, 10.0] and fast["gain_points_per_seed"] == [20.0, 20.0]
    assert agg["target_pass@1"] == pytest.approx(0.325)  # eta 0's mean smoothed curve at its end
    # eta 0 reaches it at its last point, 20 s; eta 4's mean on [0, 5] s is 0.275 + x/85.71
    # (0.0116667 x): 0.325 at x = 0.05 / 0.0116667 = 4.2857 s -> 20 / 4.2857 = 4.67x
    assert sync["time_to_target_s"] == pytest.approx(20.0)
    assert fast["time_to_target_s"] == pytest.approx(30 / 7, rel=1e-3) and fast["speedup_vs_eta0"] == 4.67
    assert fast["speedup_per_step_vs_eta0"] == 4.0 and sync["speedup_vs_eta0"] == 1.0
    assert fast["by_version"]["x"][-1] == 4 and fast["by_train_s"]["band"] == "se over seeds"
    assert "4 | 2 | 0.200 | 0.400 ± 0.000 | [20.0, 20.0]" in table({"aggregate": {"longchain": agg}})


def test_one_seed_band_is_the_evaluations_own_error_and_no_gain_means_no_target():
    one = mean_curve([run(0, 0, [(0, 0, 0.2), (1, 10, 0.3)], 10.0, se=0.02)], "train_s", 3)
    assert one["seeds"] == 1 and set(one["se"]) == {0.02} and one["band"].startswith("held-out stderr")
    flat = aggregate([run(0, 0, [(0, 0, 0.3), (1, 10, 0.3)], 10.0), run(0, 4, [(0, 0, 0.3), (1, 5, 0.4)], 5.0)])
    assert flat["longchain"]["target_pass@1"] is None and flat["longchain"]["etas"]["4"]["time_to_target_s"] is None


def test_describe_the_long_task_meets_the_issue(capsys):
    """Issue 42: correct solutions of median >= 512 new tokens, p99 >= 4,096; printed on CPU."""
    out = learn_async.describe("longchain", n=2000, qwen=False)
    chars = out["char_tokens"]
    assert chars["median"] >= 512 and chars["p99"] >= 4096 and chars["max"] <= 6502
    assert out["steps"]["median"] == pytest.approx(34, abs=2)
    assert learn_async.main(["--describe", "--no-qwen", "--describe-n", "500"]) == 0
    printed = capsys.readouterr().out
    assert "correct solutions in char tokens (characters + <eos>): median" in printed and "p99" in printed
