"""The shipped recipes against their specification, vllm-ascend v0.23.0's own tutorials (vendored verbatim in
tests/fixtures/vllm_ascend_tutorials/, SOURCES.md there): each tutorial's `vllm serve` command and its exports are
parsed, the recipe is previewed on nodes like the tutorial's hardware (POST /api/v1/endpoints/preview, which runs the
launch's own service and builders), and the two must agree flag for flag, value for value, variable for variable.

The console owns a few things the tutorials write by hand, each listed below with its reason: where the server
listens (--host, --port, the data-parallel RPC port it claims), the model path (the artifact's), the replica key
guard (--middleware), and the batch and memory settings it always states (--max-num-seqs, --max-model-len,
--gpu-memory-utilization: its capacity estimate's defaults where the tutorial leaves vLLM's own). Two tutorials
misspell an additional-config key that vllm-ascend never reads (CORRECTIONS): the recipes spell it as
vllm_ascend/ascend_config.py reads it."""

import copy
import json
import shlex
from pathlib import Path

import pytest
from django.utils import timezone

from endpoints.commands.cache import ENGINE_CACHE_ENV
from endpoints.models import Endpoint, Recipe
from endpoints.recipes import recipe_get, shipped_recipes
from models_registry.models import Artifact, Model
from workers.models import Device, Node

TUTORIALS = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_ascend_tutorials"
MARK = "# ---- verbatim"
NIC, HEAD_IP, WORKER_IP = "enp189s0f0", "10.20.0.11", "10.20.0.12"
INTERFACES = {"HCCL_SOCKET_IFNAME": NIC, "GLOO_SOCKET_IFNAME": NIC, "TP_SOCKET_IFNAME": NIC}

#: Flags the console sets from its own state, compared by presence (or not at all where the tutorial omits them).
CONSOLE_OWNED = {
    "--host": "the console binds replicas to ENDPOINT_BIND_HOST (the gateway is the way in)",
    "--port": "the agent claims a free port per replica",
    "--model": "the artifact's path (the tutorial's is a placeholder)",
    "--data-parallel-rpc-port": "the agent claims the group's RPC port on the head node",
}
#: Flags the console adds to every command.
CONSOLE_ADDS = {
    "--middleware": "the replica key guard (endpoints.commands.guard)",
    "--max-num-seqs": "the console always states the batch (its capacity estimate's recommendation by default)",
    "--max-model-len": "the console always states the context (min(8192, the model's) by default)",
    "--gpu-memory-utilization": "the console always states it (GPU_MEMORY_UTILIZATION by default)",
}
#: Values the console leaves to vLLM's default, which the tutorial writes out.
VLLM_DEFAULTS = {"--data-parallel-size": "1"}
#: Variables the console sets: the device list (compared with the launch's devices), its platform defaults, the
#: engine cache under the node's folder, and the node's recorded interfaces.
CONSOLE_ENV = {
    "ASCEND_RT_VISIBLE_DEVICES",
    "PYTORCH_NPU_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "HCCL_BUFFSIZE",
    *ENGINE_CACHE_ENV,
    "HCCL_IF_IP",
    *INTERFACES,
}
#: (tutorial, flag, key path as the tutorial writes it, as vllm_ascend/ascend_config.py at v0.23.0 reads it).
CORRECTIONS = [
    (
        "qwen3-30b-a3b-300i-duo.sh",
        "--additional-config",
        "ascend_compilation_config.enable_npu_graph_ex",
        "ascend_compilation_config.enable_npugraph_ex",
    ),  # ascend_config.py:609
    (
        "suffix-speculative.sh",
        "--additional-config",
        "weight_prefetch_config.enable",
        "weight_prefetch_config.enabled",
    ),  # ascend_config.py:719
]
#: (tutorial, flag, key path, type): values the tutorial writes as text where vLLM's class declares another type
#: (KVTransferConfig.kv_port: int, which vLLM coerces from "30000"; the console takes the type itself).
TYPE_CORRECTIONS = [
    ("pd-mooncake-single-node-prefill.sh", "--kv-transfer-config", "kv_port", int),
    ("pd-mooncake-single-node-decode.sh", "--kv-transfer-config", "kv_port", int),
]
JSON_FLAGS = {
    "--speculative-config",
    "--compilation-config",
    "--additional-config",
    "--hf-overrides",
    "--kv-transfer-config",
}


