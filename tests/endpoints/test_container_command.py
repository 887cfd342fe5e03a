"""The Docker/Podman runtime's argv against vllm-ascend's own container command (v0.23.0's quick start,
vendored in tests/fixtures/ascend/ with its provenance), flag by flag: every upstream flag is ours or
left out for a stated reason, every flag of ours is upstream's or added for a stated reason."""

import re
import shlex

import pytest
import yaml

from endpoints.commands import (
    CommandSpecError,
    ContainerSpec,
    LaunchSpec,
    build_command,
    build_container_command,
    container_name,
    guarded_argv,
)
from endpoints.commands.container import SHELL_WRAPPER
from endpoints.commands.guard import GUARD_MIDDLEWARE
from endpoints.launch import replica_process, replica_work_dir
from endpoints.models import Endpoint, Replica
from endpoints.reconcile import ReplicaWorkload
from tests.support import FIXTURES, ROOT
from workers import engine_images
from workers.agent.supervisor import Supervisor

ASCEND = FIXTURES / "ascend"
QUICK_START = ASCEND / "vllm-ascend_v0.23.0_quick_start_docker_run.sh"
INSTALLATION_A2 = ASCEND / "vllm-ascend_v0.23.0_installation_docker_run_a2.sh"
IMAGE_MATRIX = ASCEND / "vllm-ascend_v0.23.0_image_matrix.yaml"
DOCS_VERSION = "v0.23.0"  # docs/source/conf.py's myst_substitutions["vllm_ascend_version"] at v0.23.0

# Upstream flags the runtime leaves out, each with why (endpoints/commands/container.py says more).
LEFT_OUT = {
    ("--rm", None): "the agent reads a crashed container's exit code and logs, then removes it (rm -f)",
    ("-it", None): "run detached (-d) and watched by the agent",
    ("-p", "8000:8000"): "--net=host instead, as installation.md's A2/A3 command: the claimed port on the host",
    ("-v", "/root/.cache:/root/.cache"): "models are local paths mounted read-only; the host root's cache stays out",
}
# Flags of ours that the quick start does not have, each with why.
ADDED = {
    "-d": "detached, for --rm/-it",
    "--pull=never": "a missing image fails at once, no multi-GB pull inside the agent's loop",
    "--net=host": "installation.md's A2/A3 command (checked below)",
    # The runtime's own copy of the output, bounded (ENDPOINT_LOG_MAX_BYTES, ENDPOINT_LOG_KEEP, as the agent's).
    "--log-driver=json-file": "the file driver, for which the bound holds (a journald daemon refuses max-size)",
    "--log-opt=max-size=20480k": "the runtime's log of a long-running vLLM grew without limit",
    "--log-opt=max-file=5": "docker's rotation, as many files as the agent keeps",
}
# The replica's working directory (endpoints.launch.make_work_dir: the replica key guard's module in it, and
# what CANN writes into the working directory), mounted read-write at its host path, for the image's WORKDIR.
WORK_DIR = "/var/lib/llm-console/work/endpoints/qwen3/replica-0"
WORK_FLAGS = {("-v", f"{WORK_DIR}:{WORK_DIR}:rw"), ("-w", WORK_DIR)}


def upstream_command(path) -> tuple[list[tuple[str, str | None]], str, list[str]]:
    """The vendored block's `docker run`: (options as (flag, value) pairs, image, command), with its
    `export` variables and the docs' |vllm_ascend_version| substituted."""
    text = path.read_text().replace("|vllm_ascend_version|", DOCS_VERSION)
    variables = dict(re.findall(r"^export (\w+)=(\S+)$", text, flags=re.MULTILINE))
    line = re.search(r"^docker run .*?(?<!\\)$", text.replace("\\\n", " "), flags=re.MULTILINE).group(0)
    words = [re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], w) for w in shlex.split(line)[2:]]
    return parse_run(words)


def parse_run(words: list[str]) -> tuple[list[tuple[str, str | None]], str, list[str]]:
    takes_value = {"--name", "--device", "-v", "-p", "-e", "-w"}
    options, i = [], 0
    while words[i].startswith("-"):
        if words[i] in takes_value:
            options.append((words[i], words[i + 1]))
            i += 2
        else:
            options.append((words[i], None))
            i += 1
    return options, words[i], words[i + 1 :]


def vllm_spec(**changes) -> LaunchSpec:
    values = {
        "platform": "ascend",
        "engine_python": "/opt/engine/bin/python",
        "model_path": "/models/qwen3-0.6b",
        "served_model_name": "qwen3",
        "port": 8601,
        "devices": [0],
        "chip_name": "910B4",
        "env": {"VLLM_LOGGING_LEVEL": "INFO"},
    }
    return LaunchSpec(**{**values, **changes})


