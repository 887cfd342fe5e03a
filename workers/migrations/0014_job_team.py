import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    # The jobs that exist get their team from what they work on in evaluations 0003_evaluation_team_owner (the
    # highest app, which sees every team-owned model): this app sits below the ones that own things.
    dependencies = [
        ('console', '0005_audit_event_team'),
        ('workers', '0013_alert_rule_kind_budget'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='team',
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name='+',
                to='console.team',
            ),
        ),
    ]
