import django.db.models.deletion
from django.db import migrations, models

from console.migrations._teams import default_team_id


def uploaded_to_default_team(apps, schema_editor):
    """Uploaded datasets that exist go to the default team; the built-in ones stay everyone's (no team)."""
    dataset = apps.get_model("models_registry", "CalibrationDataset")
    if dataset.objects.filter(builtin=False).exists():
        dataset.objects.filter(builtin=False, team__isnull=True).update(team_id=default_team_id(apps))


class Migration(migrations.Migration):
    dependencies = [
        ('console', '0005_audit_event_team'),
        ('models_registry', '0005_team_owner'),
    ]

    operations = [
        migrations.AddField(
            model_name='calibrationdataset',
            name='team',
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name='+',
                to='console.team',
            ),
        ),
        migrations.RunPython(uploaded_to_default_team, migrations.RunPython.noop),
    ]
