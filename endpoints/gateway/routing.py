"""How the gateway chooses a replica: least outstanding requests, or prefix-aware (a home
replica per request's leading content, with a bound on load), and which side of a
blue-green pair takes a request when the staged side has a canary share.

Pure functions over the counts the gateway passes in (its own plus the other gateways', shared through Redis:
endpoints/gateway/shared_routing.py), no I/O and no Django: the gateway (endpoints/gateway/asgi.py) filters out
replicas that are tried, down or whose endpoint is full, then calls these. With several gateways, a key new to one
takes the home another gateway recorded (shared_routing.SharedRouting.claim_home, then PrefixHomes.set_home).

Prefix-aware routing sends requests that start alike to the replica that has most likely
kept that start in its prefix cache (vLLM's automatic prefix caching), so it is not computed
again. The key is the request's leading content, bounded (the system prompt and first user
turn of a chat, which stay the same for every turn of a conversation; a completion prompt's
first characters or token ids), hashed once with BLAKE2b.

A key seen for the first time goes to the least loaded replica, and stays there (PrefixHomes):
vllm-router 0.1.17's cache_aware policy does the same on a prefix miss (src/policies/cache_aware.rs,
select_prepared: the least loaded worker, the prefix then recorded in that worker's tree). Hashing each key
to a replica with no memory (rendezvous hashing) split groups unevenly (benchmarks/routing.py:
docs/benchmarks.md, "Prefix-aware routing").

The load bound is "consistent hashing with bounded loads" (Mirrokni, Thorup and
Zadimoghaddam, SODA 2018, arXiv:1608.01350): with n replicas and m requests in flight
(this one included), a replica takes the request only while its load stays within
ceil(c * m / n), c = 1 + epsilon, plus an absolute slack; otherwise the request overflows to the
first replica within the bound in the key's rendezvous (highest random weight) order, a stable
second choice for a hot prefix instead of a pile-up on one replica. Some replica is always within
the bound (they cannot all be above the mean)."""

from __future__ import annotations

import hashlib
import math
import random
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

#: Characters of leading text (chat messages or a completion prompt) that make the key. Short on
#: purpose: requests that share a longer prefix (a system prompt, a few-shot block) then share a
#: key; a long key would tell apart prompts whose caches overlap.
PREFIX_CHARS = 512
#: Leading token ids that make the key of a prompt given as token ids.
PREFIX_TOKENS = 128
#: Bounded-load factor c = 1 + epsilon (Mirrokni et al.); 1.25 is KubeAI's default for the same rule.
LOAD_FACTOR = 1.25
#: A key's home is forgotten this long after its last request: a prefix unused for 10 minutes has
#: most likely left a busy replica's cache, and the homes then count only the keys in use.
HOME_IDLE_SECONDS = 600.0
#: The most keys remembered (the least recently used go first): about 200 bytes each.
HOMES_MAX = 65_536


class Routable(Protocol):
    url: str


B = TypeVar("B", bound=Routable)


def least_outstanding(
    candidates: Sequence[B], load: Mapping[str, int], rnd: Callable[[Sequence], B] = random.choice
) -> B | None:
    """The candidate with the fewest requests in flight (random among equals)."""
    best, best_n = [], None
    for b in candidates:
        n = load.get(b.url, 0)
        if best_n is None or n < best_n:
            best, best_n = [b], n
        elif n == best_n:
            best.append(b)
    return rnd(best) if best else None


def _text(content, budget: int) -> str:
    """A message's content as text, at most `budget` characters: a string, or the text (or URL) of
    its parts in order (OpenAI's content parts)."""
    if isinstance(content, str):
        return content[:budget]
    out, used = [], 0
    if isinstance(content, list):
        for part in content:
            if used >= budget or not isinstance(part, dict):
                break
            piece = part.get("text")
            if not isinstance(piece, str):
                url = part.get("image_url") or part.get("video_url") or part.get("audio_url")
                url = url.get("url") if isinstance(url, dict) else url
                piece = url if isinstance(url, str) else str(part.get("type", ""))
            piece = piece[: budget - used] if isinstance(piece, str) else ""
            out.append(piece)
            used += len(piece)
    return "\x1e".join(out)


def prefix_key(payload: Mapping, *, chars: int = PREFIX_CHARS, tokens: int = PREFIX_TOKENS) -> bytes | None:
    """The leading content of a chat or completion request, bounded, as bytes to hash; None when
    there is none to go by (then the policy falls back to least outstanding).

    Chat: the messages up to and including the first user message (system and developer prompts,
    then the first turn), as role and text, cut at `chars` characters in all: every later turn
    of the conversation has the same key. Completions: the prompt's first `chars` characters, or
    its first `tokens` token ids; of a batch, its first prompt. Never serialises a whole body."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts, used = [], 0
        for message in messages:
            if used >= chars or not isinstance(message, dict):
                break
            role = message.get("role")
            text = _text(message.get("content"), chars - used)
            parts.append(f"{role}\x1f{text}")
            used += len(text)
            if role == "user":
                break
        return "\x1d".join(parts).encode("utf-8", "surrogatepass") if parts else None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt[:chars].encode("utf-8", "surrogatepass") if prompt else None
    if isinstance(prompt, list) and prompt:
        try:  # token ids: packed in C (a float or a negative id is refused there)
            return b"\x00ids" + array("I", prompt[:tokens]).tobytes()
        except (TypeError, OverflowError):
            return None
    return None


def digest(key: bytes) -> bytes:
    """The key's hash, computed once per request."""
    return hashlib.blake2b(key, digest_size=16).digest()


