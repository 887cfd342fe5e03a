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


def from_parents(app_label: str, model_name: str, *parents: str) -> migrations.RunPython:
    """Existing objects of `model_name` take the team of the first of `parents` (foreign keys to team-owned
    objects) they have, as console.models.TeamOwned.save does for a new one; the rest go to the default team."""

    def forward(apps, schema_editor):
        from django.db.models import OuterRef, Subquery

        model = apps.get_model(app_label, model_name)
        for parent in parents:
            related = model._meta.get_field(parent).related_model
            team_of_parent = Subquery(related.objects.filter(pk=OuterRef(f"{parent}_id")).values("team_id")[:1])
            model.objects.filter(team__isnull=True, **{f"{parent}__isnull": False}).update(team_id=team_of_parent)
        model.objects.filter(team__isnull=True).update(team_id=default_team_id(apps))

    return migrations.RunPython(forward, migrations.RunPython.noop)
