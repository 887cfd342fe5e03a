"""The `bench` job kind. Imported by EndpointsConfig.ready(): defining the runner registers it."""

from endpoints.bench.client import execute_run
from endpoints.bench.models import BenchmarkRun, BenchStatus
from endpoints.bench.services import benchmark_resubmit, end_open_runs
from workers.jobs.context import JobCancelled, JobFailed
from workers.jobs.models import Job
from workers.jobs.runner import JobRunner


class Bench(JobRunner):
    name = "bench"
    queue = "bench"  # the default; a benchmark goes to its endpoint's node queue (the tokenizer is there)
    timeout = 3600

    def run(self, job, ctx) -> dict:
        return execute_job(job, ctx)

    def resubmit(self, *, job, user, request=None):
        """The same workload, validated again."""
        return benchmark_resubmit(job=job, user=user, request=request)


def execute_job(job: Job, ctx) -> dict:
    """The `bench` job: run each of its runs in order (one, or a sweep's levels)."""
    runs = list(BenchmarkRun.objects.filter(job=job).order_by("sweep_index", "pk"))
    if not runs:
        raise JobFailed("This job has no benchmark run (was it deleted?).")
    done = []
    try:
        for i, run in enumerate(runs):
            span = (100.0 * i / len(runs), 100.0 * (i + 1) / len(runs))
            execute_run(run, ctx, span=span, step=f"{i + 1}/{len(runs)} " if len(runs) > 1 else "")
            done.append(run)
    except JobCancelled:
        end_open_runs(job, BenchStatus.CANCELLED, "Cancelled.")
        raise
    except JobFailed as exc:
        end_open_runs(job, BenchStatus.FAILED, str(exc))
        raise
    except Exception as exc:
        end_open_runs(job, BenchStatus.FAILED, f"{type(exc).__name__}: {exc}")
        raise
    last = done[-1]
    summary = {k: last.result.get(k) for k in ("request_throughput", "output_throughput", "p99_e2el_ms", "p99_ttft_ms")}
    return {"benchmark_runs": [r.pk for r in done], "sweep": runs[0].sweep_id, **summary}
