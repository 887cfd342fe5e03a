"""Reads for profiles."""

from console.roles import VIEWER
from console.teams import visible, visible_get
from endpoints.profiling.models import PROFILE_ACTIVE, Profile


def profile_get(profile_id: int, *, user, role: str = VIEWER) -> Profile:
    """404 for another team's profile; 403 where the user's role in its team is below `role`."""
    return visible_get(Profile.objects.select_related("job", "endpoint", "created_by"), user, role=role, pk=profile_id)


def profiles_for_endpoint(endpoint, limit: int = 20):
    return Profile.objects.filter(endpoint=endpoint).select_related("job", "created_by")[:limit]


def active_profile_of_replica(endpoint, replica_index: int) -> Profile | None:
    """A profile of this replica still queued or working (its job not ended)."""
    for profile in Profile.objects.filter(
        endpoint=endpoint, replica_index=replica_index, status__in=PROFILE_ACTIVE
    ).select_related("job"):
        if profile.is_active:
            return profile
    return None


def profiles_by_ids(ids, *, user) -> list[Profile]:
    found = {p.pk: p for p in visible(Profile.objects.filter(pk__in=list(ids)), user).select_related("job")}
    return [found[i] for i in ids if i in found]


def comparable_profiles(profile: Profile, *, user, limit: int = 20) -> tuple[list[Profile], list[Profile]]:
    """Finished profiles of the user's teams to compare this one with: (of the same endpoint, of other endpoints),
    newest first. The others matter as much: the same model served as bf16 and as a quantized artifact are two
    endpoints."""
    done = (
        visible(Profile.objects.filter(status="succeeded"), user).exclude(pk=profile.pk).order_by("-created_at", "-pk")
    )
    same = list(done.filter(endpoint_name=profile.endpoint_name)[:limit])
    return same, list(done.exclude(endpoint_name=profile.endpoint_name)[:limit])
