"""The node agent: registers the node, keeps its heartbeat and telemetry, and runs the
registered workloads' reconcile with a process supervisor."""

from workers.agent.loop import NodeAgent
from workers.agent.supervisor import ProcessHandle, ProcessSpec, Stopped, Supervisor
from workers.agent.workloads import register_workload

__all__ = ["NodeAgent", "ProcessHandle", "ProcessSpec", "Stopped", "Supervisor", "register_workload"]
