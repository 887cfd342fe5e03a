"""The gateway's end of its compiled data path (GATEWAY_DATAPLANE, endpoints/gateway/dataplane/src/main.rs).

The compiled program serves the clients' HTTP and proxies to the replicas; for every decision it asks this
process over a Unix socket pair (it inherits one end): each request arrives here as a frame and runs through the
very same ``Gateway.handle`` as under uvicorn (keys, scopes, limits, queue, routing, wake, accounting), as an ASGI
request whose ``send`` answers in a frame and whose proxying step (``Forwarder.forward``) tells the data path
which replica to send it to and waits for how that went. The frames are described in main.rs.

Why: at concurrency 1 the gateway's added latency is its CPU per request, and uvicorn and aiohttp took most
of it (docs/benchmarks.md, "Gateway"); here the HTTP on both sides is compiled and Python keeps only the rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from console.env import child_environment
from endpoints.gateway import protocol
from endpoints.gateway.asgi import DATAPLANE_EXTENSION, MAX_BODY, TOO_LARGE, UPSTREAM_IDLE_SECONDS, Gateway
from endpoints.gateway.protocol import PREFIX

log = logging.getLogger("console.gateway")

KINDS = {k: bytes((k,)) for k in range(256)}
GATEWAY_FAILED = b'{"error": {"message": "The gateway failed.", "type": "bad_gateway", "code": 502}}'
STOP_SECONDS = 30  # on SIGTERM, the requests under way get this long before the data path is killed


@dataclass(slots=True)
class Outcome:
    """How a forwarded request went, as the data path reported it."""

    kind: str  # "done", "connect" (not reached: try another replica), "error" (no answer), "mid" (cut short)
    status: int = 0
    ttft: float | None = None
    events: int = 0
    streamed: bool = False
    data: bytes = b""  # the answer's tail (all of it when asked for), where its usage is
    content_type: str = ""
    error: str = ""


def binary() -> Path:
    return Path(settings.GATEWAY_DATAPLANE_BINARY)


def chosen() -> str:
    """The data path this gateway runs: GATEWAY_DATAPLANE, "auto" being the compiled one where it is built."""
    wanted = settings.GATEWAY_DATAPLANE
    if wanted == "auto":
        return "rust" if binary().is_file() and not protocol.binary_refusal(binary()) else "python"
    return wanted


def cpu_quota(root: Path = Path("/")) -> float | None:
    """The CPUs this process's cgroup may use (its CFS quota / period), None where no quota is set: cgroup v2's
    cpu.max ("max 100000" or "150000 100000"), else v1's cpu.cfs_quota_us / cpu.cfs_period_us (-1: none)."""
    fs = root / "sys" / "fs" / "cgroup"
    with contextlib.suppress(OSError, ValueError, IndexError):
        quota, period = (fs / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((fs / "cpu" / "cpu.cfs_quota_us").read_text())
        return None if quota_us < 0 else quota_us / int((fs / "cpu" / "cpu.cfs_period_us").read_text())
    return None


def auto_pin_refusal(*, root: Path = Path("/"), environ=os.environ) -> str:
    """Why GATEWAY_CPU=auto pins nothing here, or "". Under Kubernetes the process may run on every CPU of the node
    (its affinity) while the kubelet grants it a share of them (a quota): the node's last core is then everybody's,
    not the gateway's. Under a quota of less than two CPUs the two halves share what they are granted anyway."""
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return "under Kubernetes the node's last core is not this pod's"
    quota = cpu_quota(root)
    if quota is not None and quota < 2:
        return f"the cgroup grants {quota:g} CPU(s), under two"
    return ""


def bind_cpu() -> int | None:
    """Pin this process, every thread of it and the data path it will start (which inherits the binding) to
    GATEWAY_CPU: the CPU, or None where it is "none", or "auto" where auto_pin_refusal says why not. The two halves
    then take turns on one core instead of waking each other across two (settings.GATEWAY_CPU says what that costs).
    ValueError names a CPU this process may not run on."""
    wanted = settings.GATEWAY_CPU
    if wanted == "none":
        return None
    if wanted == "auto" and (why := auto_pin_refusal()):
        log.info("GATEWAY_CPU=auto pins nothing: %s", why)
        return None
    allowed = sorted(os.sched_getaffinity(0))
    cpu = allowed[-1] if wanted == "auto" else int(wanted)
    if cpu not in allowed:
        raise ValueError(f"GATEWAY_CPU={wanted}, but this process may run only on CPUs {allowed}")
    for thread in os.listdir("/proc/self/task"):  # the threads already started (sched_setaffinity is per thread)
        with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
            os.sched_setaffinity(int(thread), {cpu})
    return cpu


class Forwarder:
    """One request from the data path: the ASGI receive/send the gateway's handler runs with, and its
    proxying step."""

    __slots__ = (
        "control",
        "id",
        "body",
        "body_read",
        "body_wanted",
        "gone",
        "left",
        "handler",
        "outcome",
        "whole",
        "settled",
        "status",
        "headers",
        "chunks",
    )

    def __init__(self, control: Control, request_id: int, body: bytes | None):
        self.control, self.id, self.body = control, request_id, body  # None: the data path sends it when asked
        self.body_read = False
        self.body_wanted: asyncio.Future | None = None
        self.gone: asyncio.Future | None = None  # made by a receive() that waits for the client to leave
        self.left = False  # the client left
        self.handler: asyncio.Task | None = None  # cancelled if the client leaves while it is proxied
        self.outcome: asyncio.Future | None = None
        self.whole = False
        self.settled = False  # the data path has its answer, or needs none
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] | tuple[()] = ()
        self.chunks: list[bytes] = []

    async def receive(self) -> dict:
        if not self.body_read:
            self.body_read = True
            if self.body is not None:  # it came with the request
                body, self.body = self.body, None
                return {"type": "http.request", "body": body, "more_body": False}
            if not self.left:  # a large body is read only now, after the key: ask for it
                self.body_wanted = asyncio.get_running_loop().create_future()
                self.control.write(self.id, protocol.SEND_BODY, "")
                return await self.body_wanted
        if not self.left:
            if self.gone is None:
                self.gone = asyncio.get_running_loop().create_future()
            await asyncio.shield(self.gone)
        return {"type": "http.disconnect"}

    def watch(self, send):
        """What asgi.py's _ClientWatch is under uvicorn: while the request is proxied, a client leaving cancels
        its handler (the data path has dropped the replica's connection already)."""
        self.handler = asyncio.current_task()
        if self.left and self.handler is not None:
            self.handler.cancel()
        return self

    def close(self) -> None:
        self.handler = None

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], message.get("headers", ())
            return
        self.chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        content_type, retry_after = "application/json", ""
        for name, value in self.headers:
            if name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"retry-after":
                retry_after = value.decode("latin-1")
        self.settled = True
        self.control.write(
            self.id, protocol.ANSWER, f"{self.status}\n{content_type}\n{retry_after}", b"".join(self.chunks)
        )

    async def forward(
        self, url: str, token: str, body: bytes, *, whole: bool, engine_headers: bool = False, notice: str = ""
    ) -> Outcome:
        """Send the request to this replica and wait for how it went. `whole`: the answer comes back here
        (the gateway rewrites it, and answers by `send`); else the data path relays it to the client.
        `engine_headers`: the endpoint takes vLLM's routing headers (asgi.py ENGINE_HEADERS); `notice`: what the
        gateway changed in the request, told to the client (asgi.py NOTICE_HEADER)."""
        self.outcome, self.whole = asyncio.get_running_loop().create_future(), whole
        self.control.write(
            self.id, protocol.FORWARD, f"{url}\n{token}\n{int(whole)}\n{int(engine_headers)}\n{notice}", body
        )
        return await self.outcome

    def report(self, kind: bytes, head: list[str], data: bytes) -> None:
        if self.outcome is None or self.outcome.done():
            return
        if kind == protocol.ANSWERED:
            status, ttft, events, streamed, content_type = head
            outcome = Outcome(
                "done",
                status=int(status),
                ttft=int(ttft) / 1e6 if ttft else None,
                events=int(events),
                streamed=streamed == "1",
                data=data,
                content_type=content_type,
            )
            # A relayed answer is the data path's to send; one asked for whole is answered by `send`.
            self.settled = self.settled or not self.whole
        elif kind == protocol.CUT_SHORT:
            streamed, ttft, events, error = head
            outcome = Outcome(
                "mid", ttft=int(ttft) / 1e6 if ttft else None, events=int(events), streamed=streamed == "1", error=error
            )
            self.settled = self.settled or outcome.streamed  # the data path ended the stream itself
        else:
            outcome = Outcome("connect" if kind == protocol.UNREACHABLE else "error", error=head[0])
        self.outcome.set_result(outcome)

    def body_came(self, verdict: str, data: bytes) -> None:
        if self.body_wanted is not None and not self.body_wanted.done():
            self.body_wanted.set_result(
                {"type": "http.request", "body": data, "more_body": False, TOO_LARGE: verdict == "too_large"}
            )

    def client_left(self) -> None:
        if self.body_wanted is not None and not self.body_wanted.done():
            self.body_wanted.set_result({"type": "http.disconnect"})
        answered, self.settled, self.left = self.settled, True, True
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        if self.handler is not None and not answered:  # an answer already sent is accounted for, not cut
            self.handler.cancel()


