from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("workers", "0005_job_target_data"),
    ]

    operations = [
        migrations.RemoveField(model_name="job", name="result_artifact"),
        migrations.RemoveField(model_name="job", name="target_artifact"),
        migrations.RemoveField(model_name="job", name="target_model"),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(fields=["target_type", "target_id"], name="job_target"),
        ),
    ]
