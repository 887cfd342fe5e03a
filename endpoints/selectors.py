from endpoints.models import Endpoint


def endpoint_list():
    return Endpoint.objects.select_related("artifact", "artifact__model", "node").prefetch_related("replica_set")


def replicas_of(endpoint: Endpoint):
    return endpoint.replica_set.select_related("node").order_by("index")
