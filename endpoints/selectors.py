from endpoints.models import Endpoint


def endpoint_list():
    return Endpoint.objects.select_related("artifact", "artifact__model", "node").prefetch_related("replica_set")


def replicas_of(endpoint: Endpoint):
    return endpoint.replica_set.select_related("node").prefetch_related("members__node").order_by("index")


def replicas_on_node(node):
    """What a node runs now, for its page (stopped replicas left out)."""
    return node.replicas.select_related("endpoint").exclude(state=Endpoint.State.STOPPED)
