"""RQ entrypoints. Thin: they take a Job id and hand over to the runtime."""
from rq import get_current_job


def run(job_id: int) -> str:
    from workers.runtime import run_job

    current = get_current_job()
    worker = (current.worker_name if current is not None else "") or ""
    return run_job(job_id, worker_name=worker)
