from workers.models import Job


def job_list(*, status: str = "", kind: str = "", model_id: int | None = None, username: str = ""):
    jobs = Job.objects.select_related("created_by", "target_model", "target_artifact")
    if status:
        jobs = jobs.filter(status=status)
    if kind:
        jobs = jobs.filter(kind=kind)
    if model_id:
        jobs = jobs.filter(target_model_id=model_id)
    if username:
        jobs = jobs.filter(created_by__username=username)
    return jobs
