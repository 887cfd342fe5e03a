"""Telemetry's series and alerts keep their endpoint's id, not a foreign key to endpoints.Endpoint: serving sits
above telemetry, at the schema level too (issue 39). The column, its values and its indexes stay; only the
constraint goes (on SQLite the table is rebuilt with its rows). The endpoints app owns the link: it names the
endpoint (endpoints.telemetry.endpoint_names) and deletes an endpoint's series and alerts with it."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("endpoints", "0001_initial"),
        ("workers", "0011_node_agent_lease"),
    ]

    operations = [
        # 1. Drop the database constraints (the field stays a foreign key in the state for now).
        migrations.AlterField(
            model_name="series",
            name="endpoint",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="series",
                to="endpoints.endpoint",
            ),
        ),
        migrations.AlterField(
            model_name="alert",
            name="endpoint",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="endpoints.endpoint",
            ),
        ),
        # 2. The same column (endpoint_id, indexed), now a plain integer: a change of the state alone.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="series", name="tm_series_ep_metric"),
                migrations.RemoveField(model_name="series", name="endpoint"),
                migrations.AddField(
                    model_name="series",
                    name="endpoint_id",
                    field=models.BigIntegerField(blank=True, db_index=True, null=True),
                ),
                migrations.AddIndex(
                    model_name="series",
                    index=models.Index(fields=["endpoint_id", "metric"], name="tm_series_ep_metric"),
                ),
                migrations.RemoveField(model_name="alert", name="endpoint"),
                migrations.AddField(
                    model_name="alert",
                    name="endpoint_id",
                    field=models.BigIntegerField(blank=True, db_index=True, null=True),
                ),
            ]
        ),
    ]
