"""The "profiling enabled" launch option (issue 17): vLLM's --profiler-config in the replica's argv on cpu
and ascend, checked against vLLM's own ProfilerConfig (the engine venv) and against vllm-ascend v0.23.0's
NPU profiler (vendored in tests/fixtures/ascend/, SOURCES.md); the option through the API, the form and
the endpoint page; turning it on or off restarts running replicas one at a time."""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from django.utils import timezone

from console.models import AuditEvent
from endpoints.commands import (
    PROFILER_FLAG,
    CommandSpecError,
    ContainerSpec,
    build_command,
    build_container_command,
    emittable_flags,
    validate_env,
    validate_extra_args,
)
from endpoints.launch import launch_spec, make_profile_dir, replica_process
from endpoints.models import Endpoint, EndpointEvent, Replica
from endpoints.profiling.paths import replica_profile_dir
from endpoints.reconcile import ReplicaWorkload
from endpoints.services import endpoint_set_profiling
from tests.support import FIXTURES
from tests.support.command_specs import ASCEND_DEFAULTS, flag_value, spec

ASCEND = FIXTURES / "ascend"
PROFILES = "/var/lib/llm-console/profiles/replicas/qwen-0"
EXPECTED = {
    "profiler": "torch",
    "torch_profiler_dir": PROFILES,
    "torch_profiler_with_stack": False,
    "ignore_frontend": True,
}


def _config(argv: list[str]) -> dict:
    assert argv.count(PROFILER_FLAG) == 1
    return json.loads(flag_value(argv, PROFILER_FLAG))


# ------------------------------------------------------------------ the command


def test_cpu_argv_has_the_profiler_config_and_nothing_without_it():
    argv, env = build_command(spec(platform="cpu", devices=[], profiler_dir=PROFILES))
    assert _config(argv) == EXPECTED
    assert "VLLM_TORCH_PROFILER_DIR" not in env  # deprecated by vLLM; the flag replaces it
    argv, _ = build_command(spec(platform="cpu", devices=[]))
    assert PROFILER_FLAG not in argv and not any("profil" in a for a in argv)
    assert PROFILER_FLAG in emittable_flags()  # so the installed-parser test checks it


def test_ascend_argv_builds_what_vllm_ascends_npu_profiler_reads():
    """vllm-ascend v0.23.0 builds its NPU profiler from vLLM's ProfilerConfig: vllm_ascend/profiler/
    torch_npu_profiler.py lines 38-76 (TorchNPUProfilerWrapper._create_profiler), created by
    vllm_ascend/worker/worker.py lines 940-968 (NPUWorker.profile); its guide starts the server with
    --profiler-config (service_profiling_guide.md lines 28-52). No variable is needed beside the flag."""
    argv, env = build_command(spec(devices=[0, 1], tensor_parallel_size=2, profiler_dir=PROFILES))
    config = _config(argv)
    assert config == EXPECTED
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "0,1", **ASCEND_DEFAULTS}

    source = (ASCEND / "vllm-ascend_v0.23.0_torch_npu_profiler.py.txt").read_text()
    # What the NPU profiler reads of the config, and how: "torch" is the one profiler it builds, the
    # directory goes to torch_npu's trace handler, the stack switch to with_modules (off: it costs most).
    assert set(re.findall(r"profiler_config\.(\w+)", source)) == {
        "profiler",
        "torch_profiler_dir",
        "torch_profiler_with_memory",
        "torch_profiler_with_stack",
    }
    assert 'if profiler_config.profiler != "torch":' in source and config["profiler"] == "torch"
    assert re.search(
        r"tensorboard_trace_handler\(\s*profiler_config\.torch_profiler_dir,\s*worker_name=trace_name", source
    )
    assert "with_modules=profiler_config.torch_profiler_with_stack" in source
    assert config["torch_profiler_with_stack"] is False
    # Fixed in the source, nothing for the console to set: CPU + NPU activities, Level1, PipeUtilization.
    assert "ProfilerLevel.Level1" in source and "AiCMetrics.PipeUtilization" in source
    # It refuses to build while msMonitor's daemon is on: a variable the console never lets through.
    assert "MSMONITOR_USE_DAEMON" in source
    with pytest.raises(CommandSpecError, match="MSMONITOR_USE_DAEMON is not an allowed"):
        validate_env({"MSMONITOR_USE_DAEMON": "1"})

    worker = (ASCEND / "vllm-ascend_v0.23.0_worker_profile.py.txt").read_text()
    assert "TorchNPUProfilerWrapper(self.profiler_config, trace_name)" in worker
    assert "get_worker_rank_suffix(global_rank=self.rank)" in worker  # the <worker> of the file names

    # The guide's own flag: ours has its settings, with an absolute directory, plus ignore_frontend.
    guide = (ASCEND / "vllm-ascend_v0.23.0_service_profiling_guide.md").read_text()
    words = shlex.split(
        re.search(r"python3 -m vllm\.entrypoints\.openai\.api_server.*?```", guide, re.DOTALL)
        .group(0)
        .replace("\\\n", " ")
        .removesuffix("```")
    )
    upstream = json.loads(words[words.index(PROFILER_FLAG) + 1])
    assert upstream.keys() <= config.keys()
    assert {k: v for k, v in upstream.items() if k != "torch_profiler_dir"} == {
        k: config[k] for k in upstream if k != "torch_profiler_dir"
    }
    assert config.keys() - upstream.keys() == {"ignore_frontend"}


