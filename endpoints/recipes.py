"""Recipes: named, versioned launch templates, each a partial launch spec (endpoints.endpoint_spec.EndpointSpec).

The shipped ones are files in endpoints/recipe_files/ (JSON, one per recipe), each citing the vllm-ascend tutorial it
follows (file, tag, section): tests/endpoints/test_recipes.py parses that tutorial's command, vendored in
tests/fixtures/vllm_ascend_tutorials/, and checks a preview of the recipe gives the same flags, values and
environment. An operator's own are Recipe rows, saved from an endpoint; a new save of a name adds a version.
"name" picks a recipe's newest version, "name@3" that version. A launch with a recipe takes the recipe's fields
and overrides each one given beside it, whole (a given env replaces the recipe's env)."""

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from pydantic import ValidationError as SpecError

from console.audit import audit_log
from endpoints.endpoint_spec import EndpointSpec
from endpoints.models import ENDPOINT_NAME, Endpoint, Recipe
from models_registry.capacity_moe import deployment_capacity

SHIPPED_DIR = Path(__file__).parent / "recipe_files"
_REF = re.compile(r"(?P<name>[a-z0-9][a-z0-9-]{0,62})(@(?P<version>[0-9]{1,6}))?")
#: A recipe is a template: where and as what an endpoint runs is the launch's own. LoRA adapters too: they are
#: artifacts of one model, and a recipe names no artifact; the LoRA limits (max_lora_rank, max_loras, max_cpu_loras)
#: are engine settings and stay, so a launch from the recipe can load adapters of its own model.
NOT_IN_RECIPES = (
    "name",
    "team",
    "adapters",
    "stage_beside",
    "recipe",
    "artifact",
    "node",
    "devices",
    "worker_nodes",
    "served_model_name",
    "capacity_override",
)


@dataclass(frozen=True)
class RecipeInfo:
    name: str
    version: int
    title: str
    platform: str
    hardware: str
    nodes: int
    spec: dict
    source: dict = field(default_factory=dict)  # shipped: {"file", "tag", "section", ...}; saved: {"saved_from"}
    shipped: bool = True
    # For the capacity estimate of a shipped recipe: the model's config.json keys and the weight scheme.
    model: dict = field(default_factory=dict)
    devices_per_node: int = 0  # the devices the recipe's hardware gives each node (0: a CPU host)
    device_memory_gib: float = 0  # each device's memory on that hardware
    notes: tuple[str, ...] = ()  # where the recipe departs from its tutorial, and why

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "title": self.title,
            "platform": self.platform,
            "hardware": self.hardware,
            "nodes": self.nodes,
            "source": self.source,
            "shipped": self.shipped,
            "spec": self.spec,
            "devices_per_node": self.devices_per_node,
            "notes": list(self.notes),
            "capacity": self.capacity(),
        }

    def capacity(self) -> dict | None:
        """Does the recipe fit its stated hardware, and with how much KV room (models_registry.capacity_moe: MoE
        experts under EP, MLA's compressed KV, the weight scheme); None where the recipe names no model."""
        if not self.model or not self.devices_per_node:
            return None
        spec = self.spec
        return deployment_capacity(
            hf_config=self.model["hf_config"],
            quantization=self.model["quantization"],
            device_memory_gib=self.device_memory_gib,
            devices_per_node=self.devices_per_node,
            nodes=self.nodes,
            tensor_parallel_size=spec.get("tensor_parallel_size") or 1,
            data_parallel_size=spec.get("data_parallel_size") or 1,
            enable_expert_parallel=bool((spec.get("extra_args") or {}).get("--enable-expert-parallel")),
            max_model_len=spec["max_model_len"],
            max_num_seqs=spec.get("max_num_seqs") or 256,
            gpu_memory_utilization=spec.get("gpu_memory_utilization") or 0.9,
            speculative_tokens=(spec.get("speculative") or {}).get("num_speculative_tokens", 0)
            if (spec.get("speculative") or {}).get("method") == "mtp"
            else 0,
        )


