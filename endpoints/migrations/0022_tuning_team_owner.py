import django.db.models.deletion
from django.db import migrations, models

from console.migrations._teams import from_parents


class Migration(migrations.Migration):
    dependencies = [
        ('console', '0005_audit_event_team'),
        ('endpoints', '0021_tuning_of_an_artifact_on_a_node'),
    ]

    operations = [
        migrations.AddField(
            model_name='tuning',
            name='team',
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.PROTECT, related_name='+', to='console.team'
            ),
        ),
        # Existing tunings: their endpoint's team, else (the endpoint deleted) the default team.
        from_parents("endpoints", "tuning", "endpoint"),
        migrations.AlterField(
            model_name='tuning',
            name='team',
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='+', to='console.team'),
        ),
    ]