@pytest.mark.parametrize(
    "value",
    [
        "profiles",
        "./vllm_profile",
        "/a b",
        "/a:b",
        "/a,b",
        "/a/../b",
        "/a/./b",
        "//a",
        "/a\nb",
        "/a\x00b",
        "/ä",
        "",
        7,
        "/" + "a" * 1100,
    ],
)
def test_a_bad_profiler_dir_is_refused(value):
    with pytest.raises(CommandSpecError, match="profiler_dir"):
        build_command(spec(profiler_dir=value))


@pytest.mark.parametrize("key", ["--profiler-config", "profiler_config", "profiler-config"])
def test_extra_args_cannot_set_the_profiler(key):
    with pytest.raises(CommandSpecError, match="set by the endpoint's profiling option"):
        validate_extra_args({key: json.dumps(EXPECTED)})


def test_a_container_mounts_the_profile_directory_read_write():
    argv, env = build_command(spec(model_path="/models/qwen", profiler_dir=PROFILES))
    container = ContainerSpec(
        runtime="docker", image="quay.io/ascend/vllm-ascend:v0.23.0", name="llm-console-qwen-r0", devices=[0]
    )
    run = build_container_command(container, argv, env)
    mounts = [run[i + 1] for i, word in enumerate(run) if word == "-v"]
    assert f"{PROFILES}:{PROFILES}:rw" in mounts and "/models/qwen:/models/qwen:ro" in mounts
    assert _config(run[run.index("python3") :]) == EXPECTED  # the same flag inside
    plain, env = build_command(spec(model_path="/models/qwen"))
    assert not any(word.endswith(":rw") for word in build_container_command(container, plain, env))


# ------------------------------------------------------------------ vLLM's own ProfilerConfig

_PROFILER_PROBE = r"""
import json, sys
from pydantic import TypeAdapter
from vllm.config.profiler import ProfilerConfig
text = sys.stdin.read()
for config in (ProfilerConfig(**json.loads(text)), TypeAdapter(ProfilerConfig).validate_json(text)):
    print(json.dumps({"profiler": config.profiler, "dir": config.torch_profiler_dir,
                      "with_stack": config.torch_profiler_with_stack, "gzip": config.torch_profiler_use_gzip,
                      "frontend": config.should_profile_frontend}))
"""


