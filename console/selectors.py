from models_registry.models import Artifact, Model
from workers.jobs.models import Job


def overview_counts() -> dict:
    return {
        "models": Model.objects.alive().count(),
        "artifacts": Artifact.objects.alive().count(),
        "artifacts_ready": Artifact.objects.filter(status=Artifact.Status.READY).count(),
        "jobs_active": Job.objects.active().count(),
        "jobs_failed": Job.objects.filter(status=Job.Status.FAILED).count(),
        "jobs_total": Job.objects.count(),
        "recent_jobs": list(Job.objects.select_related("created_by").prefetch_related("target")[:8]),
    }
