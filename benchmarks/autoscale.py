"""From a load step to the second replica serving: eager, compiled cold, and compiled with the node's warm engine
cache, through the whole console (run by hand; prints figures).

    .venv/bin/python benchmarks/autoscale.py [--arms eager cold warm] [--clients 3] [--json]

A scratch console (SQLite and DATA_DIR in a temporary directory, Redis database 13) with its real processes:
one node agent (``manage.py agent``, telemetry every --interval seconds), the gateway and the serving
controller. Per arm, a new endpoint of the demo model (vllm-cpu, float32, max_model_len 1024, ``max_num_seqs``
1 so that concurrent requests queue in vLLM: its ``num_requests_waiting``), autoscaling min 1, max 2,
target_waiting 1, a --window seconds scale-up window, no cooldown. When its first replica is ready and the
gateway routes to it, the load steps from nothing to --clients clients sending completions through the
gateway in a loop. Timed from the step:

  decided   the controller's scale-up (its event on the endpoint);
  ready     the second replica ready (the agent's health check passed);
  serving   the second replica's first answered request (its own vLLM's request_success_total).

Arms, in this order (one node engine cache, ENDPOINT_ENGINE_CACHE_ROOT, for all):
  eager  --enforce-eager: nothing to compile;
  cold   compiled; the node's engine cache is emptied once the first replica is ready, so the second
         compiles from scratch (what every start paid before the cache);
  warm   compiled; the second replica finds what the cold arm's second replica compiled (a scale-up of the
         same artifact with the same settings).

Every request of every arm must answer 200 (goal: no failed request during a scale event). On this 2-core
machine the running replica, the starting one, the agent and the clients share the cores, so the second
replica's start is slower than a start alone (benchmarks/warm_restart.py). Needs `make engine` and the demo
model cache (tests/support/demo.py); a running Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORK = Path(tempfile.mkdtemp(prefix="autoscale-bench-"))
os.environ.update(
    {
        "DATA_DIR": str(WORK / "data"),
        "DATABASE_URL": f"sqlite:///{WORK / 'console.sqlite3'}",
        "REDIS_URL": os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13"),
        "DJANGO_SETTINGS_MODULE": "console.settings",
        "MODEL_ROOTS": str(WORK / "models"),
        "ENDPOINT_PORT_RANGE": "8860-8879",
    }
)

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402

from endpoints.endpoint_spec import EndpointSpec  # noqa: E402
from endpoints.gateway import services as gateway_services  # noqa: E402
from endpoints.models import Endpoint, EndpointEvent, Replica  # noqa: E402
from endpoints.services import endpoint_create, endpoint_stop  # noqa: E402
from models_registry.services import model_register  # noqa: E402
from tests.support.agents import ENGINE_PYTHON, kill_leftovers, start_agent, stop_agent, wait_for  # noqa: E402
from tests.support.gateway import CompletionLoad, GatewayProc, served_requests  # noqa: E402
from workers.models import Node  # noqa: E402

MODEL = "bench-autoscale"
NODE = "bench-autoscale-node"


def ready_count(endpoint_id: int) -> int:
    return Replica.objects.filter(endpoint_id=endpoint_id, state="ready").count()


def empty(directory: Path):
    for child in directory.iterdir() if directory.exists() else ():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def run_arm(arm: str, *, artifact: int, user, gateway: GatewayProc, key: str, args) -> dict:
    eager = arm == "eager"
    endpoint = endpoint_create(
        spec=EndpointSpec(
            name=f"bench-{arm}",
            artifact=artifact,
            node=NODE,
            served_model_name=MODEL,
            enforce_eager=eager,
            dtype="float32",
            max_model_len=1024,
            max_num_seqs=1,
            autoscale={
                "min_replicas": 1,
                "max_replicas": 2,
                "target_waiting": 1,
                "scale_up_window_s": args.window,
                "scale_down_window_s": 3600,
                "cooldown_s": 0,
            },
        ),
        user=user,
    )
    t0 = time.monotonic()
    try:
        wait_for(
            lambda: ready_count(endpoint.pk) == 1,
            timeout=args.start_timeout,
            interval=0.5,
            what=f"{arm}: the first replica ready",
        )
        first_s = time.monotonic() - t0
        gateway.wait_routes(MODEL, 1, timeout=30)
        if arm == "cold":
            empty(Path(os.environ["DATA_DIR"]) / "engine-cache")
        time.sleep(2 * args.interval)  # an idle sample or two before the step

        load = CompletionLoad(gateway.url, key, model=MODEL, threads=args.clients, max_tokens=args.max_tokens)
        step = time.monotonic()
        try:
            wait_for(
                lambda: Endpoint.objects.get(pk=endpoint.pk).replicas == 2,
                timeout=args.start_timeout,
                interval=0.2,
                what=f"{arm}: the scale-up decision",
            )
            decided_s = time.monotonic() - step
            wait_for(
                lambda: ready_count(endpoint.pk) == 2,
                timeout=args.start_timeout,
                interval=0.2,
                what=f"{arm}: the second replica ready",
            )
            ready_s = time.monotonic() - step
            second = Replica.objects.get(endpoint_id=endpoint.pk, index=1)
            wait_for(
                lambda: served_requests(second.port) >= 1,
                timeout=120,
                interval=0.2,
                what=f"{arm}: the second replica's first answer",
            )
            serving_s = time.monotonic() - step
            time.sleep(args.after)  # both replicas serving a while: failures after the switch count too
        finally:
            statuses = load.stop()
        event = EndpointEvent.objects.filter(endpoint_id=endpoint.pk, kind="autoscale").order_by("pk").first()
        return {
            "first_replica_s": first_s,
            "decided_s": decided_s,
            "ready_s": ready_s,
            "serving_s": serving_s,
            "requests": len(statuses),
            "failed": sum(1 for s in statuses if s != 200),
            "decision": event.message if event else "",
        }
    finally:
        endpoint_stop(endpoint=Endpoint.objects.get(pk=endpoint.pk), user=user)
        wait_for(
            lambda: not Replica.objects.filter(endpoint_id=endpoint.pk, pid__isnull=False).exists(),
            timeout=120,
            interval=0.5,
            what=f"{arm}: the replicas stopped",
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["eager", "cold", "warm"], choices=["eager", "cold", "warm"])
    parser.add_argument("--clients", type=int, default=3, help="clients of the load step")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--interval", type=float, default=4, help="the agent's telemetry interval, seconds")
    parser.add_argument("--window", type=int, default=20, help="the scale-up window, seconds")
    parser.add_argument("--after", type=float, default=10, help="seconds of load after the second replica serves")
    parser.add_argument("--start-timeout", type=float, default=1200)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, database)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not Path(ENGINE_PYTHON).exists():
        parser.error("no .venv-engine: run `make engine`")

    from tests.support.demo import demo_hf_float32

    call_command("migrate", verbosity=0)
    models = WORK / "models"
    shutil.copytree(demo_hf_float32(), models / "smollm2-f32")
    env = {**os.environ, "TELEMETRY_INTERVAL_SECONDS": str(args.interval)}
    user = get_user_model().objects.create_superuser("bench", password=None)
    artifact = model_register(name="smollm2", path=str(models / "smollm2-f32"), user=user).artifacts.get().pk
    _, key = gateway_services.key_create(name="bench", models=[MODEL], actor=user)

    agent = start_agent(env, NODE, log_path=WORK / "agent.log")
    controller_log = open(WORK / "controller.log", "ab")
    controller = subprocess.Popen(
        [sys.executable, "manage.py", "serving_controller", "--interval", "1"],
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=controller_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    gateway = GatewayProc(
        env,
        {
            "GATEWAY_KEY_CACHE_SECONDS": "30",
            "GATEWAY_ROUTES_REFRESH_SECONDS": "1",
            "GATEWAY_TELEMETRY_SECONDS": str(args.interval),
        },
    )
    results, ok = {}, False
    try:
        wait_for(
            lambda: Node.objects.filter(name=NODE, last_heartbeat__isnull=False).exists(),
            timeout=120,
            what="the node's registration",
        )
        for arm in args.arms:
            results[arm] = run_arm(arm, artifact=artifact, user=user, gateway=gateway, key=key, args=args)
            print(
                f"{arm}: {json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in results[arm].items()})}",  # noqa: E501
                file=sys.stderr,
            )
        ok = True
    finally:
        gateway.stop()
        os.killpg(controller.pid, signal.SIGTERM)
        controller.wait(timeout=30)
        stop_agent(agent)
        kill_leftovers(MODEL)
        if ok and not args.keep:
            shutil.rmtree(WORK, ignore_errors=True)
        else:
            print(f"logs and database kept in {WORK}", file=sys.stderr)

    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"demo model, vllm-cpu float32, max_num_seqs 1; load step: {args.clients} clients through the gateway, "
        f"{args.max_tokens} tokens each; telemetry every {args.interval:g} s, scale-up window {args.window} s"
    )
    print(
        f"{'arm':<8}{'1st replica s':>14}{'decided s':>11}{'2nd ready s':>13}{'2nd serving s':>15}"
        f"{'requests':>10}{'failed':>8}"
    )
    for arm, r in results.items():
        print(
            f"{arm:<8}{r['first_replica_s']:>14.1f}{r['decided_s']:>11.1f}{r['ready_s']:>13.1f}"
            f"{r['serving_s']:>15.1f}{r['requests']:>10}{r['failed']:>8}"
        )
    if "eager" in results and "warm" in results:
        print(
            "step -> second replica ready, warm compiled / eager: "
            f"{results['warm']['ready_s'] / results['eager']['ready_s']:.2f}"
            + (
                f"; cold compiled / eager: {results['cold']['ready_s'] / results['eager']['ready_s']:.2f}"
                if "cold" in results
                else ""
            )
        )


if __name__ == "__main__":
    main()
