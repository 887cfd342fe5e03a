"""Issue 19's serving findings (2, 5, 6, 9, 10) and the CPU default dtype: each test failed before its fix."""

import json
import stat
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.http import QuietHandler, ServerThread

SECRETS = {
    "METRICS_TOKEN": "m-secret",
    "REDIS_URL": "redis://secret/9",
    "SECRET_KEY": "s-secret",
    "DATABASE_URL": "postgres://u:p@h/db",
    "CONSOLE_ADMIN_PASSWORD": "admin-secret",
    "DJANGO_SETTINGS_MODULE": "tests.settings",
    "OPENAI_API_KEY": "sk-parent",
}


class _Ctx:
    def progress(self, pct, stage=None):
        pass


def _env_dumper(tmp_path: Path) -> Path:
    """An executable that writes its whole environment to env.json and prints {} (a probe's answer)."""
    script = tmp_path / "dump-env"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump(dict(os.environ), open({str(tmp_path / 'env.json')!r}, 'w'))\nprint('{{}}')\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


# ---------------------------------------------------------------- finding 2: children inherit no secrets


def test_bench_client_child_gets_none_of_the_consoles_secrets(monkeypatch, tmp_path):
    from endpoints.bench.client import run_client

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TZ", "UTC")
    script = _env_dumper(tmp_path)
    run_client(
        [str(script)],
        cwd=tmp_path,
        ctx=_Ctx(),
        span=(0, 1),
        step="",
        num_prompts=1,
        timeout_s=60,
        log_path=tmp_path / "client.log",
        extra_env={"OPENAI_API_KEY": "sk-run"},
    )
    env = json.loads((tmp_path / "env.json").read_text())
    for name in SECRETS:
        if name != "OPENAI_API_KEY":
            assert name not in env, name
    assert env["OPENAI_API_KEY"] == "sk-run"  # the run's own key, never the parent's
    assert env["TZ"] == "UTC" and env["PYTHONUNBUFFERED"] == "1"
    assert "PATH" in env


def test_engine_probe_child_gets_none_of_the_consoles_secrets(monkeypatch, tmp_path):
    from workers.engine_info import probe_engine

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    probe_engine(str(_env_dumper(tmp_path)))
    env = json.loads((tmp_path / "env.json").read_text())
    assert not set(SECRETS) & set(env)


def test_one_function_builds_every_child_environment():
    """No spawn under endpoints or workers hands a child os.environ itself."""
    root = ROOT
    offenders = []
    for app in ("endpoints", "workers"):
        for path in (root / app).rglob("*.py"):
            text = path.read_text()
            if "**os.environ" in text or "env=os.environ" in text or "dict(os.environ" in text:
                offenders.append(str(path.relative_to(root)))
    assert offenders == []


# ---------------------------------------------------------------- findings 5 and 9: the gateway

from tests.support.gateway import HEALTH_TOKEN, chat, make_endpoint  # noqa: E402


@pytest.mark.django_db(transaction=True)
def test_tokens_per_minute_are_reserved_at_admission(fakes, gateway, admin):
    """4 concurrent requests on a 20 tokens/min key, each estimated at 17 (a 9-token prompt, max_tokens 8): one
    passes, the others wait (they all passed). A key whose limit is below a request's prompt admits none of it."""
    from concurrent.futures import ThreadPoolExecutor

    from endpoints.gateway import services

    make_endpoint("ep-tpm", [fakes("slow", delay=1.0)], model="tpm")
    _, raw = services.key_create(name="tpm-20", tpm_limit=20, actor=admin)
    gw = gateway()
    gw.wait_routes("tpm", 1)
    with ThreadPoolExecutor(4) as pool:
        codes = sorted(pool.map(lambda _: gw.post("/v1/chat/completions", raw, chat("tpm")).status_code, range(4)))
    assert codes == [200, 429, 429, 429], codes


