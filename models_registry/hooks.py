"""Facts the registry needs from the layers above it (serving), which register them in
``AppConfig.ready()``: the registry never imports them.  With nothing registered the registry
knows of no endpoint and no live device (as when it runs alone)."""

from collections.abc import Callable

# artifact -> names of the endpoints that use it (any state but stopped)
ArtifactUsers = Callable[[object], list[str]]
# () -> (label, free bytes) per live accelerator
LiveDeviceMemory = Callable[[], list[tuple[str, int]]]

# target format ("ascend-modelslim") -> the versions of the engine that serves it on this site's nodes
TargetEngineVersions = Callable[[str], list[str]]

# artifact -> why no endpoint can be launched from it on this site ("" when one can)
LaunchRefusal = Callable[[object], str]

# (quantized artifact, its source) -> called once the quantize job's perplexity gate passed: serving may score the
# two through an engine (evaluations/gates.py) and mark the artifact with the outcome.
QuantizedArtifact = Callable[[object, object], None]

_artifact_users: list[ArtifactUsers] = []
_quantized: list[QuantizedArtifact] = []
_launch_refusal: list[LaunchRefusal] = []
_target_engine_versions: list[TargetEngineVersions] = []
_live_device_memory: list[LiveDeviceMemory] = []


def register_artifact_users(source: ArtifactUsers) -> None:
    if source not in _artifact_users:
        _artifact_users.append(source)


def register_launch_refusal(source: LaunchRefusal) -> None:
    if source not in _launch_refusal:
        _launch_refusal.append(source)


def register_live_device_memory(source: LiveDeviceMemory) -> None:
    if source not in _live_device_memory:
        _live_device_memory.append(source)


def register_target_engine_versions(source: TargetEngineVersions) -> None:
    if source not in _target_engine_versions:
        _target_engine_versions.append(source)


def register_quantized(source: QuantizedArtifact) -> None:
    if source not in _quantized:
        _quantized.append(source)


def quantized(artifact, source) -> None:
    for hook in _quantized:
        hook(artifact, source)


def target_engine_versions(target: str) -> list[str]:
    return sorted({v for source in _target_engine_versions for v in source(target)})


def launch_refusal(artifact) -> str:
    """Why the artifact cannot be launched (the first reason given), or ""; with no serving layer, that."""
    if not _launch_refusal:
        return "No serving layer is installed in this console."
    return next((reason for source in _launch_refusal if (reason := source(artifact))), "")


def artifact_users(artifact) -> list[str]:
    return [name for source in _artifact_users for name in source(artifact)]


def live_device_memory() -> list[tuple[str, int]]:
    return [row for source in _live_device_memory for row in source()]
