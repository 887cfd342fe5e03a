"""The `docker run` / `podman run` that starts a replica in vllm-ascend's official image, wrapping the
same vLLM argv the process runtime runs.

Upstream's quick start (vllm-ascend v0.23.0, docs/source/quick_start.md, "Setup environment using
container", Ubuntu; vendored with its provenance in tests/fixtures/ascend/) runs::

    docker run --rm --name vllm-ascend --shm-size=1g --device $DEVICE --device /dev/davinci_manager
      --device /dev/devmm_svm --device /dev/hisi_hdc -v /usr/local/dcmi:/usr/local/dcmi
      -v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi
      -v /usr/local/Ascend/driver/lib64/:/usr/local/Ascend/driver/lib64/
      -v /usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info
      -v /etc/ascend_install.info:/etc/ascend_install.info -v /root/.cache:/root/.cache
      -p 8000:8000 -it $IMAGE bash

and then `vllm serve` in that shell. What this builder changes, and why (the test checks each):

- ``-d`` for ``-it``: the agent runs it detached and watches it (inspect, logs), as it does a process.
- no ``--rm``: a crashed container keeps its exit code and logs until the agent has read them; the
  agent removes it itself (``rm -f``) on stop and after a crash.
- ``--net=host`` for ``-p 8000:8000``: as installation.md's A2/A3 and multi-node commands do; the
  replica's port is claimed on the host like a process's, and vLLM binds the same host:port.
- ``--device /dev/davinciN`` for each of the replica's NPUs (``$DEVICE``: one per chip). The mounted
  chips are all the container sees, so ``ASCEND_RT_VISIBLE_DEVICES`` (host numbering) is left out:
  in the quick start, too, the one chip mounted is simply the container's device.
- the model directory bind-mounted read-only at the same path, so ``--model`` is unchanged; no
  ``/root/.cache`` mount: models are local paths, and the host root's cache (tokens included) stays
  out of the container.
- the profile directory, when the argv has ``--profiler-config``, bind-mounted read-write at the same
  path, so the engine's traces land on the host where the console collects them (endpoints.commands.
  profiler).
- the node's engine cache (endpoints.commands.cache), when the environment names one, bind-mounted
  read-write at the same path, so compile caches outlive the container (``--rm`` or not, each start is a
  new container) and a restart loads them; the variables pointing there travel as ``-e`` flags.
- the replica's working directory (endpoints.launch.make_work_dir: on the host, under DATA_DIR, holding
  the console's replica key guard, endpoints.commands.guard) bind-mounted read-write at the same path and
  made the working directory (``-w``, for the image's ``WORKDIR /workspace``): ``python3 -m`` finds the
  module that ``--middleware`` names there, and what CANN writes into the working directory
  (fusion_result.json, dumps) lands in the replica's own directory, not the image's layer.
- ``--log-driver`` (docker: ``json-file``; podman: ``k8s-file``, its own name for it) with ``--log-opt
  max-size=…`` (and, docker only, ``max-file=…``): without them the runtime keeps a replica's whole output for as
  long as its container lives (a long-running vLLM logs every request), on the runtime's disk, beside the copy
  the agent keeps and rotates itself. The driver is named because the bound holds only for a file driver, and a
  daemon defaulting to journald or syslog refuses ``max-size``; the agent reads the output with ``logs``, which
  both file drivers answer. Podman has no ``max-file`` (conmon keeps one file and truncates it: containers/podman
  issue 21361), so it gets ``max-size`` alone.
- ``--pull=never``: a missing image fails at once with the runtime's message instead of a pull of
  many GB inside the agent's loop (the doctor names the ``docker pull`` to run).
- the engine environment as ``-e KEY=VALUE`` (the allow-listed variables only); secrets as ``-e KEY``
  alone, which docker and podman read from their own environment, so no key shows in any argv.
- the command: ``bash -ic 'exec "$@"' bash python3 -m vllm.entrypoints.openai.api_server …``. The
  image sets ``LD_PRELOAD`` (jemalloc) and ``LD_LIBRARY_PATH`` (the driver's devlib) in root's
  ``~/.bashrc`` only (Dockerfile*, v0.23.0), which bash reads when interactive, as in the quick start's
  ``-it … bash``. The script is a constant; the vLLM argv goes in as positional parameters, never
  into shell text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from endpoints.commands.cache import engine_cache_dir_in
from endpoints.commands.checks import CommandSpecError
from endpoints.commands.lora import lora_paths_in
from endpoints.commands.platforms import DEVICE_ENV
from endpoints.commands.profiler import profiler_dir_in

CONTAINER_RUNTIMES = ("docker", "podman")
CONTAINER_PYTHON = "python3"  # the image's python (its vLLM and vllm-ascend are installed there)
SHELL_WRAPPER = ["bash", "-ic", 'exec "$@"', "bash"]

#: The device nodes and driver mounts every Ascend container gets (the quick start's, in its order).
ASCEND_CONTROL_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
ASCEND_DRIVER_MOUNTS = (
    "/usr/local/dcmi:/usr/local/dcmi",
    "/usr/local/bin/npu-smi:/usr/local/bin/npu-smi",
    "/usr/local/Ascend/driver/lib64/:/usr/local/Ascend/driver/lib64/",
    "/usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info",
    "/etc/ascend_install.info:/etc/ascend_install.info",
)
SHM_SIZE = "1g"

# Docker's own rule for names ([a-zA-Z0-9][a-zA-Z0-9_.-]+), kept to 128 characters.
_NAME_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{1,127}")
_IMAGE_RE = re.compile(r"[a-z0-9][a-z0-9._/-]{0,254}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?")
_ENV_KEY_RE = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")


@dataclass(kw_only=True)
class ContainerSpec:
    runtime: str  # "docker" | "podman"
    image: str  # e.g. quay.io/ascend/vllm-ascend:v0.23.0
    name: str  # deterministic per replica: container_name()
    devices: list[int] = field(default_factory=list)  # the replica's NPUs (host ids)
    secret_env: tuple[str, ...] = ("VLLM_API_KEY",)  # passed by name only: values from the CLI's environment
    work_dir: str | None = None  # the replica's working directory on the host, with the guard's module in it
    log_max_bytes: int | None = None  # the runtime's own log of it, per file (None: no limit, the runtime's driver)
    log_files: int = 1  # how many such files docker keeps (podman keeps one)


def container_name(endpoint_name: str, replica_index: int) -> str:
    """One name per replica, the same on every start: the agent finds it again after a restart, and
    a leftover of an earlier start is recognised and removed before the next one."""
    return f"llm-console-{endpoint_name}-r{replica_index}"


def _model_path(argv: list[str]) -> str:
    try:
        path = argv[argv.index("--model") + 1]
    except (ValueError, IndexError):
        raise CommandSpecError("the vLLM argv has no --model to mount into the container") from None
    return _mountable("model_path", path)


def _mountable(field: str, path: str) -> str:
    """A host path a bind mount can take: absolute, without the ':' and ',' that separate mount fields."""
    if not path.startswith("/"):
        raise CommandSpecError(f"{field} must be an absolute path to mount into the container, got {path!r}")
    if ":" in path or "," in path:
        raise CommandSpecError(f"{field} {path!r} cannot be bind-mounted: ':' and ',' separate mount fields")
    return path


def build_container_command(container: ContainerSpec, argv: list[str], env: Mapping[str, str]) -> list[str]:
    """``[runtime, "run", …, image, "bash", "-ic", 'exec "$@"', "bash", "python3", "-m", …]`` for the
    vLLM ``argv``/``env`` that :func:`build_command` returned (argv[0], the host's engine python, becomes
    the image's ``python3``). Raises :class:`CommandSpecError` naming the bad field."""
    _check_container(runtime=container.runtime, image=container.image, name=container.name)
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1024 for d in container.devices):
        raise CommandSpecError(f"devices must be NPU ids (0..1023), got {container.devices!r}")
    model = _model_path(argv)

    run = [
        container.runtime,
        "run",
        "-d",
        "--pull=never",
        "--name",
        container.name,
        "--net=host",
        f"--shm-size={SHM_SIZE}",
        *log_flags(container),
    ]
    for device in container.devices:
        run += ["--device", f"/dev/davinci{device}"]
    for control in ASCEND_CONTROL_DEVICES:
        run += ["--device", control]
    for mount in ASCEND_DRIVER_MOUNTS:
        run += ["-v", mount]
    run += ["-v", f"{model}:{model}:ro"]
    for adapter in lora_paths_in(argv):  # LoRA adapters loaded at start; run-time loads need theirs mounted too
        adapter = _mountable("lora path", adapter)
        run += ["-v", f"{adapter}:{adapter}:ro"]
    if profiles := profiler_dir_in(argv):
        run += ["-v", f"{profiles}:{profiles}:rw"]
    if cache := engine_cache_dir_in(env):
        run += ["-v", f"{cache}:{cache}:rw"]
    if container.work_dir is not None:
        work = _mountable("work_dir", container.work_dir)
        run += ["-v", f"{work}:{work}:rw", "-w", work]
    run += env_flags(env, secret=container.secret_env)
    return run + [container.image, *SHELL_WRAPPER, CONTAINER_PYTHON, *argv[1:]]


