"""How the console calls a node's container CLI (Docker or Podman): one environment for every call (the
replicas' runs, the engine probes in the image, the doctor's checks), so they all reach the same daemon."""

import os
import subprocess
from collections.abc import Mapping

from console.env import child_environment

# The CLI's own settings (which daemon or context, rootless Podman's socket directory), passed to it.
CLIENT_ENV = (
    "DOCKER_HOST",
    "DOCKER_CONTEXT",
    "DOCKER_CONFIG",
    "DOCKER_CERT_PATH",
    "DOCKER_TLS_VERIFY",
    "XDG_RUNTIME_DIR",
    "CONTAINER_HOST",
    "CONTAINER_CONNECTION",
    "CONTAINERS_CONF",
)


def client_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (the allow-listed environment by default) with the CLI's own settings from this process's."""
    client = {k: os.environ[k] for k in CLIENT_ENV if k in os.environ}
    return {**(dict(base) if base is not None else child_environment({})), **client}


def image_id(runtime: str, image: str, *, timeout: float = 30) -> str:
    """The id of the image the reference names on this node (``image inspect``: a tag pulled again names
    another), or "" when the runtime cannot say. A reference that could read as a flag, or is no single
    word, is not asked about (the serving side's runner refuses it with the reason)."""
    if not image or image.startswith("-") or any(c.isspace() for c in image):
        return ""
    try:
        result = subprocess.run(
            [runtime, "image", "inspect", "--format", "{{.Id}}", image],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            env=client_environment(),
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = result.stdout.strip().splitlines()
    return lines[0].strip() if result.returncode == 0 and lines else ""


def short_image_id(found: str) -> str:
    """12 hex digits, as `docker images` shows ids (docker's id has a "sha256:" prefix, podman's none)."""
    return found.removeprefix("sha256:")[:12]