def parse_tutorial(name: str, *, local_ip: str, node0_ip: str = HEAD_IP) -> tuple[dict, dict, str]:
    """(exported variables, {flag: value or None}, the model argument) of a vendored tutorial script, its shell
    variables replaced by the test nodes' values."""
    text = (TUTORIALS / name).read_text().split(MARK, 1)[1].split("\n", 1)[1]
    text = text.replace("\\\n", " ")
    values = {"$nic_name": NIC, "$local_ip": local_ip, "$node0_ip": node0_ip}
    env, flags, model = {}, {}, ""
    pending = ""
    for line in text.splitlines():
        pending += line
        try:
            tokens = [values.get(t, t) for t in shlex.split(pending, comments=True)]
        except ValueError:  # a quoted JSON value that spans lines (the PD tutorial's --kv-transfer-config)
            pending += "\n"
            continue
        pending = ""
        if tokens[:1] == ["export"]:
            key, _, value = tokens[1].partition("=")
            env[key] = values.get(value, value)
        elif tokens[:2] == ["vllm", "serve"]:
            model, rest = tokens[2], tokens[3:]
            i = 0
            while i < len(rest):
                name_, _, inline = rest[i].partition("=")
                flag = "--" + name_[2:].replace("_", "-")
                if inline:
                    flags[flag] = inline
                elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                    flags[flag] = rest[i + 1]
                    i += 1
                else:
                    flags[flag] = None
                i += 1
    assert model and flags, f"{name}: no vllm serve command"
    return env, flags, model


def argv_flags(argv: list[str]) -> dict:
    """{flag: value or None} of a console argv (after the module)."""
    start = argv.index("--model")
    flags, i = {}, start
    while i < len(argv):
        if argv[i].startswith("--"):
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            flags[argv[i]] = value
            i += 2 if value is not None else 1
        else:
            i += 1
    return flags


def _rename(config: dict, old: str, new: str) -> dict:
    config = copy.deepcopy(config)
    *parents, leaf = old.split(".")
    where = config
    for key in parents:
        where = where[key]
    where[new.split(".")[-1]] = where.pop(leaf)
    return config


def assert_same_command(fixture: str, entry: dict, *, local_ip: str, artifact: Artifact, draft: Artifact | None):
    env, tutorial, _ = parse_tutorial(fixture, local_ip=local_ip)
    console = argv_flags(entry["argv"])
    for flag, value in VLLM_DEFAULTS.items():
        if tutorial.get(flag) == value and flag not in console:
            del tutorial[flag]
    assert console["--model"] == artifact.path
    for flag, value in tutorial.items():
        assert flag in console, f"{fixture}: {flag} {value} is missing from the console's command"
        if flag in CONSOLE_OWNED:
            continue
        if flag in JSON_FLAGS:
            expected, got = json.loads(value), json.loads(console[flag])
            for file, fixed_flag, old, new in CORRECTIONS:
                if file == fixture and fixed_flag == flag:
                    expected = _rename(expected, old, new)
            for file, fixed_flag, key, kind in TYPE_CORRECTIONS:
                if file == fixture and fixed_flag == flag:
                    expected[key] = kind(expected[key])
            if flag == "--speculative-config" and "model" in expected:
                assert got.pop("model") == draft.path  # the draft comes from the registry, never a typed path
                expected.pop("model")
            assert got == expected, f"{fixture}: {flag}"
        else:
            assert console[flag] == value, f"{fixture}: {flag} is {console[flag]!r}, the tutorial's {value!r}"
    extra = set(console) - set(tutorial) - set(CONSOLE_OWNED)
    assert extra <= set(CONSOLE_ADDS), f"{fixture}: the console adds {sorted(extra - set(CONSOLE_ADDS))}"
    shown = entry["env"]
    for key, value in env.items():
        assert shown.get(key) == value, f"{fixture}: {key} is {shown.get(key)!r}, the tutorial's {value!r}"
    assert set(shown) - set(env) <= CONSOLE_ENV, (
        f"{fixture}: the console adds {sorted(set(shown) - set(env) - CONSOLE_ENV)}"
    )


