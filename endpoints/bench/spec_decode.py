"""Speculative decoding figures of a benchmark run, for an endpoint launched with a speculative config: the
measured replicas' vLLM ``/metrics`` read just before and just after the client runs (vLLM's spec-decode
counters, parsed by endpoints.vllm_metrics), summed over the replicas, give the run's acceptance rate and mean
accepted length, stored with its results.

vLLM's own client (vllm/benchmarks/serve.py at 0.32.0, fetch_spec_decode_metrics) reads the same counters at its
--base-url and saves them as ``spec_decode_acceptance_rate`` (a percentage) and ``spec_decode_acceptance_length``,
kept in the result under those names when it does; it cannot through the gateway (the gateway's /metrics is not a
replica's). The console's reading covers both targets and includes the client's warm-up requests."""

from __future__ import annotations

import logging

from django.conf import settings

from endpoints.models import Endpoint, Replica
from endpoints.telemetry import scrape
from endpoints.vllm_metrics import Snapshot, parse_metrics, window_stats

log = logging.getLogger("console.job")

#: The figures a run stores in its result (scalars) when its endpoint speculates.
RESULT_KEYS = (
    "spec_acceptance_rate",
    "spec_mean_accepted_length",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
)


def speculates(endpoint: Endpoint) -> bool:
    return bool((endpoint.engine_configs or {}).get("speculative"))


def measured_replicas(endpoint: Endpoint, replica: Replica, *, via_gateway: bool) -> list[Replica]:
    """The replica a run measures, or every ready replica of the endpoint (through the gateway)."""
    if not via_gateway:
        return [replica]
    return list(
        endpoint.replica_set.select_related("node", "endpoint").filter(state=Endpoint.State.READY, port__isnull=False)
    )


def read(replicas: list[Replica]) -> dict[int, Snapshot | None]:
    """Replica id -> its parsed ``/metrics`` (None: not read or not parsed; the run goes on without it)."""
    out: dict[int, Snapshot | None] = {}
    for replica in replicas:
        text, error = scrape(replica.port, settings.TELEMETRY_SCRAPE_TIMEOUT_SECONDS, host=replica.node.address or None)
        snap = None
        if text is not None:
            try:
                snap = parse_metrics(text, model_name=replica.endpoint.served_model_name)
                if snap.models and replica.endpoint.served_model_name not in snap.models:
                    snap = parse_metrics(text)
            except ValueError as exc:
                error = str(exc)
        if snap is None:
            log.warning("speculative decoding counters of replica %s not read: %s", replica.index, error)
        out[replica.pk] = snap
    return out


def figures(before: dict[int, Snapshot | None], after: dict[int, Snapshot | None], seconds: float) -> dict:
    """The run's speculative decoding over the replicas read both times: ``spec_num_drafts``,
    ``spec_num_draft_tokens``, ``spec_num_accepted_tokens``, ``spec_acceptance_rate`` (accepted / draft tokens,
    0..1), ``spec_mean_accepted_length`` (1 + accepted / drafts) and ``spec_acceptance_by_position`` (accepted at
    draft position i / drafts). Empty when no replica exposed the counters both times."""
    drafts = draft_tokens = accepted = 0.0
    by_position: list[float] = []
    seen = False
    for pk, previous in before.items():
        current = after.get(pk)
        if previous is None or current is None or current.spec_drafts is None:
            continue
        seen = True
        stats = window_stats(previous, current, max(seconds, 1e-6))
        n = stats["spec_drafts"] or 0.0
        drafts += n
        draft_tokens += stats["spec_draft_tokens"] or 0.0
        accepted += stats["spec_accepted_tokens"] or 0.0
        for position, rate in enumerate(stats["spec_acceptance_by_position"] or []):
            if position == len(by_position):
                by_position.append(0.0)
            by_position[position] += rate * n
    if not seen:
        return {}
    return {
        "spec_num_drafts": int(drafts),
        "spec_num_draft_tokens": int(draft_tokens),
        "spec_num_accepted_tokens": int(accepted),
        "spec_acceptance_rate": round(min(accepted / draft_tokens, 1.0), 6) if draft_tokens else None,
        "spec_mean_accepted_length": round(1.0 + accepted / drafts, 6) if drafts else None,
        "spec_acceptance_by_position": [round(v / drafts, 6) for v in by_position] if drafts else [],
    }
