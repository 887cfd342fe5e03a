import django.db.models.deletion
from django.db import migrations, models

from console.migrations._teams import from_parents


def jobs_to_their_teams(apps, schema_editor):
    """The jobs that exist take the team of what they work on: their target where it is team-owned, else the
    endpoint (a benchmark's or profile's) or tuning their parameters name. The rest (a node's, or whose object is
    gone) stay without a team: everyone's, as before teams."""
    job = apps.get_model("workers", "Job")
    content_type = apps.get_model("contenttypes", "ContentType")
    found: dict[int, set[int]] = {}  # team id -> job ids
    pending = job.objects.filter(team__isnull=True)
    for ct in content_type.objects.filter(pk__in=pending.exclude(target_type=None).values("target_type")):
        try:
            model = apps.get_model(ct.app_label, ct.model)
        except LookupError:
            continue
        if "team" not in {f.name for f in model._meta.get_fields()}:
            continue
        of_jobs = pending.filter(target_type=ct).values_list("pk", "target_id")
        teams = dict(model.objects.filter(pk__in={t for _, t in of_jobs}).values_list("pk", "team_id"))
        for job_id, target_id in of_jobs:
            if target_id in teams:
                found.setdefault(teams[target_id], set()).add(job_id)
    endpoints = dict(apps.get_model("endpoints", "Endpoint").objects.values_list("pk", "team_id"))
    tunings = dict(apps.get_model("endpoints", "Tuning").objects.values_list("pk", "team_id"))
    for job_id, params in pending.filter(target_type=None).values_list("pk", "params"):
        params = params if isinstance(params, dict) else {}
        team_id = endpoints.get(params.get("endpoint")) or tunings.get(params.get("tuning"))
        if team_id is not None:
            found.setdefault(team_id, set()).add(job_id)
    for team_id, job_ids in found.items():
        job.objects.filter(pk__in=job_ids).update(team_id=team_id)


class Migration(migrations.Migration):
    dependencies = [
        ('console', '0005_audit_event_team'),
        ('contenttypes', '0002_remove_content_type_name'),
        ('endpoints', '0022_tuning_team_owner'),
        ('evaluations', '0002_rollout_gate_above_share'),
        ('models_registry', '0005_team_owner'),
        ('workers', '0014_job_team'),
    ]

    operations = [
        migrations.AddField(
            model_name='evaluation',
            name='team',
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='console.team'
            ),
        ),
        # Existing evaluations: their endpoint's team, else their artifact's, else the default team.
        from_parents("evaluations", "evaluation", "endpoint", "artifact"),
        migrations.AlterField(
            model_name='evaluation',
            name='team',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='+', to='console.team'),
        ),
        migrations.RunPython(jobs_to_their_teams, migrations.RunPython.noop),
    ]
