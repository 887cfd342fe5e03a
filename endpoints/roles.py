"""Prefill/decode disaggregation at launch: the spec's roles checked into where each role's replicas run, and the
connector both share (endpoints.commands.pd renders each replica's --kv-transfer-config from it).

Each role names its node, devices and replica count; the endpoint's TP x PP applies to both. Autoscaled (per
role, endpoints.autoscale.parse_role_settings), a role's devices are held for its max_replicas. The checks a plain
launch makes of its node and devices are made per role, their refusals naming the role's field
("roles.decode.devices"); the two roles' devices on one node must not overlap."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.core.exceptions import ValidationError

from console.validation import int_in_range
from endpoints.autoscale import RoleSettings, parse_role_settings
from endpoints.commands import CommandSpecError
from endpoints.commands.engine_configs import ENGINE_CONFIG_FLAGS, check_engine_config
from endpoints.commands.pd import ROLES, check_connector, role_launch
from endpoints.endpoint_spec import EndpointSpec
from workers.models import Node


@dataclass(frozen=True)
class RolePlacement:
    role: str
    node: Node
    devices: list[int]
    replicas: int

    def as_json(self) -> dict:
        return {"replicas": self.replicas, "node": self.node.name, "devices": self.devices}


@dataclass(frozen=True)
class RolesLayout:
    prefill: RolePlacement
    decode: RolePlacement
    connector: dict  # the shared kv_transfer (no kv_role: each role's is set per replica)
    scaling: dict[str, RoleSettings] | None = None  # per-role autoscaling (endpoints.autoscale), None: off

    @property
    def placements(self) -> tuple[RolePlacement, RolePlacement]:
        return (self.prefill, self.decode)

    @property
    def replicas(self) -> int:
        return self.prefill.replicas + self.decode.replicas

    @property
    def nodes(self) -> list[Node]:
        return list({p.node.pk: p.node for p in self.placements}.values())

    def as_json(self) -> dict:
        return {p.role: p.as_json() for p in self.placements}

    def scaling_json(self) -> dict | None:
        return None if self.scaling is None else {role: s.as_json() for role, s in self.scaling.items()}


def _rekeyed(error: ValidationError, prefix: str) -> ValidationError:
    """A plain launch's refusal of `node` / `devices` / `replicas` as the role's field."""
    if not hasattr(error, "error_dict"):
        return ValidationError({prefix: error.messages})
    return ValidationError(
        {f"{prefix}.{key}": [m for e in errs for m in e.messages] for key, errs in error.error_dict.items()}
    )


def checked_roles(
    spec: EndpointSpec,
    *,
    tp: int,
    pp: int,
    launch_node: Callable[[object, str], Node],
    check_devices: Callable[..., None],
) -> RolesLayout:
    """The roles of `spec` placed and checked; ValidationError names the field. `launch_node(ref, field)` and
    `check_devices(node=, devices=, tp=, pp=, replicas=, share=)` are the plain launch's own checks
    (endpoints.services), so a role is held to exactly what an endpoint is."""
    for field, given in (
        ("node", spec.node not in (None, "")),
        ("devices", bool(spec.devices)),
        ("replicas", spec.replicas is not None),
    ):
        if given:
            raise ValidationError(
                {field: f"With roles, each role names its {field} (roles.prefill.{field}, roles.decode.{field})."}
            )
    if spec.distributed:
        raise ValidationError(
            {"distributed": "A disaggregated endpoint runs each replica on one node: leave distributed blank."}
        )
    scaling = parse_role_settings(spec.autoscale)  # per role; ValidationError names autoscale.<role>.<name>
    if spec.adapters or spec.max_lora_rank:
        raise ValidationError({"adapters": "LoRA adapters are not served by a disaggregated endpoint here."})
    placements = []
    for role in ROLES:
        given = getattr(spec.roles, role)
        prefix = f"roles.{role}"
        node = launch_node(given.node, f"{prefix}.node")
        replicas = int_in_range(given.replicas, f"{prefix}.replicas", low=1, high=32, default=1)
        held_for = replicas
        if scaling is not None:  # it starts within its bounds, its devices held for its max_replicas
            bounds = scaling[role].settings
            replicas = min(max(replicas, bounds.min_replicas), bounds.max_replicas)
            held_for = bounds.max_replicas
        try:
            check_devices(
                node=node, devices=list(given.devices), tp=tp, pp=pp, replicas=held_for, share=spec.share_devices
            )
        except ValidationError as exc:
            raise _rekeyed(exc, prefix) from exc
        placements.append(RolePlacement(role=role, node=node, devices=list(given.devices), replicas=replicas))
    prefill, decode = placements
    if prefill.node.platform != decode.node.platform:
        raise ValidationError(
            {
                "roles.decode.node": f"Both roles run on one platform: {prefill.node.name} is "
                f"{prefill.node.platform}, {decode.node.name} is {decode.node.platform}."
            }
        )
    if prefill.node.pk == decode.node.pk and (clash := sorted(set(prefill.devices) & set(decode.devices))):
        raise ValidationError(
            {
                "roles.decode.devices": f"{clash} are the prefill role's on {prefill.node.name}: each role has "
                "its own devices."
            }
        )
    try:
        connector = check_connector(spec.kv_transfer, platform=prefill.node.platform)
    except CommandSpecError as exc:
        raise ValidationError({"kv_transfer": str(exc)}) from exc
    if connector["kv_connector"] == "ExampleConnector" and prefill.node.pk != decode.node.pk:
        # Its KV goes through a folder on the node: both roles must see the same one.
        raise ValidationError(
            {
                "roles.decode.node": "ExampleConnector passes the KV through a folder on one node: run both "
                f"roles on {prefill.node.name}."
            }
        )
    return RolesLayout(prefill=prefill, decode=decode, connector=connector, scaling=scaling)


def check_role_configs(layout: RolesLayout, *, nodes: Sequence[Node], tp: int, dp: int = 1) -> None:
    """Each role's rendered --kv-transfer-config against the node's own KVTransferConfig schema (its agent's
    report), as a plain launch's kv_transfer is: what the replica would get, kv_role and all."""
    sizes = {"dp_size": dp, "tp_size": tp}
    for placement in layout.placements:
        rendered = role_launch(
            platform=placement.node.platform,
            role=placement.role,
            connector=layout.connector,
            replica_index=0,
            parallel={"prefill": sizes, "decode": sizes},
            storage_dir="/checked",
            host=placement.node.address or None,
        )["kv_transfer"]
        schema = ((placement.node.engine_cli or {}).get("configs") or {}).get(ENGINE_CONFIG_FLAGS["kv_transfer"])
        if schema is None:
            continue
        try:
            check_engine_config("kv_transfer", rendered, schema)
        except CommandSpecError as exc:
            raise ValidationError(
                {"kv_transfer": f"{exc} (as the {placement.role} role's, on {placement.node.name})"}
            ) from exc