@pytest.mark.django_db(transaction=True)
def test_models_list_is_scoped_to_the_key_and_healthz_is_a_status(fakes, gateway, admin):
    from endpoints.gateway import services

    make_endpoint("ep-one", [fakes("one")], model="one")
    make_endpoint("ep-two", [fakes("two")], model="two")
    _, ep_raw = services.key_create(name="only-ep-one", endpoints=["ep-one"], actor=admin)
    _, model_raw = services.key_create(name="only-two", models=["two"], actor=admin)
    gw = gateway()
    gw.wait_routes("one", 1)
    gw.wait_routes("two", 1)
    for raw, seen in ((ep_raw, ["one"]), (model_raw, ["two"])):
        listed = gw.client.get("/v1/models", headers={"Authorization": f"Bearer {raw}"}).json()
        assert [m["id"] for m in listed["data"]] == seen
    health = gw.client.get("/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert "one" not in health.text and "two" not in health.text
    for wrong in (ep_raw, "Bearer nope"):
        assert gw.client.get("/healthz", headers={"Authorization": wrong}).json() == {"status": "ok"}
    monitored = gw.client.get("/healthz", headers={"Authorization": f"Bearer {HEALTH_TOKEN}"}).json()
    assert monitored["replicas"] == {"one": 1, "two": 1}


# ---------------------------------------------------------------- finding 6: the env allow-list


@pytest.mark.parametrize(
    "key",
    [
        "VLLM_TUNED_CONFIG_FOLDER",
        "VLLM_USAGE_STATS_SERVER",
        "VLLM_TRACE_FUNCTION",
        "VLLM_SOME_FUTURE_SETTING",
        "HCCL_ANYTHING",
        "ASCEND_ANYTHING",
    ],
)
def test_env_names_off_the_explicit_list_are_refused_naming_the_key(key):
    from endpoints.commands import CommandSpecError, validate_env

    with pytest.raises(CommandSpecError, match=f"{key} is not an allowed environment variable"):
        validate_env({key: "1"})


@pytest.mark.parametrize(
    "env, message",
    [
        ({"VLLM_CPU_KVCACHE_SPACE": "lots"}, "VLLM_CPU_KVCACHE_SPACE"),
        ({"VLLM_LOGGING_LEVEL": "LOUD"}, "VLLM_LOGGING_LEVEL must be one of"),
        ({"HCCL_CONNECT_TIMEOUT": "-1"}, "HCCL_CONNECT_TIMEOUT"),
        ({"VLLM_HOST_IP": "http://evil"}, "VLLM_HOST_IP must be an IP address"),
        ({"PYTORCH_NPU_ALLOC_CONF": "$(rm -rf /)"}, "PYTORCH_NPU_ALLOC_CONF must be"),
        ({"ASCEND_RT_VISIBLE_DEVICES": "0;1"}, "ASCEND_RT_VISIBLE_DEVICES must be"),
    ],
)
def test_each_allowed_variable_has_a_validator(env, message):
    from endpoints.commands import CommandSpecError, validate_env

    with pytest.raises(CommandSpecError, match=message):
        validate_env(env)


def test_every_variable_the_console_emits_is_on_the_list():
    """...but the console's own vLLM plugin on cpu (its search path and name, endpoints/commands/cache.py),
    which an endpoint's env may not name."""
    from endpoints.commands import ENV_VARIABLES, CommandSpecError, LaunchSpec, build_command, validate_env

    for platform, devices in (("cpu", []), ("ascend", [0, 1]), ("cuda", [0])):
        _, env = build_command(
            LaunchSpec(
                platform=platform,
                engine_python="/x/python",
                model_path="/models/m",
                served_model_name="m",
                port=8000,
                devices=devices,
                tensor_parallel_size=max(1, len(devices)),
            )
        )
        env.pop("PYTHONPATH", None), env.pop("VLLM_PLUGINS", None)
        assert set(env) <= set(ENV_VARIABLES), set(env) - set(ENV_VARIABLES)
        assert validate_env(env) == env
    with pytest.raises(CommandSpecError, match="PYTHONPATH is not an allowed environment variable"):
        validate_env({"PYTHONPATH": "/tmp/x"})
    with pytest.raises(CommandSpecError, match="VLLM_PLUGINS is not an allowed environment variable"):
        validate_env({"VLLM_PLUGINS": "llm_console_cpu_aot_loader"})


# ---------------------------------------------------------------- finding 10: bad input is a 400 naming the field


def _launch_form(artifact, node, **changes):
    form = {
        "name": "bad-ep",
        "artifact": str(artifact.pk),
        "node": str(node.pk),
        "devices": "0",
        "replicas": "1",
        "tensor_parallel_size": "1",
        "pipeline_parallel_size": "",
        "max_model_len": "",
        "max_num_seqs": "",
        "gpu_memory_utilization": "",
        "dtype": "",
        "served_model_name": "",
        "extra_args": "",
        "env": "",
        "capacity_override": "",
        "restart_every_hours": "",
        "restart_daily_at": "",
    }
    return {**form, **changes}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("gpu_memory_utilization", "abc", "Between 0.1 and 0.99."),
        ("extra_args", "null", "Extra vLLM args: a JSON object"),
        ("extra_args", "[1, 2]", "Extra vLLM args: a JSON object"),
        ("env", "null", "Environment: a JSON object"),
        ("dtype", "float64; rm", "Choose one of"),
    ],
)
def test_launch_form_refuses_bad_values_with_400_naming_the_field(
    as_operator, ascend_node, tiny_artifact, field, value, message
):
    from endpoints.models import Endpoint

    resp = as_operator.post("/endpoints/launch", _launch_form(tiny_artifact, ascend_node, **{field: value}))
    assert resp.status_code == 400, (field, resp.status_code)
    assert message in resp.content.decode(), field
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "field, value",
    [
        ("quantization", "bogus; --trust-remote-code"),
        ("dtype", "float64"),
        ("extra_args", None),
        ("gpu_memory_utilization", "abc"),
    ],
)
def test_endpoint_api_refuses_bad_values_with_400_naming_the_field(
    operator, api_for, cpu_node, tiny_artifact, field, value
):
    from endpoints.models import Endpoint

    api = api_for(operator)
    resp = api.post(
        "/api/v1/endpoints", {"name": "bad-api", "artifact": tiny_artifact.pk, "node": cpu_node.name, field: value}
    )
    assert resp.status_code in (400, 422), (field, resp.status_code, resp.content)
    assert field in resp.content.decode(), (field, resp.content)
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_a_100k_character_model_path_is_a_400_naming_the_path(admin, api_for, as_admin, model_root):
    from models_registry.models import Model

    api = api_for(admin)
    long_path = str(model_root) + "/" + "a" * 100_000
    resp = api.post("/api/v1/models", {"name": "long-path", "path": long_path})
    assert resp.status_code == 400 and "path" in resp.content.decode(), resp.content[:300]
    page = as_admin.post("/models/register", {"name": "long-path", "path": long_path})
    assert page.status_code == 400 and "path" in page.content.decode().lower()
    assert not Model.objects.filter(name="long-path").exists()


