"""The gateway's compiled data path (endpoints/gateway/dataplane/, GATEWAY_DATAPLANE) as a process: chosen where
it is built, a crash of it stops the gateway to be restarted, a bad setting is refused naming it; and what each
data path does at the edges of the HTTP it owns (a body over the limit, a replica that breaks mid-stream).
Everything else the gateway does is tested with both data paths (the `gateway` fixture, tests/endpoints)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from endpoints.gateway import protocol
from endpoints.gateway.asgi import MAX_BODY
from endpoints.gateway.dataplane import PREFIX, Control
from endpoints.gateway.models import GatewayKey
from tests.support import ROOT
from tests.support.agents import wait_for
from tests.support.gateway import HEALTH_TOKEN, GatewayProc, free_port
from tests.support.http import QuietHandler, ServerThread


def _children(pid: int) -> list[int]:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _exe(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/exe")


def _frame(request_id: int, kind: bytes, head: bytes, body: bytes = b"") -> bytes:
    """A frame as either half writes it (main.rs, dataplane.py PREFIX)."""
    return PREFIX.pack(13 + len(head) + len(body), request_id, kind[0], len(head)) + head + body


@pytest.mark.django_db(transaction=True)
def test_auto_serves_with_the_compiled_data_path_where_it_is_built_and_says_so(worker_env, settings):
    gw = GatewayProc(worker_env, {"GATEWAY_DATAPLANE": "auto"})
    try:
        health = gw.client.get("/healthz", headers={"Authorization": f"Bearer {HEALTH_TOKEN}"}).json()
        assert health["dataplane"] == "rust"
        assert [_exe(c) for c in _children(gw.proc.pid)] == [settings.GATEWAY_DATAPLANE_BINARY]
        assert "dataplane" not in gw.client.get("/healthz").json()  # anonymous: a status, nothing more
    finally:
        gw.stop()
    python = GatewayProc(worker_env, {"GATEWAY_DATAPLANE": "python"})
    try:
        health = python.client.get("/healthz", headers={"Authorization": f"Bearer {HEALTH_TOKEN}"}).json()
        assert health["dataplane"] == "python" and _children(python.proc.pid) == []
    finally:
        python.stop()


@pytest.mark.django_db(transaction=True)
def test_a_crash_of_the_data_path_stops_the_gateway_with_an_error_for_its_supervisor(worker_env):
    gw = GatewayProc(worker_env, {"GATEWAY_DATAPLANE": "rust"})
    try:
        (child,) = _children(gw.proc.pid)
        os.kill(child, signal.SIGKILL)
        assert gw.proc.wait(timeout=20) == 1  # supervisord / systemd restart it, both halves
        assert b"the data path stopped" in gw.proc.stdout.read()
    finally:
        gw.stop()


@pytest.mark.django_db(transaction=True)
def test_the_two_halves_speak_over_a_socket_pair_that_leaves_nothing_behind_when_killed(worker_env, tmp_path):
    temporary = tmp_path / "tmp"  # beside the test's gateway usage journals (worker_env), which a kill leaves
    temporary.mkdir()
    gw = GatewayProc(worker_env, {"GATEWAY_DATAPLANE": "rust", "TMPDIR": str(temporary)})
    try:
        assert gw.client.get("/healthz").status_code == 200  # the data path asked the gateway
        os.killpg(gw.proc.pid, signal.SIGKILL)  # both halves, as an OOM kill of the group would
        gw.proc.wait(timeout=10)
        assert list(temporary.iterdir()) == []
    finally:
        gw.stop()


@pytest.mark.django_db(transaction=True)
def test_the_two_halves_run_together_on_the_cpu_gateway_cpu_names(worker_env):
    """GATEWAY_CPU: both halves, every thread of each, on the last CPU this process may use ("auto"), on the one
    named, or where the scheduler puts them ("none", and always with the Python data path, a process alone)."""
    allowed = os.sched_getaffinity(0)

    def cpus(env):
        gw = GatewayProc(worker_env, env)
        try:
            assert gw.client.get("/healthz").status_code == 200
            pids = [gw.proc.pid, *_children(gw.proc.pid)]
            threads = [int(t) for pid in pids for t in os.listdir(f"/proc/{pid}/task")]
            return len(pids), {frozenset(os.sched_getaffinity(t)) for t in threads}
        finally:
            gw.stop()

    assert cpus({"GATEWAY_DATAPLANE": "rust"}) == (2, {frozenset({max(allowed)})})
    assert cpus({"GATEWAY_DATAPLANE": "rust", "GATEWAY_CPU": str(min(allowed))}) == (2, {frozenset({min(allowed)})})
    assert cpus({"GATEWAY_DATAPLANE": "rust", "GATEWAY_CPU": "none"}) == (2, {frozenset(allowed)})
    assert cpus({"GATEWAY_DATAPLANE": "python"}) == (1, {frozenset(allowed)})


@pytest.mark.django_db(transaction=True)
def test_stopping_the_gateway_stops_its_data_path(worker_env):
    gw = GatewayProc(worker_env, {"GATEWAY_DATAPLANE": "rust"})
    (child,) = _children(gw.proc.pid)
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(timeout=20) == 0
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"
    gw.stop()


def test_a_bad_data_path_setting_is_refused_naming_it(worker_env, tmp_path):
    def gateway(**env):
        return subprocess.run(
            [sys.executable, "manage.py", "gateway", "--port", "1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**worker_env, **env},
        )

    wrong = gateway(GATEWAY_DATAPLANE="go")
    assert wrong.returncode != 0 and "GATEWAY_DATAPLANE must be auto, rust or python, not 'go'" in wrong.stderr
    missing = tmp_path / "llm-console-dataplane"
    unbuilt = gateway(GATEWAY_DATAPLANE="rust", GATEWAY_DATAPLANE_BINARY=str(missing))
    assert unbuilt.returncode != 0
    assert f"GATEWAY_DATAPLANE=rust, but {missing} is not built: run `make dataplane`" in unbuilt.stderr
    wrong = gateway(GATEWAY_CPU="last")
    assert wrong.returncode != 0 and "GATEWAY_CPU must be auto, none or a CPU's number, not 'last'" in wrong.stderr
    beyond = max(os.sched_getaffinity(0)) + 1
    elsewhere = gateway(GATEWAY_DATAPLANE="rust", GATEWAY_CPU=str(beyond))
    assert elsewhere.returncode != 0
    assert (
        f"GATEWAY_CPU={beyond}, but this process may run only on CPUs {sorted(os.sched_getaffinity(0))}"
        in elsewhere.stderr
    )


class _BreaksMidStream(ServerThread):
    """A replica that sends one event of a streamed answer, then drops the connection (a crashed vLLM)."""

    def __init__(self):
        class Handler(QuietHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                event = b'data: {"choices": [{"index": 0, "delta": {"content": "w "}}]}\n\n'
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))  # one chunk; the last never comes
                self.wfile.flush()
                self.close_connection = True

        self.serve(Handler)


@pytest.mark.django_db(transaction=True)
def test_a_body_over_the_limit_is_413_and_a_stream_cut_short_ends_with_an_error_event(serving):
    upstream = _BreaksMidStream()
    key, raw, gw = serving(upstream, "ep-breaks")
    auth = {"Authorization": f"Bearer {raw}"}

    big = httpx.post(gw.url + "/v1/completions", content=b" " * (MAX_BODY + 1), headers=auth, timeout=60)
    assert big.status_code == 413 and big.json()["error"] == {
        "message": "The request body is too large.",
        "type": "too_large",
        "code": 413,
    }

    with gw.client.stream(
        "POST",
        "/v1/chat/completions",
        headers=auth,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "w "
    assert json.loads(events[-1]) == {"error": {"message": "The replica failed mid-stream.", "type": "bad_gateway"}}
    deadline = time.monotonic() + 10  # flushed every second (GatewayProc)
    while time.monotonic() < deadline and not GatewayKey.objects.get(pk=key.pk).errors_total:
        time.sleep(0.2)
    counted = GatewayKey.objects.get(pk=key.pk)
    # The 413 is refused before the key is looked at; the stream that broke is an error with its one event.
    assert (counted.requests_total, counted.errors_total, counted.tokens_total) == (1, 1, 1)


def test_frames_are_read_however_the_socket_splits_or_joins_them():
    """The data path coalesces frames into one write and a body may come in many reads: the gateway's end reads
    each frame whole, answers each request under its own id (a real Unix socket, the real Gateway.handle)."""
    import asyncio
    import struct

    from endpoints.gateway.asgi import Gateway

    async def scenario():
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # as serve() makes them
        await loop.create_unix_connection(lambda: Control(Gateway(), lost), sock=ours)
        reader, writer = await asyncio.open_unix_connection(sock=theirs)
        hello = _frame(0, protocol.HELLO, protocol.FINGERPRINT.encode())  # the data path's first frame
        health = _frame(1, b"Q", b"GET\n/healthz\n\n\n1")
        big = _frame(2, b"Q", b"POST\n/v1/completions\n\n\n1", b"x" * 300_000)  # no key: 401
        other = _frame(3, b"Q", b"GET\n/healthz\n\n\n1")
        # A body left behind (the data path reads it when asked): no key, so it is never asked for.
        unread = _frame(4, b"Q", b"POST\n/v1/completions\n\nBearer gk_nothing\n0")
        stream = hello + health + big + other + unread
        cut = len(hello) + len(health) + 7
        for piece in (stream[:5], stream[5:cut], stream[cut:-3], stream[-3:]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        answers = {}
        while len(answers) < 4:
            length, request_id, kind, head_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
            rest = await reader.readexactly(length - 13)
            answers[request_id] = (bytes((kind,)), rest[:head_len].decode(), json.loads(rest[head_len:]))
        writer.close()
        return answers

    answers = asyncio.run(scenario())
    assert answers[1] == answers[3] == (b"A", "200\napplication/json\n", {"status": "ok"})
    for request_id in (2, 4):
        kind, head, body = answers[request_id]
        assert (kind, head, body["error"]["type"]) == (b"A", "401\napplication/json\n", "invalid_api_key")
    assert struct.calcsize("<IQBI") == PREFIX.size == 17  # main.rs reads the same 17 bytes (protocol.toml)


class _Recorder(ServerThread):
    """A replica that records the bodies it is sent, answers a whole completion with a long text and usage followed
    by vLLM's own fields (vLLM 0.32 CompletionResponse: kv_transfer_params, ec_transfer_params, metrics), or streams
    one event and then stays silent, noting when the gateway drops the connection."""

    def __init__(self):
        self.bodies, self.aborted = [], []
        outer = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.bodies.append(body)
                if not json.loads(body).get("stream"):
                    answer = json.dumps(
                        {
                            "id": "x",
                            "object": "text_completion",
                            "model": "tiny",
                            "choices": [{"index": 0, "text": "w " * 20_000, "finish_reason": "length"}],
                            "usage": {"prompt_tokens": 3, "completion_tokens": 20_000, "total_tokens": 20_003},
                            "kv_transfer_params": None,
                            "ec_transfer_params": None,
                            "metrics": None,
                        },
                        separators=(",", ":"),
                    ).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": "w "}}]}\n\n')
                self.wfile.flush()
                self.close_connection = True
                for _ in range(200):  # a long prefill: nothing to send, so only the peer's close can be seen
                    time.sleep(0.05)
                    self.connection.setblocking(False)
                    try:
                        if self.connection.recv(1, socket.MSG_PEEK) == b"":
                            outer.aborted.append(time.monotonic())
                            return
                    except BlockingIOError:
                        pass
                    except ConnectionResetError:
                        outer.aborted.append(time.monotonic())
                        return
                    finally:
                        self.connection.setblocking(True)

        self.serve(Handler)


@pytest.mark.django_db(transaction=True)
def test_bodies_wait_for_the_key_usage_is_counted_past_vllms_own_fields_and_a_silent_stream_is_dropped(serving):
    """A body is read only once the key is good (an anonymous client announcing 10 MB gets its 401 without sending
    it); a large one reaches the replica whole; the tokens of a long answer are counted though vLLM writes fields
    after its usage; a client leaving a stream the replica is silent on drops the replica's connection at once."""
    upstream = _Recorder()
    key, raw, gw = serving(upstream, "ep-rec")

    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000\r\n\r\n"
        )
        assert conn.recv(4096).startswith(b"HTTP/1.1 401 ")

    big = {"model": "tiny", "prompt": "p" * 200_000, "max_tokens": 1}
    answer = gw.post("/v1/completions", raw, big)
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["text"]) == 40_000
    assert json.loads(upstream.bodies[-1])["prompt"] == big["prompt"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and GatewayKey.objects.get(pk=key.pk).tokens_total < 20_003:
        time.sleep(0.2)
    assert GatewayKey.objects.get(pk=key.pk).tokens_total == 20_003

    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        timeout=10,
        headers={"Authorization": f"Bearer {raw}"},
        json={"model": "tiny", "prompt": "hi", "stream": True},
    ) as response:
        assert next(response.iter_bytes()).startswith(b"data: ")
        left = time.monotonic()
    while time.monotonic() - left < 5 and not upstream.aborted:
        time.sleep(0.05)
    assert upstream.aborted and upstream.aborted[0] - left < 2, "the replica's connection was kept"


