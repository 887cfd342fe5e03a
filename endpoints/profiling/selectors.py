"""Reads for profiles."""
from endpoints.profiling.models import PROFILE_ACTIVE, Profile


def profile_get(profile_id: int) -> Profile:
    return Profile.objects.select_related("job", "endpoint", "created_by").get(pk=profile_id)


def profiles_for_endpoint(endpoint, limit: int = 20):
    return Profile.objects.filter(endpoint=endpoint).select_related("job", "created_by")[:limit]


def active_profile_of_replica(endpoint, replica_index: int) -> Profile | None:
    """A profile of this replica still queued or working (its job not ended)."""
    for profile in Profile.objects.filter(endpoint=endpoint, replica_index=replica_index,
                                          status__in=PROFILE_ACTIVE).select_related("job"):
        if profile.is_active:
            return profile
    return None


def profiles_by_ids(ids) -> list[Profile]:
    found = {p.pk: p for p in Profile.objects.filter(pk__in=list(ids)).select_related("job")}
    return [found[i] for i in ids if i in found]
