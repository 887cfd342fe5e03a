"""Writes to nodes that people make (the agent keeps the rest of a Node fresh itself)."""

from django.core.exceptions import ValidationError
from django.db import transaction

from console.audit import audit_log
from workers import engine_images, nudges
from workers.models import Node


def node_set_engine_runtime(*, node: Node, engine_runtime: str, engine_image_variant: str, user, request=None) -> Node:
    """How the node's agent runs its replicas from their next start: as processes of the engine venv, or
    in vllm-ascend's image under Docker or Podman (Ascend nodes only), with the image variant for its
    hardware and OS. Replicas already running keep their runtime until they restart."""
    errors = {}
    runtimes = Node.Runtime.values
    if engine_runtime not in runtimes:
        errors["engine_runtime"] = f"Engine runtime must be one of {', '.join(runtimes)}; got {engine_runtime!r}."
    elif engine_runtime != Node.Runtime.PROCESS and node.platform != Node.Platform.ASCEND:
        errors["engine_runtime"] = (
            f"{Node.Runtime(engine_runtime).label} runs vllm-ascend's image, which serves "
            f"Ascend NPUs; {node.name} is a {node.get_platform_display()} node, so its "
            "replicas run as processes."
        )
    if engine_image_variant not in engine_images.CHOICES:
        errors["engine_image_variant"] = (
            f"Image must be one of {', '.join(engine_images.CHOICES)}; got {engine_image_variant!r}."
        )
    if errors:
        raise ValidationError(errors)
    changes: dict[str, list | str] = {
        field: [getattr(node, field), value]
        for field, value in (("engine_runtime", engine_runtime), ("engine_image_variant", engine_image_variant))
        if getattr(node, field) != value
    }
    if not changes:
        return node
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(engine_runtime=engine_runtime, engine_image_variant=engine_image_variant)
        node.engine_runtime, node.engine_image_variant = engine_runtime, engine_image_variant
        changes["image"] = node.engine_image() if node.containerised else ""
        audit_log(actor=user, action="node.engine_runtime", obj=node, changes=changes, request=request)
        transaction.on_commit(lambda: nudges.publish(node.name))  # its agent reads the engine where it now is
    return node