def _node(name: str, address: str, *, devices: int, chip: str, gib: int, interfaces: dict | None = None) -> Node:
    node = Node.objects.create(
        name=name,
        hostname=name,
        address=address,
        platform="ascend",
        engine_python="/opt/engine/bin/python",
        last_heartbeat=timezone.now(),
        settings={"interfaces": interfaces or {"HCCL_IF_IP": address, **INTERFACES}},
    )
    for index in range(devices):
        Device.objects.create(
            node=node, index=index, kind="npu", name=chip, memory_total_bytes=gib * 1024**3, health="OK"
        )
    return node


@pytest.fixture
def checkpoints(tiny_artifact):
    """A ModelSlim artifact (the W8A8 recipes), the tiny HF one (BF16) and a draft (EAGLE-3 head) over its files,
    recorded with the long context of the tutorials' models (their config.json: 131072 and more with YaRN)."""
    tiny_artifact.inspection = {**tiny_artifact.inspection, "max_position_embeddings": 262144}
    tiny_artifact.save()
    modelslim = Artifact.objects.create(
        model=tiny_artifact.model,
        format="ascend-modelslim",
        dtype="W8A8",
        path=tiny_artifact.path,
        inspection=tiny_artifact.inspection,
    )
    draft_model = Model.objects.create(name="tiny-eagle3")
    draft = Artifact.objects.create(
        model=draft_model, format="hf", dtype="bfloat16", path=tiny_artifact.path, inspection=tiny_artifact.inspection
    )
    return {"w8a8": modelslim, "bf16": tiny_artifact, "draft": draft}


