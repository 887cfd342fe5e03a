"""Where a replica launched with profiling writes vLLM's traces (LaunchSpec.profiler_dir): one directory
per replica under ENDPOINT_PROFILE_ROOT, on the node that runs it. endpoints.commands.profiler says
which files each platform writes there."""

from pathlib import Path

from django.conf import settings

from endpoints.models import Replica


def replica_profile_root() -> Path:
    return Path(settings.ENDPOINT_PROFILE_ROOT) / "replicas"


def replica_profile_dir(replica: Replica) -> Path:
    """``<ENDPOINT_PROFILE_ROOT>/replicas/<endpoint>-<index>``: the endpoint's name is URL-safe
    (ENDPOINT_NAME), so the path passes the command builder's check."""
    return replica_profile_root() / f"{replica.endpoint.name}-{replica.index}"
