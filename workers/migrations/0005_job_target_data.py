# Moves each job's links to the generic target: the artifact wins over the model (the artifact
# knows its model). The result artifact is already named in `result["artifact_id"]`.
from django.db import migrations
from django.db.models import F, OuterRef, Subquery


def _content_type(apps, model):
    ContentType = apps.get_model("contenttypes", "ContentType")
    return ContentType.objects.get_or_create(app_label="models_registry", model=model)[0]


def forward(apps, schema_editor):
    Job = apps.get_model("workers", "Job")
    jobs = Job.objects.all()
    if jobs.filter(target_artifact__isnull=False).exists():
        jobs.filter(target_artifact__isnull=False).update(
            target_type=_content_type(apps, "artifact"), target_id=F("target_artifact_id")
        )
    if jobs.filter(target_artifact__isnull=True, target_model__isnull=False).exists():
        jobs.filter(target_artifact__isnull=True, target_model__isnull=False).update(
            target_type=_content_type(apps, "model"), target_id=F("target_model_id")
        )
    for job in jobs.filter(result_artifact__isnull=False).only("pk", "result", "result_artifact_id"):
        if (job.result or {}).get("artifact_id") != job.result_artifact_id:
            job.result = {**(job.result or {}), "artifact_id": job.result_artifact_id}
            job.save(update_fields=["result"])


def backward(apps, schema_editor):
    Job = apps.get_model("workers", "Job")
    Artifact = apps.get_model("models_registry", "Artifact")
    Model = apps.get_model("models_registry", "Model")
    on_artifact = Job.objects.filter(
        target_type=_content_type(apps, "artifact"), target_id__in=Artifact.objects.values("pk")
    )
    on_artifact.update(
        target_artifact_id=F("target_id"),
        target_model_id=Subquery(Artifact.objects.filter(pk=OuterRef("target_id")).values("model_id")[:1]),
    )
    Job.objects.filter(target_type=_content_type(apps, "model"), target_id__in=Model.objects.values("pk")).update(
        target_model_id=F("target_id")
    )
    artifact_ids = set(Artifact.objects.values_list("pk", flat=True))
    for job in Job.objects.exclude(result={}).only("pk", "result"):
        artifact_id = (job.result or {}).get("artifact_id") if isinstance(job.result, dict) else None
        if artifact_id in artifact_ids:
            Job.objects.filter(pk=job.pk).update(result_artifact_id=artifact_id)


class Migration(migrations.Migration):
    dependencies = [
        ("models_registry", "0003_calibrationdataset"),
        ("workers", "0004_job_target"),
    ]

    operations = [migrations.RunPython(forward, backward)]
