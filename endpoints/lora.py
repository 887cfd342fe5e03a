"""LoRA on an endpoint: a launch's adapters and limits checked against the registry (checked_lora), the
LaunchSpec's lora from the stored endpoint (launch_lora), and adapters loaded into or unloaded from the running
replicas (endpoint_adapter_change), which also changes the endpoint's list, so a later start loads the same.

Adapters are registry artifacts of format lora (models_registry.lora), of the served model; requests name one by
its name as their "model". A replica's vLLM loads the endpoint's adapters at start (--lora-modules) and takes
run-time changes on /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING, set by
the console alone), behind the replica's own key."""

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from django.core.exceptions import ValidationError
from django.db import transaction

from console.audit import audit_log
from console.exceptions import Conflict
from console.validation import int_in_range
from endpoints.commands import LORA_RANKS, lora_rank_for
from endpoints.models import Endpoint, EndpointEvent, Replica
from models_registry.lora import base_mismatch
from models_registry.models import Artifact

#: A run-time load reads the adapter's files in every replica: seconds for a small one.
ADAPTER_CALL_SECONDS = 60


@dataclass
class LoraChoice:
    """What a launch's LoRA fields came to: the adapters (in the order given) and vLLM's limits."""

    adapters: list[Artifact] = field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def as_json(self) -> dict:
        return {
            "adapters": [a.pk for a in self.adapters],
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            **({"max_cpu_loras": self.max_cpu_loras} if self.max_cpu_loras is not None else {}),
        }


def _adapter_label(adapter: Artifact) -> str:
    return f"adapter {adapter.name!r} (#{adapter.pk})"


def adapter_refusal(adapter: Artifact, *, artifact: Artifact, served_model_name: str, max_lora_rank: int | None) -> str:
    """Why the endpoint serving `artifact` cannot take this adapter, naming both, or ""."""
    label = _adapter_label(adapter)
    if adapter.format != Artifact.Format.LORA:
        return f"Artifact #{adapter.pk} is {adapter.get_format_display()}, not a LoRA adapter."
    if adapter.status != Artifact.Status.READY:
        return f"The {label} is {adapter.status}, not ready."
    if adapter.model_id != artifact.model_id:
        return (
            f"The {label} belongs to model {adapter.model.name}; the endpoint serves {artifact.model.name} "
            f"(artifact #{artifact.pk})."
        )
    if adapter.name == served_model_name:
        return f"The {label} has the endpoint's served model name: requests could not tell them apart."
    rank = (adapter.inspection or {}).get("rank") or 0
    if max_lora_rank is not None and rank > max_lora_rank:
        return f"The {label} has rank {rank}, above the endpoint's max_lora_rank {max_lora_rank}."
    return base_mismatch(
        adapter.inspection or {},
        artifact.inspection or {},
        adapter_name=f"The {label}",
        base_name=f"{artifact.model.name} (artifact #{artifact.pk})",
    )


