"""Two evaluations side by side, as pure functions over their stored rows ({"task", "metric", "value", "stderr"}):
each common figure's difference, and whether it is beyond noise; and a gate's verdict on the primary metrics.

Noise: lm-eval's standard error of each mean (its `*_stderr` figures: the sample standard deviation over √n,
lm_eval/api/metrics.py `mean_stderr`). Two independent runs differ by more than twice the standard error of the
difference, 2·√(se₁² + se₂²) (about a 95 % interval), rarely by chance: such a difference is "beyond noise". On
the shipped suites (30-40 documents) that is 15-25 points: they tell a broken model from a sound one, not two
sound ones apart. A gate compares the drop with its threshold whatever the noise, and says both."""

from __future__ import annotations

import math

from evaluations.tasks import PRIMARY_METRIC

__all__ = ["compare_rows", "gate_verdict", "primary_metric"]


def compare_rows(baseline: list[dict], candidate: list[dict]) -> list[dict]:
    """One row per (task, metric) both have: the two values, the difference (candidate - baseline), the standard
    error of the difference and whether |difference| > 2·se (None when a standard error is missing)."""
    theirs = {(r["task"], r["metric"]): r for r in candidate}
    out = []
    for mine in baseline:
        other = theirs.get((mine["task"], mine["metric"]))
        if other is None or mine["value"] is None or other["value"] is None:
            continue
        diff = other["value"] - mine["value"]
        se = None
        if mine.get("stderr") is not None and other.get("stderr") is not None:
            se = math.sqrt(mine["stderr"] ** 2 + other["stderr"] ** 2)
        out.append(
            {
                "task": mine["task"],
                "metric": mine["metric"],
                "baseline": mine["value"],
                "candidate": other["value"],
                "diff": diff,
                "diff_se": se,
                "noise": None if se is None else 2 * se,
                "beyond_noise": None if se is None else abs(diff) > 2 * se,
            }
        )
    return out


def primary_metric(task: str, rows: list[dict], output_type: str = "") -> str | None:
    """The metric a gate judges a task on: by its output type (acc for multiple choice, exact_match for
    generation), else the task's first metric."""
    mine = [r["metric"] for r in rows if r["task"] == task]
    wanted = PRIMARY_METRIC.get(output_type)
    if wanted in mine:
        return wanted
    for candidate in PRIMARY_METRIC.values():
        if candidate in mine:
            return candidate
    return mine[0] if mine else None


def gate_verdict(comparison: list[dict], *, max_drop_points: float, output_types: dict[str, str]) -> dict:
    """Passed when no task's primary metric dropped by more than `max_drop_points` (points on a 0-100 scale: a
    fraction's drop × 100). Returns {"passed", "reason", "tasks": [{task, metric, baseline, candidate,
    drop_points, noise_points, beyond_noise}]}."""
    rows = []
    for task in sorted({r["task"] for r in comparison}):
        metric = primary_metric(task, comparison, output_types.get(task, ""))
        row = next(r for r in comparison if r["task"] == task and r["metric"] == metric)
        rows.append(
            {
                "task": task,
                "metric": metric,
                "baseline": row["baseline"],
                "candidate": row["candidate"],
                "drop_points": round(100.0 * (row["baseline"] - row["candidate"]), 4),
                "noise_points": None if row["diff_se"] is None else round(200.0 * row["diff_se"], 4),
                "beyond_noise": row["beyond_noise"],
            }
        )
    if not rows:
        return {"passed": False, "reason": "no figure in common to compare", "tasks": []}
    over = [r for r in rows if r["drop_points"] > max_drop_points]
    figures = "; ".join(
        f"{r['task']} {r['metric'].split(',')[0]} {100 * r['baseline']:.1f} → {100 * r['candidate']:.1f} "
        f"({100 * (r['candidate'] - r['baseline']):+.1f} points"
        + (f", noise ±{r['noise_points']:.1f}" if r["noise_points"] is not None else "")
        + ")"
        for r in rows
    )
    if over:
        reason = f"accuracy dropped beyond the gate ({max_drop_points:g} points): {figures}"
    else:
        reason = f"accuracy within the gate ({max_drop_points:g} points): {figures}"
    return {"passed": not over, "reason": reason, "tasks": rows}
