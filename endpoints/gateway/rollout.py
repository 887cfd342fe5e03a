"""The SLO gate of a canary rollout, as a pure function: from the staged side's gateway figures
since the last step, hold, step up to the plan's next share, promote (the next share is 100:
switch) or roll back. No database, no clock: the controller (endpoints/gateway/controller.py)
reads the samples and applies the decision; the tests feed it recorded series.

How a window is judged (each gateway flush is one sample: its request count, its P99 latency and
TTFT, its error rate):
- Only samples after the last step count: a new share starts a new window, so figures earned at
  10 % never promote 25 %. The window is the last `window_s` seconds, cut at the last step.
- Error rate: the window's own, errors over requests (each flush's rate weighted by its count).
- P99 latency and TTFT: the worst flush's P99. Each flush has at most 1 % of its requests above
  its P99, so the window has at most 1 % above the worst one: an upper bound of the window's P99,
  never an under-estimate (flushes cannot be merged exactly without their raw latencies).
- A figure exactly at its threshold is within it; above it is a breach.
- Fewer than `min_requests` in the window: hold, whatever the figures (one slow request of three
  is no evidence either way).
- A breach rolls back as soon as the window has enough requests, even before the window's time
  is up (fail fast); a step needs a whole clean window: `window_s` since the last step.
- A threshold that is set but whose metric has no sample in the window (TTFT with no streamed
  answers) holds: it cannot be checked, so the share is not raised on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Sample", "Thresholds", "Decision", "decide", "next_share", "HOLD", "STEP", "PROMOTE", "ROLLBACK"]

HOLD, STEP, PROMOTE, ROLLBACK = "hold", "step", "promote", "rollback"


@dataclass(frozen=True)
class Sample:
    """One gateway flush of one side: when (Unix s), how many requests, and its figures (None: not
    recorded in that flush)."""

    ts: float
    requests: int
    p99_s: float | None = None
    ttft_p99_s: float | None = None
    error_rate: float | None = None  # 0..1, as the gateway stores it


@dataclass(frozen=True)
class Thresholds:
    """Each optional: None is not checked."""

    p99_ms: float | None = None
    error_pct: float | None = None
    ttft_p99_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.p99_ms, self.error_pct, self.ttft_p99_ms))


@dataclass(frozen=True)
class Decision:
    action: str  # hold | step | promote | rollback
    reason: str
    share: int  # the share after the decision (the current one on hold; 100 on promote; 0 on rollback)
    figures: dict = field(default_factory=dict)  # the staged side's window figures (and the live side's)

    def as_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "share": self.share, "figures": self.figures}


def next_share(steps: list[int], current: int) -> int | None:
    """The plan's first share above the current one (None: the plan is done)."""
    return next((s for s in sorted(steps) if s > current), None)


def window_figures(samples: Sequence[Sample], *, start: float, end: float) -> dict:
    """Requests, error rate (%), worst P99 and TTFT P99 (ms) of the samples in (start, end]."""
    inside = [s for s in samples if start < s.ts <= end]
    requests = sum(max(0, int(s.requests)) for s in inside)
    rated = [s for s in inside if s.error_rate is not None and s.requests > 0]
    rated_n = sum(s.requests for s in rated)
    p99 = [s.p99_s for s in inside if s.p99_s is not None and s.requests > 0]
    ttft = [s.ttft_p99_s for s in inside if s.ttft_p99_s is not None and s.requests > 0]
    return {
        "requests": requests,
        "flushes": len(inside),
        "error_pct": (
            round(100.0 * sum((s.error_rate or 0.0) * s.requests for s in rated) / rated_n, 4) if rated_n else None
        ),
        "p99_ms": round(1000.0 * max(p99), 3) if p99 else None,
        "ttft_p99_ms": round(1000.0 * max(ttft), 3) if ttft else None,
    }


_CHECKS = (("p99_ms", "P99 latency", "ms"), ("error_pct", "error rate", "%"), ("ttft_p99_ms", "TTFT P99", "ms"))


def decide(
    *,
    thresholds: Thresholds,
    window_s: float,
    steps: list[int],
    current: int,
    last_step_at: float | None,
    now: float,
    staged: list[Sample],
    live: Sequence[Sample] = (),
    min_requests: int,
) -> Decision:
    """One decision for one pair (see the module's notes). `current`: the staged side's share now
    (percent); `last_step_at`: when it was set (Unix s; None: unknown, the window alone counts)."""
    start = now - window_s
    if last_step_at is not None:
        start = max(start, last_step_at)
    fig = window_figures(staged, start=start, end=now)
    figures = {
        "window_start": int(start),
        "window_end": int(now),
        "share": current,
        "staged": fig,
        "live": window_figures(list(live), start=start, end=now),
        "thresholds": {
            "p99_ms": thresholds.p99_ms,
            "error_pct": thresholds.error_pct,
            "ttft_p99_ms": thresholds.ttft_p99_ms,
        },
        "min_requests": min_requests,
    }

    def out(action, reason, share=current):
        return Decision(action=action, reason=reason, share=share, figures=figures)

    if current <= 0:
        return out(HOLD, "no canary share yet: the staged side takes no traffic")
    if not thresholds.any:
        return out(HOLD, "no SLO threshold set")
    if fig["requests"] < min_requests:
        return out(HOLD, f"{fig['requests']} requests to the staged side in the window, fewer than {min_requests}")
    breaches = [
        f"{label} {fig[name]:g} {unit} > {getattr(thresholds, name):g} {unit}"
        for name, label, unit in _CHECKS
        if getattr(thresholds, name) is not None and fig[name] is not None and fig[name] > getattr(thresholds, name)
    ]
    if breaches:
        return out(ROLLBACK, "breach: " + "; ".join(breaches), share=0)
    unchecked = [label for name, label, _ in _CHECKS if getattr(thresholds, name) is not None and fig[name] is None]
    if unchecked:
        why = (
            " (TTFT comes from streamed answers only: /generate and non-streamed requests give none)"
            if thresholds.ttft_p99_ms is not None and fig["ttft_p99_ms"] is None
            else ""
        )
        return out(HOLD, f"no {', '.join(unchecked)} figures in the window: cannot check the threshold{why}")
    if last_step_at is not None and now - last_step_at < window_s:
        return out(HOLD, f"within thresholds; {window_s - (now - last_step_at):.0f} s of the window left")
    target = next_share(steps, current)
    if target is None:
        return out(HOLD, "the step plan is done")
    if target >= 100:
        return out(PROMOTE, f"within thresholds for {window_s:g} s at {current} %: promote", share=100)
    return out(STEP, f"within thresholds for {window_s:g} s at {current} %: step to {target} %", share=target)