#: The file log driver of each runtime: the one both bound with max-size (podman's json-file is an alias of k8s-file).
LOG_DRIVERS = {"docker": "json-file", "podman": "k8s-file"}


def log_flags(container: ContainerSpec) -> list[str]:
    """The runtime's own log of the container, bounded: a file driver with max-size (in KiB, a unit both
    parse), and docker's max-file. A setting below 1 KiB or 1 file is taken as that: a bound, never a refused start."""
    if container.log_max_bytes is None:
        return []
    flags = [
        f"--log-driver={LOG_DRIVERS[container.runtime]}",
        f"--log-opt=max-size={max(1, container.log_max_bytes // 1024)}k",
    ]
    if container.runtime == "docker":
        flags.append(f"--log-opt=max-file={max(1, container.log_files)}")
    return flags


def probe_container_command(
    *, runtime: str, image: str, name: str, python_args: list[str], env: Mapping[str, str], nice: int = 0
) -> list[str]:
    """The agent's engine probes (versions, vLLM's parser: workers.engine_info) of a containerised node, run
    in the image its replicas run in, as they run: the same driver mounts and interactive-bash wrapper (the
    image's ``~/.bashrc`` sets the CANN/driver library paths that importing torch-npu needs), the image's
    ``python3`` with ``python_args``, under ``nice -n NICE`` when ``nice`` is given (the container's
    processes are the daemon's, not the CLI client's children, so lowering the client would not lower them;
    coreutils' ``nice`` is in the image). No NPU, no network (``--net=none``), removed on exit (``--rm``);
    attached, so the probe reads its output. vllm-ascend's plugin names its platform without looking for a
    device (``vllm_ascend/__init__.py`` ``register``), so its parser builds without one."""
    _check_container(runtime=runtime, image=image, name=name)
    run = [runtime, "run", "--rm", "--pull=never", "--name", name, "--net=none"]
    for mount in ASCEND_DRIVER_MOUNTS:
        run += ["-v", mount]
    lowered = ["nice", "-n", str(int(nice))] if nice else []
    return [*run, *env_flags(env), image, *SHELL_WRAPPER, *lowered, CONTAINER_PYTHON, *python_args]


