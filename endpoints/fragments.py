"""Serving facts shown on registry pages, as htmx fragments (the registry does not import serving):
who serves an artifact, and the capacity estimate on the live devices."""

from django.shortcuts import render
from django.views.decorators.http import require_GET

from console.roles import VIEWER, require_role
from endpoints.registry_facts import artifact_users, live_device_memory
from models_registry.capacity_view import artifact_capacity
from models_registry.selectors import artifact_get


def _float(raw):
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


@require_role(VIEWER)
@require_GET
def artifact_served_by(request, artifact_id: int):
    artifact = artifact_get(artifact_id, user=request.user)
    return render(request, "endpoints/_artifact_served_by.html", {"in_use": artifact_users(artifact)})


@require_role(VIEWER)
@require_GET
def artifact_capacity_live(request, artifact_id: int):
    """The capacity table's rows for the live devices (the most free memory on each node's parts)."""
    artifact = artifact_get(artifact_id, user=request.user)
    capacity = artifact_capacity(
        artifact, memory_utilization=_float(request.GET.get("util")), devices=live_device_memory()
    )
    return render(request, "endpoints/_artifact_capacity_live.html", {"capacity": capacity})
