"""The outside probe's cases (issue 37, "Gateway hardening"), each against a real gateway process with both data
paths (the `gateway` fixture): requests framed by Content-Length and Transfer-Encoding at once, sockets held open
(idle, a trickling head, a body announced and not sent), connection caps, the token estimate read as vLLM reads a
request, 404 for a model outside a key's scope, and the client headers a replica gets. The HTTP cases are written
byte for byte on raw sockets: an HTTP library would not send them."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from console.models import AuditEvent
from endpoints.gateway import services
from endpoints.gateway.asgi import token_estimate
from endpoints.gateway.models import GatewayEndpoint
from tests.support.agents import wait_for
from tests.support.gateway import FakeReplica, make_endpoint
from tests.support.http import QuietHandler, ServerThread


class RecordingReplica(ServerThread):
    """An OpenAI-like replica that keeps each request's body and headers, answering after `delay` seconds with a
    usage of 10 tokens."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.bodies, self.headers = delay, [], []
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                outer.bodies.append(body)
                outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                time.sleep(outer.delay)
                raw = json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.serve(Handler)


def _peers(gw) -> set[int]:
    """The client ports of the connections the gateway (either half) holds a socket for: each is counted against
    the caps as it is accepted and uncounted before its socket is closed (guard.py, dataplane/src/main.rs)."""
    gateway = psutil.Process(gw.proc.pid)
    return {
        c.raddr.port
        for p in (gateway, *gateway.children())
        for c in p.net_connections("tcp")
        if c.raddr and c.laddr.port == gw.port
    }


def _hold(gw, n: int) -> list[socket.socket]:
    held = [_connect(gw) for _ in range(n)]
    ports = {sock.getsockname()[1] for sock in held}
    wait_for(lambda: ports <= _peers(gw), timeout=10, interval=0.05, what=f"the gateway accepting {n} connections")
    return held


def _connect(gw) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    return sock


def _read_until_closed(sock: socket.socket, within: float) -> bytes | None:
    """All the gateway sent until it closed the connection; None if it was still open after `within` seconds."""
    sock.settimeout(0.2)
    data, deadline = b"", time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    return None


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


# --- both framings at once (RFC 9112 §6.1) ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_content_length_with_transfer_encoding_is_refused_with_400_and_closed_before_any_body(serving):
    _, raw, gw = serving(FakeReplica("r1"), "ep-te")
    for key in ("", f"Authorization: Bearer {raw}\r\n"):
        sock = _connect(gw)
        try:
            # The probe's request: a small Content-Length, then a chunked body that does not end (32 MiB were read
            # before the key was checked). Nothing of the body may be needed for the answer.
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                + key.encode()
                + b"Content-Type: application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"4000\r\n"
                + b"x" * 0x4000
                + b"\r\n"
            )
            answer = _read_until_closed(sock, within=10)
            assert answer is not None, "the connection stayed open"
            assert _status(answer) == 400
        finally:
            sock.close()


@pytest.mark.django_db(transaction=True)
def test_a_chunked_request_body_is_not_read_before_the_key_and_its_connection_closes_after(serving):
    _, raw, gw = serving(FakeReplica("r1"), "ep-chunked")
    sock = _connect(gw)
    try:
        # Transfer-Encoding first: the compiled path's HTTP library (hyper 0.14) then drops Content-Length and reads
        # the chunks; llhttp (the Python path) refuses both orders. Either way the body that never ends is not
        # waited for, and the connection does not stay open for another request.
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n"
            b"\r\n4000\r\n" + b"x" * 0x4000 + b"\r\n"
        )
        answer = _read_until_closed(sock, within=10)
        assert answer is not None and _status(answer) in (400, 401)
    finally:
        sock.close()


# --- timeouts and connection caps ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_idle_sockets_trickling_heads_and_bodies_not_sent_are_closed(gateway, admin):
    make_endpoint("ep-slow", [FakeReplica("r1")], model="tiny")
    _, raw = services.key_create(name="app", actor=admin)
    gw = gateway(
        GATEWAY_HEADER_TIMEOUT_SECONDS="1.5", GATEWAY_BODY_TIMEOUT_SECONDS="1.5", GATEWAY_IDLE_TIMEOUT_SECONDS="1.5"
    )
    idle, trickle, body = _connect(gw), _connect(gw), _connect(gw)
    try:
        body.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {raw}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Slow: " + b"a" * 100
        trickle.settimeout(0.05)
        started, closed = time.monotonic(), False
        for byte in head:  # a byte every 0.2 s: each would have put uvicorn's keep-alive timer off again
            try:
                trickle.sendall(bytes([byte]))
                closed = trickle.recv(65536) == b""
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
            time.sleep(0.2)
        assert closed and time.monotonic() - started < 8, "a head trickling in held its connection"
        for name, sock in (("idle", idle), ("body", body)):
            answer = _read_until_closed(sock, within=8)
            assert answer is not None, f"{name}: still open"
    finally:
        for sock in (idle, trickle, body):
            sock.close()
    assert gw.post("/v1/chat/completions", raw, _chat()).status_code == 200  # the gateway itself is fine