# ---------------------------------------------------------------- the default launch on a CPU node


@pytest.mark.django_db
def test_default_launch_on_a_cpu_node_stores_float32_for_the_demo_size_model(
    as_operator, cpu_node, ascend_node, tiny_artifact
):
    from endpoints.models import Endpoint
    from endpoints.services import CPU_FLOAT32_MAX_PARAMS, default_dtype

    page = as_operator.get(f"/endpoints/launch?artifact={tiny_artifact.pk}").content.decode()
    assert "runs models of up to 3 B parameters in float32" in page  # the form says why
    form = _launch_form(tiny_artifact, cpu_node, name="cpu-default", devices="")
    assert as_operator.post("/endpoints/launch", form).status_code == 302
    assert Endpoint.objects.get(name="cpu-default").dtype == "float32"
    # An explicit choice wins; other platforms and big models keep the model's dtype.
    assert as_operator.post("/endpoints/launch", {**form, "name": "cpu-bf16", "dtype": "bfloat16"}).status_code == 302
    assert Endpoint.objects.get(name="cpu-bf16").dtype == "bfloat16"
    assert default_dtype(artifact=tiny_artifact, platform="ascend") == ""
    tiny_artifact.inspection = {**tiny_artifact.inspection, "param_count": CPU_FLOAT32_MAX_PARAMS + 1}
    assert default_dtype(artifact=tiny_artifact, platform="cpu") == ""


# ---------------------------------------------------------------- finding 9: replicas demand their own key