def checked_lora(*, spec, artifact: Artifact, served_model_name: str) -> LoraChoice | None:
    """The launch's LoRA (None: off), or a ValidationError naming the field. LoRA is on with adapters or a
    max_lora_rank; the default rank is the smallest vLLM allows above the largest adapter's, max_loras the
    number of adapters (1 to 4)."""
    ids = list(spec.adapters)
    if not ids and spec.max_lora_rank is None:
        for name in ("max_loras", "max_cpu_loras", "adapters_on_demand"):
            if getattr(spec, name) not in (None, False):
                raise ValidationError({name: "LoRA is off: give adapters or max_lora_rank to turn it on."})
        return None
    if len(set(ids)) != len(ids):
        raise ValidationError({"adapters": "An adapter is listed twice."})
    found = {a.pk: a for a in Artifact.objects.alive().select_related("model").filter(pk__in=ids)}
    if missing := [i for i in ids if i not in found]:
        raise ValidationError({"adapters": f"No adapter #{missing[0]}: name registered LoRA adapters by id."})
    adapters = [found[i] for i in ids]
    rank = spec.max_lora_rank
    if rank is not None and rank not in LORA_RANKS:
        raise ValidationError({"max_lora_rank": f"vLLM takes one of {', '.join(map(str, LORA_RANKS))}, not {rank}."})
    for adapter in adapters:
        why = adapter_refusal(adapter, artifact=artifact, served_model_name=served_model_name, max_lora_rank=None)
        if why:
            raise ValidationError({"adapters": why})
        adapter_rank = (adapter.inspection or {}).get("rank") or 0
        if rank is not None and adapter_rank > rank:
            raise ValidationError(
                {"max_lora_rank": f"The {_adapter_label(adapter)} has rank {adapter_rank}, above max_lora_rank {rank}."}
            )
        if lora_rank_for(adapter_rank) is None:
            raise ValidationError(
                {
                    "adapters": (
                        f"The {_adapter_label(adapter)} has rank {adapter_rank}: vLLM's largest is {LORA_RANKS[-1]}."
                    )
                }
            )
    if rank is None:
        rank = lora_rank_for(max((a.inspection or {}).get("rank") or 1 for a in adapters))
    max_loras = int_in_range(spec.max_loras, "max_loras", low=1, high=256, default=max(1, min(len(adapters), 4)))
    cpu = int_in_range(spec.max_cpu_loras, "max_cpu_loras", low=1, high=4096, default=None)
    if cpu is not None and cpu < max_loras:
        raise ValidationError({"max_cpu_loras": f"At least max_loras ({max_loras}): vLLM keeps those on the CPU too."})
    return LoraChoice(adapters=adapters, max_loras=max_loras, max_lora_rank=rank, max_cpu_loras=cpu)


def lora_option_flags(spec) -> dict[str, str]:
    """{option: field} of what the LoRA fields add to the command, for the nodes' own parsers: a node whose vLLM
    has no --enable-lora is refused, naming it."""
    if not spec.adapters and spec.max_lora_rank is None:
        return {}
    flags = {"--enable-lora": "adapters", "--max-loras": "max_loras", "--max-lora-rank": "max_lora_rank"}
    if spec.adapters:
        flags["--lora-modules"] = "adapters"
    if spec.max_cpu_loras is not None:
        flags["--max-cpu-loras"] = "max_cpu_loras"
    return flags


def launch_lora(endpoint: Endpoint) -> dict | None:
    """LaunchSpec.lora for a replica's start: the endpoint's adapters as they are now."""
    if not endpoint.lora_enabled:
        return None
    adapters = endpoint.adapters.alive().order_by("pk")
    return {
        "max_loras": endpoint.max_loras or 1,
        "max_lora_rank": endpoint.max_lora_rank,
        "max_cpu_loras": endpoint.max_cpu_loras,
        "modules": [{"name": a.name, "path": a.path} for a in adapters],
    }


# --- run time ----------------------------------------------------------------------------------------------