@pytest.mark.django_db(transaction=True)
def test_connections_are_capped_per_address_and_in_all(gateway):
    gw = gateway(
        GATEWAY_MAX_CONNECTIONS="5", GATEWAY_MAX_CONNECTIONS_PER_ADDRESS="3", GATEWAY_IDLE_TIMEOUT_SECONDS="30"
    )
    gw.client.close()  # its pooled connection would count
    held = _hold(gw, 3)
    try:
        extra = _connect(gw)
        answer = _read_until_closed(extra, within=5)
        assert answer is not None and _status(answer) == 503, answer
        extra.close()
        gone = held.pop()
        port = gone.getsockname()[1]
        gone.close()
        wait_for(lambda: port not in _peers(gw), timeout=10, interval=0.05, what="the gateway closing its end")
        again = _connect(gw)
        again.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        assert _status(_read_until_closed(again, within=5)) == 200
        again.close()
    finally:
        for sock in held:
            sock.close()


@pytest.mark.django_db(transaction=True)
def test_connections_are_capped_in_all(gateway):
    gw = gateway(
        GATEWAY_MAX_CONNECTIONS="4", GATEWAY_MAX_CONNECTIONS_PER_ADDRESS="0", GATEWAY_IDLE_TIMEOUT_SECONDS="30"
    )
    gw.client.close()
    held = _hold(gw, 4)
    try:
        extra = _connect(gw)
        answer = _read_until_closed(extra, within=5)
        assert answer is not None and _status(answer) == 503, answer
        extra.close()
    finally:
        for sock in held:
            sock.close()


# --- the token estimate ---------------------------------------------------------------------------------------------


def _chat(**extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_the_estimate_reads_a_request_as_vllm_does():
    # Floats with no fraction are counts (pydantic's lax int in vLLM's request models); n multiplies the completions.
    e = token_estimate(_chat(max_tokens=60.0, n=3.0), route="/v1/chat/completions", context=4096)
    assert (e.each, e.completions, e.limit_field, e.asked) == (60, 3, "max_tokens", 60)
    # Chat: max_completion_tokens wins over max_tokens (chat_completion/serving.py); none: the rest of the context.
    e = token_estimate(_chat(max_tokens=5, max_completion_tokens=70), route="/v1/chat/completions", context=4096)
    assert (e.each, e.limit_field) == (70, "max_completion_tokens")
    e = token_estimate(_chat(), route="/v1/chat/completions", context=4096)
    assert e.tokens == 4096 and e.asked is None
    # Completions: max_tokens only (16 by default, CompletionRequest); max_completion_tokens is not read there.
    prompt = {"model": "tiny", "prompt": "hello"}
    assert token_estimate(prompt, route="/v1/completions", context=4096).each == 16
    e = token_estimate({**prompt, "max_completion_tokens": 900}, route="/v1/completions", context=4096)
    assert (e.each, e.limit_field) == (16, "max_tokens")
    assert token_estimate({**prompt, "max_tokens": None}, route="/v1/completions", context=4096).tokens == 4096
    # A list of prompts is a request each: n completions for every one of them.
    e = token_estimate({**prompt, "prompt": ["a", "b"], "n": 2, "max_tokens": 7}, route="/v1/completions", context=99)
    assert (e.completions, e.each) == (4, 7)
    assert token_estimate({**prompt, "max_tokens": 9}, route="/generate", context=4096).each == 9


@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_cannot_overrun_a_token_limit_and_are_lowered_to_what_is_left(gateway, admin):
    replica = RecordingReplica(delay=1.0)
    try:
        make_endpoint("ep-tok", [replica], model="tiny")
        _, raw = services.key_create(name="tok", tpm_limit=40, actor=admin)
        gw = gateway()
        gw.wait_routes("tiny", 1)
        # The probe: four at once, 60.0 tokens each (a float, which the old estimate took for 16).
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: gw.post("/v1/chat/completions", raw, _chat(max_tokens=60.0)), range(4)))
        codes = sorted(a.status_code for a in answers)
        assert codes == [200, 429, 429, 429], codes
        (ok,) = [a for a in answers if a.status_code == 200]
        (sent,) = replica.bodies
        # Admitted with what was left: its max_tokens lowered, and the answer says so.
        prompt = token_estimate(_chat(), route="/v1/chat/completions", context=None).prompt
        assert sent["max_tokens"] == 40 - prompt
        assert (
            ok.headers["x-gateway-notice"]
            == f"max_tokens lowered from 60 to {40 - prompt}: the key's tokens per minute left"
        )
        # Settled with the engine's usage (10 tokens): what the estimate held comes back, and a request fits again.
        again = gw.post("/v1/chat/completions", raw, _chat(max_tokens=3))
        assert again.status_code == 200 and "x-gateway-notice" not in again.headers
        # No max_tokens on chat: vLLM may use the rest of the context, so the estimate is the whole context.
        lowered = gw.post("/v1/chat/completions", raw, _chat())
        assert lowered.status_code == 200 and "max_tokens lowered from unset" in lowered.headers["x-gateway-notice"]
        assert replica.bodies[-1]["max_tokens"] < 40
    finally:
        replica.stop()


