"""The gateway keys' per-minute limits, shared by every gateway process through Redis (docs/gateway-scale-out.md).

One admission is one round trip: a Lua script (run atomically by Redis, so concurrent admissions on any number of
gateways are serialised) drops the window's expired entries, checks the key's requests and tokens in the last
minute and, if the request fits, records it in the same step. Nothing can slip in between a check and its count.

Tokens: a request reserves its estimate (what vLLM may make it use: asgi.py token_estimate); when the estimate does
not fit what is left of the key's tokens this minute but its prompt and at least one token per completion do, its
completion limit is lowered to what is left (the caller rewrites max_tokens and says so); else it is refused.
After the answer the reservation is settled to the engine's own usage (settle: a second round trip, off the
admission path).

Redis unreachable (docs/gateway-scale-out.md "When Redis is unreachable"): a key with a token limit is refused
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
from dataclasses import dataclass

import redis.asyncio as aioredis
from django.conf import settings
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger("console.gateway")

WINDOW_MS = 60_000

# KEYS: requests zset, tokens zset (reservation id -> time), tokens hash (reservation id -> tokens; "_total": their
# sum).
# ARGV: rpm limit, tpm limit, reservation id, prompt tokens, completions (n x prompts), tokens per completion.
# Returns {admitted (1/0), wait ms, tokens per completion granted, tokens reserved}.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local since = now - tonumber(ARGV[7])
local rpm, tpm, id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local prompt, completions, each = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', since)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {0, tonumber(oldest[2]) - since, 0, 0}
  end
end
local need = 0
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
  local used = tonumber(redis.call('HGET', KEYS[3], '_total') or '0')
  local left = tpm - used
  need = prompt + completions * each
  if need > left then
    local lowered = math.floor((left - prompt) / completions)
    if lowered < 1 then
      local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
      local wait = tonumber(ARGV[7])
      if oldest[2] then wait = tonumber(oldest[2]) - since end
      return {0, wait, 0, 0}
    end
    each = lowered
    need = prompt + completions * each
  end
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
return {1, 0, each, need}
"""

# A reservation settled to the real usage, if it is still in the window (an expired one is gone for good).
SETTLE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[1], '_total', tonumber(ARGV[2]) - tonumber(old))
end
return 0
"""


@dataclass(slots=True)
class Admission:
    admitted: bool
    wait: float = 0.0  # seconds until the window allows the request, when refused
    each: int = 0  # tokens per completion granted (lower than asked: the caller lowers max_tokens)
    reservation: str = ""  # settled by settle() to the real usage
    key_id: str = ""
    unavailable: bool = False  # refused because the shared counters could not be reached (fail closed)


def _keys(key_id: str) -> list[str]:
    # One hash tag per key: in a Redis Cluster the three live on one slot, as a script's keys must.
    return [f"gw:{{{key_id}}}:rpm", f"gw:{{{key_id}}}:tpm", f"gw:{{{key_id}}}:tpmv"]


class SharedLimits:
    """The per-minute request and token limits of the gateway keys, held in Redis for every gateway."""

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
        self.down_logged = 0.0

    async def close(self) -> None:
        await self.redis.aclose()

    async def admit(self, key, *, prompt: int, completions: int, each: int) -> Admission:
        """Admit one request of `key` (its rpm_limit and tpm_limit): `prompt` tokens and `completions` completions of
        up to `each` tokens. Keys with no limit pass without a round trip."""
        rpm, tpm = key.rpm_limit or 0, key.tpm_limit or 0
        if not rpm and not tpm:
            return Admission(True, each=each)
        reservation = uuid.uuid4().hex
        try:
            ok, wait_ms, granted, _ = await self.admit_script(
                keys=_keys(key.limits_id),
                args=[rpm, tpm, reservation, prompt, max(1, completions), max(1, each), WINDOW_MS],
            )
        except (RedisConnectionError, ConnectionRefusedError) as exc:
            # Not reached: nothing was counted. A token limit is refused; a request limit counts here meanwhile.
            self._log_down(exc)
            if tpm:
                return Admission(False, wait=1.0, unavailable=True)
            return self._local(key.limits_id, rpm, each)
        except (RedisError, OSError) as exc:
            # A timeout or an error mid-call: the script may have counted the request or not. Refused, so that a
            # slow Redis cannot let every gateway admit a key's requests on its own count as well.
            self._log_down(exc)
            return Admission(False, wait=1.0, unavailable=True)
        if not ok:
            return Admission(False, wait=max(0.001, wait_ms / 1000))
        return Admission(True, each=int(granted), reservation=reservation if tpm else "", key_id=key.limits_id)

    async def settle(self, admission: Admission, tokens: int) -> None:
        """Replace the admission's reserved estimate by the tokens the engine says it used."""
        if not admission.reservation:
            return
        try:
            await self.settle_script(keys=[_keys(admission.key_id)[2]], args=[admission.reservation, int(tokens)])
        except (RedisError, OSError) as exc:
            self._log_down(exc)

    def _local(self, key_id: str, rpm: int, each: int) -> Admission:
        now = time.monotonic()
        window = self.local_rpm[key_id]
        while window and window[0] <= now - WINDOW_MS / 1000:
            window.popleft()
        if len(window) >= rpm:
            return Admission(False, wait=max(1.0, WINDOW_MS / 1000 - (now - window[0])))
        window.append(now)
        return Admission(True, each=each)

    def _log_down(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self.down_logged > 10:  # once in a while, not once per request
            self.down_logged = now
            log.error(
                "gateway: the shared limits (Redis) are unreachable: %r; keys with a token limit are refused, "
                "request limits are counted per gateway meanwhile",
                exc,
            )
