"""Reads for jobs."""

from django.contrib.contenttypes.models import ContentType
from django.db.models import Q

from console.roles import VIEWER
from console.teams import visible_or_shared, visible_or_shared_get
from workers.jobs.models import Job
from workers.jobs.registry import runner_class, target_filter


def job_list(*, user, status: str = "", kind: str = "", targets: dict[str, int] | None = None, username: str = ""):
    """The jobs `user` sees (their teams' and those of no team), newest first. `targets` maps a registered target
    filter (e.g. "model") to an id."""
    jobs = visible_or_shared(Job.objects.select_related("created_by", "target_type"), user).prefetch_related("target")
    if status:
        jobs = jobs.filter(status=status)
    if kind:
        jobs = jobs.filter(kind=kind)
    for name, pk in (targets or {}).items():
        found = target_filter(name)
        if pk and found is not None:
            jobs = jobs.filter(found.jobs_q(pk))
    if username:
        jobs = jobs.filter(created_by__username=username)
    return jobs


def job_get(job_id: int, *, user, role: str = VIEWER) -> Job:
    """A job `user` sees: 404 for another team's; 403 below `role` in its team (console.teams)."""
    return visible_or_shared_get(Job.objects.select_related("created_by", "target_type"), user, role=role, pk=job_id)


def target_choices(name: str):
    """What the job list offers for a target filter (empty when no app registered it)."""
    found = target_filter(name)
    return found.choices() if found is not None else []


def jobs_on(obj):
    """The jobs whose target is `obj`, newest first."""
    return Job.objects.filter(target_q(obj))


def target_q(obj) -> Q:
    return Q(target_type=ContentType.objects.get_for_model(obj), target_id=obj.pk)


def result_object(job: Job):
    """What the job made (the kind's runner decides), for the job page's Result link."""
    runner = runner_class(job.kind)
    return runner().result_object(job) if runner is not None and job.result else None