@pytest.mark.slow  # imports vLLM's config package in the engine venv (seconds idle, minutes on a busy CI host)
def test_vllms_profiler_config_takes_the_json(settings):
    """The engine's own class: ProfilerConfig(**json) and the CLI's TypeAdapter(...).validate_json
    (vllm/engine/arg_utils.py _compute_kwargs) accept it and read the intended settings."""
    engine_python = Path(settings.ENGINE_PYTHON)
    if not engine_python.exists():
        assert not os.environ.get("CI"), f"no engine python at {engine_python}: run `make engine`"
        pytest.skip(f"no engine python at {engine_python} (ENGINE_PYTHON): run `make engine`")
    argv, _ = build_command(spec(platform="cpu", devices=[], profiler_dir=PROFILES))
    proc = subprocess.run(
        [str(engine_python), "-c", _PROFILER_PROBE],
        check=False,
        input=flag_value(argv, PROFILER_FLAG),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]]
    expected = {"profiler": "torch", "dir": PROFILES, "with_stack": False, "gzip": True, "frontend": False}
    assert lines == [expected, expected]


# ------------------------------------------------------------------ the option: API, form, page, launch


def _launch(api, artifact, **changes):
    return api.post("/api/v1/endpoints", {"name": "qwen", "artifact": artifact.pk, **changes})


@pytest.mark.django_db
@pytest.mark.parametrize("profiling", [True, False, None])
def test_api_create_round_trips_profiling(profiling, operator, api_for, cpu_node, tiny_artifact, settings):
    changes = {} if profiling is None else {"profiling": profiling}
    response = _launch(api_for(operator), tiny_artifact, **changes)
    assert response.status_code == 201, response.content
    assert response.json()["profiling"] is bool(profiling)
    endpoint = Endpoint.objects.get(name="qwen")
    assert endpoint.profiling is bool(profiling)
    assert api_for(operator).get(f"/api/v1/endpoints/{endpoint.pk}").json()["profiling"] is bool(profiling)
    assert AuditEvent.objects.get(action="endpoint.launch").changes["profiling"] is bool(profiling)
    replica = endpoint.replica_set.get()
    argv, _ = build_command(launch_spec(endpoint=endpoint, replica=replica, node=cpu_node, port=8650))
    if profiling:
        expected_dir = Path(settings.ENDPOINT_PROFILE_ROOT) / "replicas" / "qwen-0"
        assert replica_profile_dir(replica) == expected_dir
        assert _config(argv)["torch_profiler_dir"] == str(expected_dir)
    else:
        assert PROFILER_FLAG not in argv


@pytest.mark.django_db
@pytest.mark.parametrize("bad", ["maybe", "true", 1, [True], None])
def test_api_refuses_a_profiling_that_is_not_a_boolean(bad, operator, api_for, cpu_node, tiny_artifact):
    response = _launch(api_for(operator), tiny_artifact, profiling=bad)
    assert response.status_code == 422, response.content
    assert any(error["loc"][-1] == "profiling" for error in response.json()["detail"])
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_the_launch_form_has_the_checkbox(as_operator, cpu_node, tiny_artifact):
    page = as_operator.get("/endpoints/launch").content.decode()
    assert 'name="profiling"' in page and "Profiling enabled" in page and "overhead" in page
    response = as_operator.post("/endpoints/launch", {"name": "qwen", "artifact": tiny_artifact.pk, "profiling": "on"})
    assert response.status_code == 302, response.content.decode()[-2000:]
    assert Endpoint.objects.get(name="qwen").profiling is True
    as_operator.post("/endpoints/launch", {"name": "plain", "artifact": tiny_artifact.pk})
    assert Endpoint.objects.get(name="plain").profiling is False


@pytest.mark.django_db
def test_a_node_whose_vllm_has_no_profiler_config_is_refused(operator, api_for, ascend_node, tiny_artifact):
    ascend_node.engine_cli = json.loads((FIXTURES / "vllm_cli" / "vllm-0.11.0.json").read_text())
    ascend_node.save()
    response = _launch(api_for(operator), tiny_artifact, devices=[0], profiling=True)
    assert response.status_code == 400
    assert response.json()["errors"] == {
        "profiling": ["vLLM 0.11.0 on node npu-host has no --profiler-config: profiling needs a newer vLLM there."]
    }
    assert not Endpoint.objects.exists()
    response = _launch(api_for(operator), tiny_artifact, devices=[0])
    assert response.status_code == 201
    response = api_for(operator).post(f"/api/v1/endpoints/{response.json()['id']}/profiling", {"enabled": True})
    assert response.status_code == 400 and "profiling" in response.json()["errors"]
    assert (
        Endpoint.objects.get().profiling is False
        and not AuditEvent.objects.filter(action="endpoint.profiling").exists()
    )


