from ninja import Query, Router

from console.api_auth import api_route
from console.roles import ADMIN, OPERATOR, VIEWER, has_role
from workers.jobs import selectors as job_selectors
from workers.jobs import services as job_services
from workers.jobs.models import Job

router = Router(tags=["jobs"])


def job_json(job: Job, *, user=None) -> dict:
    data = {
        "id": job.pk,
        "team": job.team_id,  # none: a job about no team's object, everyone's
        "kind": job.kind,
        "status": job.status,
        "progress": round(job.progress, 1),
        "stage": job.stage,
        "error": job.error or None,
        "params": job.params,
        "result": job.result,
        "result_artifact": job.result.get("artifact_id"),
        **_target_keys(job),
        "queue": job.queue,
        "node": job.node,
        "worker": job.worker_name,
        "created_by": job.created_by.username if job.created_by else None,
        "created_at": job.created_at.isoformat(),
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "retry_of": job.retry_of_id,
    }
    if user is not None and has_role(user, ADMIN):
        data["traceback"] = job.traceback or None
    return data


def _target_keys(job: Job) -> dict:
    """The API's keys from before targets were generic: `target_<its model name>` is the target's id
    (an artifact), and `target_model` also names the model an artifact belongs to."""
    keys = {"target_model": None, "target_artifact": None}
    if job.target_type_id is not None:
        name = f"target_{job.target_type.model}"
        if name in keys:
            keys[name] = job.target_id
        if keys["target_model"] is None:
            keys["target_model"] = getattr(job.target, "model_id", None)
    return keys


@api_route(router, "get", "/jobs", role=VIEWER, response=list[dict])
def list_jobs(
    request,
    status: str = "",
    kind: str = "",
    model: int | None = None,
    user: str = "",
    limit: int = Query(100, ge=1, le=500),
):
    jobs = job_selectors.job_list(user=request.user, status=status, kind=kind, targets={"model": model}, username=user)[
        :limit
    ]
    return [job_json(j) for j in jobs]


@api_route(router, "get", "/jobs/{job_id}", role=VIEWER, response=dict)
def get_job(request, job_id: int):
    job = job_selectors.job_get(job_id, user=request.user)
    return job_json(job, user=request.user) | {"log_tail": job.log[-5000:]}


@api_route(router, "post", "/jobs/{job_id}/cancel", role=OPERATOR, response=dict)
def cancel_job(request, job_id: int):
    job = job_selectors.job_get(job_id, user=request.user, role=OPERATOR)
    job = job_services.job_cancel(job=job, user=request.user, request=request)
    return job_json(job)


@api_route(router, "post", "/jobs/{job_id}/retry", role=OPERATOR, response={202: dict})
def retry_job(request, job_id: int):
    job = job_selectors.job_get(job_id, user=request.user, role=OPERATOR)
    new = job_services.job_retry(job=job, user=request.user, request=request)
    return 202, {"job": new.pk}