def ours(devices=(0,), **changes) -> tuple[list[str], list[str], dict]:
    argv, env = build_command(vllm_spec(devices=list(devices), **changes))
    argv = guarded_argv(argv)  # as endpoints.launch.replica_process runs it
    container = ContainerSpec(
        runtime="docker",
        image=f"quay.io/ascend/vllm-ascend:{DOCS_VERSION}",
        name=container_name("qwen3", 0),
        devices=list(devices),
        work_dir=WORK_DIR,
        log_max_bytes=20 * 1024 * 1024,
        log_files=5,
    )
    return build_container_command(container, argv, env), argv, env


def test_the_argv_is_upstreams_quick_start_flag_by_flag():
    upstream, upstream_image, upstream_cmd = upstream_command(QUICK_START)
    run, vllm_argv, env = ours(devices=[0])  # the quick start's DEVICE=/dev/davinci0
    assert run[:2] == ["docker", "run"]
    options, image, command = parse_run(run[2:])
    assert image == upstream_image == "quay.io/ascend/vllm-ascend:v0.23.0"

    for flag in upstream:
        if flag in LEFT_OUT:
            assert flag not in options, flag
        elif flag[0] == "--name":
            assert ("--name", "llm-console-qwen3-r0") in options  # ours: one deterministic name per replica
        else:
            assert flag in options, f"upstream's {flag} is missing"
    model = vllm_spec().model_path
    for flag in options:
        if flag in upstream or flag[0] == "--name":
            continue
        if flag[0] == "-e":
            key = flag[1].split("=", 1)[0]
            assert key in env or key == "VLLM_API_KEY", flag
        elif flag == ("-v", f"{model}:{model}:ro") or flag in WORK_FLAGS:
            pass
        else:
            assert flag[1] is None and flag[0] in ADDED, f"{flag} is neither upstream's nor a stated addition"
    # Upstream opens `bash` in the image; ours is that bash, interactive so that it reads the image's ~/.bashrc,
    # exec-ing the same vLLM argv the process runtime runs, with the image's python.
    assert upstream_cmd == ["bash"] and command[:4] == SHELL_WRAPPER == ["bash", "-ic", 'exec "$@"', "bash"]
    assert command[4:] == ["python3", *vllm_argv[1:]] and vllm_argv[-2:] == ["--middleware", GUARD_MIDDLEWARE]
    assert WORK_FLAGS <= set(options)


def test_host_networking_is_what_the_installation_page_runs():
    options, image, command = upstream_command(INSTALLATION_A2)
    assert ("--net=host", None) in options and image == "quay.io/ascend/vllm-ascend:v0.23.0"
    # Its devices are the node's eight chips, one --device each, as ours are the replica's.
    assert [v for f, v in options if f == "--device" and "davinci" in v and v[-1].isdigit()] == [
        f"/dev/davinci{n}" for n in range(8)
    ]
    run, _, _ = ours(devices=[2, 3], tensor_parallel_size=2)
    davinci = [run[i + 1] for i, word in enumerate(run) if word == "--device"]
    assert davinci == ["/dev/davinci2", "/dev/davinci3", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]


def test_only_the_allow_listed_environment_goes_in_and_the_key_by_name():
    run, _, env = ours(devices=[4], env={"VLLM_LOGGING_LEVEL": "DEBUG", "HCCL_CONNECT_TIMEOUT": "600"})
    passed = [run[i + 1] for i, word in enumerate(run) if word == "-e"]
    assert passed == [f"{k}={v}" for k, v in env.items() if k != "ASCEND_RT_VISIBLE_DEVICES"] + ["VLLM_API_KEY"]
    assert "VLLM_LOGGING_LEVEL=DEBUG" in passed and "HCCL_CONNECT_TIMEOUT=600" in passed
    # The mounted chips are all the container sees: the host's numbering (4) would name a chip it hasn't.
    assert not any(p.startswith("ASCEND_RT_VISIBLE_DEVICES") for p in passed)
    with pytest.raises(CommandSpecError, match="LD_PRELOAD is not an allowed environment variable"):
        ours(env={"LD_PRELOAD": "/tmp/x.so"})


