"""Profiles API: record a ready replica with vLLM's profiler (optionally under the console's own
load), read the breakdown, top operators and advice, delete."""

from django.http import Http404
from ninja import Router, Schema
from pydantic import ConfigDict

from console.api_auth import api_route
from console.roles import OPERATOR, VIEWER
from endpoints.profiling import selectors, services
from endpoints.profiling.models import Profile
from endpoints.selectors import endpoint_get

router = Router(tags=["profiles"])


class ProfileIn(Schema):
    model_config = ConfigDict(extra="forbid")

    replica: int | None = None  # default: the first ready replica
    duration_s: int | None = None  # default PROFILE_DEFAULT_SECONDS, at most PROFILE_MAX_SECONDS
    load: bool | dict | None = None  # true: the default load; an object: benchmark settings; none: no load
    label: str = ""


def profile_json(profile: Profile, *, detail: bool = True) -> dict:
    data = {
        "id": profile.pk,
        "state": profile.state,
        "error": profile.display_error or None,
        "endpoint": profile.endpoint_id,
        "endpoint_name": profile.endpoint_name,
        "replica": profile.replica_index,
        "label": profile.label,
        "setup": profile.setup,
        "job": profile.job_id,
        "duration_s": profile.duration_s,
        "load": profile.load or None,
        "traced_seconds": profile.traced_seconds,
        "files": profile.files,
        "total_bytes": profile.total_bytes,
        "created_by": profile.created_by.username if profile.created_by else None,
        "created_at": profile.created_at.isoformat(),
        "started_at": profile.started_at.isoformat() if profile.started_at else None,
        "finished_at": profile.finished_at.isoformat() if profile.finished_at else None,
        "url": profile.get_absolute_url(),
    }
    if detail:
        data.update(
            breakdown=profile.breakdown,
            top_ops=profile.top_ops,
            advice=profile.advice,
            window=profile.window,
            config=profile.config,
        )
    return data


def _profile(request, endpoint_id: int, profile_id: int, role: str) -> Profile:
    profile = selectors.profile_get(profile_id, user=request.user, role=role)
    if profile.endpoint_id != endpoint_id:
        raise Http404
    return profile


@api_route(router, "post", "/endpoints/{endpoint_id}/profiles", role=OPERATOR, response={202: dict})
def create_profile(request, endpoint_id: int, payload: ProfileIn):
    endpoint = endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    profile = services.profile_create(
        endpoint=endpoint,
        replica=payload.replica,
        duration_s=payload.duration_s,
        load=payload.load,
        label=payload.label,
        user=request.user,
        request=request,
    )
    return 202, profile_json(profile)


@api_route(router, "get", "/endpoints/{endpoint_id}/profiles", role=VIEWER, response=list[dict])
def list_profiles(request, endpoint_id: int, limit: int = 50):
    endpoint = endpoint_get(endpoint_id, user=request.user, role=VIEWER)
    return [
        profile_json(p, detail=False) for p in selectors.profiles_for_endpoint(endpoint, limit=max(1, min(limit, 500)))
    ]


@api_route(router, "get", "/endpoints/{endpoint_id}/profiles/{profile_id}", role=VIEWER, response=dict)
def get_profile(request, endpoint_id: int, profile_id: int):
    return profile_json(_profile(request, endpoint_id, profile_id, VIEWER))


@api_route(router, "delete", "/endpoints/{endpoint_id}/profiles/{profile_id}", role=OPERATOR, response={204: None})
def delete_profile(request, endpoint_id: int, profile_id: int):
    services.profile_delete(
        profile=_profile(request, endpoint_id, profile_id, OPERATOR), user=request.user, request=request
    )
    return 204, None
