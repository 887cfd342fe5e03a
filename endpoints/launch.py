"""The whole launch of one replica: the LaunchSpec from the endpoint, replica and node, the argv
(endpoints.commands.build_command), the child's environment and its log file. The agent's
supervisor gets the finished ProcessSpec and runs it. On a node whose engine runtime is Docker or
Podman the same vLLM argv runs inside vllm-ascend's image (build_container_command)."""
from pathlib import Path

from django.conf import settings

from console.env import child_environment
from endpoints.commands import (CommandSpecError, ContainerSpec, LaunchSpec, build_command, build_container_command,
                                container_name)
from endpoints.models import Endpoint, Replica
from workers.agent.supervisor import ProcessSpec
from workers.models import Node


def launch_spec(*, endpoint: Endpoint, replica: Replica, node: Node, port: int) -> LaunchSpec:
    chip = node.devices.filter(index__in=replica.devices).values_list("name", flat=True).first()
    return LaunchSpec(
        platform=node.platform, engine_python=node.engine_python or settings.ENGINE_PYTHON,
        model_path=endpoint.artifact.path, served_model_name=endpoint.served_model_name,
        host=settings.ENDPOINT_BIND_HOST, port=port, devices=list(replica.devices),
        tensor_parallel_size=endpoint.tensor_parallel_size, pipeline_parallel_size=endpoint.pipeline_parallel_size,
        max_num_seqs=endpoint.max_num_seqs, max_model_len=endpoint.max_model_len,
        gpu_memory_utilization=endpoint.gpu_memory_utilization, dtype=endpoint.dtype or None,
        quantization=endpoint.quantization or None, enforce_eager=endpoint.enforce_eager, chip_name=chip,
        extra_args=dict(endpoint.extra_args), env=dict(endpoint.env), cpu_kvcache_gib=settings.VLLM_CPU_KVCACHE_GIB,
    )


def replica_log_path(replica: Replica) -> Path:
    return Path(settings.DATA_DIR) / "logs" / "endpoints" / replica.endpoint.name / f"replica-{replica.index}.log"


def replica_process(*, replica: Replica, node: Node, port: int) -> tuple[ProcessSpec, dict[str, str]]:
    """(what the supervisor runs, the variables the console set: shown on the endpoint page)."""
    launch = launch_spec(endpoint=replica.endpoint, replica=replica, node=node, port=port)
    argv, env_added = build_command(launch)
    # The replica's key goes in the child's environment only: env_added is shown on the endpoint page.
    secret = {"VLLM_API_KEY": replica.api_key}
    if not node.containerised:
        spec = ProcessSpec(argv=argv, env=child_environment({**env_added, **secret}),
                           log_path=replica_log_path(replica), log_keep=settings.ENDPOINT_LOG_KEEP)
        return spec, env_added
    if node.platform != Node.Platform.ASCEND:
        raise CommandSpecError(f"{node.name} runs replicas under {node.engine_runtime}, which serves vllm-ascend's "
                               f"image: Ascend nodes only, and this is a {node.get_platform_display()} node")
    container = ContainerSpec(runtime=node.engine_runtime, image=node.engine_image(launch.chip_name),
                              name=container_name(replica.endpoint.name, replica.index), devices=list(replica.devices),
                              secret_env=tuple(secret))
    # The engine variables travel as `-e` flags in the argv (shown there); the key by name only, its value
    # from the CLI's own environment.
    spec = ProcessSpec(argv=build_container_command(container, argv, env_added), env=child_environment(secret),
                       log_path=replica_log_path(replica), log_keep=settings.ENDPOINT_LOG_KEEP,
                       runtime=node.engine_runtime, container_name=container.name)
    return spec, {}