def _call(replica: Replica, path: str, body: dict) -> tuple[int, str]:
    """(HTTP status, vLLM's answer text) of one POST to the replica, with its key; (0, why) when unreachable."""
    request = urllib.request.Request(
        f"{replica.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **replica.auth_header},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=ADAPTER_CALL_SECONDS) as response:  # noqa: S310 (our replica)
            return response.status, response.read().decode(errors="replace")[:500]
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            text = json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            pass
        return exc.code, str(text)[:500]
    except (urllib.error.URLError, OSError) as exc:
        return 0, f"unreachable: {getattr(exc, 'reason', exc)}"


def _ready_replicas(endpoint: Endpoint) -> list[Replica]:
    return [
        r
        for r in endpoint.replica_set.select_related("node").order_by("index")
        if r.state == Endpoint.State.READY and r.url
    ]


def _load(replica: Replica, adapter: Artifact) -> tuple[bool, str]:
    status, text = _call(replica, "/v1/load_lora_adapter", {"lora_name": adapter.name, "lora_path": adapter.path})
    if status == 200 or (status == 400 and "has already been loaded" in text):
        return True, "loaded"
    return False, f"HTTP {status}: {text}" if status else text


def _unload(replica: Replica, adapter: Artifact) -> tuple[bool, str]:
    status, text = _call(replica, "/v1/unload_lora_adapter", {"lora_name": adapter.name})
    if status == 200 or status == 404:  # 404: not loaded there (a replica started before the load)
        return True, "unloaded"
    return False, f"HTTP {status}: {text}" if status else text


def endpoint_adapter_change(
    *, endpoint: Endpoint, adapter_id: int, action: str, user, request=None, via: str = ""
) -> dict:
    """Load an adapter into, or unload it from, every ready replica, and add it to or remove it from the endpoint's
    adapters (so later starts load the same). A load that a ready replica refuses is undone on the others and
    changes nothing (vLLM's answer is the Conflict's message); an unload always leaves the list without it.
    Replicas that are starting pick the list up from their argv. Nudges nothing: no process is restarted."""
    if action not in ("load", "unload"):
        raise ValidationError({"action": "Choose load or unload."})
    try:
        adapter = Artifact.objects.alive().select_related("model").get(pk=adapter_id, format=Artifact.Format.LORA)
    except Artifact.DoesNotExist:
        raise ValidationError({"adapter": f"No LoRA adapter #{adapter_id}."}) from None
    if not endpoint.lora_enabled:
        raise ValidationError(
            {"adapter": f"{endpoint.name} was launched without LoRA (no adapters, no max_lora_rank): launch it anew."}
        )
    held = endpoint.adapters.filter(pk=adapter.pk).exists()
    replicas = _ready_replicas(endpoint)
    results = []
    if action == "load":
        why = adapter_refusal(
            adapter,
            artifact=endpoint.artifact,
            served_model_name=endpoint.served_model_name,
            max_lora_rank=endpoint.max_lora_rank,
        )
        if why:
            raise ValidationError({"adapter": why})
        clash = endpoint.adapters.exclude(pk=adapter.pk).filter(name=adapter.name).first()
        if clash is not None:  # a deleted adapter's name taken again
            raise ValidationError({"adapter": f"{endpoint.name} holds another adapter named {adapter.name!r}."})
        for replica in replicas:
            ok, message = _load(replica, adapter)
            results.append({"replica": replica.index, "ok": ok, "message": message})
            if not ok:
                for done in results[:-1]:
                    _unload(next(r for r in replicas if r.index == done["replica"]), adapter)
                raise Conflict(
                    f"Replica {replica.index} of {endpoint.name} refused {_adapter_label(adapter)}: {message}"
                )
    else:
        if not held:
            raise ValidationError({"adapter": f"{endpoint.name} does not hold {_adapter_label(adapter)}."})
        for replica in replicas:
            ok, message = _unload(replica, adapter)
            results.append({"replica": replica.index, "ok": ok, "message": message})
    failed = [r for r in results if not r["ok"]]
    where = ", ".join(str(r["replica"]) for r in results if r["ok"]) or "none ready"
    with transaction.atomic():
        if action == "load":
            endpoint.adapters.add(adapter)
        else:
            endpoint.adapters.remove(adapter)
        who = getattr(user, "username", None) or via or "system"
        message = f"{_adapter_label(adapter)} {action}ed by {who} (replicas: {where})"
        if failed:
            message += "; " + "; ".join(f"replica {r['replica']}: {r['message']}" for r in failed)
        EndpointEvent.objects.create(
            endpoint=endpoint, kind=f"adapter-{action}", level="warning" if failed else "info", message=message
        )
        audit_log(
            actor=user,
            action=f"endpoint.adapter.{action}",
            obj=endpoint,
            request=request,
            via=via,
            changes={"adapter": adapter.pk, "name": adapter.name, "replicas": results},
        )
    return {"adapter": adapter.pk, "name": adapter.name, "action": action, "replicas": results}


def adapter_choices(endpoint: Endpoint) -> list[Artifact]:
    """The served model's adapters the endpoint does not hold (for its page's load form)."""
    if not endpoint.lora_enabled:
        return []
    held = set(endpoint.adapters.values_list("pk", flat=True))
    return [
        a
        for a in Artifact.objects.alive()
        .filter(model_id=endpoint.artifact.model_id, format=Artifact.Format.LORA, status=Artifact.Status.READY)
        .order_by("name")
        if a.pk not in held
    ]
