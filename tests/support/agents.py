"""Running real node agents (subprocesses) against the test database."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.support import ROOT

ENGINE_PYTHON = os.environ.get("ENGINE_PYTHON", str(ROOT / ".venv-engine" / "bin" / "python"))

# Short intervals so a test sees crashes, restarts and give-ups in seconds.
AGENT_ENV = {
    "AGENT_HEARTBEAT_SECONDS": "1",
    "AGENT_RECONCILE_SECONDS": "1",
    "ENDPOINT_HEALTH_INTERVAL_SECONDS": "1",
    "ENDPOINT_BACKOFF_BASE_SECONDS": "1",
    "ENDPOINT_BACKOFF_MAX_SECONDS": "4",
    "ENDPOINT_STOP_GRACE_SECONDS": "15",
    "ENDPOINT_PORT_RANGE": os.environ.get("ENDPOINT_PORT_RANGE", "8500-8599"),  # parallel runs pass their own
    "VLLM_CPU_KVCACHE_GIB": "1",
}


def engine_available() -> bool:
    return Path(ENGINE_PYTHON).exists()


# vLLM keeps what it learns by importing a model's class (its interfaces) in <VLLM_CACHE_ROOT>/modelinfos, checked
# against the hash of the class's module (vllm/model_executor/models/registry.py, _LazyRegisteredModel.
# inspect_model_cls); a start without it runs that inspection in a process of its own. A real node keeps its cache
# folder between starts (endpoints.launch.engine_cache_dir), but each test's agent is a new node: it is given the
# model information the test run's earlier nodes made, as a node that has served before has it. Compiled code is
# not shared: it stays in each node's own folder, as on real nodes.
_NODE_CACHES: list[Path] = []


def _modelinfos(node_cache: Path) -> Path:
    from endpoints.commands.cache import engine_cache_env

    return Path(engine_cache_env(str(node_cache))["VLLM_CACHE_ROOT"]) / "modelinfos"


def _give_model_information(env: dict, node: str) -> None:
    from endpoints.launch import engine_cache_dir
    from workers.models import Node

    root = Path(
        env.get("ENDPOINT_ENGINE_CACHE_ROOT") or Path(env.get("DATA_DIR") or os.environ["DATA_DIR"]) / "engine-cache"
    )
    folder = root / engine_cache_dir(Node(name=node)).name
    # A restarted agent keeps its node's folder: it is no source of its own copy (shutil refuses a file onto itself).
    learnt = [_modelinfos(earlier) for earlier in _NODE_CACHES if earlier != folder and _modelinfos(earlier).is_dir()]
    if learnt:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for earlier in learnt:
        shutil.copytree(earlier, _modelinfos(folder), dirs_exist_ok=True)
    if folder not in _NODE_CACHES:
        _NODE_CACHES.append(folder)


def start_agent(env: dict, node: str, *, extra: dict | None = None, log_path: Path | None = None) -> subprocess.Popen:
    full = {**env, **AGENT_ENV, "ENGINE_PYTHON": ENGINE_PYTHON, "PYTHONUNBUFFERED": "1", **(extra or {})}
    _give_model_information(full, node)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "manage.py", "agent", "--node", node],
        cwd=ROOT,
        env=full,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_agent(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(predicate, *, timeout: float, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def vllm_processes(marker: str) -> list[psutil.Process]:
    """vLLM processes (server and engine children) whose command line or parent mentions marker."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if marker in cmd:
            found.append(proc)
            try:
                found.extend(proc.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def kill_leftovers(marker: str) -> None:
    """Kill test vLLM servers and their whole process groups (engine cores rename themselves),
    and engine processes orphaned by a server a test killed before the agent reaped them."""
    orphans = []
    for proc in psutil.process_iter(["name", "ppid"]):
        if (proc.info["name"] or "").startswith("VLLM::") and proc.info["ppid"] == 1:
            orphans.append(proc)
    for proc in orphans:
        try:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in vllm_processes(marker):
        try:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def register_demo_copy(api, tmp_path, settings, name: str = "smollm2", *, float32: bool = False) -> tuple[int, Path]:
    """Copy the demo model (HF, cached; bf16, or its float32 copy) under a fresh model root, register it;
    return (artifact id, model directory)."""
    import shutil

    from tests.support.demo import demo_hf, demo_hf_float32

    root = tmp_path / "models"
    shutil.copytree(demo_hf_float32() if float32 else demo_hf(), root / f"{name}-hf")
    settings.MODEL_ROOTS = [root.resolve()]
    response = api.post("/api/v1/models", {"name": name, "path": str(root / f"{name}-hf")})
    assert response.status_code == 201, response.content
    return response.json()["artifacts"][0]["id"], root / f"{name}-hf"


def assert_replica_wants_its_key(replica) -> None:
    assert_server_wants_its_key(url=replica.url, api_key=replica.api_key, model=replica.endpoint.served_model_name)


def assert_server_wants_its_key(*, url: str, api_key: str, model: str) -> None:
    """vLLM's --api-key leaves /invocations (the same completions: vLLM issue #58144) and more open; the
    console's guard (endpoints/replica_guard) closes them in the real server, and leaves /health and /metrics
    to the agent and Prometheus, /tokenize to vLLM's benchmark client."""
    completion = {"model": model, "prompt": "The capital of France is", "max_tokens": 1}
    keyed = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=url, timeout=60) as client:
        for path, body in (
            ("/invocations", completion),
            ("/v1/completions", completion),
            ("/generative_scoring", {}),
            ("/scale_elastic_ep", {"new_data_parallel_size": 2}),
        ):
            refused = client.post(path, json=body)
            assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}, (path, refused.text)
        served = client.post("/invocations", json=completion, headers=keyed)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 1, served.text
        assert client.post("/tokenize", json={"prompt": "hi"}).json()["count"] >= 1
        assert client.get("/health").status_code == 200
        assert "vllm:num_requests_waiting" in client.get("/metrics").text