class KeyedReplica(ServerThread):
    """A replica that, like vLLM started with --api-key, answers /v1 only with its key."""

    def __init__(self, key: str):
        outer = self
        self.key, self.seen = key, []

        class Handler(QuietHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.seen.append(self.headers.get("Authorization"))
                ok = self.headers.get("Authorization") == f"Bearer {outer.key}"
                raw = json.dumps(
                    {
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                        "usage": {"total_tokens": 2},
                    }
                    if ok
                    else {"error": "Unauthorized"}
                ).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.serve(Handler)


@pytest.mark.django_db
def test_each_replica_starts_with_its_own_key_in_its_environment_only(ascend_node, tiny_artifact, operator, settings):
    from endpoints.endpoint_spec import EndpointSpec
    from endpoints.launch import replica_process
    from endpoints.services import endpoint_create

    endpoint = endpoint_create(
        spec=EndpointSpec(name="keyed", artifact=tiny_artifact.pk, node=ascend_node.pk, devices=[0, 1], replicas=2),
        user=operator,
    )
    first, second = endpoint.replica_set.order_by("index")
    spec, shown = replica_process(replica=first, node=ascend_node, port=8581)
    assert spec.env["VLLM_API_KEY"] == first.api_key and first.api_key.startswith("rk_")
    assert "VLLM_API_KEY" not in shown and first.api_key not in " ".join(spec.argv)  # not on the page, not in ps
    assert first.api_key != second.api_key
    before = first.api_key
    settings.SECRET_KEY = "another-secret-key-" + "x" * 40
    assert first.api_key != before  # derived from the console's secret: a replica's port alone lets no one in


@pytest.mark.django_db(transaction=True)
def test_gateway_and_try_it_send_the_replicas_key(gateway, admin, operator):
    from endpoints.gateway import services as gateway_services
    from endpoints.services import endpoint_chat

    ep = make_endpoint("ep-keyed", [], model="keyed")
    replica = ep.replica_set.model.objects.create(endpoint=ep, index=0, node=ep.node, state="ready", port=1)
    fake = KeyedReplica(replica.api_key)
    try:
        replica.port, replica.port_host = fake.port, f"fake-{fake.port}"
        replica.save()
        ep.state = "ready"
        ep.save()
        _, raw = gateway_services.key_create(name="client", actor=admin)
        gw = gateway()
        gw.wait_routes("keyed", 1)
        answer = gw.post("/v1/chat/completions", raw, chat("keyed"))
        assert answer.status_code == 200, answer.text
        assert fake.seen[-1] == f"Bearer {replica.api_key}"  # the replica's key, not the client's
        assert endpoint_chat(endpoint=ep, message="hi", user=operator)["text"] == "hi"
        assert fake.seen[-1] == f"Bearer {replica.api_key}"
    finally:
        fake.stop()


# ------------------------------------------------ the model's files are checked again on every start


@pytest.mark.django_db
def test_a_link_planted_in_a_served_model_after_registration_stops_its_start(
    cpu_node, tiny_artifact, operator, settings, tmp_path, monkeypatch
):
    """vLLM reads the model's files itself on the node: a link out of the model roots added after registration
    (a tokenizer file pointing at a secret) refuses the start, as a start the node's parser refuses ("not
    started", until an operator's Start); removed, the next Start runs."""
    from endpoints import reconcile as reconcile_module
    from endpoints.models import Endpoint, EndpointEvent, Replica
    from endpoints.reconcile import ReplicaWorkload
    from endpoints.services import endpoint_start
    from tests.endpoints.test_npu_faults import StandInSupervisor

    settings.DATA_DIR = tmp_path / "data"
    monkeypatch.setattr(reconcile_module, "check_ready", lambda replica: (True, "ok"))
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "a tokenizer"}')
    link = Path(tiny_artifact.path) / "tokenizer_config.json"
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    endpoint = Endpoint.objects.create(name="e", artifact=tiny_artifact, node=cpu_node, served_model_name="e")
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    supervisor, workload = StandInSupervisor(), ReplicaWorkload()
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    replica, endpoint = Replica.objects.get(), Endpoint.objects.get()
    assert supervisor.started == [] and replica.state == Endpoint.State.FAILED and replica.port is None
    assert replica.state_reason.startswith("not started: the model's files on node cpu-host: ")
    assert str(link) in replica.state_reason and "leads outside the allowed model roots" in replica.state_reason
    assert endpoint.state == Endpoint.State.FAILED and endpoint.state_reason == replica.state_reason
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind="start-refused").count() == 1
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert supervisor.started == []  # not retried on its own

    link.unlink()
    endpoint_start(endpoint=endpoint, user=operator)
    workload.reconcile(node=cpu_node, supervisor=supervisor)
    assert len(supervisor.started) == 1 and Replica.objects.get().state == Endpoint.State.STARTING
