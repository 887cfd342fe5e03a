"""The gateway under test: a real `manage.py gateway` subprocess on the test database (GatewayProc), in
front of FakeReplica, a small in-test HTTP server that speaks the OpenAI protocol."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from endpoints.models import Endpoint, Replica
from models_registry.models import Artifact, Model
from tests.support import ROOT
from tests.support.http import QuietHandler, ServerThread  # noqa: F401 (ServerThread: for the tests)
from workers.models import Node

HEALTH_TOKEN = "gateway-monitoring-token"


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def free_port() -> int:
    """A port nothing listens on now, below the kernel's ephemeral range. A port from bind(0) is ephemeral: any
    outgoing connection of the streams running beside this one may take it before the server under test binds it
    (a CI run lost a test to exactly that); below the range only another free_port() can, and at random that is
    rare. Above the replica port ranges of the streams (6400-9899: the Makefile, tests/settings.py)."""
    below = max(_ephemeral_low(), 20000)
    rng = random.Random()  # system-seeded: the streams must not draw the same sequence
    while True:
        port = rng.randrange(10000, below)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class FakeReplica(ServerThread):
    """Answers /v1/chat/completions and /v1/completions (plain and SSE) like vLLM, and counts."""

    def __init__(self, name: str, delay: float = 0.0):
        self.name, self.delay, self.served = name, delay, 0
        # Set by a test once its client has read the first streamed event: the rest is sent only then (or after 10 s),
        # so a proxy that buffers a stream shows as the wait timing out, whatever the machine's load.
        self.first_event_read: threading.Event | None = None
        self.stream_waited: list[bool] = []  # per stream held back: whether the client read its first event in time
        self.models: list = []  # the "model" of each request, as the gateway forwarded it
        self.posts: list = []  # (path, body) of each POST
        self.lock = threading.Lock()
        outer = self

        class Handler(QuietHandler):
            def do_GET(self):
                self._send(200, {"status": "ok"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with outer.lock:
                    outer.served += 1
                    outer.models.append(body.get("model"))
                    outer.posts.append((self.path, body))
                if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                    return self._send(200, {"status": "ok"})  # as vLLM answers (a text; JSON is fine here)
                if outer.delay:
                    time.sleep(outer.delay)
                text = f"hello from {outer.name}"
                chat = self.path == "/v1/chat/completions"
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for i, word in enumerate(text.split()):
                        delta = {"delta": {"content": word + " "}} if chat else {"text": word + " "}
                        self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, **delta}]})}\n\n".encode())
                        self.wfile.flush()
                        if i == 0 and outer.first_event_read is not None:
                            outer.stream_waited.append(outer.first_event_read.wait(timeout=10))
                        else:
                            time.sleep(0.05)
                    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
                    self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                    self.close_connection = True
                    return
                choice = (
                    {"index": 0, "message": {"role": "assistant", "content": text}}
                    if chat
                    else {"index": 0, "text": text}
                )
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion" if chat else "text_completion",
                        "model": body.get("model"),
                        "choices": [choice],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
                    },
                )

            def _send(self, status, data):
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.serve(Handler)


def make_endpoint(name, replicas, *, model="tiny", node=None):
    """An endpoint row whose ready replicas are the given fake servers (no agent involved)."""
    node = node or Node.objects.get_or_create(name="gw-node", defaults={"address": "127.0.0.1"})[0]
    m, _ = Model.objects.get_or_create(name="m")
    artifact = Artifact.objects.get_or_create(model=m, format="hf", path="/models/x")[0]
    ep = Endpoint.objects.create(
        name=name,
        artifact=artifact,
        node=node,
        served_model_name=model,
        replicas=max(1, len(replicas)),
        state=Endpoint.State.READY if replicas else Endpoint.State.STARTING,
    )
    for i, fake in enumerate(replicas):
        Replica.objects.create(
            endpoint=ep, index=i, node=node, state=Endpoint.State.READY, port=fake.port, port_host=f"fake-{fake.port}"
        )
    return ep


class GatewayProc:
    def __init__(self, env, extra=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full = {
            **env,
            "GATEWAY_KEY_CACHE_SECONDS": "1",
            "GATEWAY_ROUTES_REFRESH_SECONDS": "0.3",
            "GATEWAY_TELEMETRY_SECONDS": "1",
            "PYTHONUNBUFFERED": "1",
            "METRICS_TOKEN": HEALTH_TOKEN,
            **(extra or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "gateway", "--port", str(self.port)],
            cwd=ROOT,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.stdout.read().decode())
            time.sleep(0.2)
        else:
            raise AssertionError("the gateway did not start")
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def post(self, path, key, data):
        return self.client.post(path, json=data, headers={"Authorization": f"Bearer {key}"} if key else {})

    def wait_routes(self, model, n, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_replicas(model) >= n:
                return
            time.sleep(0.1)
        raise AssertionError(f"{model}: not {n} ready replicas in the gateway")

    def ready_replicas(self, model) -> int:
        """How many replicas the gateway routes `model` to now."""
        # Replica counts are for the monitoring token only (an anonymous /healthz is a status).
        health = self.client.get("/healthz", headers={"Authorization": f"Bearer {HEALTH_TOKEN}"})
        return health.json().get("replicas", {}).get(model, 0)

    def stop(self):
        self.client.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        print("gateway output:\n" + self.proc.stdout.read().decode(errors="replace")[-5000:])


class CompletionLoad:
    """`threads` clients sending completions for `model` to `url` (a gateway) in a loop until stopped,
    `think` seconds apart; every status kept, 0 for a request that got no answer (a transport error)."""

    def __init__(self, url: str, key: str, *, model: str, threads: int, max_tokens: int):
        self.statuses: list[int] = []
        self.think = 0.0
        self.stopping = [threading.Event() for _ in range(threads)]
        body = {"model": model, "prompt": "Count: one two three", "max_tokens": max_tokens, "ignore_eos": True}

        def run(stop):
            with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {key}"}) as client:
                while not stop.is_set():
                    try:
                        self.statuses.append(client.post("/v1/completions", json=body).status_code)
                    except httpx.HTTPError:
                        self.statuses.append(0)
                    time.sleep(self.think)

        self.threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in self.stopping]
        for thread in self.threads:
            thread.start()

    def keep(self, n: int):
        """Stop all but n clients (each finishes its request in flight)."""
        for stop, thread in list(zip(self.stopping, self.threads, strict=False))[n:]:
            stop.set()
            thread.join(timeout=600)

    def stop(self) -> list[int]:
        self.keep(0)
        return self.statuses


def served_requests(port: int) -> float:
    """Requests a real vLLM replica finished (vllm:request_success_total on its own /metrics)."""
    return _metric_sum(port, "vllm:request_success_total")


def requests_in_engine(port: int) -> float:
    """Requests a real vLLM replica is running or has waiting (vllm:num_requests_running and _waiting)."""
    return _metric_sum(port, "vllm:num_requests_running") + _metric_sum(port, "vllm:num_requests_waiting")


def _metric_sum(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def chat(model="tiny", stream=False):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
