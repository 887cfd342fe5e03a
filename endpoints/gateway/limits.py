"""The gateway keys' per-minute limits and the token budgets of keys and teams, shared by every gateway process
through Redis (docs/gateway-scale-out.md, docs/usage-and-budgets.md).

One admission is one round trip: a Lua script (run atomically by Redis, so concurrent admissions on any number of
gateways are serialised) drops the window's expired entries, checks the key's requests and tokens in the last
minute and, if the request fits, records it in the same step. Nothing can slip in between a check and its count.

Tokens: a request reserves its estimate (what vLLM may make it use: asgi.py token_estimate); when the estimate does
not fit what is left of the key's tokens this minute but its prompt and at least one token per completion do, its
completion limit is lowered to what is left (the caller rewrites max_tokens and says so); else it is refused.
After the answer the reservation is settled to the engine's own usage (settle: a second round trip, off the
admission path).

Budgets (a key's own and its team's, per UTC day or month) are counters of the period's tokens in the same round trip:
a hard or queue budget bounds what is left as the token limit does (the tightest of them decides, and is named), a
soft one only counts. A counter missing (its period just began, or Redis lost it) is seeded from the metered usage
(UsageHour) before the request is admitted.

Redis unreachable (docs/gateway-scale-out.md "When Redis is unreachable"): a key with a token limit, or under a hard
or queue budget, is refused
(503: fail closed, a budget cannot be held without the shared count); a key with only a request limit is counted in
this process alone meanwhile (each gateway then admits up to the limit: fail open, bounded by the number of
gateways), and a key with no limit never touches Redis. A Redis that is reached but does not answer within
GATEWAY_LIMITS_TIMEOUT_SECONDS (or fails mid-call) may have counted the request: that request is refused (503),
whatever the key's limits, rather than counted twice.

The window is Redis's clock (TIME), not the gateways': hosts whose clocks disagree still share one window.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from endpoints.gateway.selectors import BudgetInfo, period_bounds

log = logging.getLogger("console.gateway")

WINDOW_MS = 60_000

# KEYS: requests zset, tokens zset (reservation id -> time), tokens hash (reservation id -> tokens; "_total": their
# sum), then one counter per token budget (tokens used in its day or month: a team's and the key's own).
# ARGV: rpm limit, tpm limit, reservation id, prompt tokens, completions (n x prompts), tokens per completion, window
# ms, number of budgets, then per budget: its tokens, enforced (1: hard or queue, 0: soft), the counter's lifetime (s),
# its seed (what was used before, from the metered usage; -1: not read).
# Returns {admitted (1/0), wait ms, tokens per completion granted, tokens reserved, what bound it (0: nothing, 1: the
# key's rpm or tpm, 1 + i: budget i), each budget's total after the admission...}. A refusal with wait -1 asks for
# the seeds: a budget's counter is missing (its period began, or Redis lost it) and no seed was given.
ADMIT = """
local nb = tonumber(ARGV[8])
for i = 1, nb do
  local key = KEYS[3 + i]
  if redis.call('EXISTS', key) == 0 then
    local seed = tonumber(ARGV[8 + (i - 1) * 4 + 4])
    if seed < 0 then return {0, -1, 0, 0, 0} end
    redis.call('SET', key, seed, 'EX', ARGV[8 + (i - 1) * 4 + 3])
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local since = now - tonumber(ARGV[7])
local rpm, tpm, id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local prompt, completions, each = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', since)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {0, tonumber(oldest[2]) - since, 0, 0, 1}
  end
end
local left = nil
local bound = 0
if tpm > 0 then
  -- The window's total is kept in the hash (field "_total"), not summed at each admission: summing every
  -- reservation of the last minute made an admission cost grow with the key's traffic (benchmarks/gateway_scale.py).
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', since)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', since)
    local gone = 0
    for _, old in ipairs(expired) do
      local v = redis.call('HGET', KEYS[3], old)
      if v then
        gone = gone + tonumber(v)
        redis.call('HDEL', KEYS[3], old)
      end
    end
    redis.call('HINCRBY', KEYS[3], '_total', -gone)
  end
  left = tpm - tonumber(redis.call('HGET', KEYS[3], '_total') or '0')
  bound = 1
end
for i = 1, nb do
  if ARGV[8 + (i - 1) * 4 + 2] == '1' then
    local l = tonumber(ARGV[8 + (i - 1) * 4 + 1]) - tonumber(redis.call('GET', KEYS[3 + i]) or '0')
    if left == nil or l < left then
      left = l
      bound = 1 + i
    end
  end
