"""Reads for benchmarks (pages and API)."""

from django.db.models import Q, QuerySet

from endpoints.bench.models import BenchmarkRun, BenchmarkSweep, BenchStatus

STATES = [s.value for s in BenchStatus]


def run_list(
    *, endpoint: str | int | None = None, state: str = "", sweeps: bool = True
) -> QuerySet[BenchmarkRun] | list[BenchmarkRun]:
    runs = BenchmarkRun.objects.select_related("job", "endpoint", "created_by", "sweep").defer("detail", "telemetry")
    if endpoint not in (None, ""):
        if str(endpoint).isdigit():
            runs = runs.filter(Q(endpoint_id=int(endpoint)) | Q(endpoint_name=str(endpoint)))
        else:
            runs = runs.filter(endpoint_name=str(endpoint))
    if not sweeps:
        runs = runs.filter(sweep__isnull=True)
    if state in STATES:
        # `state` folds in the job's outcome; filter coarsely in SQL, exactly in Python.
        return [r for r in runs if r.state == state]
    return runs


def recent_for_endpoint(endpoint, limit: int = 10):
    return list(
        BenchmarkRun.objects.filter(endpoint=endpoint).select_related("job").defer("detail", "telemetry")[:limit]
    )


def active_for_endpoint(endpoint):
    return next(
        (
            r
            for r in BenchmarkRun.objects.filter(endpoint=endpoint, job__status__in=("queued", "running"))
            .select_related("job")
            .defer("detail", "telemetry")
        ),
        None,
    )


def run_get(run_id: int) -> BenchmarkRun:
    return BenchmarkRun.objects.select_related("job", "endpoint", "created_by", "sweep").get(pk=run_id)


def runs_by_ids(ids) -> list[BenchmarkRun]:
    ids = [int(i) for i in ids]
    found = {
        r.pk: r for r in BenchmarkRun.objects.filter(pk__in=ids).select_related("job").defer("detail", "telemetry")
    }
    seen, ordered = set(), []
    for i in ids:
        if i in found and i not in seen:
            seen.add(i)
            ordered.append(found[i])
    return ordered


def sweep_list(limit: int = 20):
    return BenchmarkSweep.objects.select_related("job", "created_by").prefetch_related("runs__job")[:limit]


def sweep_get(sweep_id: int) -> BenchmarkSweep:
    return BenchmarkSweep.objects.select_related("job", "endpoint", "created_by").get(pk=sweep_id)


def sweep_points(sweep: BenchmarkSweep) -> list[dict]:
    """The throughput-versus-latency curve: one point per concurrency level."""
    points = []
    for run in sweep.runs.select_related("job").defer("detail", "telemetry").order_by("sweep_index"):
        result = run.result or {}
        points.append(
            {
                "run": run.pk,
                "max_concurrency": run.max_concurrency,
                "state": run.state,
                "num_prompts": run.num_prompts,
                **{
                    k: result.get(k)
                    for k in (
                        "request_throughput",
                        "output_throughput",
                        "total_token_throughput",
                        "median_e2el_ms",
                        "p99_e2el_ms",
                        "median_ttft_ms",
                        "p99_ttft_ms",
                        "median_tpot_ms",
                        "p99_tpot_ms",
                        "failed",
                    )
                },
            }
        )
    return points


def parse_ids(raw) -> list[int]:
    """Run ids from ?runs=1&runs=2 or ?runs=1,2."""
    values = raw if isinstance(raw, (list, tuple)) else [raw]
    ids = []
    for value in values:
        for part in str(value or "").replace(" ", ",").split(","):
            if part.strip().isdigit():
                ids.append(int(part))
    return ids
