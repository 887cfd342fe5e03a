"""RQ entrypoint. Thin: it takes a Job id and hands over to the runner."""

from rq import get_current_job

from workers.jobs.runner import run_job


def run(job_id: int) -> str:
    current = get_current_job()
    worker = (current.worker_name if current is not None else "") or ""
    return run_job(job_id, worker_name=worker)
