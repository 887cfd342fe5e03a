"""Writes for benchmarks: validate and queue runs and sweeps (one `bench` job each), retry and cancel them.
The job itself is endpoints.bench.jobs; what it runs, endpoints.bench.client."""

from pathlib import Path

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from console.audit import audit_log
from console.roles import OPERATOR, at_least
from console.teams import team_role
from endpoints.bench.models import BENCH_ENDED, BenchmarkRun, BenchmarkSweep, BenchStatus
from endpoints.bench.workload import (
    DEDUPE,
    WorkloadRequest,
    clean_workload,
    prompt_file_path,
    read_prompt_file,
    resolve_endpoint,
    store_prompt_file,
)
from endpoints.models import Endpoint
from workers.jobs.models import Job
from workers.jobs.queues import node_queue
from workers.jobs.services import job_cancel, job_enqueue


def _run_fields(endpoint: Endpoint, workload: dict, *, max_concurrency, num_prompts, file_name: str, user) -> dict:
    return {
        "endpoint": endpoint,
        "endpoint_name": endpoint.name,
        "label": workload["label"],
        "dataset": workload["dataset"],
        "prompt_file_name": file_name,
        "num_prompts": num_prompts,
        "input_len": workload["input_len"],
        "output_len": workload["output_len"],
        "max_concurrency": max_concurrency,
        "request_rate": workload["request_rate"],
        "num_warmups": workload["num_warmups"],
        "timeout_s": workload["timeout_s"],
        "created_by": user if user is not None and user.pk else None,
    }


def _check_ready(endpoint: Endpoint, replica: int | None) -> None:
    ready = endpoint.replica_set.filter(state=Endpoint.State.READY)
    if replica is not None:
        ready = ready.filter(index=replica)
    if not ready.exists():
        which = f"replica {replica} of {endpoint.name}" if replica is not None else endpoint.name
        raise ValidationError(
            {"endpoint": f"{which} has no ready replica (state: {endpoint.state}); start it and wait for ready first."}
        )


def _enqueue(*, endpoint: Endpoint, params: dict, user, request, retry_of, timeout_s: int) -> Job:
    # One benchmark per endpoint at a time: the lock serialises concurrent requests, the
    # dedupe key refuses a second while the first is queued or running.
    Endpoint.objects.select_for_update().filter(pk=endpoint.pk).first()
    # The client reads the model's tokenizer from the artifact's path: run it on the endpoint's node.
    # The job may run longer than the kind's default: every run's timeout plus client start-up.
    return job_enqueue(
        kind="bench",
        params=params,
        user=user,
        dedupe_key=DEDUPE.format(endpoint.pk),
        request=request,
        retry_of=retry_of,
        queue=node_queue(endpoint.node.name),
        timeout_s=timeout_s,
        team_id=endpoint.team_id,
    )


def _prepare(endpoint_ref, prompt_file, stored_prompt_path: str | None, prompt_file_name: str, *, user):
    """(endpoint, prompt rows, the prompt file's path, its name, an upload's content still to store). Only an
    endpoint of a team where `user` is an Operator: another team's is refused as if it did not exist."""
    endpoint = resolve_endpoint(endpoint_ref)
    if user is not None and not at_least(team_role(user, endpoint.team_id), OPERATOR):
        raise ValidationError({"endpoint": "Choose an endpoint of this console (its id or name)."})
    rows, path, file_name, upload = None, None, "", None
    if stored_prompt_path:  # a retry: the file the first run stored
        path = Path(stored_prompt_path)
        if not path.exists():
            raise ValidationError({"prompt_file": "The prompt file of the first run is gone; upload it again."})
        rows, _ = read_prompt_file(path.read_bytes())
        file_name = str(prompt_file_name or path.name)
    elif prompt_file is not None:
        content = prompt_file.read() if hasattr(prompt_file, "read") else prompt_file
        rows, upload = read_prompt_file(content)
        path = prompt_file_path(upload)
        file_name = getattr(prompt_file, "name", "") or "prompts.jsonl"
    return endpoint, rows, path, file_name, upload


def _store_upload(upload: bytes | None) -> None:
    """An uploaded prompt file is written once the request has passed every check and its job is queued (a
    refused request leaves no file). Named by its content: never removed, as another run may read the same."""
    if upload is not None:
        store_prompt_file(upload)