end
local need = prompt + completions * each
local lowered_by = 0
if left ~= nil and need > left then
  local lowered = math.floor((left - prompt) / completions)
  if lowered < 1 then
    local wait = tonumber(ARGV[7])
    if bound == 1 then
      local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
      if oldest[2] then wait = tonumber(oldest[2]) - since end
    end
    return {0, wait, 0, 0, bound}
  end
  each = lowered
  need = prompt + completions * each
  lowered_by = bound
end
if tpm > 0 then
  redis.call('ZADD', KEYS[2], now, id)
  redis.call('HSET', KEYS[3], id, need)
  redis.call('HINCRBY', KEYS[3], '_total', need)
  redis.call('PEXPIRE', KEYS[2], ARGV[7] + 1000)
  redis.call('PEXPIRE', KEYS[3], ARGV[7] + 1000)
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('PEXPIRE', KEYS[1], ARGV[7] + 1000)
end
local out = {1, 0, each, need, lowered_by}
for i = 1, nb do
  out[5 + i] = redis.call('INCRBY', KEYS[3 + i], need)
end
return out
"""

# A reservation settled to the real usage: in the key's tokens window if it is still there (an expired one is gone for
# good; ARGV[1] "" when the key has no token limit), and in each budget counter (KEYS[2..]) by the difference
# ARGV[3] (real - reserved). A budget counter that is gone (Redis lost it) stays gone: the next admission seeds it
# from the metered usage, which this request will be part of. Returns each budget's total (-1: gone).
SETTLE = """
if ARGV[1] ~= '' then
  local old = redis.call('HGET', KEYS[1], ARGV[1])
  if old then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    redis.call('HINCRBY', KEYS[1], '_total', tonumber(ARGV[2]) - tonumber(old))
  end
end
local out = {}
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    out[i - 1] = redis.call('INCRBY', KEYS[i], ARGV[3])
  else
    out[i - 1] = -1
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Counted:
    """One budget an admission counts against: its counter in Redis for the current period, and that period."""

    budget: BudgetInfo
    counter: str
    start: datetime
    reset: datetime


