from django.shortcuts import get_object_or_404
from ninja import Router

from console.api_auth import api_route
from console.roles import VIEWER
from workers.models import Node

router = Router(tags=["nodes"])


def node_json(node: Node) -> dict:
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
                "latest": d.latest,
            }
            for d in node.devices.all()
        ],
    }


@api_route(router, "get", "/nodes", role=VIEWER, response=list[dict])
def list_nodes(request):
    return [node_json(n) for n in Node.objects.prefetch_related("devices")]


@api_route(router, "get", "/nodes/{node_id}", role=VIEWER, response=dict)
def get_node(request, node_id: int):
    return node_json(get_object_or_404(Node, pk=node_id))