def benchmark_create(
    *,
    endpoint: int | str,
    workload: WorkloadRequest,
    user,
    prompt_file=None,
    request=None,
    retry_of: Job | None = None,
    stored_prompt_path: str | None = None,
    prompt_file_name: str = "",
) -> BenchmarkRun:
    """Validate one benchmark of an endpoint (its id or name) and queue it on the endpoint's node.
    `prompt_file`: uploaded JSONL (a file or its content); a retry passes the stored file instead."""
    target, rows, path, file_name, upload = _prepare(
        endpoint, prompt_file, stored_prompt_path, prompt_file_name, user=user
    )
    cleaned = clean_workload(workload, endpoint=target, prompt_rows=rows)
    _check_ready(target, cleaned["replica"])
    params = {
        "mode": "run",
        "endpoint": target.pk,
        "endpoint_name": target.name,
        **cleaned,
        "prompt_file": str(path) if path else None,
        "prompt_file_name": file_name,
    }
    with transaction.atomic():
        job = _enqueue(
            endpoint=target,
            params=params,
            user=user,
            request=request,
            retry_of=retry_of,
            timeout_s=cleaned["timeout_s"] + 300,
        )
        _store_upload(upload)
        run = BenchmarkRun.objects.create(
            job=job,
            params=params,
            **_run_fields(
                target,
                cleaned,
                max_concurrency=cleaned["max_concurrency"],
                num_prompts=cleaned["num_prompts"],
                file_name=file_name,
                user=user,
            ),
        )
        audit_log(
            actor=user,
            action="benchmark.create",
            obj=run,
            request=request,
            changes={
                "endpoint": target.name,
                "job": job.pk,
                **{k: v for k, v in cleaned.items() if v not in (None, "")},
            },
        )
    return run


def sweep_create(
    *,
    endpoint: int | str,
    workload: WorkloadRequest,
    user,
    prompt_file=None,
    request=None,
    retry_of: Job | None = None,
    stored_prompt_path: str | None = None,
    prompt_file_name: str = "",
) -> BenchmarkSweep:
    """A concurrency sweep (1, 2, 4, … N) in one job: one run per level, in order."""
    target, rows, path, file_name, upload = _prepare(
        endpoint, prompt_file, stored_prompt_path, prompt_file_name, user=user
    )
    cleaned = clean_workload(workload, endpoint=target, prompt_rows=rows, sweep=True)
    if cleaned["request_rate"] is not None:
        raise ValidationError({"request_rate": "A sweep varies the concurrency; leave the request rate empty."})
    _check_ready(target, cleaned["replica"])
    levels = cleaned["concurrencies"]
    params = {
        "mode": "sweep",
        "endpoint": target.pk,
        "endpoint_name": target.name,
        **cleaned,
        "prompt_file": str(path) if path else None,
        "prompt_file_name": file_name,
    }
    with transaction.atomic():
        job = _enqueue(
            endpoint=target,
            params=params,
            user=user,
            request=request,
            retry_of=retry_of,
            timeout_s=len(levels) * (cleaned["timeout_s"] + 300),
        )
        _store_upload(upload)
        sweep = BenchmarkSweep.objects.create(
            endpoint=target,
            endpoint_name=target.name,
            job=job,
            label=cleaned["label"],
            concurrencies=levels,
            params=params,
            created_by=user if user is not None and user.pk else None,
        )
        for index, level in enumerate(levels):
            # Without a prompt count, each level gets enough prompts to reach its concurrency.
            prompts = cleaned["num_prompts"] or max(16, 4 * level)
            BenchmarkRun.objects.create(
                job=job,
                sweep=sweep,
                sweep_index=index,
                params={**params, "max_concurrency": level, "num_prompts": prompts},
                **_run_fields(
                    target, cleaned, max_concurrency=level, num_prompts=prompts, file_name=file_name, user=user
                ),
            )
        audit_log(
            actor=user,
            action="benchmark.sweep",
            obj=sweep,
            request=request,
            changes={"endpoint": target.name, "job": job.pk, "concurrencies": levels},
        )
    return sweep


def benchmark_resubmit(*, job: Job, user, request=None) -> Job:
    """Retry of a bench job: the same workload, validated again. Returns the new job."""
    params = job.params
    create = sweep_create if params.get("mode") == "sweep" else benchmark_create
    created = create(
        endpoint=params.get("endpoint"),
        workload=WorkloadRequest.from_params(params),
        user=user,
        request=request,
        retry_of=job,
        stored_prompt_path=params.get("prompt_file"),
        prompt_file_name=params.get("prompt_file_name") or "",
    )
    assert created.job is not None  # both create their job with the row
    return created.job


def benchmark_cancel(*, job: Job, user, request=None) -> Job:
    job = job_cancel(job=job, user=user, request=request)
    end_open_runs(job, BenchStatus.CANCELLED, f"Cancelled by {getattr(user, 'username', 'system')}.")
    return job


def end_open_runs(job: Job, status: str, error: str) -> None:
    BenchmarkRun.objects.filter(job=job).exclude(status__in=BENCH_ENDED).update(
        status=status, error=error, finished_at=timezone.now()
    )
