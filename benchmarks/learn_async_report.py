"""The numbers and the plot of benchmarks/learn_async.py: pure functions of its runs.

Consumes the ``runs`` of one or more ``learn_async.json`` (each run: ``workload``,
``seed``, ``eta``, a ``curve`` of held-out evaluations, ``{version, pass@1,
pass@1_stderr, greedy, train_s, wall_s}``); emits the ``aggregate`` section of the report
(keyed by workload, then eta) and a PNG per workload. Nothing here runs a model.

- **Smoothing**: a run's curve is smoothed by a centred moving average over
  ``window`` evaluations (fewer at the ends: the last point is the mean of the last
  ``window // 2 + 1``), so a target is never set or met by one noisy point.
- **Mean over seeds**: the smoothed curves of an eta's seeds are interpolated linearly
  onto a common grid of the x axis (train clock in seconds, or the policy version), from
  0 to the end of the shortest run (no extrapolation), and averaged; the band is one
  standard error across seeds (sample sd / sqrt(n)), or with one seed the evaluation's
  own ``pass@1_stderr`` (the held-out set's sampling error).
- **Time to accuracy**: the target is the synchronous run's (eta 0) final accuracy, the
  last point of its mean smoothed curve by train clock (none when that is not above its
  mean version 0: nothing was learnt to time); an eta's time is the first
  crossing of that target by its own mean curve (interpolated between grid points), and
  its speed-up is eta 0's time over it. Each seed's own crossing is reported too.
- **Gain**: a run's last smoothed pass@1 minus its version 0's (the SFT start), per seed.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

GRID_POINTS = 60


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ascending ``sorted_values``."""
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


def length_stats(lengths: Sequence[int]) -> dict[str, Any]:
    """Median, p90, p99, max (and mean) of token counts."""
    s = sorted(lengths)
    med = statistics.median(s)
    return {"n": len(s), "median": med, "p90": quantile(s, 0.9), "p99": quantile(s, 0.99), "max": s[-1],
            "mean": round(statistics.mean(s), 1), "max_over_median": round(s[-1] / med, 2),
            "share_over_4x_median": round(sum(x > 4 * med for x in s) / len(s), 4)}


