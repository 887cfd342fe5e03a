"""The gateway's figures between two flushes: counts, latencies and TTFTs per endpoint and per
key (and counts per LoRA adapter), and the percentile used to summarise them. Pure Python: the gateway process fills it,
the services store it."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-quantile (q in 0..1); None without values."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class Stats:
    """What happened since the last flush, per endpoint and per key."""

    def __init__(self):
        # counts ("n", "errors", "tokens") and lists of seconds ("lat", "ttft"), by endpoint id and by key id
        self.ep: defaultdict[int, dict[str, Any]] = defaultdict(lambda: {"n": 0, "errors": 0, "lat": [], "ttft": []})
        self.key: defaultdict[int, dict[str, Any]] = defaultdict(
            lambda: {"n": 0, "errors": 0, "tokens": 0, "lat": [], "ttft": []}
        )
        # LoRA adapters, by (endpoint id, adapter name): requests, tokens and errors
        self.adapter: defaultdict[tuple[int, str], dict[str, int]] = defaultdict(
            lambda: {"n": 0, "errors": 0, "tokens": 0}
        )
        # Metered usage (UsageHour), by (hour, team id, key id, key name, endpoint id, model, adapter name or "")
        self.usage: defaultdict[tuple, dict[str, int]] = defaultdict(
            lambda: {"requests": 0, "errors": 0, "interrupted": 0, "prompt_tokens": 0, "completion_tokens": 0}
        )
        # Soft budgets past 80 % / 100 % of their period: (budget id, percent, period start, reset) -> tokens used
        self.budget_alerts: dict[tuple, int] = {}

    def record_usage(self, *, row: tuple, status: int, prompt: int, completion: int):
        u = self.usage[row]
        u["requests"] += 1
        u["prompt_tokens"] += prompt
        u["completion_tokens"] += completion
        if status >= 400:
            u["errors"] += 1

    def record_interrupted(self, *, row: tuple):
        """A request in flight on a gateway that died: the replica received it; its answer and tokens are unknown."""
        u = self.usage[row]
        u["requests"] += 1
        u["interrupted"] += 1

    def record_adapter(self, *, endpoint_id, name, status, tokens):
        a = self.adapter[(endpoint_id, name)]
        a["n"] += 1
        a["tokens"] += tokens
        if status >= 400:
            a["errors"] += 1

    def record(self, *, endpoint_id, key_id, status, latency, ttft, tokens):
        if endpoint_id is not None:
            e = self.ep[endpoint_id]
            e["n"] += 1
            e["lat"].append(latency)
            if ttft is not None:
                e["ttft"].append(ttft)
            if status >= 500:
                e["errors"] += 1
        if key_id is not None:
            k = self.key[key_id]
            k["n"] += 1
            k["tokens"] += tokens
            k["lat"].append(latency)
            if ttft is not None:
                k["ttft"].append(ttft)
            if status >= 400:
                k["errors"] += 1
