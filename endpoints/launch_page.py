"""The launch page: the launch form's fields in their sections, each with its label, the vLLM option it becomes, its
choices, the value shown and its errors; the recipes for the picker; a refusal's errors by the field they name.

The launch (endpoints.views.endpoint_launch) and its preview (endpoint_launch_preview, the "Show command" button)
parse the same form the same way (parsed_spec) and read a refusal the same way (launch_errors)."""

import re

from django import forms
from django.core.exceptions import ValidationError

from console.form_layout import field_context
from console.teams import team_options, visible
from endpoints import services
from endpoints.commands.pd import ROLES
from endpoints.commands.platforms import QUANTIZATION_METHODS
from endpoints.commands.spec import EXECUTOR_BACKENDS
from endpoints.endpoint_spec import EndpointSpec
from endpoints.forms import CONFIG_INPUTS, FLAGS, ROLE_INPUTS, EndpointLaunchForm
from endpoints.models import Endpoint
from endpoints.recipes import NOT_IN_RECIPES, RecipeInfo, recipe_list
from models_registry.models import Artifact
from models_registry.views import _errors
from workers.models import Node

#: (id, title, folded, the fields in the order shown). Every field of EndpointLaunchForm is in one section.
SECTIONS = (
    (
        "model",
        "Model and node",
        False,
        ("recipe", "name", "artifact", "team", "node", "worker_nodes", "devices", "served_model_name"),
    ),
    (
        "parallelism",
        "Parallelism",
        False,
        (
            "replicas",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "distributed",
            "distributed_executor_backend",
        ),
    ),
    (
        "engine",
        "Engine",
        False,
        (
            "max_model_len",
            "max_num_seqs",
            "gpu_memory_utilization",
            "dtype",
            "quantization",
            "async_scheduling",
            "enforce_eager",
            "trust_remote_code",
        ),
    ),
    ("lora", "LoRA adapters", False, ("adapters", "max_lora_rank", "max_loras", "max_cpu_loras", "adapters_on_demand")),
    (
        "speculative",
        "Speculative decoding",
        False,
        ("speculative_method", "num_speculative_tokens", "draft_artifact", "speculative"),
    ),
    ("compilation", "Compilation", False, ("cudagraph_mode", "cudagraph_capture_sizes", "compilation")),
    ("configs", "Ascend and config overrides", False, ("ascend", "hf_overrides", "kv_transfer")),
    (
        "gateway",
        "Gateway and scaling",
        False,
        (
            "routing",
            "stage_beside",
            "autoscale_min_replicas",
            "autoscale_max_replicas",
            "autoscale_target_waiting",
            "autoscale",
        ),
    ),
    ("restarts", "Restarts", False, ("restart_every_hours", "restart_daily_at")),
    ("roles", "Disaggregated prefill and decode", True, tuple(ROLE_INPUTS)),
    ("advanced", "Advanced", True, ("extra_args", "env", "share_devices", "capacity_override", "profiling")),
)
#: What a new launch page shows.
#: Not Replicas (its placeholder shows the default): with roles it stays blank (endpoints.roles).
DEFAULTS = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "enforce_eager": True}
#: Input attributes beyond name, id and value (keys are this module's; values are escaped by the template).
ATTRS = {
    "replicas": {"placeholder": "1"},
    "tensor_parallel_size": {"placeholder": "1"},
    "pipeline_parallel_size": {"placeholder": "1"},
    "name": {"pattern": "[a-z0-9][a-z0-9-]*", "autocomplete": "off"},
    "devices": {"placeholder": "0,1"},
    "prefill_replicas": {"placeholder": "1"},
    "decode_replicas": {"placeholder": "1"},
    "prefill_devices": {"placeholder": "0"},
    "decode_devices": {"placeholder": "1"},
    "worker_nodes": {"placeholder": "npu-2,npu-3"},
    "gpu_memory_utilization": {"placeholder": "0.9", "inputmode": "decimal"},
    "restart_daily_at": {"placeholder": "03:30"},
    "cudagraph_capture_sizes": {"placeholder": "1,2,4,8"},
    "extra_args": {"placeholder": '{"--enable-prefix-caching": true}'},
    "env": {"placeholder": '{"VLLM_LOGGING_LEVEL": "INFO"}'},
    "autoscale": {
        "placeholder": '{"schedule": [{"days": "mon-fri", "from": "08:00", "to": "20:00", "min_replicas": 2}]}'
    },
    "autoscale_target_waiting": {"placeholder": "4", "inputmode": "decimal"},
}
_MIN_ONE = {
    "replicas",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "restart_every_hours",
    "num_speculative_tokens",
    "max_loras",
    "max_cpu_loras",
    "prefill_replicas",
    "decode_replicas",
}
_INPUT_OF = {(config, key): field for field, (config, key) in CONFIG_INPUTS.items()}
_ROLE_INPUT_OF = {(role, key): field for field, (role, key) in ROLE_INPUTS.items()}
#: Each role's node: chosen among the nodes, and left alone by a recipe (where a role runs belongs to the launch).
_ROLE_NODE_INPUTS = tuple(_ROLE_INPUT_OF[(role, "node")] for role in ROLES)
_CONFIG_MESSAGE = re.compile(r"(?P<config>[a-z_]+)\.(?P<key>[a-z_]+)\b")


