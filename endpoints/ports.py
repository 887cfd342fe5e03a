"""Ports reserved on a host through the Replica table: each replica's API port, and a multi-node
replica's rendezvous port (Ray head, data-parallel RPC) on its head node."""

from django.conf import settings
from django.db import IntegrityError, transaction

from endpoints.models import Replica
from workers.agent.supervisor import port_is_free
from workers.models import Node


def claim_port(node: Node, replica: Replica, *, field: str = "port") -> int:
    """Reserve a free port for the replica in `field` ("port": ENDPOINT_PORT_RANGE, "cluster_port":
    ENDPOINT_CLUSTER_PORT_RANGE). The unique (port_host, port) and (port_host, cluster_port)
    constraints make a claim race-safe between agents on the same host; a port held in the other
    column is skipped too (a clash that slips between the two is a bind error, then a restart)."""
    low, high = settings.ENDPOINT_CLUSTER_PORT_RANGE if field == "cluster_port" else settings.ENDPOINT_PORT_RANGE
    others = Replica.objects.filter(port_host=node.hostname).exclude(pk=replica.pk)
    taken = {p for pair in others.values_list("port", "cluster_port") for p in pair if p is not None}
    bind_host = "0.0.0.0" if field == "cluster_port" else settings.ENDPOINT_BIND_HOST  # Ray listens on all
    for port in range(low, high + 1):
        if port in taken or not port_is_free(port, bind_host):
            continue
        try:
            with transaction.atomic():
                Replica.objects.filter(pk=replica.pk).update(**{field: port}, port_host=node.hostname)
            return port
        except IntegrityError:
            continue  # another agent claimed it a moment ago
    raise RuntimeError(f"No free port in {low}-{high} on {node.name}")
