# The job runtime knows no domain: a Job points at what it works on through a generic link
# (filled from the old foreign keys by 0005; those go in 0006, in their own transaction so
# PostgreSQL has no pending deferred-constraint checks when the columns are dropped).
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("workers", "0003_telemetry"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="target_id",
            field=models.PositiveBigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="job",
            name="target_type",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="contenttypes.contenttype",
            ),
        ),
    ]