class RedisDownLog:
    """An error about the shared state in Redis, logged once in a while (every 10 s), not once per request or
    period: a Redis that is down would otherwise fill the log."""

    def __init__(self, message: str):
        self.message = message  # with one %r: the exception
        self.logged = 0.0

    def __call__(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self.logged > 10:
            self.logged = now
            log.error(self.message, exc)


@dataclass(slots=True)
class Admission:
    admitted: bool
    wait: float = 0.0  # seconds until the window allows the request, when refused
    each: int = 0  # tokens per completion granted (lower than asked: the caller lowers max_tokens)
    reservation: str = ""  # settled by settle() to the real usage
    key_id: str = ""
    unavailable: bool = False  # refused because the shared counters could not be reached (fail closed)
    reserved: int = 0  # the tokens reserved (the estimate, or what was left), settled to the real usage
    budgets: tuple[Counted, ...] = ()  # the budgets counted (settled with the reservation)
    bound: Counted | None = None  # the budget that refused the request or lowered its completion limit
    lowered_by_key: bool = False  # the key's tokens per minute lowered it


def _keys(key_id: str) -> list[str]:
    # One hash tag per key: in a Redis Cluster the three live on one slot, as a script's keys must.
    return [f"gw:{{{key_id}}}:rpm", f"gw:{{{key_id}}}:tpm", f"gw:{{{key_id}}}:tpmv"]


def _counted(key, now: datetime) -> tuple[Counted, ...]:
    """The budget counters of a key's admission, for the periods `now` is in. A key's own budget shares the key's hash
    tag; a team's has the team's, which every key of the team shares. In a Redis Cluster the two are on different
    slots and one script cannot hold both (CROSSSLOT): a single Redis (or one primary) is what budgets need
    (docs/usage-and-budgets.md)."""
    out = []
    for b in key.budgets:
        start, reset = period_bounds(b.period, now)
        tag = key.limits_id if b.owner == "key" else f"team{b.owner_id}"
        out.append(Counted(b, f"gw:{{{tag}}}:budget:{b.period}:{start:%Y%m%d}", start, reset))
    return tuple(out)


Seeder = Callable[[tuple[Counted, ...]], Awaitable[list[int]]]


class SharedLimits:
    """The per-minute request and token limits of the gateway keys, and the token budgets of keys and teams, held in
    Redis for every gateway."""

    def __init__(self, url: str | None = None):
        self.redis = aioredis.Redis.from_url(
            url or settings.REDIS_URL,
            socket_timeout=settings.GATEWAY_LIMITS_TIMEOUT_SECONDS,
            socket_connect_timeout=settings.GATEWAY_LIMITS_TIMEOUT_SECONDS,
            max_connections=256,
        )
        self.admit_script = self.redis.register_script(ADMIT)
        self.settle_script = self.redis.register_script(SETTLE)
        self.local_rpm: dict[str, deque] = defaultdict(deque)  # the fallback while Redis is down (request limits)
        self._log_down = RedisDownLog(
            "gateway: the shared limits (Redis) are unreachable: %r; keys with a token limit or a hard or queue "
            "budget are refused, request limits are counted per gateway meanwhile"
        )

    async def close(self) -> None:
        await self.redis.aclose()

    async def admit(self, key, *, prompt: int, completions: int, each: int, seed: Seeder | None = None) -> Admission:
        """Admit one request of `key` (its rpm_limit and tpm_limit, its own and its team's budgets): `prompt` tokens
        and `completions` completions of up to `each` tokens. Keys with no limit and no budget pass without a round
        trip. A budget counter missing in Redis is seeded by `seed` (the metered usage of its period) first."""
        rpm, tpm = key.rpm_limit or 0, key.tpm_limit or 0
        budgets = _counted(key, datetime.now(UTC))
        if not rpm and not tpm and not budgets:
            return Admission(True, each=each)
        reservation = uuid.uuid4().hex
        seeds = [-1] * len(budgets)
        try:
            for _ in range(2):
                args = [rpm, tpm, reservation, prompt, max(1, completions), max(1, each), WINDOW_MS, len(budgets)]
                for c, s in zip(budgets, seeds, strict=True):
                    ttl = int((c.reset - datetime.now(UTC)).total_seconds()) + 86_400  # a day past its reset
                    args += [c.budget.tokens, 1 if c.budget.enforced else 0, ttl, s]
                ok, wait_ms, granted, reserved, bound, *_ = await self.admit_script(
                    keys=[*_keys(key.limits_id), *(c.counter for c in budgets)], args=args
                )
                if ok or wait_ms != -1 or seed is None:
                    break
                seeds = await seed(budgets)  # a counter is missing: read the period's metered usage, then again
        except (RedisConnectionError, ConnectionRefusedError) as exc:
            # Not reached: nothing was counted. A token limit or budget is refused; a request limit counts here
            # meanwhile; soft budgets go uncounted (their usage is still metered in the database).
            self._log_down(exc)
            if tpm or any(c.budget.enforced for c in budgets):
                return Admission(False, wait=1.0, unavailable=True)
            return self._local(key.limits_id, rpm, each) if rpm else Admission(True, each=each)
        except (RedisError, OSError) as exc:
            # A timeout or an error mid-call: the script may have counted the request or not. Refused, so that a
            # slow Redis cannot let every gateway admit a key's requests on its own count as well.
            self._log_down(exc)
            return Admission(False, wait=1.0, unavailable=True)
        counted = budgets[bound - 2] if bound >= 2 else None
        if not ok:
            if wait_ms == -1:  # no seed could be given (no seeder): as if Redis were unreachable
                return Admission(False, wait=1.0, unavailable=True)
            if counted is not None:  # a budget: its period's reset
                wait = (counted.reset - datetime.now(UTC)).total_seconds()
                return Admission(False, wait=max(1.0, wait), bound=counted)
            return Admission(False, wait=max(0.001, wait_ms / 1000))
        return Admission(
            True,
            each=int(granted),
            reservation=reservation if tpm else "",
            key_id=key.limits_id,
            reserved=int(reserved),
            budgets=budgets,
            bound=counted if int(granted) < each else None,
            lowered_by_key=bound == 1 and int(granted) < each,
        )

    async def settle(self, admission: Admission, tokens: int) -> list[tuple[Counted, int]]:
        """Replace the admission's reserved estimate by the tokens the engine says it used, in the key's tokens per
        minute and in each budget counted. Returns each budget's total after it (-1: its counter is gone)."""
        if not admission.reservation and not admission.budgets:
            return []
        try:
            totals = await self.settle_script(
                keys=[_keys(admission.key_id)[2], *(c.counter for c in admission.budgets)],
                args=[admission.reservation, int(tokens), int(tokens) - admission.reserved],
            )
        except (RedisError, OSError) as exc:
            self._log_down(exc)
            return []
        return list(zip(admission.budgets, (int(t) for t in totals), strict=False))

    def _local(self, key_id: str, rpm: int, each: int) -> Admission:
        now = time.monotonic()
        window = self.local_rpm[key_id]
        while window and window[0] <= now - WINDOW_MS / 1000:
            window.popleft()
        if len(window) >= rpm:
            return Admission(False, wait=max(1.0, WINDOW_MS / 1000 - (now - window[0])))
        window.append(now)
        return Admission(True, each=each)