def home_key(*, model: str, staged: bool, leading: bytes) -> bytes:
    """The digest a request's prefix home is kept under: per model and per side of a canary. The live and
    staged sides share the model's prompts; one key for both would home a conversation on one side and route
    it on the other by rendezvous order alone, with the other side's home counts (the tie-break) wrong."""
    return digest((b"staged\0" if staged else b"live\0") + model.encode() + b"\0" + leading)


def _score(key_digest: bytes, url: str) -> bytes:
    return hashlib.blake2b(key_digest + url.encode(), digest_size=8).digest()


def rendezvous_order(key_digest: bytes, candidates: Sequence[B]) -> list[B]:
    """Candidates by rendezvous (highest random weight) score for this key, best first: each
    replica's score depends on the key and its own URL only, so adding or removing one replica
    reorders nothing else."""
    return sorted(candidates, reverse=True, key=lambda b: _score(key_digest, b.url))


def load_bound(candidates: Sequence[B], load: Mapping[str, int], *, factor: float, slack: int) -> int:
    """The most requests one replica may run, this one included: ceil(factor * (requests in flight
    + 1) / replicas) + slack (Mirrokni et al., plus an absolute slack: GATEWAY_PREFIX_LOAD_SLACK)."""
    total = sum(load.get(b.url, 0) for b in candidates)
    return math.ceil(factor * (total + 1) / len(candidates)) + slack


def overflow_pick(key_digest: bytes, candidates: Sequence[B], load: Mapping[str, int], bound: int) -> B | None:
    """The first candidate in the key's rendezvous order that stays within the bound with this
    request; least outstanding if none does (cannot happen with factor >= 1: kept as the safe answer)."""
    for b in rendezvous_order(key_digest, candidates):
        if load.get(b.url, 0) + 1 <= bound:
            return b
    return least_outstanding(candidates, load)


class PrefixHomes:
    """Each prefix key's home replica: the one its first request went to, kept for its later
    requests while that replica is routable and within the load bound.

    A new key goes to the least loaded candidate; among equals, to the one that is home to fewer
    keys in use, then the first in the key's rendezvous order (so the choice is the same whatever
    the candidates' order). A request whose home is over the bound, down, tried or full overflows
    (overflow_pick) and the key keeps its home. Homes of replicas that left the routing table are
    forgotten (keep_only), so their keys find new homes on their next request.

    Written by hand (an OrderedDict as LRU with per-replica counts): cachetools' caches expire by
    time or size but keep no count per value, which the tie-break needs in O(1)."""

    def __init__(
        self,
        *,
        idle_seconds: float = HOME_IDLE_SECONDS,
        max_keys: int = HOMES_MAX,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.idle_seconds, self.max_keys, self.clock = idle_seconds, max_keys, clock
        self._homes: OrderedDict[bytes, tuple[str, float]] = OrderedDict()  # key -> (url, last use), oldest first
        self.keys_of: Counter[str] = Counter()  # url -> keys at home there
        self._urls: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self._homes)

    def home_of(self, key_digest: bytes) -> str | None:
        home = self._homes.get(key_digest)
        return home[0] if home else None

    def pick(
        self,
        key_digest: bytes,
        candidates: Sequence[B],
        load: Mapping[str, int],
        *,
        factor: float = LOAD_FACTOR,
        slack: int = 0,
    ) -> B | None:
        if not candidates:
            return None
        now = self.clock()
        self._expire(now)
        home = self._homes.get(key_digest)
        if home is not None:
            self._homes[key_digest] = (home[0], now)
            self._homes.move_to_end(key_digest)
            bound = load_bound(candidates, load, factor=factor, slack=slack)
            for b in candidates:
                if b.url == home[0]:
                    if load.get(b.url, 0) + 1 <= bound:
                        return b
                    break
            return overflow_pick(key_digest, [b for b in candidates if b.url != home[0]] or candidates, load, bound)
        # The least loaded is always within the bound (factor >= 1); min() keeps the first of equals, so
        # walking the rendezvous order makes that order the last tie-break.
        keys_of = self.keys_of
        choice = min(rendezvous_order(key_digest, candidates), key=lambda b: (load.get(b.url, 0), keys_of[b.url]))
        self._homes[key_digest] = (choice.url, now)
        keys_of[choice.url] += 1
        if len(self._homes) > self.max_keys:
            self._drop(next(iter(self._homes)))
        return choice

    def set_home(self, key_digest: bytes, url: str) -> None:
        """Make `url` the key's home (the one the gateways agreed on: shared_routing.SharedRouting.claim_home)."""
        if key_digest in self._homes:
            self._drop(key_digest)
        self._homes[key_digest] = (url, self.clock())
        self.keys_of[url] += 1
        if len(self._homes) > self.max_keys:
            self._drop(next(iter(self._homes)))

    def keep_only(self, urls: frozenset[str]) -> None:
        """Forget the homes on replicas not in `urls` (the routing table's, after each refresh)."""
        if urls == self._urls:
            return
        self._urls = urls
        gone = [k for k, (url, _) in self._homes.items() if url not in urls]
        for k in gone:
            self._drop(k)

    def _expire(self, now: float) -> None:
        homes, oldest = self._homes, now - self.idle_seconds
        while homes:
            key, (_, last) = next(iter(homes.items()))
            if last > oldest:
                return
            self._drop(key)

    def _drop(self, key: bytes) -> None:
        url, _ = self._homes.pop(key)
        self.keys_of[url] -= 1
        if not self.keys_of[url]:
            del self.keys_of[url]


def staged_takes_it(canary_percent: int, rnd: Callable[[], float] = random.random) -> bool:
    """Whether this request goes to the staged side of a pair with this canary share (0..100)."""
    return canary_percent > 0 and rnd() * 100 < canary_percent