class Control(asyncio.Protocol):
    """The data path's socket: frames in, requests run through the gateway, frames out."""

    def __init__(self, gateway: Gateway, lost: asyncio.Future):
        self.gateway, self.lost = gateway, lost
        self.requests: dict[int, Forwarder] = {}
        self.tasks: set[asyncio.Task] = set()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.loop = asyncio.get_running_loop()
        self.greeted = False  # the data path's hello frame came, with this protocol's fingerprint

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        if not self.lost.done():
            self.lost.set_result(exc)

    def write(self, request_id: int, kind: bytes, head: str, body: bytes = b"") -> None:
        if self.transport is None or self.transport.is_closing():
            return  # the data path is gone: the gateway is stopping
        raw = head.encode()
        self.transport.write(PREFIX.pack(13 + len(raw) + len(body), request_id, kind[0], len(raw)) + raw + body)

    def data_received(self, data: bytes) -> None:
        if not self.buffer and len(data) >= PREFIX.size:
            length, request_id, kind, head_len = PREFIX.unpack_from(data)
            if len(data) == 4 + length:  # the usual case, one whole frame: read in place, no copy into the buffer
                self.read_frame(
                    request_id, kind, data[PREFIX.size : PREFIX.size + head_len], data[PREFIX.size + head_len :]
                )
                return
        buffer = self.buffer
        buffer += data
        at = 0
        while len(buffer) - at >= PREFIX.size:
            length, request_id, kind, head_len = PREFIX.unpack_from(buffer, at)
            end = at + 4 + length
            if len(buffer) < end:
                break
            head = bytes(buffer[at + PREFIX.size : at + PREFIX.size + head_len])
            body = bytes(buffer[at + PREFIX.size + head_len : end])
            at = end
            self.read_frame(request_id, kind, head, body)
        del buffer[:at]

    def read_frame(self, request_id: int, kind: int, head: bytes, body: bytes) -> None:
        try:
            self.dispatch(request_id, KINDS[kind], head, body)
        except Exception:  # a frame this end cannot read fails its request, not every other one
            log.exception("gateway: a frame from the data path could not be read (kind %r)", kind)
            if kind == protocol.REQUEST[0]:
                self.write(request_id, protocol.ANSWER, "502\napplication/json\n", GATEWAY_FAILED)
                return
            forwarder = self.requests.get(request_id)
            if forwarder is not None and forwarder.outcome is not None and not forwarder.outcome.done():
                forwarder.outcome.set_result(Outcome("error", error="DataplaneProtocolError"))

    def dispatch(self, request_id: int, kind: bytes, head: bytes, body: bytes) -> None:
        if not self.greeted:  # the handshake: the data path's first frame names the protocol it was built from
            theirs = head.decode("latin-1") if kind == protocol.HELLO else "none (no hello frame)"
            if theirs != protocol.FINGERPRINT:
                log.error(
                    "gateway: the data path speaks another version of the protocol (%s, this gateway %s): run "
                    "`make dataplane`; the gateway stops",
                    theirs[:12],
                    protocol.FINGERPRINT[:12],
                )
                if not self.lost.done():
                    self.lost.set_result(None)
                return
            self.greeted = True
            return
        if kind == protocol.REQUEST:
            method, path, authorization, api_key, body_follows = head.decode("latin-1").split("\n")
            if "%" in path:  # the path as uvicorn gives it to the gateway (httptools_impl.py: unquoted)
                path = urllib.parse.unquote(path)
            forwarder = Forwarder(self, request_id, body if body_follows == "1" else None)
            self.requests[request_id] = forwarder
            headers = []
            if authorization:
                headers.append((b"authorization", authorization.encode("latin-1")))
            if api_key:
                headers.append((b"x-api-key", api_key.encode("latin-1")))
            scope = {
                "type": "http",
                "method": method,
                "path": path,
                "headers": headers,
                "extensions": {DATAPLANE_EXTENSION: forwarder},
            }
            task = self.loop.create_task(self.gateway.handle(scope, forwarder.receive, forwarder.send))
            self.tasks.add(task)
            task.add_done_callback(functools.partial(self.ended, forwarder))
            return
        known = self.requests.get(request_id)
        if known is None:
            return
        if kind == protocol.LEFT:
            known.client_left()
        elif kind == protocol.BODY:
            known.body_came(head.decode(), body)
        else:
            known.report(kind, head.decode("latin-1").split("\n"), body)

    def ended(self, forwarder: Forwarder, task: asyncio.Task) -> None:
        self.requests.pop(forwarder.id, None)
        self.tasks.discard(task)
        failed = not task.cancelled() and task.exception() is not None
        if failed:
            log.error("gateway: a request failed", exc_info=task.exception())
        if not forwarder.settled:
            # The handler ended without an answer (it failed, or a client that left was held): say something.
            self.write(forwarder.id, protocol.ANSWER, "502\napplication/json\n", GATEWAY_FAILED)


