"""Reads for benchmarks (pages and API)."""

from django.db.models import Q, QuerySet

from console.roles import VIEWER
from console.teams import visible, visible_get
from endpoints.bench.models import BenchmarkRun, BenchmarkSweep, BenchStatus

STATES = [s.value for s in BenchStatus]


def run_list(
    *, user, endpoint: str | int | None = None, state: str = "", sweeps: bool = True
) -> QuerySet[BenchmarkRun] | list[BenchmarkRun]:
    """The benchmarks of the user's teams (every team's for the console Admin)."""
    runs = BenchmarkRun.objects.select_related("job", "endpoint", "created_by", "sweep").defer("detail", "telemetry")
    runs = visible(runs, user)
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


def run_get(run_id: int, *, user, role: str = VIEWER) -> BenchmarkRun:
    """404 for another team's benchmark; 403 where the user's role in its team is below `role`."""
    runs = BenchmarkRun.objects.select_related("job", "endpoint", "created_by", "sweep")
    return visible_get(runs, user, role=role, pk=run_id)


def runs_by_ids(ids, *, user) -> list[BenchmarkRun]:
    """The user's teams' runs among `ids`, in that order (another team's are left out, as if they did not exist)."""
    ids = [int(i) for i in ids]
    runs = visible(BenchmarkRun.objects.filter(pk__in=ids), user).select_related("job").defer("detail", "telemetry")
    found = {r.pk: r for r in runs}
    seen, ordered = set(), []
    for i in ids:
        if i in found and i not in seen:
            seen.add(i)
            ordered.append(found[i])
    return ordered


def sweep_list(*, user, limit: int = 20):
    sweeps = BenchmarkSweep.objects.select_related("job", "created_by").prefetch_related("runs__job")
    return visible(sweeps, user)[:limit]


def sweep_get(sweep_id: int, *, user, role: str = VIEWER) -> BenchmarkSweep:
    """404 for another team's sweep; 403 where the user's role in its team is below `role`."""
    sweeps = BenchmarkSweep.objects.select_related("job", "endpoint", "created_by")
    return visible_get(sweeps, user, role=role, pk=sweep_id)


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