def launchable_artifacts():
    return (
        Artifact.objects.alive()
        .filter(status=Artifact.Status.READY, format__in=services.LAUNCHABLE_FORMATS)
        .select_related("model")
    )


def adapter_artifacts():
    """The registry's ready LoRA adapters (the service refuses one of another model, naming both)."""
    return (
        Artifact.objects.alive()
        .filter(status=Artifact.Status.READY, format=Artifact.Format.LORA)
        .select_related("model")
        .order_by("model__name", "name")
    )


def parsed_spec(form: EndpointLaunchForm) -> EndpointSpec:
    """The form's launch spec; a field the form refuses raises ValidationError naming it, as the service does."""
    if not form.is_valid():
        raise ValidationError(form.errors.as_data())
    return form.spec()


def posted_values(form: EndpointLaunchForm, data) -> dict:
    """What the operator typed, to show again with the errors."""
    return {
        name: data.get(name) == "on"
        if isinstance(field, forms.BooleanField)
        else data.getlist(name)
        if isinstance(field.widget, forms.SelectMultiple)
        else data.get(name, "").strip()
        for name, field in form.fields.items()
    }


def launch_errors(exc: ValidationError) -> dict[str, list[str]]:
    """A refusal's messages by the field they go under: "autoscale.min_replicas" under autoscale, naming its setting;
    a config key with an input of its own ("speculative.draft_artifact: ...") under that input; a role's
    ("roles.decode.devices") under the role's input, else its replicas."""
    found: dict[str, list[str]] = {}
    for key, messages in _errors(exc).items():
        head, dot, rest = key.partition(".")
        for message in messages:
            if head == "roles" and dot:
                role, _, setting = rest.partition(".")
                target = _ROLE_INPUT_OF.get((role, setting.split(".")[0])) or _ROLE_INPUT_OF.get((role, "replicas"))
                message = f"{key}: {message}"
            elif dot:
                target = _INPUT_OF.get((head, rest.split(".")[0]), head)
                message = f"{key}: {message}"
            else:
                named = _CONFIG_MESSAGE.match(message)
                target = _INPUT_OF.get((key, named["key"])) if named and named["config"] == key else None
            found.setdefault(target or key, []).append(message)
    return found


def labelled_errors(errors: dict[str, list[str]]) -> list[dict]:
    """The errors as [{"field", "label", "id", "messages"}], in the page's order, those of no field last."""
    fields = EndpointLaunchForm.base_fields
    order = [name for *_, names in SECTIONS for name in names]
    keys = sorted(errors, key=lambda k: order.index(k) if k in order else len(order))
    return [
        {
            "field": key,
            "label": fields[key].label if key in fields else ("Launch" if key == "general" else key),
            "id": f"id_{key}" if key in fields else "",
            "messages": errors[key],
        }
        for key in keys
    ]


def _recipe_source(info: RecipeInfo, *, short: bool = False) -> str:
    """Where a recipe comes from: a tutorial's file @ tag (and section), what it was made for, or the endpoint it
    was saved from."""
    source = info.source
    if not info.shipped:
        return f"saved from {source.get('saved_from') or 'an endpoint'}"
    if source.get("file"):
        file = (
            source["file"].rsplit("/", 1)[-1]
            if short
            else " ".join(filter(None, [source.get("repository"), source["file"]]))
        )
        where = f"source: {file} @ {source.get('tag', '?')}"
        return where if short or not source.get("section") else f"{where}, section “{source['section']}”"
    return f"source: {source.get('made_for', 'shipped with the console')}"


def _recipe_about(info: RecipeInfo) -> str:
    nodes = f"{info.nodes} node{'s' if info.nodes != 1 else ''}"
    return f"{info.title} · {_recipe_source(info)} · hardware: {info.hardware} · {nodes} · platform {info.platform}"