@pytest.fixture
def two_ready(ascend_node, tiny_artifact, operator, api_for):
    """An endpoint of two replicas, both running (as the agent records them) without the profiler."""
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "qwen", "artifact": tiny_artifact.pk, "devices": [0, 1], "replicas": 2}
    )
    assert response.status_code == 201, response.content
    endpoint = Endpoint.objects.get(name="qwen")
    for replica in endpoint.replica_set.all():
        _run(replica)
    return endpoint


def _run(replica: Replica) -> None:
    """Record the replica as started from the endpoint as it is now, and ready."""
    replica = Replica.objects.select_related("endpoint", "node").get(pk=replica.pk)
    argv, env = build_command(
        launch_spec(endpoint=replica.endpoint, replica=replica, node=replica.node, port=8650 + replica.index)
    )
    Replica.objects.filter(pk=replica.pk).update(
        argv=argv,
        env=env,
        state=Endpoint.State.READY,
        pid=4000 + replica.index,
        ready_at=timezone.now(),
        restart_requested=False,
    )


def _restart_pass(endpoint: Endpoint) -> list[int]:
    """What the agents' health pass asks to restart now, replica by replica, as they do."""
    workload = ReplicaWorkload()
    for replica in Replica.objects.filter(endpoint=endpoint).select_related("endpoint", "node"):
        workload.maybe_scheduled_restart(replica, timezone.now())
    return list(Replica.objects.filter(endpoint=endpoint, restart_requested=True).values_list("index", flat=True))


@pytest.mark.django_db
def test_set_profiling_audits_and_restarts_replicas_one_at_a_time(two_ready, operator):
    endpoint = two_ready
    assert _restart_pass(endpoint) == []  # running as configured: nothing to do
    endpoint = endpoint_set_profiling(endpoint=endpoint, enabled=True, user=operator)
    assert endpoint.profiling is True
    audit = AuditEvent.objects.get(action="endpoint.profiling")
    assert audit.changes == {"profiling": [False, True]} and audit.actor == operator
    assert EndpointEvent.objects.filter(kind="profiling", message__contains="replicas restart one at a time").exists()

    assert _restart_pass(endpoint) == [0]  # the first; the second waits while it restarts
    assert _restart_pass(endpoint) == [0]
    restarting = EndpointEvent.objects.get(kind="profiling-restart")
    assert restarting.replica_index == 0 and restarting.message == "restart to enable profiling"
    _run(Replica.objects.get(endpoint=endpoint, index=0))  # it came back, with the profiler
    assert PROFILER_FLAG in Replica.objects.get(endpoint=endpoint, index=0).argv
    assert _restart_pass(endpoint) == [1]
    _run(Replica.objects.get(endpoint=endpoint, index=1))
    assert _restart_pass(endpoint) == []

    # The same value again changes nothing; off again restarts them the same way.
    endpoint_set_profiling(endpoint=endpoint, enabled=True, user=operator)
    assert AuditEvent.objects.filter(action="endpoint.profiling").count() == 1
    endpoint_set_profiling(endpoint=endpoint, enabled=False, user=operator)
    assert _restart_pass(endpoint) == [0]
    assert EndpointEvent.objects.filter(kind="profiling-restart", message="restart to disable profiling").exists()


@pytest.mark.django_db
def test_turned_back_before_a_restart_nothing_restarts(two_ready, operator):
    endpoint_set_profiling(endpoint=two_ready, enabled=True, user=operator)
    endpoint_set_profiling(endpoint=two_ready, enabled=False, user=operator)
    assert AuditEvent.objects.filter(action="endpoint.profiling").count() == 2
    assert _restart_pass(two_ready) == []


