from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("endpoints", "0015_endpoint_roles_replica_role")]

    operations = [
        migrations.AddField(
            model_name="endpoint",
            name="adapters_on_demand",
            field=models.BooleanField(default=False),
        ),
    ]