SINGLE_NODE = [
    ("deepseek-r1-w8a8-a3", "deepseek-r1-w8a8-single-node.sh", "910_9392", "deepseek_r1"),
    ("deepseek-v3-1-w8a8-a3", "deepseek-v3.1-w8a8-single-node.sh", "910_9392", "deepseek_v3"),
    ("qwen3-235b-a22b-w8a8", "qwen3-235b-a22b.sh", "910B1", "qwen3"),
    ("qwen3-30b-a3b-w8a8-eagle3", "qwen3-30b-a3b-a2-eagle3.sh", "910B1", "qwen3"),
    ("qwen3-30b-a3b-w8a8-300i-duo", "qwen3-30b-a3b-300i-duo.sh", "310P3", "qwen3"),
    ("qwen3-32b-w8a8", "qwen3-32b-w8a8.sh", "910B1", "qwen3"),
    ("qwen3-32b-suffix-decoding", "suffix-speculative.sh", "910B1", "qwen3"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("recipe_name", "fixture", "chip", "served"), SINGLE_NODE)
def test_recipe_preview_is_its_tutorials_command(recipe_name, fixture, chip, served, operator, api_for, checkpoints):
    recipe = shipped_recipes()[recipe_name]
    assert recipe.source["fixture"].endswith(fixture) and recipe.source["tag"] == "v0.23.0"
    env, _, _ = parse_tutorial(fixture, local_ip=HEAD_IP)
    devices = (
        [int(d) for d in env["ASCEND_RT_VISIBLE_DEVICES"].split(",")]
        if "ASCEND_RT_VISIBLE_DEVICES" in env
        else list(range(recipe.devices_per_node))
    )
    node = _node("npu-a", HEAD_IP, devices=recipe.devices_per_node, chip=chip, gib=int(recipe.device_memory_gib))
    artifact = checkpoints["bf16" if recipe.model["quantization"] == "bf16" else "w8a8"]
    body = {
        "name": "from-recipe",
        "recipe": recipe_name,
        "artifact": artifact.pk,
        "node": node.name,
        "devices": devices,
        "served_model_name": served,
    }
    if "eagle3" in recipe_name:
        body["speculative"] = {**recipe.spec["speculative"], "draft_artifact": checkpoints["draft"].pk}
    response = api_for(operator).post("/api/v1/endpoints/preview", body)
    assert response.status_code == 200, response.json()
    preview = response.json()
    assert preview["recipe"] == f"{recipe_name}@1" and len(preview["nodes"]) == 1
    entry = preview["nodes"][0]
    assert all(c["level"] != "error" for c in entry["checks"]), entry["checks"]
    assert entry["env"]["ASCEND_RT_VISIBLE_DEVICES"] == ",".join(map(str, devices))
    assert_same_command(fixture, entry, local_ip=HEAD_IP, artifact=artifact, draft=checkpoints["draft"])
    assert not Endpoint.objects.exists()  # a preview launches nothing


@pytest.mark.django_db
def test_two_node_recipe_preview_is_both_nodes_tutorial_commands(operator, api_for, checkpoints):
    recipe = shipped_recipes()["deepseek-r1-w8a8-a2-two-nodes"]
    head = _node("a2-head", HEAD_IP, devices=8, chip="910B1", gib=64)
    worker = _node("a2-worker", WORKER_IP, devices=8, chip="910B1", gib=64)
    body = {
        "name": "r1",
        "recipe": recipe.name,
        "artifact": checkpoints["w8a8"].pk,
        "node": head.name,
        "worker_nodes": [worker.name],
        "devices": list(range(8)),
        "served_model_name": "deepseek_r1",
    }
    preview = api_for(operator).post("/api/v1/endpoints/preview", body).json()
    server, headless = preview["nodes"]
    assert server["argv"] and headless["argv"], (server["checks"], headless["checks"])
    assert (server["node"], headless["node"], headless["role"]) == (head.name, worker.name, "dp-headless")
    assert_same_command(
        "deepseek-r1-w8a8-two-nodes-node0.sh", server, local_ip=HEAD_IP, artifact=checkpoints["w8a8"], draft=None
    )
    # The headless node serves no HTTP: the tutorial's --host/--port there are inert (vllm serve --headless).
    assert "--host" not in headless["argv"] and "--port" not in headless["argv"]
    env, flags, _ = parse_tutorial("deepseek-r1-w8a8-two-nodes-node1.sh", local_ip=WORKER_IP)
    flags.pop("--host"), flags.pop("--port")
    console = argv_flags(headless["argv"])
    assert console["--data-parallel-address"] == HEAD_IP and console["--data-parallel-start-rank"] == "2"
    for flag, value in flags.items():
        if flag not in CONSOLE_OWNED and flag not in JSON_FLAGS:
            assert console.get(flag, "absent") == value, flag
    assert {k: headless["env"].get(k) for k in env} == env


@pytest.mark.django_db
def test_recipes_api_lists_each_with_its_source_hardware_and_fit(as_viewer, viewer, api_for):
    recipes = {r["name"]: r for r in api_for(viewer).get("/api/v1/recipes").json()}
    assert set(shipped_recipes()) <= set(recipes)
    r1 = recipes["deepseek-r1-w8a8-a3"]
    assert r1["source"]["file"] == "docs/source/tutorials/models/DeepSeek-R1.md" and r1["source"]["tag"] == "v0.23.0"
    assert r1["hardware"].startswith("Atlas 800 A3") and r1["nodes"] == 1
    assert r1["spec"]["speculative"] == {"num_speculative_tokens": 3, "method": "mtp"}
    assert r1["capacity"]["fits"] and r1["capacity"]["kv_room_gib_per_device"] > 0
    assert recipes["cpu-demo"]["capacity"] is None


@pytest.mark.django_db
def test_a_field_beside_the_recipe_overrides_it_whole(operator, api_for, checkpoints):
    node = _node("npu-b", HEAD_IP, devices=4, chip="910B1", gib=64)
    body = {
        "name": "x",
        "recipe": "qwen3-32b-w8a8",
        "artifact": checkpoints["w8a8"].pk,
        "node": node.name,
        "devices": [0, 1, 2, 3],
        "max_model_len": 4096,
        "env": {"TASK_QUEUE_ENABLE": "2"},
        "compilation": {"cudagraph_mode": "PIECEWISE"},
    }
    entry = api_for(operator).post("/api/v1/endpoints/preview", body).json()["nodes"][0]
    flags = argv_flags(entry["argv"])
    assert flags["--max-model-len"] == "4096" and json.loads(flags["--compilation-config"]) == {
        "cudagraph_mode": "PIECEWISE"
    }
    assert entry["env"]["TASK_QUEUE_ENABLE"] == "2" and "HCCL_OP_EXPANSION_MODE" not in entry["env"]
    assert json.loads(flags["--additional-config"]) == {"enable_flashcomm1": True}  # not given: the recipe's


@pytest.mark.django_db
def test_launch_with_a_recipe_records_it_and_an_unknown_recipe_is_refused(operator, api_for, checkpoints):
    node = _node("npu-c", HEAD_IP, devices=4, chip="910B1", gib=64)
    base = {"name": "q32", "artifact": checkpoints["w8a8"].pk, "node": node.name, "devices": [0, 1, 2, 3]}
    bad = api_for(operator).post("/api/v1/endpoints", {**base, "recipe": "no-such-recipe"})
    assert bad.status_code == 400 and "recipe" in bad.json()["errors"] and "No recipe" in bad.json()["detail"]
    made = api_for(operator).post("/api/v1/endpoints", {**base, "recipe": "qwen3-32b-w8a8"})
    assert made.status_code == 201, made.json()
    endpoint = Endpoint.objects.get(name="q32")
    assert endpoint.recipe == "qwen3-32b-w8a8@1" and made.json()["recipe"] == "qwen3-32b-w8a8@1"
    assert endpoint.engine_configs["ascend"] == {"enable_flashcomm1": True}
    assert endpoint.async_scheduling is True and endpoint.distributed_executor_backend == "mp"


@pytest.mark.django_db
def test_save_an_endpoint_as_a_recipe_in_versions(operator, api_for, checkpoints):
    node = _node("npu-d", HEAD_IP, devices=4, chip="910B1", gib=64)
    api = api_for(operator)
    made = api.post(
        "/api/v1/endpoints",
        {
            "name": "mine",
            "recipe": "qwen3-32b-w8a8",
            "artifact": checkpoints["w8a8"].pk,
            "node": node.name,
            "devices": [0, 1, 2, 3],
            "max_model_len": 4096,
        },
    )
    endpoint_id = made.json()["id"]
    first = api.post("/api/v1/recipes", {"endpoint": endpoint_id, "name": "team-qwen", "title": "ours"})
    second = api.post("/api/v1/recipes", {"endpoint": endpoint_id, "name": "team-qwen"})
    assert (first.status_code, second.status_code) == (201, 201)
    assert (first.json()["version"], second.json()["version"]) == (1, 2) and not first.json()["shipped"]
    saved = recipe_get("team-qwen")
    assert saved.version == 2 and saved.spec["max_model_len"] == 4096 and "artifact" not in saved.spec
    assert saved.spec["ascend"] == {"enable_flashcomm1": True} and recipe_get("team-qwen@1").version == 1
    shipped = api.post("/api/v1/recipes", {"endpoint": endpoint_id, "name": "qwen3-32b-w8a8"})
    assert shipped.status_code == 400 and "shipped recipe" in shipped.json()["detail"]
    assert Recipe.objects.count() == 2
    # and it launches again
    again = api.post(
        "/api/v1/endpoints/preview",
        {
            "name": "again",
            "recipe": "team-qwen",
            "artifact": checkpoints["w8a8"].pk,
            "node": node.name,
            "devices": [0, 1, 2, 3],
            "share_devices": True,
        },
    )
    assert again.status_code == 200, again.json()


@pytest.mark.django_db
def test_recipe_files_are_launch_specs_citing_a_vendored_tutorial():
    for recipe in shipped_recipes().values():
        if recipe.platform == "cpu":
            continue
        fixture = Path(__file__).resolve().parents[2] / recipe.source["fixture"]
        assert fixture.is_file(), recipe.name
        header = fixture.read_text().split(MARK)[0]
        assert recipe.source["file"] in header and "v0.23.0" in header


@pytest.mark.django_db
def test_pd_recipe_is_the_mooncake_tutorials_two_instances_as_one_endpoint_with_roles(operator, api_for, checkpoints):
    """vllm-ascend's 1P1D Mooncake tutorial on one A2 node is one endpoint with roles: the preview's prefill replica
    is the tutorial's Prefiller and its decode replica the Decoder, flag for flag and variable for variable (kv_role,
    kv_port 30000 / 30100 and the extra config's sizes set by the console; its fixed 192.0.0.1 and eth0 are the
    node's interfaces), and the preview lists each role's node and devices."""
    tutorial_ip = "192.0.0.1"
    node = _node(
        "a2-pd",
        tutorial_ip,
        devices=8,
        chip="910B1",
        gib=64,
        interfaces={
            "HCCL_IF_IP": tutorial_ip,
            "GLOO_SOCKET_IFNAME": "eth0",
            "TP_SOCKET_IFNAME": "eth0",
            "HCCL_SOCKET_IFNAME": "eth0",
        },
    )
    recipe = shipped_recipes()["qwen2-5-vl-pd-mooncake"]
    assert [f.rsplit("/", 1)[1] for f in recipe.source["fixtures"]] == [
        "pd-mooncake-single-node-prefill.sh",
        "pd-mooncake-single-node-decode.sh",
    ]
    body = {
        "name": "pd",
        "recipe": "qwen2-5-vl-pd-mooncake",
        "artifact": checkpoints["bf16"].pk,
        "served_model_name": "qwen25vl",
    }
    preview = api_for(operator).post("/api/v1/endpoints/preview", body)
    assert preview.status_code == 200, preview.json()
    prefill, decode = preview.json()["nodes"]
    for role, entry in (("prefill", prefill), ("decode", decode)):
        assert entry["role"] == role
        assert all(c["level"] != "error" for c in entry["checks"]), entry["checks"]
        assert_same_command(
            f"pd-mooncake-single-node-{role}.sh", entry, local_ip=tutorial_ip, artifact=checkpoints["bf16"], draft=None
        )
    assert preview.json()["roles"] == {
        "prefill": {
            "replicas": 1,
            "connector": "MooncakeConnectorV1",
            "nodes": [{"node": node.name, "replicas": [0], "devices": [[0]]}],
        },
        "decode": {
            "replicas": 1,
            "connector": "MooncakeConnectorV1",
            "nodes": [{"node": node.name, "replicas": [1], "devices": [[1]]}],
        },
    }
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(n for n, r in shipped_recipes().items() if r.model))
def test_each_recipe_fits_the_hardware_its_tutorial_states(name):
    """The MoE/MLA-aware estimate (models_registry/capacity_moe.py) of each shipped recipe on the hardware it states
    (its tutorial's: devices per node, their memory, nodes) fits, with KV room for one full sequence per DP rank."""
    capacity = shipped_recipes()[name].capacity()
    assert capacity["fits"], capacity["summary"]
    assert capacity["kv_room_gib_per_device"] > 0 and capacity["needed_devices"] <= capacity["available_devices"]


@pytest.mark.django_db
def test_deepseek_r1_needs_two_a2_nodes_and_fits_one_a3():
    """DeepSeek-R1.md at v0.23.0 (3.1): "1 Atlas 800 A3 (64G x 16) or 2 Atlas 800 A2 (64G x 8)": the single-node
    recipe does not fit one A2 node, the two-node one fits two."""
    from dataclasses import replace

    a3 = shipped_recipes()["deepseek-r1-w8a8-a3"]
    assert a3.capacity()["fits"]
    assert not replace(a3, devices_per_node=8).capacity()["fits"]  # one A2: 8 NPUs
    assert shipped_recipes()["deepseek-r1-w8a8-a2-two-nodes"].capacity()["fits"]
