"""Benchmarks API: queue a run or a concurrency sweep against an endpoint of this console,
read results (vLLM's own field names), compare runs, cancel."""

from django.http import Http404
from ninja import Router, Schema
from pydantic import ConfigDict

from console.api_auth import api_route
from console.exceptions import Conflict
from console.roles import OPERATOR, VIEWER
from endpoints.bench import compare, selectors, services
from endpoints.bench.models import BenchmarkRun, BenchmarkSweep
from endpoints.bench.workload import WorkloadRequest

router = Router(tags=["benchmarks"])


class BenchmarkIn(Schema):
    # Unknown fields (a "url", a "base_url") are refused, not ignored: the target is an endpoint.
    model_config = ConfigDict(extra="forbid")

    endpoint: int | str
    replica: int | None = None
    via: str = "replica"  # or "gateway": through the console's gateway, to every ready replica
    label: str = ""
    num_prompts: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    max_concurrency: int | None = None
    request_rate: float | None = None
    num_warmups: int = 0
    timeout_s: int | None = None
    ignore_eos: bool = True
    seed: int | None = None  # default 0
    prompt_file: str | None = None  # JSONL content: {"prompt": ..., "output_tokens"?: ...} per line


class SweepIn(BenchmarkIn):
    concurrencies: list[int] | None = None  # default: 1, 2, 4, … max_concurrency


def run_json(run: BenchmarkRun, *, detail: bool = False) -> dict:
    data = {
        "id": run.pk,
        "status": run.state,
        "error": run.display_error or None,
        "endpoint": run.endpoint_id,
        "endpoint_name": run.endpoint_name,
        "label": run.label,
        "setup": run.setup,
        "job": run.job_id,
        "sweep": run.sweep_id,
        "workload": {
            "dataset": run.dataset,
            "prompt_file": run.prompt_file_name or None,
            "num_prompts": run.num_prompts,
            "input_len": run.input_len,
            "output_len": run.output_len,
            "max_concurrency": run.max_concurrency,
            "request_rate": run.request_rate,
            "num_warmups": run.num_warmups,
            "timeout_s": run.timeout_s,
            "seed": run.params.get("seed", 0),
            "replica": run.params.get("replica"),
            "via": run.params.get("via", "replica"),
        },
        "target": {
            "via": run.params.get("via", "replica"),
            "replica": run.replica_index,
            "url": run.target_url or None,
        },
        "result": run.result,
        "config": run.config,
        "created_by": run.created_by.username if run.created_by else None,
        "created_at": run.created_at.isoformat(),
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "url": run.get_absolute_url(),
    }
    if detail:
        data["detail"] = run.detail
        data["telemetry"] = run.telemetry
        data["command"] = run.command
    return data


def sweep_json(sweep: BenchmarkSweep) -> dict:
    return {
        "id": sweep.pk,
        "status": sweep.state,
        "endpoint": sweep.endpoint_id,
        "endpoint_name": sweep.endpoint_name,
        "label": sweep.label,
        "job": sweep.job_id,
        "concurrencies": sweep.concurrencies,
        "points": selectors.sweep_points(sweep),
        "created_at": sweep.created_at.isoformat(),
        "url": sweep.get_absolute_url(),
    }


def _request(payload: Schema) -> dict:
    """The service's keyword arguments: the endpoint, the prompt file's content, the workload."""
    data = payload.dict()
    return {
        "endpoint": data.pop("endpoint"),
        "prompt_file": data.pop("prompt_file", None),
        "workload": WorkloadRequest(**data),
    }


@api_route(router, "post", "/benchmarks", role=OPERATOR, response={202: dict})
def create_benchmark(request, payload: BenchmarkIn):
    run = services.benchmark_create(**_request(payload), user=request.user, request=request)
    return 202, run_json(run)


@api_route(router, "get", "/benchmarks", role=VIEWER, response=list[dict])
def list_benchmarks(request, endpoint: str = "", status: str = "", limit: int = 100):
    runs = selectors.run_list(user=request.user, endpoint=endpoint or None, state=status)
    return [run_json(r) for r in list(runs[: max(1, min(limit, 500))])]


@api_route(router, "get", "/benchmarks/compare", role=VIEWER, response=dict)
def compare_benchmarks(request, runs: str, baseline: int | None = None):
    """?runs=1,2,3&baseline=1; costs per device-hour from settings, or ?cost_<type>=x (e.g. cost_910b4=1.9)."""
    overrides = {k[5:]: v for k, v in request.GET.items() if k.startswith("cost_")}
    try:
        rates = compare.cost_rates(overrides)
    except ValueError as exc:
        from django.core.exceptions import ValidationError

        raise ValidationError({"cost": str(exc)}) from None
    return compare.compare_rows(
        selectors.runs_by_ids(selectors.parse_ids(runs), user=request.user), baseline_id=baseline, rates=rates
    )


# Before /benchmarks/{run_id}: ninja's path parameters match any segment.
@api_route(router, "post", "/benchmarks/sweeps", role=OPERATOR, response={202: dict})
def create_sweep(request, payload: SweepIn):
    sweep = services.sweep_create(**_request(payload), user=request.user, request=request)
    return 202, sweep_json(sweep)


@api_route(router, "get", "/benchmarks/sweeps/{sweep_id}", role=VIEWER, response=dict)
def get_sweep(request, sweep_id: int):
    return sweep_json(selectors.sweep_get(sweep_id, user=request.user))


@api_route(router, "get", "/benchmarks/{run_id}", role=VIEWER, response=dict)
def get_benchmark(request, run_id: int, detail: bool = False):
    try:
        run = selectors.run_get(run_id, user=request.user)
    except BenchmarkRun.DoesNotExist:
        raise Http404 from None
    return run_json(run, detail=detail)


@api_route(router, "post", "/benchmarks/{run_id}/cancel", role=OPERATOR, response=dict)
def cancel_benchmark(request, run_id: int):
    run = selectors.run_get(run_id, user=request.user, role=OPERATOR)
    if run.job is None:
        raise Conflict(f"Benchmark #{run.pk} has no job to cancel.")
    services.benchmark_cancel(job=run.job, user=request.user, request=request)
    return run_json(selectors.run_get(run.pk, user=request.user))
