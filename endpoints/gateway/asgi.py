"""The gateway: one OpenAI-compatible entry point for every served model (`manage.py gateway`).

An ASGI app that checks the application's key, its scope and per-minute limits, the endpoint's
queue depth, then proxies the request to the ready replica the endpoint's routing policy picks:
the fewest outstanding requests, or prefix-aware, by a consistent hash of the prompt's start with
a bound on load (endpoints/gateway/routing.py); a blue-green pair's staged side may take a canary
share; streaming the answer (SSE included) through as it comes. The replicas come from the
console's database (refreshed every GATEWAY_ROUTES_REFRESH_SECONDS); a replica that refuses the
connection is skipped for a while and the request goes to another one. A request for an endpoint
scaled to zero wakes it (endpoints.services.endpoint_wake) and is held until a replica is ready,
or GATEWAY_WAKE_TIMEOUT_SECONDS.

Who does the HTTP (GATEWAY_DATAPLANE): the compiled data path (endpoints/gateway/dataplane/, Rust,
hyper), which runs each request through this app over a private socket and does the proxying step
itself (endpoints/gateway/dataplane.py: Forwarder), or this process alone (uvicorn with uvloop and
httptools; aiohttp with pooled keep-alive connections to the replicas). The rules are this module's
either way. At concurrency 1 a proxy's added latency is its CPU per request, which the compiled data path
keeps down (benchmarks/gateway.py; its figures against vLLM's Rust router: docs/benchmarks.md).

Why not vLLM's Rust router (vllm-router 0.1.17) as the data path behind this layer? It installs
cleanly, but it does not fit here:
- this layer must count each endpoint's outstanding requests anyway (queue depth -> 429, the
  blue-green drain, per-key accounting), so it already holds everything least-outstanding
  routing needs, and a second hop would add its cost to ours;
- one router pool serves one model: one router process per endpoint to start, give ports to,
  watch and restart (its multi-model IGW mode is unproven here), plus a loopback admin API
  with no auth to keep in sync by POST /add_worker, which blocks up to
  --worker-startup-timeout-secs on an unreachable URL;
- it has no least-outstanding policy, and power_of_two refuses to start with one worker;
- blue-green with zero failed requests needs the switch and the drain under our control.
So the console proxies itself. The keys' per-minute limits are shared by every gateway process through Redis
(endpoints/gateway/limits.py): run as many gateways as the load needs, behind a load balancer
(docs/gateway-scale-out.md).

The Python data path's upstream client is aiohttp (what vLLM's own benchmark client uses), not httpx, whose
per-request CPU cost showed at concurrency 32 (benchmarks/gateway.py: docs/benchmarks.md, "Gateway")."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import json
import logging
import math
import os
import re
import socket
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp
from django.conf import settings
from django.db import connection
from django.utils import timezone

from endpoints.gateway import disagg, routing, usage_journal
from endpoints.gateway.consul import ConsulSync
from endpoints.gateway.limits import SharedLimits
from endpoints.gateway.protocol import ENGINE_HEADERS, FORWARDED_HEADERS, STREAM_ERROR, TAIL_BYTES
from endpoints.gateway.selectors import (
    Backend,
    KeyInfo,
    Loadable,
    RoutingTable,
    Wakeable,
    budget_used,
    key_info,
    routing_table,
)
from endpoints.gateway.services import finish_drains, store_gateway_stats, store_journal, store_usage
from endpoints.gateway.shared_routing import Load, SharedRouting
from endpoints.gateway.stats import Stats
from endpoints.gateway.usage_journal import UsageJournal
from endpoints.lora import endpoint_adapter_change
from endpoints.models import Endpoint
from endpoints.services import endpoint_wake

#: The "model" of the request a task serves (each request runs in a task of its own, on both data paths).
REQUEST_MODEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("gateway_request_model", default=None)
# This request's ticket in the usage journal (usage_journal.py), set once it is admitted and about to be relayed.
REQUEST_TICKET: contextvars.ContextVar[int | None] = contextvars.ContextVar("gateway_request_ticket", default=None)
log = logging.getLogger("console.gateway")

# The client's request headers a replica gets: an allow-list (a client's Host, cookies, proxy or hop-by-hop headers
# and anything else unknown stay here), less any the request's Connection header names (RFC 9110 §7.6.1).
# Content-Type is always application/json (the body was read as JSON) and Authorization the replica's own key.
# Both lists are the protocol's (dataplane/protocol.toml, which both data paths read). vLLM reads X-Request-Id
# (vllm/entrypoints/serve/engine/serving.py) and the W3C trace context (vllm/tracing); its per-request routing
# headers (vllm/entrypoints/generate/base/serving.py: X-data-parallel-rank, PRIORITY_HEADER = "X-Vllm-Priority") go
# only to an endpoint that allows them (GatewayEndpoint.engine_headers).
# Says what the gateway changed in a request before forwarding it (a lowered max_tokens), on the answer.
NOTICE_HEADER = b"x-gateway-notice"
# Failures before any answer came back: the request can go to another replica.
RETRYABLE = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ConnectionTimeoutError,
)
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
MAX_BODY = 32 * 1024 * 1024
DOWN_SECONDS = 3.0  # a replica that refused a connection gets no traffic this long
# An idle connection to a replica is closed this soon, before the replica's server closes it (vLLM's API server after
# 5 s: vllm/envs.py VLLM_HTTP_TIMEOUT_KEEP_ALIVE): one reused just as the server closes it fails its request as if the
# replica were unreachable, and a healthy replica then got no traffic for DOWN_SECONDS (503s with no other one).
UPSTREAM_IDLE_SECONDS = 3.0
# While no gateway has a request in flight, or no other gateway publishes, the routing state is shared this many
# times less often (the first request after a quiet spell is seen by the other gateways up to that much later; a
# gateway just started sees a lone one's counts up to that much old).
IDLE_SYNC_FACTOR = 5
DRAIN_CHECK_SECONDS = 5.0  # how often a due blue-green drain looks whether the old side still answers
GONE = object()  # what hold() returns when the client left while its request was held
# The ASGI scope's extension by which the compiled data path (endpoints/gateway/dataplane.py) does the proxying step.
DATAPLANE_EXTENSION = "llm_console.dataplane"
# Set on the request message by the compiled data path for a body over MAX_BODY (which it does not read).
TOO_LARGE = "llm_console.too_large"


# The ORM runs on one thread of its own, never on the event loop, and keeps its connection between
# calls: connecting anew for each refresh (once a second) cost more CPU than the queries did, taken
# from the replicas on a shared host (benchmarks/gateway.py).
_DB_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-db")


def _db(fn, *args):
    """Run an ORM call on the gateway's database thread; a connection that failed and is no longer
    usable is dropped, so the next call connects again."""

    def call():
        try:
            return fn(*args)
        finally:
            if connection.errors_occurred:
                if connection.is_usable():
                    connection.errors_occurred = False
                else:
                    connection.close()

    return asyncio.get_running_loop().run_in_executor(_DB_THREAD, call)


def _load_adapter(*, endpoint_id: int, adapter_id: int):
    endpoint = Endpoint.objects.select_related("artifact__model").get(pk=endpoint_id)
    return endpoint_adapter_change(endpoint=endpoint, adapter_id=adapter_id, action="load", user=None, via="gateway")


class Gateway:
    def __init__(self, *, dataplane: str = "python"):
        self.dataplane = dataplane  # which program does the HTTP: this one (uvicorn, aiohttp) or the compiled one
        self.table = RoutingTable(backends={}, known={}, max_queue={})
        self.outstanding: dict[str, int] = defaultdict(int)  # replica url -> in flight
        self.ep_outstanding: dict[int, int] = defaultdict(int)  # endpoint id -> in flight
        self.down_until: dict[str, float] = {}
        self.held: dict[int, int] = defaultdict(int)  # endpoint id -> requests held while it wakes
        self.waking: dict[int, asyncio.Task] = {}  # endpoint id -> its wake in flight (one, shared)
        # (endpoint id, adapter id) -> its on-demand LoRA load in flight (one, shared), or the failed one's message
        self.loading: dict[tuple[int, int], asyncio.Task] = {}
        self.load_failed: dict[tuple[int, int], str] = {}
        self.poller: asyncio.Task | None = None  # refreshes the routes often while anything is held
        self.routes_changed = asyncio.Event()  # set (and replaced) at each routing table refresh
        self.key_cache: dict[str, tuple[float, KeyInfo | None]] = {}
        self.limits: SharedLimits | None = None  # the keys' per-minute limits, in Redis (made at startup)
        self.stats = Stats()
        self.client: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        self.consul: ConsulSync | None = None
        self.prefix_chars = settings.GATEWAY_PREFIX_KEY_CHARS
        self.load_factor = settings.GATEWAY_PREFIX_LOAD_FACTOR
        self.load_slack = settings.GATEWAY_PREFIX_LOAD_SLACK
        self.prefix_homes = routing.PrefixHomes()
        # The other gateways' outstanding counts and the prefix homes they agree on, in Redis (made at startup when
        # GATEWAY_SHARED_ROUTING_SECONDS > 0); `load` is what the policies read: this gateway's counts plus theirs.
        self.shared: SharedRouting | None = None
        self.load = Load(self.outstanding, None)
        self.claims: set[asyncio.Task] = set()  # prefix homes being recorded in Redis off the request's path
        self.next_drain_check = 0.0  # monotonic: a due drain reads the old side's /metrics, not at every refresh
        self.budget_alerted: set[tuple] = set()  # soft budget alerts this gateway noted (budget, percent, period)
        # Metered usage on its way to the database (usage_journal.py: made at startup; a kill -9 loses none of it).
        self.journal: UsageJournal | None = None

    # --- lifecycle ---------------------------------------------------------------------

    async def startup(self):
        self.limits = SharedLimits()
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.journal = UsageJournal(settings.GATEWAY_USAGE_JOURNAL_DIR, name)
        if self.dataplane == "python":
            self.client = self._client()
        if settings.CONSUL_HTTP_ADDR:
            self.consul = ConsulSync(settings.CONSUL_HTTP_ADDR)
        await self.refresh()
        self.tasks = [
            asyncio.create_task(self._loop(self.refresh, settings.GATEWAY_ROUTES_REFRESH_SECONDS)),
            asyncio.create_task(self._loop(self.flush, settings.GATEWAY_TELEMETRY_SECONDS)),
        ]
        if settings.GATEWAY_SHARED_ROUTING_SECONDS > 0:
            self.shared = SharedRouting()
            self.load = Load(self.outstanding, self.shared)
            await self.sync_routing()
            self.tasks.append(asyncio.create_task(self._sync_loop(settings.GATEWAY_SHARED_ROUTING_SECONDS)))

    @staticmethod
    def _client() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2048, limit_per_host=0, keepalive_timeout=UPSTREAM_IDLE_SECONDS),
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=settings.GATEWAY_CONNECT_TIMEOUT_SECONDS,
                sock_read=settings.GATEWAY_READ_TIMEOUT_SECONDS,
            ),
            auto_decompress=False,
            trust_env=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            # No cookie jar: a replica's Set-Cookie must not ride along on other clients' requests,
            # and filtering cookies per request is CPU for nothing.
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def shutdown(self):
        for t in [*self.tasks, *([self.poller] if self.poller else [])]:
            t.cancel()
        await self.flush()
        if (journal := self.journal) is not None:
            await _db(
                functools.partial(store_journal, journal=journal.name, segments=journal.segments(), finished=True)
            )
            journal.close()
        await _db(lambda: connection.close())  # looked up on the database thread: its own connection
        if self.consul is not None:
            await self.consul.client.aclose()  # registrations stay: the replicas keep serving
        if self.client:
            await self.client.close()
        if self.limits is not None:
            await self.limits.close()
        if self.shared is not None:
            for claim in list(self.claims):
                claim.cancel()
            await self.shared.close()

    async def _loop(self, fn, every):
        while True:
            await asyncio.sleep(every)
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gateway: %s failed", fn.__name__)

    async def refresh(self):
        if not await self.refresh_table():
            return
        now = time.monotonic()
        self.key_cache = {h: v for h, v in self.key_cache.items() if v[0] > now}
        if self.consul is not None:
            await self.consul.sync(self.table)

        # Only when a drain is due: most refreshes have none, and the query is a third of their CPU. Then every
        # DRAIN_CHECK_SECONDS: it reads each old-side replica's /metrics on the thread key lookups wait for.
        if (
            self.table.drain_due_at is not None
            and self.table.drain_due_at <= timezone.now()
            and now >= self.next_drain_check
        ):
            self.next_drain_check = now + DRAIN_CHECK_SECONDS
            await _db(finish_drains)

    async def refresh_table(self) -> bool:
        try:
            self.table = await _db(routing_table)
        except Exception:
            log.exception("gateway: reading the routing table failed (keeping the last one)")
            return False
        changed, self.routes_changed = self.routes_changed, asyncio.Event()
        changed.set()  # wakes the held requests to look again
        self.prefix_homes.keep_only(frozenset(b.url for backends in self.table.backends.values() for b in backends))
        return True

    async def _sync_loop(self, every: float):
        """sync_routing every `every` seconds while another gateway publishes and any gateway has a request in
        flight, IDLE_SYNC_FACTOR times less often otherwise: a gateway alone has nobody to keep up to date (an idle
        gateway's CPU: benchmarks/routing_scale.py; a lone busy one's: benchmarks/gateway_scale.py)."""
        while True:
            shared = self.shared
            busy = shared is not None and shared.peers > 0 and (bool(shared.others) or any(self.outstanding.values()))
            await asyncio.sleep(every if busy else every * IDLE_SYNC_FACTOR)
            try:
                await self.sync_routing()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gateway: sharing the routing state failed")

    async def sync_routing(self):
        """Publish this gateway's outstanding counts and read the other gateways' (shared_routing.py)."""
        if self.shared is not None:
            await self.shared.sync(self.outstanding)

    async def flush(self):
        stats, self.stats = self.stats, Stats()
        if self.journal is not None:
            self.journal.rotate()  # the segment closed here holds this flush's usage (stats holds the rest)
        held = {ep_id: n for ep_id, n in self.held.items() if n}
        if stats.ep or stats.key or held:
            await _db(store_gateway_stats, stats, settings.GATEWAY_TELEMETRY_SECONDS, dict(self.ep_outstanding), held)
        if stats.usage or stats.budget_alerts:  # usage here only where no journal was made (not started)
            await _db(store_usage, stats)
        if self.journal is not None:
            await _db(functools.partial(store_journal, journal=self.journal.name, segments=self.journal.segments()))
            await _db(self.store_orphaned_journals)
        now = datetime.now(UTC)
        self.budget_alerted = {m for m in self.budget_alerted if m[3] > now}  # past periods' marks

    # --- helpers -----------------------------------------------------------------------

    async def authenticate(self, headers: dict) -> KeyInfo | None:
        raw = ""
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if auth[:7].lower() == "bearer ":
            raw = auth[7:].strip()
        elif b"x-api-key" in headers:
            raw = headers[b"x-api-key"].decode("latin-1").strip()
        if not raw or not raw.startswith(settings.GATEWAY_KEY_PREFIX):
            return None
        now = time.monotonic()
        hit = self.key_cache.get(raw)
        if hit and hit[0] > now:
            return hit[1]

        info = await _db(key_info, raw)
        self.key_cache[raw] = (now + settings.GATEWAY_KEY_CACHE_SECONDS, info)
        return info

    def pick(self, backends, tried: set, *, staged: bool | None = None, key: bytes | None = None) -> Backend | None:
        """A replica for one try of a request, skipping those tried, down, or whose endpoint is full.
        `staged`: the side of a blue-green pair with a canary share this request goes to (if that
        side has no replica to take it, the other one does). `key`: the digest of the request's
        leading content, for a side that routes prefix-aware; else least outstanding. Loads are every gateway's
        (self.load: this one's own counts plus the others' shared through Redis)."""
        now = time.monotonic()
        down, load = self.down_until, self.load
        full = self.full_endpoints(backends)
        ok = [b for b in backends if b.url not in tried and down.get(b.url, 0) <= now and b.endpoint_id not in full]
        if staged is not None:
            ok = [b for b in ok if b.staged == staged] or ok
        if key is not None and ok and all(b.prefix for b in ok):
            if self.shared is not None:
                self.shared.touched.add(key)
            return self.prefix_homes.pick(key, ok, load, factor=self.load_factor, slack=self.load_slack)
        return routing.least_outstanding(ok, load)

    def full_endpoints(self, backends) -> set[int]:
        """The endpoints among `backends` whose requests in flight have reached their queue depth, counted across
        every gateway: this one's own (exact) plus the others' shared counts of the endpoint's replicas (at most a
        publish period old), so that N gateways do not let N queue depths in."""
        ep_out = self.ep_outstanding
        counts = {b.endpoint_id: ep_out.get(b.endpoint_id, 0) for b in backends}
        others = self.shared.others if self.shared is not None else None
        if others:
            for b in backends:
                n = others.get(b.url)
                if n:
                    counts[b.endpoint_id] += n
        return {b.endpoint_id for b in backends if counts[b.endpoint_id] >= b.queue_depth}

    async def agree_home(self, backends, *, staged: bool | None, key: bytes | None) -> None:
        """A prefix key new to this gateway gets the home every gateway uses (SharedRouting.claim_home: the first
        gateway's choice), not only this one's: one Redis round trip, for a key not seen here only (a conversation's
        later turns are local hits), and not waited for while no other gateway publishes counts. While Redis is
        unreachable this gateway's own choice stands."""
        shared = self.shared
        if key is None or shared is None or not shared.up or self.prefix_homes.home_of(key) is not None:
            return
        choice = self.pick(backends, set(), staged=staged, key=key)  # a new key: recorded here, least loaded
        if choice is None or self.prefix_homes.home_of(key) != choice.url:
            return  # not routed by prefix (a side with a least-outstanding endpoint in it)
        claim = self._claim(key, choice.url, [b.url for b in backends])
        if shared.peers:
            await claim
        else:  # alone: recorded for gateways that start later, off the request's path
            task = asyncio.create_task(claim)
            self.claims.add(task)
            task.add_done_callback(self.claims.discard)

    async def _claim(self, key: bytes, choice: str, urls: list[str]) -> None:
        assert self.shared is not None
        home = await self.shared.claim_home(key, choice, urls)
        if home is not None and home != choice:
            self.prefix_homes.set_home(key, home)

    # --- ASGI --------------------------------------------------------------------------

    async def __call__(self, scope, receive, send):
        await self.handle(scope, receive, send)  # an ASGI app returns None

    async def handle(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    try:
                        await self.startup()
                    except Exception as exc:
                        log.exception("gateway start-up failed")
                        await send({"type": "lifespan.startup.failed", "message": str(exc)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        headers = dict(scope["headers"])
        if path == "/healthz":
            return await self.health(send, headers)
        start = time.perf_counter()
        key = await self.authenticate(headers)
        if key is None:
            return await _error(
                send, 401, "A valid gateway API key is needed (Authorization: Bearer gk_…).", "invalid_api_key"
            )
        if path == "/v1/models" and method == "GET":
            return await self.list_models(send, key)
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions", "/generate"):
            return await _error(send, 404, f"No route {method} {path}.", "not_found")
        body = await _read_body(receive)
        if body is None:
            return await _error(send, 413, "The request body is too large.", "too_large")
        try:
            payload = json.loads(body or b"{}")
            if not isinstance(payload, dict):
                raise ValueError
        except (ValueError, RecursionError):  # RecursionError: "[[[[…" nested past the parser's depth
            return await _error(send, 400, "The body must be a JSON object.", "invalid_request_error")
        generate = path == "/generate"
        model = payload.get("model")
        if generate and not model:
            model = self.default_model(key)
        if not isinstance(model, str) or not model:
            return await _error(send, 400, "Say which model: \"model\" is missing.", "invalid_request_error")
        REQUEST_MODEL.set(model)  # this request's task only: finish() counts a LoRA adapter's usage by it
        if model not in self.table.known or not self.may_use(key, model):
            # A model outside the key's scope (or team) is answered as one that does not exist: a key learns nothing
            # of the models it may not use.
            return await self.refuse(
                send, key, None, start, 404, f"The model {model!r} does not exist.", "model_not_found"
            )
        backends = [b for b in self.table.backends.get(model, ()) if key.allows_backend(b, model)]
        # None ready, but an endpoint of the model scaled to zero that this key may use: wake it and wait.
        asleep: list[Wakeable | Loadable] = []
        if not backends:
            asleep = [w for w in self.table.wakeable.get(model, ()) if key.allows_backend(w, model)]
        # None ready holds this LoRA adapter, but an endpoint that loads adapters on request may: load it and wait.
        if not backends and not asleep:
            asleep = [w for w in self.table.loadable.get(model, ()) if key.allows_backend(w, model)]
        if not backends and not asleep:
            return await self.refuse(
                send,
                key,
                None,
                start,
                503,
                f"No replica of {model!r} is ready; try again shortly.",
                "unavailable",
                retry_after=settings.GATEWAY_RETRY_AFTER_SECONDS,
            )
        estimate = token_estimate(payload, route=path, context=self.table.context.get(model))
        assert self.limits is not None  # made at startup, before any request
        reservation = await self.admit(key, estimate)
        if not reservation.admitted:
            if reservation.bound is not None:  # a token budget: until its period's reset
                spent = reservation.bound.budget
                return await self.refuse(
                    send,
                    key,
                    None,
                    start,
                    429,
                    f"The {spent.owner}'s token budget for this {spent.period} is spent"
                    + (" (the request waited in its queue)." if spent.mode == "queue" else "."),
                    "budget_exceeded",
                    retry_after=math.ceil(reservation.wait),
                )
            if reservation.unavailable:
                return await self.refuse(
                    send,
                    key,
                    None,
                    start,
                    503,
                    "This key's limits cannot be checked right now; try again shortly.",
                    "limits_unavailable",
                    retry_after=1,
                )
            return await self.refuse(
                send,
                key,
                None,
                start,
                429,
                "This key is over its per-minute limit.",
                "rate_limit_exceeded",
                retry_after=math.ceil(reservation.wait),
            )
        notice = ""
        if reservation.each < estimate.each:
            # Admitted with what is left of the key's tokens this minute: its completion limit lowered, and said.
            payload[estimate.limit_field] = reservation.each
            which = (
                f"the {reservation.bound.budget.owner}'s token budget for this {reservation.bound.budget.period} left"
                if reservation.bound is not None
                else "the key's tokens per minute left"
            )
            notice = (
                f"{estimate.limit_field} lowered from {estimate.asked if estimate.asked is not None else 'unset'} "
                f"to {reservation.each}: {which}"
            )
            body = json.dumps(payload).encode()
        if generate:
            upstream_path = "/v1/completions"
            prompt = payload.get("prompt")
            if not isinstance(prompt, str):
                return await self.refuse(
                    send,
                    key,
                    None,
                    start,
                    400,
                    "\"prompt\" must be a string.",
                    "invalid_request_error",
                    reservation=reservation,
                )
            payload = {k: v for k, v in payload.items() if k in {"max_tokens", "temperature", "top_p", "stop", "seed"}}
            payload.update(model=model, prompt=prompt, stream=False)
            payload.setdefault("max_tokens", 64)
            body = json.dumps(payload).encode()
        else:
            upstream_path = path
        if not backends:
            target = asleep[0]
            if self.held[target.endpoint_id] >= self.table.max_queue.get(
                target.endpoint_id, settings.GATEWAY_QUEUE_DEPTH
            ):
                return await self.queue_full(send, key, target.endpoint_id, model, start, reservation)
            adapter_id = getattr(target, "adapter_id", None)  # a LoRA adapter to load (selectors.Loadable)
            backends = await self.hold(receive, key, model, target.endpoint_id, adapter_id=adapter_id)
            if backends is GONE:  # the client left: nothing to answer, nothing used
                await self.limits.settle(reservation, 0)
                return None
            if backends is None and adapter_id is not None:
                why = self.load_failed.get((target.endpoint_id, adapter_id), "it was not loaded in time")
                return await self.refuse(
                    send,
                    key,
                    target.endpoint_id,
                    start,
                    503,
                    f"The LoRA adapter {model!r} could not be loaded on {target.endpoint_name}: {why}",
                    "unavailable",
                    retry_after=settings.GATEWAY_RETRY_AFTER_SECONDS,
                    reservation=reservation,
                )
            if backends is None:
                timeout = settings.GATEWAY_WAKE_TIMEOUT_SECONDS
                return await self.refuse(
                    send,
                    key,
                    target.endpoint_id,
                    start,
                    503,
                    f"{model!r} is starting (it was scaled to zero) and was not ready within {timeout:g} s; "
                    "try again shortly.",
                    "unavailable",
                    retry_after=settings.GATEWAY_RETRY_AFTER_SECONDS,
                    reservation=reservation,
                )
        # The compiled data path says itself when a client leaves: it watches, with no task to spare.
        forwarder = scope.get("extensions", {}).get(DATAPLANE_EXTENSION)
        watch = forwarder.watch(send) if forwarder is not None else _ClientWatch(receive, send)
        # A disaggregated endpoint's request goes to a prefill replica, then a decode one (proxy_disaggregated).
        relay = self.proxy_disaggregated if any(b.role for b in backends) else self.proxy
        ticket = self.journal.ticket() if self.journal is not None else None
        REQUEST_TICKET.set(ticket)
        try:
            return await relay(
                watch.send,
                key,
                model,
                backends,
                upstream_path,
                headers,
                body,
                start,
                generate,
                reservation,
                payload,
                forwarder,
                notice,
            )
        except asyncio.CancelledError:
            if not watch.left:
                raise
            task = asyncio.current_task()
            assert task is not None  # a request's handler runs in a task of its own
            task.uncancel()  # ours, not the server's: the request ends here
            log.info("gateway: the client of a %s request for %r left before its answer: dropped", path, model)
            # nginx's "client closed request"; no endpoint figures (a cut-short latency), the estimate stays used.
            return await self.finish(None, key, None, start, 499)
        finally:
            watch.close()
            if ticket is not None and self.journal is not None:
                self.journal.forget(ticket)  # settled by finish() as a rule; this covers an exception

    async def admit(self, key, estimate):
        """The request's admission by the key's limits and budgets (endpoints/gateway/limits.py). Refused by a budget in
        queue mode, it is tried again, backing off, until it fits or GATEWAY_BUDGET_QUEUE_SECONDS are over (then it is
        refused as a hard budget's would be): other requests' settlements give back what their estimates held."""
        assert self.limits is not None  # made at startup, before any request
        deadline = time.monotonic() + settings.GATEWAY_BUDGET_QUEUE_SECONDS
        delay = 0.1
        while True:
            admission = await self.limits.admit(
                key,
                prompt=estimate.prompt,
                completions=estimate.completions,
                each=estimate.each,
                seed=self.seed_budgets,
            )
            queued = admission.bound is not None and admission.bound.budget.mode == "queue"
            left = deadline - time.monotonic()
            if admission.admitted or not queued or left <= 0:
                return admission
            await asyncio.sleep(min(delay, left))  # the last try at the deadline
            delay = min(2.0, delay * 2)

    async def seed_budgets(self, counted) -> list[int]:
        """The tokens metered so far in each budget's period: where a budget's counter starts when Redis has none."""
        return await _db(lambda: [budget_used(budget=c.budget, since=c.start) for c in counted])

    async def hold(self, receive, key, model: str, endpoint_id: int, *, adapter_id: int | None = None):
        """Hold a request for `model` while its endpoint `endpoint_id`, scaled to zero, wakes: ask for a
        replica once (one wake in flight per endpoint, shared by the requests held for it), look again at
        each routing table refresh (every GATEWAY_WAKE_POLL_SECONDS while anything is held) until a replica
        the key may use is ready. The backends; None after GATEWAY_WAKE_TIMEOUT_SECONDS; GONE if the
        client disconnected. Counted in self.held meanwhile (flushed as gw.waiting).
        With `adapter_id`, the endpoint is up and `model` is a LoRA adapter it does not hold: load it instead (one
        load in flight per endpoint and adapter); None at once if the load failed (self.load_failed says why)."""
        self.held[endpoint_id] += 1
        if self.poller is None or self.poller.done():
            self.poller = asyncio.create_task(self._poll_while_held())
        gone = asyncio.ensure_future(_disconnected(receive))
        deadline = time.monotonic() + settings.GATEWAY_WAKE_TIMEOUT_SECONDS
        try:
            while True:
                backends = [b for b in self.table.backends.get(model, ()) if key.allows_backend(b, model)]
                if backends:
                    return backends
                if adapter_id is not None:
                    loading = (endpoint_id, adapter_id)
                    if loading in self.load_failed:
                        return None
                    if loading not in self.loading:
                        self.loading[loading] = asyncio.create_task(self.load_adapter(endpoint_id, adapter_id))
                asleep = adapter_id is None and any(
                    w.endpoint_id == endpoint_id and w.replicas == 0 for w in self.table.wakeable.get(model, ())
                )
                if asleep and endpoint_id not in self.waking:
                    self.waking[endpoint_id] = asyncio.create_task(self.wake(endpoint_id))
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                changed = asyncio.ensure_future(self.routes_changed.wait())
                done, _ = await asyncio.wait({changed, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if gone in done:
                    return GONE
        finally:
            gone.cancel()
            self.held[endpoint_id] -= 1

    async def wake(self, endpoint_id: int):
        """Scale the endpoint from 0 to 1 (a no-op if another gateway or the controller did), then read the
        routes at once so the held requests see the endpoint waking."""
        try:
            _, woken = await _db(
                functools.partial(endpoint_wake, endpoint_id=endpoint_id, via="gateway", waiting=self.held[endpoint_id])
            )
            if woken:
                log.info("gateway: woke endpoint %s for %s held request(s)", endpoint_id, self.held[endpoint_id])
        except Exception:
            log.exception("gateway: waking endpoint %s failed", endpoint_id)
        finally:
            self.waking.pop(endpoint_id, None)
        await self.refresh_table()

    async def load_adapter(self, endpoint_id: int, adapter_id: int):
        """Load a LoRA adapter on every ready replica of the endpoint (endpoints.lora.endpoint_adapter_change:
        recorded and audited as the gateway's), then read the routes at once so the held requests find it. A
        refusal is kept for GATEWAY_RETRY_AFTER_SECONDS, so the requests held for it answer at once."""
        loading = (endpoint_id, adapter_id)
        try:
            await _db(
                functools.partial(_load_adapter, endpoint_id=endpoint_id, adapter_id=adapter_id),
            )
            log.info("gateway: loaded LoRA adapter %s on endpoint %s on request", adapter_id, endpoint_id)
        except Exception as exc:  # noqa: BLE001 (any refusal is the held requests' answer)
            self.load_failed[loading] = " ".join(getattr(exc, "messages", None) or [str(exc)])
            asyncio.get_running_loop().call_later(
                settings.GATEWAY_RETRY_AFTER_SECONDS, self.load_failed.pop, loading, None
            )
            log.warning("gateway: loading LoRA adapter %s on endpoint %s failed: %s", adapter_id, endpoint_id, exc)
        finally:
            self.loading.pop(loading, None)
        await self.refresh_table()

    async def _poll_while_held(self):
        while any(self.held.values()):
            await asyncio.sleep(settings.GATEWAY_WAKE_POLL_SECONDS)
            await self.refresh_table()

    def may_use(self, key, model: str) -> bool:
        """Within the key's scope, and served by an endpoint of the key's team (another team's model: as unknown)."""
        if key.team_id is not None and key.team_id not in self.table.teams.get(model, ()):
            return False
        return key.allows_model(model) and not (
            key.endpoints and model not in key.models and not (key.endpoint_names & self.table.known[model])
        )

    async def health(self, send, headers):
        """A status for anyone (load balancers); the models and their ready replicas only for the
        holder of METRICS_TOKEN (operators' monitoring), never to an anonymous caller."""
        payload: dict[str, object] = {"status": "ok"}
        token = settings.METRICS_TOKEN
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if token and hmac.compare_digest(auth.encode(), f"Bearer {token}".encode()):
            payload["replicas"] = {m: len(b) for m, b in self.table.backends.items()}
            payload["held"] = sum(self.held.values())  # requests waiting for an endpoint to wake
            payload["dataplane"] = self.dataplane
        return await _json(send, 200, payload)

    def default_model(self, key):
        names = [m for m in self.table.backends if self.may_use(key, m)]
        return names[0] if len(names) == 1 else None

    async def list_models(self, send, key):
        created = int(time.time())
        data = [
            {
                "id": m,
                "object": "model",
                "created": created,
                "owned_by": "console",
                "ready_replicas": len(self.table.backends.get(m, ())),
            }
            for m in sorted(self.table.known)
            if self.may_use(key, m)
        ]
        return await _json(send, 200, {"object": "list", "data": data})

    async def finish(self, send, key, endpoint_id, start, status, ttft=None, tokens=0, reservation=None, usage=(0, 0)):
        """Account for one answered request: its figures, its metered usage (the engine's `usage`: prompt and
        completion tokens; a stream cut short before its usage counts its events as completion tokens) and its
        reservation settled to that usage."""
        prompt, completion = usage
        if prompt or completion:
            tokens = prompt + completion
        else:
            completion = tokens
        self.stats.record(
            endpoint_id=endpoint_id,
            key_id=key.id if key else None,
            status=status,
            latency=time.perf_counter() - start,
            ttft=ttft,
            tokens=tokens,
        )
        if adapter := self.adapter_asked(endpoint_id):
            self.stats.record_adapter(endpoint_id=endpoint_id, name=adapter, status=status, tokens=tokens)
        if (row := self.usage_row(key, endpoint_id)) is not None:
            if self.journal is not None:
                ticket = REQUEST_TICKET.get()
                REQUEST_TICKET.set(None)
                self.journal.record(row=row, status=status, prompt=prompt, completion=completion, ticket=ticket)
            else:
                self.stats.record_usage(row=row, status=status, prompt=prompt, completion=completion)
        if reservation is not None:
            assert self.limits is not None  # a reservation comes from the limits (made at startup)
            totals = await self.limits.settle(reservation, tokens)  # the real usage replaces the estimate
            self.soft_alerts(totals)
        return status

    def usage_row(self, key, endpoint_id) -> tuple | None:
        """The UsageHour row this request of `key` counts in, at this hour: (hour, team id, key id, key name, endpoint
        id, model asked, LoRA adapter or ""); None without a key."""
        if key is None:
            return None
        model, adapter = REQUEST_MODEL.get(), self.adapter_asked(endpoint_id)
        # A model the table does not know is metered as "": a client cannot make rows of names it makes up.
        asked = model if (model is not None and model in self.table.known) or adapter else ""
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        return (hour, key.team_id, key.id, key.name, endpoint_id, asked, adapter)

    def adapter_asked(self, endpoint_id) -> str:
        """The LoRA adapter this request asked for by name, where `endpoint_id` serves it as one; else ""."""
        model = REQUEST_MODEL.get()
        if endpoint_id is not None and model is not None and endpoint_id in self.table.adapters.get(model, ()):
            return model  # its usage row's model is the endpoint's (store_gateway_stats reads it)
        return ""

    def dispatching(self, key, endpoint_id: int) -> None:
        """The request goes to a replica of `endpoint_id` now: journaled as in flight until it is settled."""
        ticket = REQUEST_TICKET.get()
        if ticket is not None and self.journal is not None and (row := self.usage_row(key, endpoint_id)) is not None:
            self.journal.dispatched(ticket, row=row)

    def store_orphaned_journals(self) -> None:
        """The usage journals of this host's gateways that died (killed, or stopped before their last flush): what
        they had not stored, stored now (usage_journal.py). On the database thread."""
        assert self.journal is not None
        directory = self.journal.directory
        for name, fd in usage_journal.orphans(directory, own=self.journal.name):
            done = False
            try:
                stored = store_journal(
                    journal=name, segments=usage_journal.segments_of(directory, name), finished=True, died=True
                )
                done = True
                if stored:
                    log.warning("gateway: stored %d usage segment(s) a stopped gateway (%s) had not", stored, name)
            finally:
                usage_journal.release(directory, name, fd, done=done)

    def soft_alerts(self, totals) -> None:
        """Note the soft budgets this settlement took past 80 % or 100 % of their period (once per gateway and
        period; the flush raises each alert once for all gateways: endpoints.gateway.services.budget_alert)."""
        for counted, total in totals:
            budget = counted.budget
            if budget.enforced or total < 0:
                continue
            for percent in (80, 100):
                if total * 100 >= budget.tokens * percent:
                    mark = (budget.id, percent, counted.start, counted.reset)
                    if mark not in self.budget_alerted:
                        self.budget_alerted.add(mark)
                        self.stats.budget_alerts[mark] = total

    async def refuse(self, send, key, endpoint_id, start, status, message, code, *, retry_after=None, reservation=None):
        """Answer the request with an OpenAI-style error and account for it as answered (finish)."""
        answered = await _error(send, status, message, code, retry_after=retry_after)
        return await self.finish(send, key, endpoint_id, start, answered, reservation=reservation)

    async def queue_full(self, send, key, endpoint_id, model, start, reservation):
        """The 429 of a model whose endpoint's queue is full (held, or every replica at its queue depth)."""
        message = f"The queue of {model!r} is full; try again shortly."
        return await self.refuse(
            send, key, endpoint_id, start, 429, message, "queue_full", retry_after=1, reservation=reservation
        )

    async def proxy(
        self,
        send,
        key,
        model,
        backends,
        path,
        headers,
        body,
        start,
        generate,
        reservation=None,
        payload=None,
        forwarder=None,
        notice="",
    ):
        """Send the request to a replica (another one if it cannot be reached) and relay its answer: here, or,
        given the compiled data path's `forwarder`, there (the same decisions, its HTTP)."""
        if forwarder is None:
            fwd, fwd_engine = _forwarded(headers, engine=False), _forwarded(headers, engine=True)
        tried: set = set()
        last_endpoint = None
        # Decided once per request (a retry stays on the same side and key order).
        percent = self.table.canary.get(model)
        staged = routing.staged_takes_it(percent) if percent else None
        prefix = None
        if model in self.table.prefix and payload is not None:
            leading = routing.prefix_key(payload, chars=self.prefix_chars, tokens=max(1, self.prefix_chars // 4))
            prefix = routing.home_key(model=model, staged=bool(staged), leading=leading) if leading else None
            await self.agree_home(backends, staged=staged, key=prefix)
        while True:
            backend = self.pick(backends, tried, staged=staged, key=prefix)
            if backend is None:
                if not tried and self.full_endpoints(backends):
                    return await self.queue_full(send, key, backends[0].endpoint_id, model, start, reservation)
                return await self.refuse(
                    send,
                    key,
                    last_endpoint,
                    start,
                    503,
                    f"No replica of {model!r} answered; try again shortly.",
                    "unavailable",
                    retry_after=settings.GATEWAY_RETRY_AFTER_SECONDS,
                    reservation=reservation,
                )
            tried.add(backend.url)
            last_endpoint = backend.endpoint_id
            self.dispatching(key, backend.endpoint_id)
            self.outstanding[backend.url] += 1
            self.ep_outstanding[backend.endpoint_id] += 1
            try:
                if forwarder is not None:
                    outcome = await forwarder.forward(
                        backend.url + path,
                        backend.api_key,
                        body,
                        whole=generate,
                        engine_headers=backend.engine_headers,
                        notice=notice,
                    )
                    if outcome.kind == "connect":
                        self.down_until[backend.url] = time.monotonic() + DOWN_SECONDS
                        log.warning(
                            "gateway: %s (%s#%s) failed: %s; trying another replica",
                            backend.url,
                            backend.endpoint_name,
                            backend.replica_index,
                            outcome.error,
                        )
                        continue
                    if outcome.kind == "error":
                        log.warning("gateway: %s failed: %s", backend.url, outcome.error)
                        return await self.refuse(
                            send,
                            key,
                            backend.endpoint_id,
                            start,
                            502,
                            f"The replica failed: {outcome.error}.",
                            "bad_gateway",
                            reservation=reservation,
                        )
                    return await self.relayed(send, key, backend, outcome, start, generate, reservation)
                assert self.client is not None  # made at startup on the Python data path, the only one here
                try:
                    response = await self.client.post(
                        backend.url + path,
                        data=body,
                        headers=[
                            *(fwd_engine if backend.engine_headers else fwd),
                            ("Authorization", f"Bearer {backend.api_key}"),
                        ],
                    )
                except RETRYABLE as exc:
                    self.down_until[backend.url] = time.monotonic() + DOWN_SECONDS
                    log.warning(
                        "gateway: %s (%s#%s) failed: %r; trying another replica",
                        backend.url,
                        backend.endpoint_name,
                        backend.replica_index,
                        exc,
                    )
                    continue
                except UPSTREAM_ERRORS as exc:
                    log.warning("gateway: %s failed: %r", backend.url, exc)
                    return await self.refuse(
                        send,
                        key,
                        backend.endpoint_id,
                        start,
                        502,
                        f"The replica failed: {type(exc).__name__}.",
                        "bad_gateway",
                        reservation=reservation,
                    )
                try:
                    return await self.relay(send, key, backend, response, start, generate, reservation, notice)
                except asyncio.CancelledError:
                    response.close()  # the connection drops, and vLLM aborts the request
                    raise
                finally:
                    response.release()
            finally:
                self.outstanding[backend.url] -= 1
                self.ep_outstanding[backend.endpoint_id] -= 1

    async def proxy_disaggregated(
        self,
        send,
        key,
        model,
        backends,
        path,
        headers,
        body,
        start,
        generate,
        reservation=None,
        payload=None,
        forwarder=None,
        notice="",
    ):
        """A request for a disaggregated endpoint (endpoints/gateway/disagg.py says how it is split): its prefill on
        the least-loaded prefill replica (another one if that one cannot be reached, fails or times out; a 4xx, the
        request's own fault, is answered as it came), then proxy() sends it to the least-loaded decode replica with
        the prefill's kv_transfer_params and relays that answer (streamed if asked; another decode replica if one
        cannot be reached). No replica of a role left: a 503 or 502 naming the role."""
        prefills = [b for b in backends if b.role == "prefill"]
        decodes = [b for b in backends if b.role == "decode"]
        missing = [role for role, ready in (("prefill", prefills), ("decode", decodes)) if not ready]
        if missing:
            return await self.refuse(
                send,
                key,
                backends[0].endpoint_id,
                start,
                503,
                f"No {' or '.join(missing)} replica of {model!r} is ready; try again shortly.",
                "unavailable",
                retry_after=settings.GATEWAY_RETRY_AFTER_SECONDS,
                reservation=reservation,
            )
        prefill_request = disagg.prefill_body(payload or {})
        tried: set = set()
        failures: list[str] = []
        while True:
            backend = self.pick(prefills, tried)
            if backend is None:
                if not tried:  # every prefill replica is at its endpoint's queue depth
                    return await self.queue_full(send, key, prefills[0].endpoint_id, model, start, reservation)
                return await self.refuse(
                    send,
                    key,
                    prefills[0].endpoint_id,
                    start,
                    502,
                    f"No prefill replica of {model!r} could prefill the request ({'; '.join(failures)}).",
                    "bad_gateway",
                    reservation=reservation,
                )
            tried.add(backend.url)
            self.dispatching(key, backend.endpoint_id)
            self.outstanding[backend.url] += 1
            self.ep_outstanding[backend.endpoint_id] += 1
            try:
                status, answer, error = await self._prefill(backend, path, headers, prefill_request, forwarder)
            finally:
                self.outstanding[backend.url] -= 1
                self.ep_outstanding[backend.endpoint_id] -= 1
            where = f"{backend.endpoint_name}#{backend.replica_index}"
            if error:
                log.warning(
                    "gateway: prefill on %s (%s) failed: %s; trying another prefill replica", backend.url, where, error
                )
                failures.append(f"{where}: {error}")
                continue
            if 400 <= status < 500:  # the request's own fault: another replica would say the same
                await _answer_whole(send, status, answer, "application/json", False)
                return await self.finish(send, key, backend.endpoint_id, start, status, reservation=reservation)
            try:
                if status != 200:
                    raise ValueError(f"HTTP {status}")
                kv_params = disagg.kv_params_of(answer)
            except ValueError as exc:  # RecursionError and JSON's errors are ValueErrors
                log.warning(
                    "gateway: prefill on %s (%s) answered %s; trying another prefill replica", backend.url, where, exc
                )
                failures.append(f"{where}: {exc}")
                continue
            break
        return await self.proxy(
            send,
            key,
            model,
            decodes,
            path,
            headers,
            disagg.decode_body(payload or {}, kv_params),
            start,
            generate,
            reservation,
            payload,
            forwarder,
            notice,
        )

    async def _prefill(self, backend, path, headers, body, forwarder) -> tuple[int, bytes, str]:
        """(status, whole answer, "") of one prefill request, or (0, b"", why) where none came: not reached,
        cut off, timed out. Through the compiled data path when it carries the request (a whole answer comes
        back here; it waits for the next step), else this process's client."""
        if forwarder is not None:
            outcome = await forwarder.forward(backend.url + path, backend.api_key, body, whole=True)
            if outcome.kind != "done":
                if outcome.kind == "connect":
                    self.down_until[backend.url] = time.monotonic() + DOWN_SECONDS
                return 0, b"", outcome.error or outcome.kind
            return outcome.status, outcome.data, ""
        fwd = [*_forwarded(headers, engine=backend.engine_headers), ("Authorization", f"Bearer {backend.api_key}")]
        assert self.client is not None  # made at startup on the Python data path, the only one here
        try:
            async with self.client.post(backend.url + path, data=body, headers=fwd) as response:
                return response.status, await response.read(), ""
        except RETRYABLE as exc:
            self.down_until[backend.url] = time.monotonic() + DOWN_SECONDS
            return 0, b"", type(exc).__name__
        except UPSTREAM_ERRORS as exc:
            return 0, b"", type(exc).__name__ or "timeout"

    async def relay(self, send, key, backend, response, start, generate, reservation=None, notice=""):
        status = response.status
        content_type = response.headers.get("content-type", "")
        streaming = content_type.startswith("text/event-stream")
        if generate or not streaming:
            try:
                data = await response.read()
            except UPSTREAM_ERRORS as exc:
                return await self.refuse(
                    send,
                    key,
                    backend.endpoint_id,
                    start,
                    502,
                    f"The replica failed mid-answer: {type(exc).__name__}.",
                    "bad_gateway",
                    reservation=reservation,
                )
            await _answer_whole(send, status, data, content_type, generate, notice)
            # One answer at the end: no first token to time (its latency is the whole).
            return await self.finish(
                send, key, backend.endpoint_id, start, status, usage=_usage_tokens(data), reservation=reservation
            )
        out_headers = [
            (b"content-type", content_type.encode()),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *([(NOTICE_HEADER, notice.encode())] if notice else []),
        ]
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        ttft, events, usage, tail = None, 0, (0, 0), b""
        try:
            async for chunk in response.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - start
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                events += chunk.count(b"data: {")
                if b'"usage"' in chunk or tail:
                    tail = (tail + chunk)[-TAIL_BYTES:]
        except UPSTREAM_ERRORS as exc:
            # Headers are gone already: end the stream with an error event the client can see.
            log.warning("gateway: %s broke mid-stream: %r", backend.url, exc)
            await send({"type": "http.response.body", "body": STREAM_ERROR, "more_body": False})
            return await self.finish(
                send, key, backend.endpoint_id, start, 502, ttft=ttft, tokens=events, reservation=reservation
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if tail:
            usage = _stream_usage(tail)
        return await self.finish(
            send,
            key,
            backend.endpoint_id,
            start,
            status,
            ttft=ttft,
            tokens=events,
            usage=usage,
            reservation=reservation,
        )

    async def relayed(self, send, key, backend, outcome, start, generate, reservation=None):
        """Account for an answer the compiled data path relayed, as relay() does for its own; a /generate
        answer comes back whole and is answered from here."""
        if outcome.kind == "mid":
            if outcome.streamed:  # the data path ended the stream with an error event
                log.warning("gateway: %s broke mid-stream: %s", backend.url, outcome.error)
                return await self.finish(
                    send,
                    key,
                    backend.endpoint_id,
                    start,
                    502,
                    ttft=outcome.ttft,
                    tokens=outcome.events,
                    reservation=reservation,
                )
            return await self.refuse(
                send,
                key,
                backend.endpoint_id,
                start,
                502,
                f"The replica failed mid-answer: {outcome.error}.",
                "bad_gateway",
                reservation=reservation,
            )
        if outcome.streamed:
            usage = _stream_usage(outcome.data) if outcome.data else (0, 0)
            return await self.finish(
                send,
                key,
                backend.endpoint_id,
                start,
                outcome.status,
                ttft=outcome.ttft,
                tokens=outcome.events,
                usage=usage,
                reservation=reservation,
            )
        if generate:
            await _answer_whole(send, outcome.status, outcome.data, outcome.content_type, generate)
        return await self.finish(
            send,
            key,
            backend.endpoint_id,
            start,
            outcome.status,
            usage=_usage_tokens(outcome.data),
            reservation=reservation,
        )


async def _answer_whole(send, status: int, data: bytes, content_type: str, generate: bool, notice: str = "") -> None:
    """A replica's whole answer to the client: as it came, or for /generate, its text alone."""
    extra = [(NOTICE_HEADER, notice.encode())] if notice else []
    if generate and status == 200:
        try:
            text = json.loads(data)["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            text = ""
        await _json(send, 200, {"text": text}, extra)
    else:
        await _raw(send, status, data, content_type, extra)


@dataclass(frozen=True, slots=True)
class Estimate:
    """What a request may make the engine use, read as vLLM 0.32 reads it: `prompt` tokens (about 4 characters a
    token), `completions` completions (n for each prompt) of up to `each` tokens, that limit given in
    `limit_field` (`asked`: as the client gave it, None if not)."""

    prompt: int
    completions: int
    each: int
    limit_field: str
    asked: int | None

    @property
    def tokens(self) -> int:
        return self.prompt + self.completions * self.each


def _whole_number(value) -> int | None:
    """A count as vLLM's request models take it (pydantic's lax int, vllm/entrypoints/serve/engine/protocol.py
    OpenAIBaseModel): an int, a float with no fraction ("max_tokens": 60.0) or a string of digits; None otherwise
    (vLLM refuses it: the estimate then takes the route's default)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value.strip())
    return None


def token_estimate(payload: dict, *, route: str, context: int | None) -> Estimate:
    """The most a request may use, reserved against the key's tokens per minute before it is admitted.

    The completion limit each route honours (vLLM 0.32):
    - /v1/chat/completions: max_completion_tokens if given, else max_tokens (chat_completion/serving.py, the
      get_max_tokens call); neither: the rest of the context, max_model_len - prompt (serve/utils/api_utils.py
      get_max_tokens: model_max_tokens), so prompt + completion is the whole context;
    - /v1/completions: max_tokens, default 16 (completion/protocol.py CompletionRequest.max_tokens = 16; an
      explicit null: the rest of the context as above); max_completion_tokens is not read there;
    - /generate (this gateway's): max_tokens, default 64 (sent to /v1/completions).
    n completions per prompt (chat_completion/protocol.py and completion/protocol.py `n`, default 1), and a
    completions prompt given as a list of prompts is one request per prompt (completion/serving.py)."""
    context = context or settings.GATEWAY_DEFAULT_CONTEXT
    chat = route == "/v1/chat/completions"
    prompt = payload.get("messages") if chat else payload.get("prompt")
    prompts = 1
    if not chat and isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompts = len(prompt)  # several prompts (strings, or lists of token ids)
    if isinstance(prompt, str):
        prompt_tokens = len(prompt) // 4 + 1
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt_tokens = len(prompt)
    else:
        prompt_tokens = len(json.dumps(prompt or "")) // 4 + 1
    prompt_tokens = min(prompt_tokens, context)
    n = _whole_number(payload.get("n"))
    completions = prompts * (n if n and n > 0 else 1)
    field, asked = "max_tokens", _whole_number(payload.get("max_tokens"))
    if chat and "max_completion_tokens" in payload and payload["max_completion_tokens"] is not None:
        field, asked = "max_completion_tokens", _whole_number(payload["max_completion_tokens"])
    rest = max(1, context - prompt_tokens // prompts)
    if asked is not None and asked >= 0:
        each = min(asked, rest)
    elif route == "/generate":
        each = 64
    elif route == "/v1/completions" and "max_tokens" not in payload:
        each = 16
    else:
        each = rest
    return Estimate(prompt=prompt_tokens, completions=completions, each=max(1, each), limit_field=field, asked=asked)


def _forwarded(headers: dict, *, engine: bool) -> list[tuple[str, str]]:
    """The client's headers a replica gets (FORWARDED_HEADERS; with `engine`, ENGINE_HEADERS too), less those its
    Connection header names, and Content-Type: application/json (the body was read as a JSON object, whatever the
    client said)."""
    named = {t.strip().lower().encode() for t in headers.get(b"connection", b"").decode("latin-1").split(",")}
    allowed = FORWARDED_HEADERS | ENGINE_HEADERS if engine else FORWARDED_HEADERS
    fwd = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers.items() if k in allowed and k not in named]
    fwd.append(("Content-Type", "application/json"))
    return fwd


_USAGE_KEY = re.compile(rb'"usage"\s*:\s*')
_JSON = json.JSONDecoder()


def _usage_tokens(data: bytes) -> tuple[int, int]:
    """The answer's usage: (prompt_tokens, completion_tokens). vLLM puts "usage" after the choices, followed only by
    its own fields (kv_transfer_params, ec_transfer_params, metrics, a chat's prompt_logprobs: vLLM 0.32
    entrypoints/openai/completion/protocol.py CompletionResponse, chat_completion/protocol.py
    ChatCompletionResponse): the last "usage" key is the answer's, and only that object is decoded, not the
    whole answer (a long completion's text; the compiled data path sends only this part). Anything else
    falls back to decoding it all."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return (0, 0)
    found = _USAGE_KEY.match(data, at)
    if found:
        try:
            tail = data[found.end() :].decode()
            usage, end = _JSON.raw_decode(tail)
            if isinstance(usage, dict) and tail[end:].lstrip()[:1] in ("}", ","):  # a member of the answer
                return _split(usage)
        except (ValueError, TypeError, UnicodeDecodeError):
            pass
    try:
        return _split(json.loads(data).get("usage") or {})
    except (ValueError, AttributeError, TypeError):
        return (0, 0)


def _split(usage) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) of a `usage` object; a total alone counts as completion."""
    if not isinstance(usage, dict):
        return (0, 0)
    prompt = _whole_number(usage.get("prompt_tokens")) or 0
    completion = _whole_number(usage.get("completion_tokens"))
    if completion is None:
        completion = max(0, (_whole_number(usage.get("total_tokens")) or 0) - prompt)
    return (max(0, prompt), max(0, completion))


def _stream_usage(tail: bytes) -> tuple[int, int]:
    """A streamed answer's usage (its last event with one: vLLM's with stream_options.include_usage)."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                return _split(json.loads(line[6:]).get("usage") or {})
            except (ValueError, AttributeError, TypeError):
                return (0, 0)
    return (0, 0)


async def _read_body(receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY or message.get(TOO_LARGE):
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _disconnected(receive) -> None:
    """Returns when the client disconnects (its request body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _ClientWatch:
    """Cancels a proxied request when its client disconnects before the answer ends. uvicorn's send returns
    silently once the client is gone (uvicorn 0.54 httptools_impl ``send``: ``if self.disconnected: return``),
    so the relay would otherwise read the replica's whole answer, minutes of generation for nobody, with the
    replica counted busy meanwhile. Cancelled, the request's connection to the replica is closed (aiohttp
    drops a connection whose request or answer is cut short), and vLLM aborts the request.

    After the answer's last body message uvicorn's receive reads "http.disconnect" too; ``send`` notes that
    message first, so the end of an answer is not taken for a client leaving."""

    __slots__ = ("_send", "answered", "left", "handler", "watcher")

    def __init__(self, receive, send):
        self._send, self.answered, self.left = send, False, False
        handler = asyncio.current_task()
        assert handler is not None  # made in the request's handler, which runs in a task of its own
        self.handler = handler
        self.watcher = asyncio.ensure_future(_disconnected(receive))
        self.watcher.add_done_callback(self._on_disconnect)

    async def send(self, message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self.answered = True
        await self._send(message)

    def _on_disconnect(self, watcher) -> None:
        if not watcher.cancelled() and not self.answered:
            self.left = True
            self.handler.cancel()

    def close(self) -> None:
        self.watcher.remove_done_callback(self._on_disconnect)
        self.watcher.cancel()


async def _raw(send, status: int, body: bytes, content_type: str = "application/json", extra=()):
    headers = [
        (b"content-type", (content_type or "application/json").encode()),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return status


async def _json(send, status: int, data, extra=()):
    return await _raw(send, status, json.dumps(data).encode(), "application/json", extra)


async def _error(send, status: int, message: str, code: str, retry_after: int | None = None):
    extra = [(b"retry-after", str(retry_after).encode())] if retry_after is not None else []
    return await _json(send, status, {"error": {"message": message, "type": code, "code": status}}, extra)
