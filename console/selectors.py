from console.teams import visible, visible_or_shared
from models_registry.models import Artifact, Model
from workers.jobs.models import Job


def overview_counts(*, user) -> dict:
    """The Overview's counts, of what `user` sees (their teams' objects; jobs of no team are everyone's)."""
    artifacts = visible(Artifact.objects.all(), user)
    jobs = visible_or_shared(Job.objects.all(), user)
    return {
        "models": visible(Model.objects.alive(), user).count(),
        "artifacts": visible(Artifact.objects.alive(), user).count(),
        "artifacts_ready": artifacts.filter(status=Artifact.Status.READY).count(),
        "jobs_active": jobs.filter(status__in=Job.ACTIVE).count(),
        "jobs_failed": jobs.filter(status=Job.Status.FAILED).count(),
        "jobs_total": jobs.count(),
        "recent_jobs": list(jobs.select_related("created_by").prefetch_related("target")[:8]),
    }