@pytest.mark.django_db
def test_a_stopped_endpoint_applies_it_at_the_next_start(two_ready, operator, api_for):
    api = api_for(operator)
    api.post(f"/api/v1/endpoints/{two_ready.pk}/stop")
    response = api.post(f"/api/v1/endpoints/{two_ready.pk}/profiling", {"enabled": True})
    assert response.status_code == 200 and response.json()["profiling"] is True
    assert EndpointEvent.objects.filter(kind="profiling", message__contains="applies at the next start").exists()


@pytest.mark.django_db
def test_api_route_roles_and_body(two_ready, operator, viewer, api_for):
    url = f"/api/v1/endpoints/{two_ready.pk}/profiling"
    response = api_for(viewer).post(url, {"enabled": True})
    assert response.status_code == 403
    assert (
        Endpoint.objects.get().profiling is False
        and not AuditEvent.objects.filter(action="endpoint.profiling").exists()
    )
    for bad in ({"enabled": "yes"}, {}, {"enabled": None}):
        response = api_for(operator).post(url, bad)
        assert response.status_code == 422 and any(e["loc"][-1] == "enabled" for e in response.json()["detail"])
    response = api_for(operator).post(url, {"enabled": True})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["profiling"] is True and [r["profiling"] for r in body["replicas"]] == [False, False]
    assert api_for(operator).post("/api/v1/endpoints/999/profiling", {"enabled": True}).status_code == 404


@pytest.mark.django_db
def test_the_endpoint_page_button(two_ready, as_operator, as_viewer):
    page = f"/endpoints/{two_ready.pk}/"
    assert "Enable profiling (restarts replicas one at a time)" in as_operator.get(page).content.decode()
    assert "Enable profiling" not in as_viewer.get(page).content.decode()
    assert as_viewer.post(f"/endpoints/{two_ready.pk}/profiling", {"enabled": "1"}).status_code == 403
    assert Endpoint.objects.get().profiling is False
    response = as_operator.post(f"/endpoints/{two_ready.pk}/profiling", {"enabled": "1"})
    assert response.status_code == 302 and Endpoint.objects.get().profiling is True
    for garbled in ({"enabled": "true"}, {}):  # refused, not read as "disable" (which restarts every replica)
        refused = as_operator.post(f"/endpoints/{two_ready.pk}/profiling", garbled, follow=True)
        assert "enabled must be 1 or 0" in refused.content.decode() and Endpoint.objects.get().profiling is True
    html = as_operator.get(page).content.decode()
    assert "Disable profiling" in html and "profiling enabled" in html
    as_operator.post(f"/endpoints/{two_ready.pk}/profiling", {"enabled": "0"})
    assert Endpoint.objects.get().profiling is False


@pytest.mark.django_db
def test_the_agent_makes_the_directory_and_a_container_mounts_it(ascend_node, tiny_artifact, settings, tmp_path):
    settings.ENDPOINT_PROFILE_ROOT = tmp_path / "profiles"
    endpoint = Endpoint.objects.create(
        name="qwen", artifact=tiny_artifact, node=ascend_node, served_model_name="qwen", devices=[2], profiling=True
    )
    replica = Replica.objects.create(endpoint=endpoint, index=0, node=ascend_node, devices=[2])
    make_profile_dir(replica)
    directory = tmp_path / "profiles" / "replicas" / "qwen-0"
    assert directory.is_dir()
    ascend_node.engine_runtime = "docker"
    spec_, _ = replica_process(replica=replica, node=ascend_node, port=8651)
    assert f"{directory}:{directory}:rw" in spec_.argv
    assert _config(spec_.argv)["torch_profiler_dir"] == str(directory)
    endpoint.profiling = False
    endpoint.save()
    other = Replica.objects.create(endpoint=endpoint, index=1, node=ascend_node, devices=[3])
    make_profile_dir(Replica.objects.select_related("endpoint").get(pk=other.pk))
    assert not (tmp_path / "profiles" / "replicas" / "qwen-1").exists()