def _checked_spec(spec: dict, where: str) -> dict:
    """A recipe's spec: EndpointSpec's fields less the launch's own; refused naming the field."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: spec must be a JSON object")
    if bad := [key for key in spec if key in NOT_IN_RECIPES]:
        raise ValueError(f"{where}: {', '.join(bad)} belong to a launch, not a recipe")
    EndpointSpec(**spec)  # the launch's own types and names
    return spec


@cache
def shipped_recipes() -> dict[str, RecipeInfo]:
    """The recipes in endpoints/recipe_files/*.json, by name (read once per process; each file is checked)."""
    found = {}
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        info = RecipeInfo(
            name=data["name"],
            version=int(data["version"]),
            title=data["title"],
            platform=data["platform"],
            hardware=data["hardware"],
            nodes=int(data["nodes"]),
            spec=_checked_spec(data["spec"], path.name),
            source=data["source"],
            model=data.get("model", {}),
            devices_per_node=int(data.get("devices_per_node", 0)),
            device_memory_gib=float(data.get("device_memory_gib", 0)),
            notes=tuple(data.get("notes", ())),
        )
        if path.stem != info.name:
            raise ValueError(f"{path.name}: its name is {info.name!r}")
        found[info.name] = info
    return found


def _saved(row: Recipe) -> RecipeInfo:
    return RecipeInfo(
        name=row.name,
        version=row.version,
        title=row.title,
        platform=row.platform,
        hardware=row.hardware,
        nodes=row.nodes,
        spec=row.spec,
        source={"saved_from": row.source},
        shipped=False,
    )


def recipe_list() -> list[RecipeInfo]:
    """Every recipe's newest version: the shipped ones, then the saved ones, by name."""
    newest: dict[str, Recipe] = {}
    for row in Recipe.objects.order_by("name", "-version"):
        newest.setdefault(row.name, row)
    return list(shipped_recipes().values()) + [_saved(row) for row in newest.values()]


def recipe_get(ref: str) -> RecipeInfo:
    """The recipe "name" (newest) or "name@version"; refused naming the field `recipe`."""
    match = _REF.fullmatch(ref or "")
    if match is None:
        raise ValidationError({"recipe": f"{ref!r} is not a recipe name (name or name@version)."})
    name, version = match["name"], match["version"]
    if name in shipped_recipes():
        shipped = shipped_recipes()[name]
        if version is None or int(version) == shipped.version:
            return shipped
        raise ValidationError({"recipe": f"{name} is shipped at version {shipped.version} only."})
    rows = Recipe.objects.filter(name=name)
    row = rows.filter(version=int(version)).first() if version else rows.order_by("-version").first()
    if row is None:
        names = ", ".join(sorted({r.name for r in recipe_list()}))
        raise ValidationError({"recipe": f"No recipe {ref!r}. Recipes: {names}."})
    return _saved(row)


def with_recipe(spec: EndpointSpec) -> tuple[EndpointSpec, RecipeInfo | None]:
    """The spec with its recipe's fields under the ones given (each given field overrides the recipe's whole)."""
    if not spec.recipe:
        return spec, None
    recipe = recipe_get(spec.recipe)
    try:
        merged = EndpointSpec(**{**recipe.spec, **spec.given(), "recipe": recipe.ref})
    except SpecError as exc:  # a saved recipe's field that this release no longer takes
        raise ValidationError({"recipe": f"{recipe.ref} no longer fits the launch spec: {exc}"}) from None
    return merged, recipe


def spec_of(endpoint: Endpoint) -> EndpointSpec:
    """The launch spec an endpoint stands for now (as stored, defaults filled in by its launch)."""
    configs = dict(endpoint.engine_configs or {})
    if endpoint.draft_artifact_id and "speculative" in configs:
        configs["speculative"] = {**configs["speculative"], "draft_artifact": endpoint.draft_artifact_id}
    # A disaggregated endpoint's node, devices and replicas are its roles' (endpoints.roles).
    placed = (
        {"roles": endpoint.roles}
        if endpoint.roles
        else {"node": endpoint.node.name, "devices": endpoint.devices, "replicas": endpoint.replicas}
    )
    return EndpointSpec(
        name=endpoint.name,
        recipe=endpoint.recipe,
        artifact=endpoint.artifact_id,
        **placed,
        tensor_parallel_size=endpoint.tensor_parallel_size,
        pipeline_parallel_size=endpoint.pipeline_parallel_size,
        data_parallel_size=endpoint.data_parallel_size,
        max_model_len=endpoint.max_model_len,
        max_num_seqs=endpoint.max_num_seqs,
        gpu_memory_utilization=endpoint.gpu_memory_utilization,
        dtype=endpoint.dtype,
        quantization=endpoint.quantization,
        enforce_eager=endpoint.enforce_eager,
        trust_remote_code=endpoint.trust_remote_code,
        profiling=endpoint.profiling,
        served_model_name=endpoint.served_model_name,
        env=endpoint.env,
        extra_args=endpoint.extra_args,
        async_scheduling=endpoint.async_scheduling,
        distributed_executor_backend=endpoint.distributed_executor_backend,
        share_devices=endpoint.share_devices,
        restart_every_hours=endpoint.restart_every_hours,
        restart_daily_at=endpoint.restart_daily_at,
        distributed=endpoint.distributed,
        routing=endpoint.routing,
        autoscale=endpoint.autoscale,
        adapters=sorted(endpoint.adapters.values_list("pk", flat=True)),
        max_loras=endpoint.max_loras,
        max_lora_rank=endpoint.max_lora_rank,
        max_cpu_loras=endpoint.max_cpu_loras,
        adapters_on_demand=endpoint.adapters_on_demand,
        **configs,
    )


def recipe_save(*, endpoint: Endpoint, name: str, title: str = "", user, request=None) -> RecipeInfo:
    """Save the endpoint's launch as the operator's recipe `name` (its next version): every setting but where and
    as what it runs (NOT_IN_RECIPES). A shipped recipe's name is refused."""
    name = (name or "").strip()
    try:
        ENDPOINT_NAME(name)
    except ValidationError as exc:
        raise ValidationError({"name": exc.messages}) from exc
    if name in shipped_recipes():
        raise ValidationError({"name": f"{name} is a shipped recipe: choose another name."})
    if len(title) > 200:
        raise ValidationError({"title": "At most 200 characters."})
    spec = spec_of(endpoint).model_dump(mode="json", exclude=set(NOT_IN_RECIPES), exclude_defaults=True)
    for role in (spec.get("roles") or {}).values():  # where each role runs belongs to a launch too
        role.pop("node", None)
    members = endpoint.replica_set.first()
    nodes = 1 + (members.members.filter(rank__gt=0).count() if members else 0)
    for _ in range(3):  # two saves of one name at once: the unique version decides, the loser takes the next
        version = (
            Recipe.objects.filter(name=name).order_by("-version").values_list("version", flat=True).first() or 0
        ) + 1
        try:
            with transaction.atomic():
                row = Recipe.objects.create(
                    name=name,
                    version=version,
                    title=title.strip(),
                    platform=endpoint.node.platform,
                    hardware=", ".join(sorted({d.name for d in endpoint.node.devices.all()})) or endpoint.node.platform,
                    nodes=nodes,
                    spec=spec,
                    source=f"endpoint {endpoint.name}",
                    created_by=user if user.pk else None,
                )
                audit_log(
                    actor=user,
                    action="recipe.save",
                    obj=endpoint,
                    request=request,
                    changes={"recipe": row.name, "version": version},
                )
        except IntegrityError:
            continue
        return _saved(row)
    raise ValidationError({"name": f"{name} is being saved by someone else right now: try again."})
