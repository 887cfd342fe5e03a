from django.shortcuts import get_object_or_404
from ninja import Router, Schema
from pydantic import ConfigDict, StrictBool

from console.api_auth import api_route
from console.roles import ADMIN, OPERATOR, VIEWER
from endpoints import selectors, services
from endpoints.commands import PROFILER_FLAG
from endpoints.endpoint_spec import CONFIG_FIELDS, EndpointSpec
from endpoints.lora import endpoint_adapter_change
from endpoints.models import Endpoint
from endpoints.preview import endpoint_preview
from endpoints.recipes import recipe_list, recipe_save

router = Router(tags=["endpoints"])


class RecipeSaveIn(Schema):
    model_config = ConfigDict(extra="forbid")

    endpoint: int
    name: str
    title: str = ""


class EndpointPatch(Schema):
    """The settings PATCH may change; absent fields stay as they are. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")
    routing: str | None = None
    autoscale: dict | None = None  # null turns it off


class ProfilingIn(Schema):
    enabled: StrictBool


class AdapterChangeIn(Schema):
    model_config = ConfigDict(extra="forbid")

    adapter: int
    action: str  # "load" | "unload"


class ChatIn(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    message: str
    max_tokens: int | None = None  # default: 64, or half of a smaller max_model_len


def member_json(member) -> dict:
    return {
        "rank": member.rank,
        "node": member.node.name,
        "role": member.role,
        "pid": member.pid,
        "devices": member.devices,
        "state": member.state,
        "reason": member.state_reason,
        "restarts": member.restarts,
    }


def replica_json(replica) -> dict:
    container = (
        {"runtime": replica.runtime, "name": replica.container_name, "id": replica.container_id}
        if replica.container_id
        else None
    )
    return {
        "index": replica.index,
        "node": replica.node.name,
        "url": replica.url,
        "pid": replica.pid,
        "container": container,
        "port": replica.port,
        "devices": replica.devices,
        "state": replica.state,
        "reason": replica.state_reason,
        "restarts": replica.restarts,
        "profiling": PROFILER_FLAG in (replica.argv or []),  # its running vLLM has the profiler
        "started_at": replica.started_at.isoformat() if replica.started_at else None,
        "ready_at": replica.ready_at.isoformat() if replica.ready_at else None,
        "cluster_port": replica.cluster_port,
        "members": [member_json(m) for m in replica.members.all()],
    }


def endpoint_json(endpoint: Endpoint) -> dict:
    return {
        "id": endpoint.pk,
        "name": endpoint.name,
        "state": endpoint.state,
        "reason": endpoint.state_reason,
        "desired_state": endpoint.desired_state,
        "served_model_name": endpoint.served_model_name,
        "artifact": endpoint.artifact_id,
        "node": endpoint.node.name,
        "devices": endpoint.devices,
        "tensor_parallel_size": endpoint.tensor_parallel_size,
        "pipeline_parallel_size": endpoint.pipeline_parallel_size,
        "max_model_len": endpoint.max_model_len,
        "max_num_seqs": endpoint.max_num_seqs,
        "enforce_eager": endpoint.enforce_eager,
        "trust_remote_code": endpoint.trust_remote_code,
        "recipe": endpoint.recipe or None,
        **{name: (endpoint.engine_configs or {}).get(name) for name in CONFIG_FIELDS},
        "draft_artifact": endpoint.draft_artifact_id,
        "adapters": [
            {"id": a.pk, "name": a.name, "rank": (a.inspection or {}).get("rank")} for a in endpoint.adapters.all()
        ],
        "max_loras": endpoint.max_loras,
        "max_lora_rank": endpoint.max_lora_rank,
        "max_cpu_loras": endpoint.max_cpu_loras,
        "async_scheduling": endpoint.async_scheduling,
        "distributed_executor_backend": endpoint.distributed_executor_backend,
        "profiling": endpoint.profiling,
        "quantization": endpoint.quantization or None,
        "distributed": endpoint.distributed,
        "data_parallel_size": endpoint.data_parallel_size,
        "routing": endpoint.routing,
        "autoscale": endpoint.autoscale,
        "replica_count": endpoint.replicas,
        "autoscale_wanted": endpoint.autoscale_wanted,
        "replicas": [replica_json(r) for r in selectors.replicas_of(endpoint)],
    }


def _get(endpoint_id):
    return get_object_or_404(Endpoint.objects.select_related("node"), pk=endpoint_id)


@api_route(router, "post", "/endpoints", role=OPERATOR, response={201: dict})
def create_endpoint(request, payload: EndpointSpec):
    """Launch an endpoint; `recipe` fills every field not given beside it."""
    endpoint = services.endpoint_create(spec=payload, user=request.user, request=request)
    return 201, endpoint_json(endpoint)


@api_route(router, "post", "/endpoints/preview", role=OPERATOR, response=dict)
def preview_endpoint(request, payload: EndpointSpec):
    """The exact commands a launch of this body would start, per node, with their checks; nothing is launched."""
    return endpoint_preview(spec=payload, user=request.user)


@api_route(router, "get", "/recipes", role=VIEWER, response=list[dict])
def list_recipes(request):
    """The shipped recipes (each citing its vllm-ascend tutorial) and the saved ones, newest version each."""
    return [recipe.as_json() for recipe in recipe_list()]


@api_route(router, "post", "/recipes", role=OPERATOR, response={201: dict})
def save_recipe(request, payload: RecipeSaveIn):
    """Save an endpoint's launch as a recipe (a new version of `name` if it exists)."""
    endpoint = _get(payload.endpoint)
    return 201, recipe_save(
        endpoint=endpoint, name=payload.name, title=payload.title, user=request.user, request=request
    ).as_json()