def _choices(artifacts, nodes, recipes, adapters, endpoints) -> dict[str, list[tuple]]:
    """Each select's options as (value, text) or (value, text, the artifact's model id: static/launch_form.js shows
    the adapters of the chosen artifact's model alone)."""
    artifact_options = [(a.pk, str(a), a.model_id) for a in artifacts]
    return {
        "recipe": [("", "none: fill the form by hand")]
        + [(r.ref, f"{r.title or r.name} — {r.hardware} — {_recipe_source(r, short=True)}") for r in recipes],
        "artifact": artifact_options or [("", "No servable artifact: convert one first")],
        "node": [(n.pk, f"{n.name} ({n.platform}{'' if n.online else ', offline'})") for n in nodes],
        **{field: [("", "none (no roles)")] + [(n.pk, n.name) for n in nodes] for field in _ROLE_NODE_INPUTS},
        "draft_artifact": [("", "none")] + [(a.pk, str(a)) for a in artifacts],
        "dtype": [(d, d or "(model default)") for d in services.DTYPES],
        "quantization": [("", "(the checkpoint's own)")] + [(q, q) for q in QUANTIZATION_METHODS],
        "distributed": list(Endpoint.Distributed.choices),
        "distributed_executor_backend": [("", "(vLLM's choice)")] + [(b, b) for b in EXECUTOR_BACKENDS],
        "routing": list(Endpoint.Routing.choices),
        "stage_beside": [("", "none: a model name of its own")]
        + [(e.name, f"{e.name} (serves {e.served_model_name or e.name})") for e in endpoints],
        "adapters": [
            (a.pk, f"{a.name} (rank {(a.inspection or {}).get('rank', '?')}, for {a.model.name})", a.model_id)
            for a in adapters
        ]
        or [("", "none registered (API: POST /api/v1/models/ID/adapters)")],
    }


def _field(name: str, field: forms.Field, value, errors: list[str], options) -> dict:
    if isinstance(field, forms.BooleanField):
        kind = "checkbox"
    elif options is not None:
        kind = "multiple" if isinstance(field.widget, forms.SelectMultiple) else "select"
    elif isinstance(field.widget, forms.Textarea):
        kind = "textarea"
    else:
        kind = "number" if isinstance(field, forms.IntegerField) else "text"
    attrs = dict(ATTRS.get(name, {}))
    if name in _MIN_ONE:
        attrs["min"] = "1"
    return field_context(
        name=name,
        label=field.label,
        kind=kind,
        value=value,
        help_text=field.help_text,
        flag=FLAGS.get(name, ""),
        errors=errors,
        options=options,
        attrs=attrs,
        rows=field.widget.attrs.get("rows", 2),
        # Long help and JSON boxes take the section's whole width.
        wide=kind == "textarea" or len(field.help_text) > 110 or name == "recipe",
        required=name in ("name", "artifact"),
    )


def page_context(*, values: dict, errors: dict[str, list[str]], user) -> dict:
    """The launch template's context: the artifacts and endpoints of `user`'s teams; the team field where they
    may choose among more than one."""
    artifacts = list(visible(launchable_artifacts(), user))
    recipes = recipe_list()
    choices = _choices(
        artifacts,
        list(Node.objects.all()),
        recipes,
        visible(adapter_artifacts(), user),
        visible(Endpoint.objects.order_by("name"), user),
    )
    teams = team_options(user)
    choices["team"] = [("", "the artifact's team")] + teams
    fields = EndpointLaunchForm.base_fields
    for name, field in fields.items():
        if isinstance(field, forms.ChoiceField):
            choices.setdefault(name, list(field.choices))
    sections = [
        {
            "id": section_id,
            "title": title,
            "folded": folded,
            "open": folded and any(name in errors for name in names),
            "fields": [
                _field(name, fields[name], values.get(name), errors.get(name, []), choices.get(name)) for name in names
            ],
        }
        for section_id, title, folded, names in SECTIONS
    ]
    if len(teams) < 2:  # no choice to make: the field is left out
        for section in sections:
            section["fields"] = [f for f in section["fields"] if f["name"] != "team"]
    shown = {name for *_, names in SECTIONS for name in names} - ({"team"} if len(teams) < 2 else set())
    about = {r.ref: _recipe_about(r) for r in recipes}
    return {
        "sections": sections,
        "errors": errors,
        "error_list": labelled_errors(errors),
        "unplaced_errors": [e for e in labelled_errors(errors) if e["field"] not in shown],
        "recipe_about": about.get(values.get("recipe") or "", ""),
        "recipe_data": {
            "recipes": {r.ref: {"spec": r.spec, "about": about[r.ref]} for r in recipes},
            "inputs": {
                config: {key: field for field, (c, key) in CONFIG_INPUTS.items() if c == config}
                for config in {c for c, _ in CONFIG_INPUTS.values()}
            },
            # A recipe's roles: each role's keys to their inputs.
            "nested": {"roles": {role: {k: f for (r, k), f in _ROLE_INPUT_OF.items() if r == role} for role in ROLES}},
            "fillable": sorted(name for name in shown if name not in NOT_IN_RECIPES and name not in _ROLE_NODE_INPUTS),
        },
    }
