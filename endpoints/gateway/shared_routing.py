"""Routing state shared by every gateway process through Redis, so that several gateways (docs/gateway-scale-out.md)
route as one: each replica's outstanding requests, and each prefix's home replica.

Outstanding counts: a gateway counts its own requests in flight in memory (asgi.py Gateway.outstanding, exact and
free), and every GATEWAY_SHARED_ROUTING_SECONDS (10 ms) one Lua script publishes them in one Redis hash (a field per
gateway, stamped with Redis's clock) and returns the other gateways' fields that are fresh; their sum per replica is
`others`. A pick reads its own counts plus `others` (Load): no Redis round trip on a request's path, the other
gateways' requests seen at most one period (plus a round trip) late. A gateway that stops publishing (killed) drops
out after STALE_SECONDS.

Prefix homes: a prefix key new to a gateway is claimed in Redis (claim_home: one round trip, only for a key this
gateway has not seen; a conversation's later turns are local hits; not waited for while no other gateway publishes
counts, so one gateway alone has no Redis round trip on a request's path): the first gateway's choice (the least loaded
replica by the shared counts) becomes every gateway's home for that key, so a prefix stays on one replica whichever
gateway receives it. The bounded-load decision then reads the shared counts, so the gateways overflow a hot prefix
alike. A gateway refreshes the Redis entries of the keys it used every TOUCH_SECONDS (one pipeline, off the request
path), so an entry outlives every gateway's own memory of it (routing.HOME_IDLE_SECONDS).

Redis unreachable (a publish fails, or times out for longer than STALE_SECONDS): `others` is emptied and no key is
claimed, so each gateway routes on its own counts and homes (as a single gateway does) until a publish succeeds
again; logged at most every 10 s. A publish that times out within STALE_SECONDS of the last good one (a late answer on
a host whose cores the replicas keep busy: benchmarks/routing.py logged fifteen in six minutes) keeps the last counts
read, which are still fresher than the cut-off that would drop them. Requests are never refused or delayed for it:
routing state is a hint, unlike the limits (limits.py).

Written by hand over redis-py's scripts: no library keeps per-process counters with a staleness cut-off in Redis."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from endpoints.gateway import routing
from endpoints.gateway.limits import RedisDownLog

LOAD_KEY = "gw:routing:load"
HOME_PREFIX = "gw:routing:home:"
#: A gateway whose counts are older than this is gone (killed, or cut off from Redis): its counts are not read.
STALE_SECONDS = 1.0
#: How often a gateway refreshes the Redis entries of the prefix homes it used.
TOUCH_SECONDS = 30.0
#: A home's Redis entry lives this long after its last refresh: a gateway's own memory of it
#: (routing.HOME_IDLE_SECONDS) ends sooner.
HOME_TTL_MS = int((routing.HOME_IDLE_SECONDS + 2 * TOUCH_SECONDS) * 1000)
#: A shared-routing call waits at most this long for Redis: a claim is on a request's path.
TIMEOUT_SECONDS = 0.25

# KEYS: the load hash. ARGV: this gateway's name, the staleness cut-off (ms), its counts ("url\tcount" lines).
# Returns the other gateways' fresh values ("<ms>\n" then their lines); drops the stale ones.
SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stale = now - tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], now .. '\\n' .. ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 10)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local who, value = all[i], all[i + 1]
  local at = tonumber(string.match(value, '^(%d+)')) or 0
  if at < stale then
    redis.call('HDEL', KEYS[1], who)
  elseif who ~= ARGV[1] then
    out[#out + 1] = value
  end
end
return out
"""

# KEYS: the home's key. ARGV: its time to live (ms), this gateway's choice, then every replica URL now routable for
# the model. The home already recorded, if it is still routable, else this gateway's choice (recorded).
CLAIM = """
local old = redis.call('GET', KEYS[1])
if old then
  for i = 3, #ARGV do
    if ARGV[i] == old then
      redis.call('PEXPIRE', KEYS[1], ARGV[1])
      return old
    end
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
return ARGV[2]
"""