@api_route(router, "get", "/endpoints", role=VIEWER, response=list[dict])
def list_endpoints(request):
    return [endpoint_json(e) for e in selectors.endpoint_list()]


@api_route(router, "get", "/endpoints/{endpoint_id}", role=VIEWER, response=dict)
def get_endpoint(request, endpoint_id: int):
    return endpoint_json(_get(endpoint_id))


@api_route(router, "patch", "/endpoints/{endpoint_id}", role=OPERATOR, response=dict)
def update_endpoint(request, endpoint_id: int, payload: EndpointPatch):
    """Change the given settings (`routing`, `autoscale`); a bad value is refused and nothing changes."""
    return endpoint_json(
        services.endpoint_update(
            endpoint=_get(endpoint_id), user=request.user, request=request, **payload.dict(exclude_unset=True)
        )
    )


@api_route(router, "post", "/endpoints/{endpoint_id}/start", role=OPERATOR, response=dict)
def start_endpoint(request, endpoint_id: int):
    return endpoint_json(services.endpoint_start(endpoint=_get(endpoint_id), user=request.user, request=request))


@api_route(router, "post", "/endpoints/{endpoint_id}/stop", role=OPERATOR, response=dict)
def stop_endpoint(request, endpoint_id: int):
    return endpoint_json(services.endpoint_stop(endpoint=_get(endpoint_id), user=request.user, request=request))


@api_route(router, "post", "/endpoints/{endpoint_id}/restart", role=OPERATOR, response=dict)
def restart_endpoint(request, endpoint_id: int):
    return endpoint_json(services.endpoint_restart(endpoint=_get(endpoint_id), user=request.user, request=request))


@api_route(router, "post", "/endpoints/{endpoint_id}/profiling", role=OPERATOR, response=dict)
def set_endpoint_profiling(request, endpoint_id: int, payload: ProfilingIn):
    """Profiling on or off; running replicas restart one at a time to apply it."""
    return endpoint_json(
        services.endpoint_set_profiling(
            endpoint=_get(endpoint_id), enabled=payload.enabled, user=request.user, request=request
        )
    )


@api_route(router, "post", "/endpoints/{endpoint_id}/adapters", role=OPERATOR, response=dict)
def change_endpoint_adapter(request, endpoint_id: int, payload: AdapterChangeIn):
    """Load a LoRA adapter of the served model into every ready replica, or unload one; later starts load the
    endpoint's list as it is then. Nothing restarts."""
    return endpoint_adapter_change(
        endpoint=_get(endpoint_id),
        adapter_id=payload.adapter,
        action=payload.action,
        user=request.user,
        request=request,
    )


@api_route(router, "post", "/endpoints/{endpoint_id}/chat", role=OPERATOR, response=dict)
def chat_endpoint(request, endpoint_id: int, payload: ChatIn):
    return services.endpoint_chat(
        endpoint=_get(endpoint_id),
        message=payload.message,
        max_tokens=payload.max_tokens,
        user=request.user,
        request=request,
    )


@api_route(router, "delete", "/endpoints/{endpoint_id}", role=ADMIN, response={204: None})
def delete_endpoint(request, endpoint_id: int):
    services.endpoint_delete(endpoint=_get(endpoint_id), user=request.user, request=request)
    return 204, None
