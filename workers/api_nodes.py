from django.shortcuts import get_object_or_404
from ninja import Router

from console.api_auth import api_route
from console.roles import VIEWER
from console.teams import visible_team_ids
from workers.models import Node
from workers.telemetry.sources import hidden_endpoints, processes_seen

router = Router(tags=["nodes"])


def _latest_seen(latest: dict | None, hidden: set[int]) -> dict | None:
    if not latest or "processes" not in latest:
        return latest
    return {**latest, "processes": processes_seen(latest, hidden)}


def node_json(node: Node, *, hidden: set[int]) -> dict:
    """`hidden`: the endpoints whose names the caller may not see on this shared node (processes_seen)."""
    return {
        "id": node.pk,
        "name": node.name,
        "hostname": node.hostname,
        "address": node.address,
        "platform": node.platform,
        "online": node.online,
        "engine_runtime": node.engine_runtime,
        "engine_image": node.engine_image() if node.containerised else None,
        "last_heartbeat": node.last_heartbeat.isoformat() if node.last_heartbeat else None,
        "engine": node.engine,
        "compat_warnings": node.compat_warnings,
        "host": node.host,
        "telemetry_error": node.telemetry_error or None,
        "devices": [
            {
                "index": d.index,
                "kind": d.kind,
                "name": d.name,
                "health": d.health,
                "memory_total_bytes": d.memory_total_bytes,
                "latest": _latest_seen(d.latest, hidden),
            }
            for d in node.devices.all()
        ],
    }


@api_route(router, "get", "/nodes", role=VIEWER, response=list[dict])
def list_nodes(request):
    hidden = hidden_endpoints(visible_team_ids(request.user))
    return [node_json(n, hidden=hidden) for n in Node.objects.prefetch_related("devices")]


@api_route(router, "get", "/nodes/{node_id}", role=VIEWER, response=dict)
def get_node(request, node_id: int):
    return node_json(get_object_or_404(Node, pk=node_id), hidden=hidden_endpoints(visible_team_ids(request.user)))