def _check_container(*, runtime: str, image: str, name: str) -> None:
    if runtime not in CONTAINER_RUNTIMES:
        raise CommandSpecError(f"runtime must be one of {', '.join(CONTAINER_RUNTIMES)}, got {runtime!r}")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise CommandSpecError(
            f"container name must be 2-128 letters, digits and _ . - (starting with a letter or digit), got {name!r}"
        )
    if not isinstance(image, str) or not _IMAGE_RE.fullmatch(image):
        raise CommandSpecError(f"image must be a reference like quay.io/ascend/vllm-ascend:v0.23.0, got {image!r}")


def env_flags(env: Mapping[str, str], *, secret: Iterable[str] = ()) -> list[str]:
    """``-e KEY=VALUE`` for each variable (the device variable left out: the ``--device`` flags choose
    the chips), then ``-e KEY`` for each secret one."""
    flags, secret = [], tuple(secret)
    for key, value in env.items():
        if key in DEVICE_ENV.values() or key in secret:
            continue
        if not _ENV_KEY_RE.fullmatch(key) or "\n" in str(value) or "\0" in str(value):
            raise CommandSpecError(f"environment variable {key!r} cannot be passed to a container")
        flags += ["-e", f"{key}={value}"]
    for key in secret:
        flags += ["-e", key]
    return flags
