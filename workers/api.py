from django.shortcuts import get_object_or_404
from ninja import Query, Router

from console.api_auth import api_route
from console.roles import ADMIN, OPERATOR, VIEWER, has_role
from workers import selectors, services
from workers.models import Job

router = Router(tags=["jobs"])


def job_json(job: Job, *, user=None) -> dict:
    data = {
        "id": job.pk,
        "kind": job.kind,
        "status": job.status,
        "progress": round(job.progress, 1),
        "stage": job.stage,
        "error": job.error or None,
        "params": job.params,
        "result": job.result,
        "result_artifact": job.result_artifact_id,
        "target_model": job.target_model_id,
        "target_artifact": job.target_artifact_id,
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


@api_route(router, "get", "/jobs", role=VIEWER, response=list[dict])
def list_jobs(request, status: str = "", kind: str = "", model: int | None = None, user: str = "",
              limit: int = Query(100, ge=1, le=500)):
    jobs = selectors.job_list(status=status, kind=kind, model_id=model, username=user)[:limit]
    return [job_json(j) for j in jobs]


@api_route(router, "get", "/jobs/{job_id}", role=VIEWER, response=dict)
def get_job(request, job_id: int):
    job = get_object_or_404(Job.objects.select_related("created_by"), pk=job_id)
    return job_json(job, user=request.user) | {"log_tail": job.log[-5000:]}


@api_route(router, "post", "/jobs/{job_id}/cancel", role=OPERATOR, response=dict)
def cancel_job(request, job_id: int):
    job = services.job_cancel(job=get_object_or_404(Job, pk=job_id), user=request.user, request=request)
    return job_json(job)


@api_route(router, "post", "/jobs/{job_id}/retry", role=OPERATOR, response={202: dict})
def retry_job(request, job_id: int):
    new = services.job_retry(job=get_object_or_404(Job, pk=job_id), user=request.user, request=request)
    return 202, {"job": new.pk}