def test_the_model_is_mounted_read_only_at_the_same_path():
    run, vllm_argv, _ = ours()
    assert run[run.index("/models/qwen3-0.6b:/models/qwen3-0.6b:ro") - 1] == "-v"
    assert vllm_argv[vllm_argv.index("--model") + 1] == "/models/qwen3-0.6b"  # unchanged inside


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"runtime": "lxc"}, "runtime must be one of docker, podman, got 'lxc'"),
        ({"name": "-rm"}, "container name must be"),
        ({"image": "quay.io/ascend/vllm-ascend:v0.23.0; rm -rf /"}, "image must be a reference"),
        ({"devices": [True]}, "devices must be NPU ids"),
    ],
)
def test_bad_container_fields_are_named(changes, message):
    argv, env = build_command(vllm_spec())
    fields = {
        "runtime": "docker",
        "image": "quay.io/ascend/vllm-ascend:v0.23.0",
        "name": "llm-console-x-r0",
        "devices": [0],
    }
    with pytest.raises(CommandSpecError, match=re.escape(message)):
        build_container_command(ContainerSpec(**{**fields, **changes}), argv, env)


@pytest.mark.parametrize(
    "path, message",
    [
        ("/models/a:b", "cannot be bind-mounted: ':' and ','"),
        ("Qwen/Qwen3-0.6B", "model_path must be an absolute path to mount into the container"),
    ],
)
def test_model_paths_a_bind_mount_cannot_take_are_refused(path, message):
    argv, env = build_command(vllm_spec(model_path=path))
    container = ContainerSpec(runtime="podman", image="quay.io/ascend/vllm-ascend:v0.23.0", name="n-r0", devices=[0])
    with pytest.raises(CommandSpecError, match=re.escape(message)):
        build_container_command(container, argv, env)


def test_podman_gets_the_same_command_but_its_own_log_driver_and_no_max_file():
    """Podman names its file driver k8s-file (json-file is an alias) and has no max-file (containers/podman#21361):
    conmon keeps one file and truncates it at max-size."""
    argv, env = build_command(vllm_spec())
    fields = {
        "image": "quay.io/ascend/vllm-ascend:v0.23.0",
        "name": "llm-console-qwen3-r0",
        "devices": [0],
        "log_max_bytes": 10 * 1024 * 1024,
        "log_files": 3,
    }
    docker = build_container_command(ContainerSpec(runtime="docker", **fields), argv, env)
    podman = build_container_command(ContainerSpec(runtime="podman", **fields), argv, env)
    docker_logs = ["--log-driver=json-file", "--log-opt=max-size=10240k", "--log-opt=max-file=3"]
    podman_logs = ["--log-driver=k8s-file", "--log-opt=max-size=10240k"]
    at = docker.index(docker_logs[0])
    assert docker[at : at + 3] == docker_logs and podman[at : at + 2] == podman_logs
    assert podman == ["podman", *docker[1:at], *podman_logs, *docker[at + 3 :]]
    unbounded = build_container_command(ContainerSpec(runtime="docker", **{**fields, "log_max_bytes": None}), argv, env)
    assert unbounded == [*docker[:at], *docker[at + 3 :]]  # no limit asked: the runtime's own driver and settings


def test_image_variants_are_the_ones_upstream_publishes_at_the_pinned_release(settings):
    matrix = yaml.safe_load("build_meta:\n" + IMAGE_MATRIX.read_text().split("build_meta:\n", 1)[1])["build_meta"]
    published = {("-" + m["suffix"]) if m["suffix"] else "" for m in matrix}
    assert {suffix for suffix, _, _ in engine_images.VARIANTS.values()} == published
    assert "-950dt" not in published  # quick_start.md's 950DT tag; the workflow publishes -a5
    makefile = (ROOT / "Makefile").read_text()
    assert (
        re.search(r"^VLLM_ASCEND_TAG := (\S+)$", makefile, re.MULTILINE).group(1) == f"v{settings.VLLM_ASCEND_VERSION}"
    )
    assert engine_images.ascend_image("auto", "910B4") == f"quay.io/ascend/vllm-ascend:v{settings.VLLM_ASCEND_VERSION}"
    assert engine_images.ascend_image("auto", "310P3") == "quay.io/ascend/vllm-ascend:v0.23.0-310p"
    assert engine_images.ascend_image("auto", "Ascend950PR") == "quay.io/ascend/vllm-ascend:v0.23.0-a5"
    assert engine_images.ascend_image("a3-openeuler", "910B4") == "quay.io/ascend/vllm-ascend:v0.23.0-a3-openeuler"
    settings.VLLM_ASCEND_VERSION = "0.24.0"  # the tag follows the pinned release
    assert engine_images.ascend_image("a2", None) == "quay.io/ascend/vllm-ascend:v0.24.0"


@pytest.fixture
def endpoint(ascend_node, tiny_artifact):
    endpoint = Endpoint.objects.create(
        name="qwen",
        artifact=tiny_artifact,
        node=ascend_node,
        served_model_name="qwen",
        devices=[2],
        env={"VLLM_LOGGING_LEVEL": "INFO"},
    )
    Replica.objects.create(endpoint=endpoint, index=0, node=ascend_node, devices=[2])
    return endpoint


