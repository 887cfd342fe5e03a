"""What the agent runs is registered by the apps that own it (AppConfig.ready()): the agent
calls each workload's reconcile on every tick and never reads their tables itself."""

from typing import Protocol

from workers.agent.supervisor import Supervisor
from workers.models import Node


class Workload(Protocol):
    def reconcile(self, *, node: Node, supervisor: Supervisor) -> bool:
        """Make this node's processes match the desired state once; True while something is
        starting (the agent then looks again within half a second)."""


_workloads: dict[str, Workload] = {}


def register_workload(name: str, workload: Workload) -> None:
    _workloads[name] = workload


def registered_workloads() -> list[Workload]:
    return list(_workloads.values())