async def serve(*, host: str, port: int) -> int:
    """Run the gateway with the compiled data path in front: until SIGTERM (0), or until the data path
    stops (1: the supervisor restarts the gateway, both halves)."""
    loop = asyncio.get_running_loop()
    gateway = Gateway(dataplane="rust")
    await gateway.startup()
    lost = loop.create_future()
    # A socket pair, one end inherited by the data path: nothing on disk to guard or leave behind, and nothing
    # else can connect to it.
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    transport, control = await loop.create_unix_connection(lambda: Control(gateway, lost), sock=ours)
    stop = loop.create_future()

    def request_stop() -> None:
        if not stop.done():
            stop.set_result(None)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop)
    try:
        child = await asyncio.create_subprocess_exec(
            str(binary()),
            "--listen",
            f"{host}:{port}",
            "--control-fd",
            str(theirs.fileno()),
            "--connect-timeout",
            str(settings.GATEWAY_CONNECT_TIMEOUT_SECONDS),
            "--read-timeout",
            str(settings.GATEWAY_READ_TIMEOUT_SECONDS),
            "--idle-timeout",
            str(UPSTREAM_IDLE_SECONDS),
            "--max-body",
            str(MAX_BODY),
            "--header-timeout",
            str(settings.GATEWAY_HEADER_TIMEOUT_SECONDS),
            "--idle-client-timeout",
            str(settings.GATEWAY_IDLE_TIMEOUT_SECONDS),
            "--body-timeout",
            str(settings.GATEWAY_BODY_TIMEOUT_SECONDS),
            "--max-connections",
            str(settings.GATEWAY_MAX_CONNECTIONS),
            "--max-connections-per-address",
            str(settings.GATEWAY_MAX_CONNECTIONS_PER_ADDRESS or 2**31),
            env=child_environment({}),
            pass_fds=(theirs.fileno(),),
        )
    finally:
        theirs.close()  # the child's now: its exit is this end's end of file
    exited = asyncio.ensure_future(child.wait())
    try:
        await asyncio.wait({stop, exited, lost}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.done() and child.returncode == 0:
            # A clean exit is the data path's answer to SIGTERM; sent to the process group (systemd, a terminal's
            # Ctrl-C) it reaches this process too, maybe a moment later.
            await asyncio.wait({stop}, timeout=1)
        if stop.done():
            return 0
        log.error(
            "gateway: the data path stopped (exit status %s); the gateway stops to be restarted", child.returncode
        )
        return 1
    finally:
        if child.returncode is None:
            child.terminate()  # it finishes the requests under way, asking this process as ever meanwhile
            try:
                await asyncio.wait_for(child.wait(), STOP_SECONDS)
            except TimeoutError:
                child.kill()
                await child.wait()
        if stop.done():
            # The data path wrote its last reports before it exited: read them, and let the requests they end do
            # their accounting before the last flush.
            await asyncio.wait({lost}, timeout=2)
            if control.tasks:
                await asyncio.wait(set(control.tasks), timeout=5)
        transport.close()
        await gateway.shutdown()
