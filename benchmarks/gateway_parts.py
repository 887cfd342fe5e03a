"""Where a Python hop's CPU goes: the gateway's HTTP client and server libraries against bare asyncio protocols
(run by hand; prints figures).

    .venv/bin/python benchmarks/gateway_parts.py [--requests 10000] [--rounds 2]

One request at a time in a tight loop over loopback keep-alive connections (uvloop everywhere), a fixed
1-token completion as the answer:

  client  the gateway's upstream client (aiohttp, configured as endpoints/gateway/asgi.py configures it:
          no cookie jar, no auto headers, no decompression) against a bare asyncio protocol client that writes
          one prepared request and parses the answer with httptools; the CPU of the client process per request;
  server  uvicorn + httptools serving an ASGI app that answers at once (benchmarks/gateway.py's fake upstream
          with no delay) against a bare asyncio protocol server parsing with httptools and writing one
          prepared answer; the CPU of the server process per request, the bare client driving both.

The bare sides are no HTTP implementation (no chunked bodies, no errors, no pooling): they are the floor a
hand-written proxy could approach, to size what replacing the libraries could save the gateway per request
(benchmarks/gateway.py measures the whole gateway against vLLM's Rust router).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gateway import free_port, wait_http  # noqa: E402

BODY = json.dumps({"model": "bench", "prompt": "x", "max_tokens": 1}).encode()
ANSWER = json.dumps(
    {
        "id": "x",
        "object": "text_completion",
        "model": "bench",
        "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }
).encode()

BARE_SERVER = r'''
import asyncio, sys
import httptools, uvloop
ANSWER = sys.argv[2].encode()
RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: " + str(len(ANSWER)).encode()
            + b"\r\n\r\n" + ANSWER)
class Server(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.parser = transport, httptools.HttpRequestParser(self)
    def data_received(self, data):
        self.parser.feed_data(data)
    def on_message_complete(self):
        self.transport.write(RESPONSE)
async def main():
    server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
uvloop.run(main())
'''


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def aiohttp_client(port: int, n: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    ) as session:
        url, headers = (
            f"http://127.0.0.1:{port}/v1/completions",
            [("Content-Type", "application/json"), ("Authorization", "Bearer x")],
        )

        async def one():
            response = await session.post(url, data=BODY, headers=headers)
            await response.read()
            response.release()

        for _ in range(50):
            await one()
        start = own_cpu()
        for _ in range(n):
            await one()
        return (own_cpu() - start) / n


class _BareClient(asyncio.Protocol):
    def __init__(self):
        import httptools

        self.parser, self.body, self.done = httptools.HttpResponseParser(self), [], None

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        self.done.set_result(b"".join(self.body))
        self.body = []


async def bare_client(port: int, n: int) -> float:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(_BareClient, "127.0.0.1", port)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer x\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY

    async def one():
        protocol.done = loop.create_future()
        transport.write(request)
        return await protocol.done

    for _ in range(50):
        await one()
    start = own_cpu()
    for _ in range(n):
        await one()
    transport.close()
    return (own_cpu() - start) / n


def start_server(kind: str, port: int) -> subprocess.Popen:
    argv = (
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gateway.py"),
            "--serve-fake",
            str(port),
            "--fake-delay-ms",
            "0",
            "--fake-slots",
            "4",
        ]
        if kind == "uvicorn"
        else [sys.executable, "-c", BARE_SERVER, str(port), ANSWER.decode()]
    )
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/", timeout=30)  # both answer any request
    except SystemExit:
        proc.kill()
        raise
    return proc


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import uvloop

    client: dict[str, list[float]] = {"aiohttp": [], "bare": []}
    server: dict[str, list[float]] = {"uvicorn": [], "bare": []}
    for _ in range(args.rounds):
        port = free_port()
        proc = start_server("uvicorn", port)
        try:
            client["aiohttp"].append(uvloop.run(aiohttp_client(port, args.requests)))
            client["bare"].append(uvloop.run(bare_client(port, args.requests)))
        finally:
            proc.kill()
        for kind in server:
            port = free_port()
            proc = start_server(kind, port)
            try:
                before = sum(psutil.Process(proc.pid).cpu_times()[:2])
                uvloop.run(bare_client(port, args.requests))
                server[kind].append((sum(psutil.Process(proc.pid).cpu_times()[:2]) - before) / (args.requests + 50))
            finally:
                proc.kill()
    print(f"{args.rounds} rounds x {args.requests} requests, one at a time; CPU ms per request (best round)")
    for side, arms in (("client", client), ("server", server)):
        for arm, runs in arms.items():
            print(f"  {side:<7}{arm:<9}{1000 * min(runs):7.3f}   rounds: {', '.join(f'{1000 * r:.3f}' for r in runs)}")


if __name__ == "__main__":
    main()