class Load(Mapping[str, int]):
    """A replica's requests in flight for routing: this gateway's own (exact) plus the other gateways' (shared, at
    most a publish period old). A read-only view: routing.py's policies call get()."""

    def __init__(self, local: Mapping[str, int], shared: SharedRouting | None):
        self.local, self.shared = local, shared

    def get(self, url, default=0):  # type: ignore[override]  # the policies' hot path: no KeyError round trip
        n = self.local.get(url, 0)
        if self.shared is not None:
            n += self.shared.others.get(url, 0)
        return n or default

    def __getitem__(self, url: str) -> int:
        return self.get(url, 0)

    def __iter__(self) -> Iterator[str]:
        return iter({*self.local, *(self.shared.others if self.shared is not None else ())})

    def __len__(self) -> int:
        return sum(1 for _ in self)


class SharedRouting:
    """One gateway's side of the shared routing state (see the module's docstring)."""

    def __init__(self, url: str | None = None, *, name: str | None = None, stale_seconds: float = STALE_SECONDS):
        self.redis = aioredis.Redis.from_url(
            url or settings.REDIS_URL,
            socket_timeout=TIMEOUT_SECONDS,
            socket_connect_timeout=TIMEOUT_SECONDS,
        )
        self.sync_script = self.redis.register_script(SYNC)
        self.claim_script = self.redis.register_script(CLAIM)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stale_ms = int(stale_seconds * 1000)
        self.others: dict[str, int] = {}  # replica url -> the other gateways' requests in flight there
        self.peers = 0  # other gateways publishing (0: this one routes alone, and claims need not be waited for)
        self.up = False  # the last publish reached Redis
        self.last_ok = 0.0  # monotonic: when a publish last reached Redis
        self.late = 0  # publishes that timed out while the last counts were still fresh (kept)
        self.touched: set[bytes] = set()  # prefix keys used since the last refresh of their entries
        self.next_touch = time.monotonic() + TOUCH_SECONDS
        self._log_down = RedisDownLog(
            "gateway: the shared routing state (Redis) is unreachable: %r; routing on this gateway's own "
            "outstanding counts and prefix homes meanwhile"
        )

    async def close(self) -> None:
        await self.redis.aclose()

    async def sync(self, local: Mapping[str, int]) -> None:
        """Publish this gateway's counts and read the others' (one round trip); on a failure, route on local counts."""
        payload = "\n".join(f"{url}\t{n}" for url, n in local.items() if n > 0)
        try:
            values = await self.sync_script(keys=[LOAD_KEY], args=[self.name, self.stale_ms, payload])
        except (RedisError, OSError) as exc:
            late = isinstance(exc, RedisTimeout | TimeoutError)
            if late and self.up and time.monotonic() - self.last_ok < self.stale_ms / 1000:
                self.late += 1  # the last counts read stand until they would be stale
                return
            self.others, self.peers, self.up = {}, 0, False
            self._log_down(exc)
            return
        self.last_ok = time.monotonic()
        others: Counter[str] = Counter()
        for value in values:
            for line in value.decode().split("\n")[1:]:
                url, _, n = line.rpartition("\t")
                if url:
                    others[url] += int(n)
        self.others, self.peers, self.up = dict(others), len(values), True
        if self.touched and time.monotonic() >= self.next_touch:
            await self.touch()

    async def touch(self) -> None:
        """Refresh the Redis entries of the homes used since the last refresh (one pipeline)."""
        keys, self.touched = self.touched, set()
        self.next_touch = time.monotonic() + TOUCH_SECONDS
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.pexpire(HOME_PREFIX + key.hex(), HOME_TTL_MS)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._log_down(exc)

    async def claim_home(self, key: bytes, choice: str, urls: Iterable[str]) -> str | None:
        """The home every gateway uses for this prefix key: the one recorded, if it is among `urls`, else `choice`
        (then recorded). None when Redis cannot be reached (the caller keeps its own choice)."""
        try:
            home = await self.claim_script(keys=[HOME_PREFIX + key.hex()], args=[HOME_TTL_MS, choice, *urls])
        except (RedisError, OSError) as exc:
            self.up = False  # no more claims until a publish succeeds again
            self._log_down(exc)
            return None
        return home.decode()
