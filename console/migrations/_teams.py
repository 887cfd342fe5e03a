"""What the migrations that give objects a team share (a name starting with "_": not a migration itself). The
default team is made here as console.models.Team.default_id makes it; existing objects go to it. Reversed, the
`team` column is dropped with its values (no update first: on PostgreSQL, rows changed in the migration's
transaction leave deferred foreign-key triggers pending, and the column cannot be dropped then)."""

from django.db import migrations

DEFAULT_SLUG, DEFAULT_NAME = "default", "Default"


def default_team_id(apps) -> int:
    team = apps.get_model("console", "Team")
    return team.objects.get_or_create(slug=DEFAULT_SLUG, defaults={"name": DEFAULT_NAME})[0].pk


def into_default_team(app_label: str, *model_names: str) -> migrations.RunPython:
    def forward(apps, schema_editor):
        team_id = default_team_id(apps)
        for name in model_names:
            apps.get_model(app_label, name).objects.filter(team__isnull=True).update(team_id=team_id)

    return migrations.RunPython(forward, migrations.RunPython.noop)