def mean_se(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample sd / sqrt(n); None for one value)."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def smooth(values: Sequence[float], window: int = 3) -> list[float]:
    """Centred moving average over ``window`` points, fewer at the ends."""
    half = max(window, 1) // 2
    return [statistics.fmean(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """Linear interpolation of (xs ascending, ys) at ``x``; None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] - 1e-9 or x > xs[-1] + 1e-9:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = xs[i - 1], xs[i]
            t = 0.0 if x1 == x0 else (x - x0) / (x1 - x0)
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def first_crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """The first x where the piecewise-linear curve reaches ``target`` (None: never)."""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y >= target - 1e-12:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (target - y0) / (y - y0) * (x - x0) if y != y0 else x
    return None


def run_series(run: dict[str, Any], clock: str, window: int) -> tuple[list[float], list[float]]:
    """(x, smoothed pass@1) of a run's curve; x is ``train_s`` or ``version``; version 0
    sits at train clock 0."""
    pts = sorted(run["curve"], key=lambda p: p["version"])
    xs = [float(p[clock]) for p in pts]
    for i in range(1, len(xs)):  # a clock never runs back (version 0 and 1 may share 0.0)
        xs[i] = max(xs[i], xs[i - 1])
    return xs, smooth([p["pass@1"] for p in pts], window)


def mean_curve(runs: Sequence[dict[str, Any]], clock: str, window: int,
               points: int = GRID_POINTS) -> dict[str, list] | None:
    """The mean (and band) over ``runs`` of their smoothed curves on a common grid of
    ``clock``; None when no run has two evaluations."""
    series = [run_series(r, clock, window) for r in runs if len(r["curve"]) >= 2]
    if not series:
        return None
    end = min(xs[-1] for xs, _ in series)
    if end <= 0:
        return None
    grid = [end * i / (points - 1) for i in range(points)]
    mean, band = [], []
    for x in grid:
        vals = [v for v in (interp(xs, ys, x) for xs, ys in series) if v is not None]
        m, se = mean_se(vals)
        if se is None:  # one seed: the evaluation's own standard error, interpolated
            r = next(r for r in runs if len(r["curve"]) >= 2)
            pts = sorted(r["curve"], key=lambda p: p["version"])
            xs = run_series(r, clock, window)[0]
            se = interp(xs, [p.get("pass@1_stderr") or 0.0 for p in pts], x)
        mean.append(round(m, 5))
        band.append(round(se or 0.0, 5))
    return {"x": [round(x, 3) for x in grid], "mean": mean, "se": band, "seeds": len(series),
            "band": "se over seeds" if len(series) > 1 else "held-out stderr (one seed)"}


def aggregate(runs: Sequence[dict[str, Any]], window: int = 3) -> dict[str, Any]:
    """Per workload and eta: the mean curves by train clock and by version, final and
    v0 pass@1 (mean, se, per seed), the gain per seed, time to the synchronous run's final
    accuracy and the speed-up; see the module docstring."""
    out: dict[str, Any] = {}
    for workload in sorted({r["workload"] for r in runs}):
        mine = [r for r in runs if r["workload"] == workload]
        per_eta: dict[str, Any] = {}
        for eta in sorted({r["eta"] for r in mine}):
            rs = sorted((r for r in mine if r["eta"] == eta and r["curve"]), key=lambda r: r["seed"])
            if not rs:
                continue
            finals = [run_series(r, "version", window)[1][-1] for r in rs]
            starts = [sorted(r["curve"], key=lambda p: p["version"])[0]["pass@1"] for r in rs]
            fm, fse = mean_se(finals)
            sm, sse = mean_se(starts)
            per_eta[str(eta)] = {
                "seeds": [r["seed"] for r in rs],
                "v0_pass@1": {"mean": round(sm, 4), "se": sse and round(sse, 4), "per_seed": starts},
                "final_pass@1_smoothed": {"mean": round(fm, 4), "se": fse and round(fse, 4),
                                          "per_seed": [round(f, 4) for f in finals]},
                "gain_points_per_seed": [round(100 * (f - s), 1) for f, s in zip(finals, starts)],
                "by_train_s": mean_curve(rs, "train_s", window),
                "by_version": mean_curve(rs, "version", window),
                "train_s_per_step_median": statistics.median(r["train_s_per_step"] for r in rs
                                                             if r.get("train_s_per_step")) if any(
                    r.get("train_s_per_step") for r in rs) else None,
            }
        sync = per_eta.get("0")
        target = None
        # No time to a target eta 0 never rose to (its final at or under its start): None.
        if sync and sync["by_train_s"] and sync["by_train_s"]["mean"][-1] > sync["v0_pass@1"]["mean"]:
            target = sync["by_train_s"]["mean"][-1]
        for eta, a in per_eta.items():
            curve = a["by_train_s"]
            a["target_pass@1"] = target
            a["time_to_target_s"] = (first_crossing(curve["x"], curve["mean"], target)
                                     if curve and target is not None else None)
            a["time_to_target_s_per_seed"] = [
                first_crossing(*run_series(r, "train_s", window), target) if target is not None else None
                for r in sorted((r for r in mine if r["eta"] == int(eta) and r["curve"]), key=lambda r: r["seed"])]
        base = sync and sync["time_to_target_s"]
        for a in per_eta.values():
            t = a["time_to_target_s"]
            a["speedup_vs_eta0"] = round(base / t, 2) if base and t else None
            step0 = sync and sync["train_s_per_step_median"]
            a["speedup_per_step_vs_eta0"] = (round(step0 / a["train_s_per_step_median"], 2)
                                             if step0 and a["train_s_per_step_median"] else None)
        out[workload] = {"target_pass@1": target, "smoothing_window": window, "etas": per_eta}
    return out


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per workload (held-out pass@1 vs train clock and vs version, mean +- band
    per eta, the target dashed); [] and a line saying so where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib here: no plot drawn; run `python benchmarks/learn_async.py --replot {out_dir}` "
              "where it is installed", flush=True)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for workload, agg in report["aggregate"].items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for eta, a in agg["etas"].items():
            for ax, key in zip(axes, ("by_train_s", "by_version")):
                c = a[key]
                if not c:
                    continue
                line, = ax.plot(c["x"], c["mean"], label=f"η {eta} ({len(a['seeds'])} seed"
                                f"{'s' if len(a['seeds']) > 1 else ''})")
                lo = [m - s for m, s in zip(c["mean"], c["se"])]
                hi = [m + s for m, s in zip(c["mean"], c["se"])]
                ax.fill_between(c["x"], lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        for ax, xl in zip(axes, ("train clock, s (from the first complete batch)", "policy version")):
            if agg["target_pass@1"] is not None:
                ax.axhline(agg["target_pass@1"], color="grey", ls="--", lw=0.8)
            ax.set_xlabel(xl)
            ax.set_ylabel("held-out pass@1 (smoothed)")
            ax.legend()
        card = report.get("card", {}).get("name", "")
        fig.suptitle(f"GRPO on {workload} from an SFT warm start, mean ± SE over seeds ({card})")
        fig.tight_layout()
        path = out_dir / f"learn_async_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def table(report: dict[str, Any]) -> str:
    """The printed summary: one line per eta (per workload)."""
    lines = []
    for workload, agg in report["aggregate"].items():
        tgt = agg["target_pass@1"]
        lines.append(f"--- {workload}: target = eta 0's final pass@1 (smoothed, mean over seeds) "
                     + ("none: eta 0 ended no higher than it started, nothing to time" if tgt is None
                        else f"{tgt:.3f}"))
        lines.append("eta | seeds | v0 pass@1 | final pass@1 ± se | gain per seed (points) | "
                     "s/step | ×η0 per step | time to target s | ×η0")
        for eta, a in agg["etas"].items():
            f = a["final_pass@1_smoothed"]
            se = f" ± {f['se']:.3f}" if f["se"] is not None else ""
            t = a["time_to_target_s"]
            lines.append(f"{eta} | {len(a['seeds'])} | {a['v0_pass@1']['mean']:.3f} | {f['mean']:.3f}{se} | "
                         f"{a['gain_points_per_seed']} | {a['train_s_per_step_median']} | "
                         f"{a['speedup_per_step_vs_eta0']} | {'-' if t is None else round(t, 1)} | "
                         f"{a['speedup_vs_eta0']}")
    return "\n".join(lines)