# --- scope and headers ------------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_model_outside_the_keys_scope_is_404_as_one_that_does_not_exist(fakes, gateway, admin):
    make_endpoint("ep-a", [fakes("a")], model="a")
    make_endpoint("ep-b", [fakes("b")], model="b")
    _, raw = services.key_create(name="only-a", models=["a"], actor=admin)
    gw = gateway()
    gw.wait_routes("b", 1)
    hidden = gw.post("/v1/chat/completions", raw, _chat(model="b"))
    missing = gw.post("/v1/chat/completions", raw, _chat(model="zzz"))
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["error"]["type"] == missing.json()["error"]["type"] == "model_not_found"
    assert gw.post("/v1/chat/completions", raw, _chat(model="a")).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_replicas_get_only_the_allowed_client_headers(gateway, admin, operator, viewer, api_for):
    replica = RecordingReplica()
    try:
        ep = make_endpoint("ep-h", [replica], model="tiny")
        _, raw = services.key_create(name="app", actor=admin)
        gw = gateway()
        gw.wait_routes("tiny", 1)
        headers = {
            "Authorization": f"Bearer {raw}",
            "X-Request-Id": "req-1",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "Tracestate": "a=1",
            "Connection": "keep-alive, tracestate",  # names a header as hop-by-hop: it goes no further
            "Cookie": "session=secret",
            "X-Forwarded-For": "10.0.0.1",
            "X-data-parallel-rank": "1",
            "X-Vllm-Priority": "-100",
        }
        assert gw.client.post("/v1/chat/completions", json=_chat(), headers=headers).status_code == 200
        got = replica.headers[-1]
        assert got["x-request-id"] == "req-1" and got["traceparent"].startswith("00-0af7")
        for absent in ("tracestate", "cookie", "x-forwarded-for", "x-data-parallel-rank", "x-vllm-priority"):
            assert absent not in got, absent
        assert got["authorization"] != f"Bearer {raw}"  # the replica's own key, never the client's

        url = f"/api/v1/gateway/endpoints/{ep.pk}/engine-headers"
        assert api_for(viewer).post(url, {"allowed": True}).status_code == 403
        assert api_for(operator).post(url, {"allowed": "maybe"}).status_code in (400, 422)
        assert not GatewayEndpoint.objects.filter(endpoint=ep, engine_headers=True).exists()
        assert api_for(operator).post(url, {"allowed": True}).json()["engine_headers"] is True
        assert AuditEvent.objects.filter(action="gateway.engine_headers").count() == 1

        def forwarded():  # once a routes refresh (0.3 s here) has the endpoint's new setting
            assert gw.client.post("/v1/chat/completions", json=_chat(), headers=headers).status_code == 200
            return replica.headers[-1] if "x-data-parallel-rank" in replica.headers[-1] else None

        got = wait_for(forwarded, timeout=10, interval=0.1, what="vLLM's routing headers forwarded")
        assert got["x-data-parallel-rank"] == "1" and got["x-vllm-priority"] == "-100"
    finally:
        replica.stop()


@pytest.mark.django_db
def test_the_estimates_context_is_the_endpoints_max_model_len_else_its_models_config(settings):
    from endpoints.gateway.selectors import routing_table

    ep = make_endpoint("ep-ctx", [], model="tiny")
    assert routing_table().context["tiny"] == settings.GATEWAY_DEFAULT_CONTEXT
    ep.artifact.inspection = {"max_position_embeddings": 2048}
    ep.artifact.save()
    assert routing_table().context["tiny"] == 2048  # vLLM derives max_model_len from it
    ep.max_model_len = 1024
    ep.save()
    assert routing_table().context["tiny"] == 1024