def test_a_report_waits_for_the_next_request_to_share_its_write_and_goes_alone_when_none_comes(settings):
    """The data path itself, its socket pair's other end played here: a report (how an answer the client already has
    went) is written after its answer, held back until the next request's frame comes and then in the same write,
    ahead of it, and alone once the moment is up when none comes; none is lost at SIGTERM. The moment is lengthened
    (`--report-delay`, 2 ms by default) so that this Python client lands its next request inside it: a data path
    that wrote each report at once fails the first check, one that held the request back with the report, or never
    held a report, the later ones."""
    import http.client
    import struct

    delay = 3.0  # seconds: the report's moment here (--report-delay)

    class Replica(QuietHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            answer = b'{"choices": [{"text": "a"}], "usage": {"total_tokens": 4}}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    replica = ServerThread().serve(Replica)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    port = free_port()
    child = subprocess.Popen(
        [
            settings.GATEWAY_DATAPLANE_BINARY,
            "--listen",
            f"127.0.0.1:{port}",
            "--control-fd",
            str(theirs.fileno()),
            "--connect-timeout",
            "5",
            "--read-timeout",
            "30",
            "--idle-timeout",
            "3",
            "--max-body",
            str(MAX_BODY),
            "--header-timeout",
            "10",
            "--idle-client-timeout",
            "10",
            "--body-timeout",
            "10",
            "--max-connections",
            "100",
            "--max-connections-per-address",
            "100",
            "--report-delay",
            str(int(delay * 1000)),
        ],
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.DEVNULL,
    )
    theirs.close()
    ours.settimeout(10)
    received = bytearray()

    def whole_frames():
        """The frames whole in what was received so far, taken out of it: (request id, kind, path or status)."""
        frames = []
        while len(received) >= 4 and len(received) >= 4 + struct.unpack_from("<I", received)[0]:
            length, request_id, kind, head_len = PREFIX.unpack_from(received)
            head = bytes(received[PREFIX.size : PREFIX.size + head_len]).decode()
            del received[: 4 + length]
            frames.append((request_id, chr(kind), head.split("\n")[1 if chr(kind) == "Q" else 0]))
        return frames

    def read_once():
        """The frames of one read of the socket, which must end on a frame's end (one write of the data path)."""
        chunk = ours.recv(65536)
        assert chunk, "the data path closed its socket"
        received.extend(chunk)
        frames = whole_frames()
        assert not received, "a frame split across writes"
        return frames

    def forward(request_id):
        ours.sendall(
            _frame(request_id, b"F", f"http://127.0.0.1:{replica.port}/v1/completions\nreplica-key\n0".encode(), b"{}")
        )

    def connected():
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            client.connect()
        except ConnectionRefusedError:
            return None
        return client

    def ask():
        client.request(
            "POST",
            "/v1/completions",
            body=b'{"model": "tiny"}',
            headers={"Authorization": "Bearer gk_x", "Content-Type": "application/json"},
        )

    def answered():
        answer = client.getresponse()
        assert (answer.status, answer.read()) == (200, b'{"choices": [{"text": "a"}], "usage": {"total_tokens": 4}}')
        return time.monotonic()

    try:
        client = wait_for(connected, timeout=20, interval=0.05, what="the data path listening")
        # The handshake: the data path's first frame names its protocol (protocol.toml's fingerprint).
        (hello,) = read_once()
        assert hello == (0, "H", protocol.FINGERPRINT)

        ask()
        ((first, kind, path),) = read_once()
        assert (kind, path) == ("Q", "/v1/completions")
        forward(first)
        answered()
        # Its report is held back: nothing comes while no request follows (a quarter of the moment, so that a
        # stalled machine does not see it go alone).
        ours.settimeout(delay / 4)
        with pytest.raises(TimeoutError):
            ours.recv(65536)
        ours.settimeout(10)

        asked_at = time.monotonic()
        ask()  # the next request: the held report goes with its frame, ahead of it, in one write
        ((reported, kind, status), (second, q, path)) = read_once()
        assert (reported, kind, status, q, path) == (first, "S", "200", "Q", "/v1/completions")
        assert time.monotonic() - asked_at < delay / 2, "the request waited for the report's moment"

        forward(second)
        answered_at = answered()
        ((reported, kind, status),) = read_once()  # no request follows: the report goes alone, once the moment is up
        alone_at = time.monotonic()
        assert (reported, kind, status) == (second, "S", "200")
        assert alone_at - answered_at > delay / 2, "the report went at once instead of waiting for a request"

        ask()
        ((third, kind, path),) = read_once()
        forward(third)
        answered()
        child.send_signal(signal.SIGTERM)  # the last answer's report is written before the data path exits
        client.close()
        while chunk := ours.recv(65536):
            received.extend(chunk)
        assert whole_frames() == [(third, "S", "200")] and not received
        assert child.wait(timeout=20) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        ours.close()
        replica.stop()


def test_auto_pins_nothing_under_kubernetes_or_a_quota_under_two_cpus(tmp_path):
    """GATEWAY_CPU=auto: a pod may run on every core of its node while it is granted a share (the kubelet's quota),
    so the node's last core is nobody's own: no pinning under Kubernetes, nor under a cgroup quota below two CPUs
    (v2's cpu.max, v1's cfs files). A container without a quota (this machine) keeps the measured default."""
    from endpoints.gateway.dataplane import auto_pin_refusal, cpu_quota

    assert "Kubernetes" in auto_pin_refusal(root=tmp_path, environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert auto_pin_refusal(root=tmp_path, environ={}) == "" and cpu_quota(tmp_path) is None
    v2 = tmp_path / "v2" / "sys" / "fs" / "cgroup"
    v2.mkdir(parents=True)
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(tmp_path / "v2") == 1.5 and "1.5 CPU(s), under two" in auto_pin_refusal(
        root=tmp_path / "v2", environ={}
    )
    (v2 / "cpu.max").write_text("max 100000\n")
    assert auto_pin_refusal(root=tmp_path / "v2", environ={}) == ""
    v1 = tmp_path / "v1" / "sys" / "fs" / "cgroup" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("400000\n")
    assert cpu_quota(tmp_path / "v1") == 4 and auto_pin_refusal(root=tmp_path / "v1", environ={}) == ""
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(tmp_path / "v1") is None
