"""Facts the registry needs from the layers above it (serving), which register them in
``AppConfig.ready()``: the registry never imports them.  With nothing registered the registry
knows of no endpoint and no live device (as when it runs alone)."""

from collections.abc import Callable

# artifact -> names of the endpoints that use it (any state but stopped)
ArtifactUsers = Callable[[object], list[str]]
# () -> (label, free bytes) per live accelerator
LiveDeviceMemory = Callable[[], list[tuple[str, int]]]

_artifact_users: list[ArtifactUsers] = []
_live_device_memory: list[LiveDeviceMemory] = []


def register_artifact_users(source: ArtifactUsers) -> None:
    if source not in _artifact_users:
        _artifact_users.append(source)


def register_live_device_memory(source: LiveDeviceMemory) -> None:
    if source not in _live_device_memory:
        _live_device_memory.append(source)


def artifact_users(artifact) -> list[str]:
    return [name for source in _artifact_users for name in source(artifact)]


def live_device_memory() -> list[tuple[str, int]]:
    return [row for source in _live_device_memory for row in source()]