def test_a_docker_node_launches_the_replica_in_the_image(endpoint, ascend_node, settings):
    ascend_node.engine_runtime = "docker"
    settings.ENDPOINT_LOG_MAX_BYTES, settings.ENDPOINT_LOG_KEEP = 8 * 1024 * 1024, 4
    replica = endpoint.replica_set.get()
    spec, shown_env = replica_process(replica=replica, node=ascend_node, port=8612)
    assert spec.runtime == "docker" and spec.container_name == "llm-console-qwen-r0"
    # The runtime's own log of the replica is bounded like the agent's copy of it (ENDPOINT_LOG_*).
    logs = ["--log-driver=json-file", "--log-opt=max-size=8192k", "--log-opt=max-file=4"]
    assert spec.argv[spec.argv.index(logs[0]) : spec.argv.index(logs[0]) + 3] == logs
    assert spec.argv[:2] == ["docker", "run"] and "quay.io/ascend/vllm-ascend:v0.23.0" in spec.argv
    assert ["--device", "/dev/davinci2"] == spec.argv[
        spec.argv.index("/dev/davinci2") - 1 : spec.argv.index("/dev/davinci2") + 1
    ]
    # The key is in the CLI's environment only (docker copies it in for `-e VLLM_API_KEY`).
    assert spec.env["VLLM_API_KEY"] == replica.api_key and replica.api_key not in " ".join(spec.argv)
    assert "VLLM_LOGGING_LEVEL=INFO" in spec.argv and shown_env == {}
    process, env = replica_process(
        replica=replica, node=ascend_node.__class__.objects.get(pk=ascend_node.pk), port=8612
    )
    assert (
        process.runtime == "process"
        and process.argv[0] == "/opt/engine/bin/python"
        and env["ASCEND_RT_VISIBLE_DEVICES"] == "2"
    )
    # Everything after the image's python is the process runtime's argv, the replica key guard included: the
    # process runs in the replica's working directory (the guard's module in it), the container in its mount.
    assert spec.argv[spec.argv.index("python3") + 1 :] == process.argv[1:]
    work = str(replica_work_dir(replica))
    assert process.argv[-2:] == ["--middleware", GUARD_MIDDLEWARE] and process.cwd == work
    assert ["-v", f"{work}:{work}:rw", "-w", work] == spec.argv[spec.argv.index("-w") - 2 : spec.argv.index("-w") + 2]


def test_a_container_runtime_on_a_cpu_node_is_refused_at_launch(cpu_node, tiny_artifact):
    cpu_node.engine_runtime = "podman"
    endpoint = Endpoint.objects.create(name="tiny", artifact=tiny_artifact, node=cpu_node, served_model_name="tiny")
    replica = Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    with pytest.raises(CommandSpecError, match="serves vllm-ascend's image: Ascend nodes only"):
        replica_process(replica=replica, node=cpu_node, port=8613)


def test_an_unreachable_container_runtime_leaves_the_replica_waiting(endpoint, ascend_node, monkeypatch, tmp_path):
    """No docker (or its daemon down): the replica is neither crashed nor failed; the reason shows, and the
    next pass tries again."""
    ascend_node.__class__.objects.filter(pk=ascend_node.pk).update(engine_runtime="docker")
    monkeypatch.setenv("PATH", str(tmp_path))
    ReplicaWorkload().reconcile(node=ascend_node, supervisor=Supervisor(ascend_node.name))
    replica = endpoint.replica_set.get()
    assert replica.state == Endpoint.State.PENDING and not replica.launched and replica.crashes_in_a_row == 0
    assert replica.state_reason.startswith("docker is not on this node's PATH")


@pytest.mark.parametrize(
    "work_dir, message",
    [
        ("relative/replica-0", "work_dir must be an absolute path to mount into the container"),
        ("/srv/a:b/replica-0", "work_dir '/srv/a:b/replica-0' cannot be bind-mounted: ':' and ','"),
        ("/srv/a,b/replica-0", "work_dir '/srv/a,b/replica-0' cannot be bind-mounted: ':' and ','"),
    ],
)
def test_a_work_directory_a_bind_mount_cannot_take_is_refused(work_dir, message):
    argv, env = build_command(vllm_spec())
    container = ContainerSpec(
        runtime="docker",
        image="quay.io/ascend/vllm-ascend:v0.23.0",
        name=container_name("qwen3", 0),
        devices=[0],
        work_dir=work_dir,
    )
    with pytest.raises(CommandSpecError, match=re.escape(message)):
        build_container_command(container, guarded_argv(argv), env)
