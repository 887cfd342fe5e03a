"""Metering and token budgets in the gateway (docs/usage-and-budgets.md): every keyed request is metered into UsageHour
from the engine's own usage (both data paths, streamed or not, per model and LoRA adapter); budgets of a team or a key
per UTC day or month are held in Redis in the admission's one round trip (endpoints/gateway/limits.py), hard (429
until the reset), queue (waits, then 429) or soft (alerts at 80 % and 100 %, once per period)."""

import asyncio
import math
import os
import signal
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from console.models import AuditEvent
from endpoints.gateway import services
from endpoints.gateway.limits import SharedLimits
from endpoints.gateway.models import Budget, GatewayKey, UsageHour
from endpoints.gateway.selectors import budget_used, key_info, period_bounds
from models_registry.models import Artifact
from tests.support.gateway import chat, free_port, make_endpoint
from workers.telemetry.models import Alert
from workers.telemetry.services import evaluate_alerts


@pytest.fixture(autouse=True)
def clean_budget_counters():
    """Team budget counters are named by the team's id, which a later test's team may reuse: none left over."""
    r = redis.Redis.from_url(settings.REDIS_URL)
    for name in r.scan_iter("gw:{team*}:budget:*"):
        r.delete(name)
    yield r
    r.close()


def _budget(*, tokens, period="day", mode="hard", key=None, team_id=None):
    return Budget.objects.create(key=key, team_id=team_id, tokens=tokens, period=period, mode=mode)


def _rows(**match):
    return list(
        UsageHour.objects.filter(**match)
        .order_by("model", "adapter", "endpoint_id")
        .values("model", "adapter", "requests", "errors", "prompt_tokens", "completion_tokens")
    )


def _wait_for(check, timeout=15, what="the gateway's flush"):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def test_periods_are_utc_calendar_days_and_months():
    at = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    assert period_bounds("day", at) == (datetime(2026, 12, 31, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert period_bounds("month", at) == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert period_bounds("month", datetime(2026, 2, 10, tzinfo=UTC))[1] == datetime(2026, 3, 1, tzinfo=UTC)


@pytest.mark.django_db(transaction=True)
def test_budgets_admit_lower_refuse_settle_and_seed_from_the_metered_usage(admin, clean_budget_counters):
    key, raw = services.key_create(name="budgeted", actor=admin)
    _budget(key=key, tokens=100)  # the key's own, per day
    _budget(team_id=key.team_id, tokens=1000, period="month")  # its team's: looser, not the one that binds
    info = key_info(raw)
    assert {(b.owner, b.tokens) for b in info.budgets} == {("key", 100), ("team", 1000)}
    seeded = []

    @sync_to_async
    def seed(counted):
        seeded.append(len(counted))
        return [budget_used(budget=c.budget, since=c.start) for c in counted]

    async def run():
        limits = SharedLimits()
        try:
            first = await limits.admit(info, prompt=10, completions=1, each=50, seed=seed)
            assert first.admitted and first.each == 50 and first.reserved == 60 and first.bound is None
            # 40 left: the completion lowered to 30, and the budget that did it named.
            second = await limits.admit(info, prompt=10, completions=1, each=50, seed=seed)
            assert second.admitted and second.each == 30 and second.bound.budget.owner == "key"
            refused = await limits.admit(info, prompt=10, completions=1, each=50, seed=seed)
            assert not refused.admitted and not refused.unavailable and refused.bound.budget.owner == "key"
            to_reset = (period_bounds("day")[1] - datetime.now(UTC)).total_seconds()
            assert abs(refused.wait - to_reset) < 5
            # The first used 20 of its 60: settled, 40 come back, and the month's team counter follows.
            totals = {c.budget.owner: t for c, t in await limits.settle(first, 20)}
            assert totals == {"key": 60, "team": 60}
            assert (await limits.admit(info, prompt=10, completions=1, each=50, seed=seed)).each == 30
            return [c.counter for c in first.budgets]
        finally:
            await limits.close()

    counters = asyncio.run(run())
    assert seeded == [2]  # the first admission found no counter for the periods: seeded once, from nothing
    # Redis lost the counters (a restart): the next admission starts them from the metered usage of the period.
    for name in counters:
        clean_budget_counters.delete(name)
    UsageHour.objects.create(
        hour=datetime.now(UTC).replace(minute=0, second=0, microsecond=0),
        team_id=key.team_id,
        key=key,
        key_name=key.name,
        model="tiny",
        requests=3,
        prompt_tokens=30,
        completion_tokens=55,
    )

    async def after_restart():
        limits = SharedLimits()
        try:
            without_seed = await limits.admit(info, prompt=10, completions=1, each=50)
            assert not without_seed.admitted and without_seed.unavailable  # no counter and no way to seed it
            again = await limits.admit(info, prompt=10, completions=1, each=50, seed=seed)
            assert again.admitted and again.each == 5  # 85 used before: 15 left, its prompt 10
        finally:
            await limits.close()

    asyncio.run(after_restart())
    assert int(clean_budget_counters.get(counters[0])) == 100


@pytest.mark.django_db(transaction=True)
def test_a_soft_budget_never_refuses_and_an_unreachable_redis_fails_budgets_closed(admin):
    key, raw = services.key_create(name="soft", actor=admin)
    _budget(key=key, tokens=10, mode="soft")
    info = key_info(raw)

    async def run(url=None):
        limits = SharedLimits(url)
        try:
            return [await limits.admit(info, prompt=10, completions=1, each=50, seed=_zero) for _ in range(3)]
        finally:
            await limits.close()

    assert all(a.admitted and a.each == 50 for a in asyncio.run(run()))
    nowhere = f"redis://127.0.0.1:{free_port()}/3"
    assert all(a.admitted for a in asyncio.run(run(nowhere)))  # soft: uncounted meanwhile, still metered
    _budget(team_id=key.team_id, tokens=10_000, mode="queue")
    info = key_info(raw)
    assert all(not a.admitted and a.unavailable for a in asyncio.run(run(nowhere)))  # enforced: 503


async def _zero(counted):
    return [0] * len(counted)


@pytest.mark.django_db(transaction=True)
def test_usage_is_metered_per_key_endpoint_model_and_adapter_from_the_engines_usage(fakes, gateway, admin):
    replica = fakes("r")
    ep = make_endpoint("ep-meter", [replica], model="tiny")
    adapter = Artifact.objects.create(model=ep.artifact.model, name="bob", format="lora", path="/models/bob")
    ep.adapters.add(adapter)
    key, raw = services.key_create(name="metered", actor=admin)
    gw = gateway()
    gw.wait_routes("bob", 1)
    assert gw.post("/v1/chat/completions", raw, chat()).status_code == 200  # usage 5 + 5
    assert gw.post("/v1/chat/completions", raw, chat()).status_code == 200
    streamed = gw.post("/v1/chat/completions", raw, chat(stream=True))  # usage 4 + 3, in the last event
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    assert gw.post("/v1/completions", raw, completion).status_code == 200
    assert gw.post("/v1/chat/completions", raw, chat("bob")).status_code == 200
    assert gw.post("/v1/chat/completions", raw, chat("nope")).status_code == 404  # metered as an error, model ""
    assert gw.post("/v1/chat/completions", None, chat()).status_code == 401  # no key: not metered
    _wait_for(lambda: sum(UsageHour.objects.values_list("requests", flat=True)) == 6)
    time.sleep(1.5)  # one more flush: nothing is counted twice
    assert _rows() == [
        {"model": "", "adapter": "", "requests": 1, "errors": 1, "prompt_tokens": 0, "completion_tokens": 0},
        {"model": "tiny", "adapter": "", "requests": 4, "errors": 0, "prompt_tokens": 19, "completion_tokens": 18},
        # The adapter's row: the endpoint's served model, and the adapter's name.
        {"model": "tiny", "adapter": "bob", "requests": 1, "errors": 0, "prompt_tokens": 5, "completion_tokens": 5},
    ]
    row = UsageHour.objects.get(model="tiny", adapter="")
    assert (row.team_id, row.key_id, row.key_name) == (key.team_id, key.pk, "metered")
    assert (row.endpoint_id, row.endpoint_name) == (ep.pk, "ep-meter")
    assert row.hour == datetime.now(UTC).replace(minute=0, second=0, microsecond=0) or row.hour.minute == 0
    assert UsageHour.objects.get(model="").endpoint_id is None


@pytest.mark.django_db(transaction=True)
def test_a_hard_budget_lowers_then_refuses_until_the_reset(fakes, gateway, admin):
    make_endpoint("ep-hard", [fakes("r")], model="tiny")
    key, raw = services.key_create(name="hard", actor=admin)
    # chat(): a prompt estimated at 9 tokens, max_tokens 8: 17 reserved, 10 used (the fake's usage).
    _budget(key=key, tokens=25)
    gw = gateway()
    gw.wait_routes("tiny", 1)
    assert gw.post("/v1/chat/completions", raw, chat()).status_code == 200  # 10 used after it
    lowered = gw.post("/v1/chat/completions", raw, {**chat(), "max_tokens": 60.0})  # 15 left: 9 + 6
    assert lowered.status_code == 200
    assert (
        lowered.headers["x-gateway-notice"]
        == "max_tokens lowered from 60 to 6: the key's token budget for this day left"
    )
    refused = gw.post("/v1/chat/completions", raw, chat())
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "budget_exceeded"
    to_reset = (period_bounds("day")[1] - datetime.now(UTC)).total_seconds()
    assert abs(int(refused.headers["retry-after"]) - math.ceil(to_reset)) <= 5


@pytest.mark.django_db(transaction=True)
def test_a_queue_budget_holds_a_request_until_a_settlement_makes_room_else_refuses(fakes, gateway, admin):
    make_endpoint("ep-queue", [fakes("r", delay=1.0)], model="tiny")
    key, raw = services.key_create(name="queued", actor=admin)
    _budget(team_id=key.team_id, tokens=20, mode="queue")  # the team's
    gw = gateway(GATEWAY_BUDGET_QUEUE_SECONDS="4")
    gw.wait_routes("tiny", 1)
    answers = {}

    def send(name, delay):
        time.sleep(delay)
        started = time.monotonic()
        answers[name] = (gw.post("/v1/chat/completions", raw, chat()), time.monotonic() - started)

    # A reserves 17 of 20; B (at least 10: its prompt and one token) waits until A settles to the 10 it used.
    threads = [threading.Thread(target=send, args=("a", 0)), threading.Thread(target=send, args=("b", 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, (b, b_took) = answers["a"][0], answers["b"]
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert b_took > 1.0  # A's second of work, then B's own
    assert b.headers["x-gateway-notice"] == "max_tokens lowered from 8 to 1: the team's token budget for this day left"
    started = time.monotonic()
    refused = gw.post("/v1/chat/completions", raw, chat())  # 20 of 20 used: waits its 4 s, then 429
    assert refused.status_code == 429 and 3.5 < time.monotonic() - started < 8
    assert refused.json()["error"]["type"] == "budget_exceeded" and int(refused.headers["retry-after"]) > 0


@pytest.mark.django_db(transaction=True)
def test_a_soft_budget_passes_and_alerts_at_80_and_100_percent_once_per_period(fakes, gateway, admin, as_admin):
    make_endpoint("ep-soft", [fakes("r")], model="tiny")
    key, raw = services.key_create(name="soft-app", actor=admin)
    budget = _budget(key=key, tokens=25, mode="soft")
    gw, other = gateway(), gateway()
    for g in (gw, other):
        g.wait_routes("tiny", 1)
    for g in (gw, other, gw):  # 10 each: 40 %, 80 %, 120 %, each gateway past a mark
        assert g.post("/v1/chat/completions", raw, chat()).status_code == 200
    assert other.post("/v1/chat/completions", raw, chat()).status_code == 200  # 160 %: passes all the same
    _wait_for(lambda: Alert.objects.filter(rule__name="Token budget at 100 %").exists(), what="the 100 % alert")
    time.sleep(2.5)  # both gateways flushed what they noted
    alerts = {a.rule.name: a for a in Alert.objects.select_related("rule")}
    assert set(alerts) == {"Token budget at 80 %", "Token budget at 100 %"}  # one of each, whichever gateway
    assert (
        alerts["Token budget at 100 %"].state == "firing"
        and alerts["Token budget at 100 %"].rule.severity == "critical"
    )
    assert "key soft-app" in alerts["Token budget at 80 %"].label
    budget.refresh_from_db()
    start = period_bounds("day")[0]
    assert budget.alerted_80_for == start and budget.alerted_100_for == start
    assert AuditEvent.objects.filter(action="budget.alert", object_id=str(budget.pk)).count() == 2
    evaluate_alerts(notify=False)  # the rules' pass keeps them firing until the period is over
    assert set(Alert.objects.values_list("state", flat=True)) == {"firing"}
    evaluate_alerts(datetime.now(UTC) + timedelta(days=1, minutes=1), notify=False)
    assert set(Alert.objects.values_list("state", flat=True)) == {"resolved"}
    page = as_admin.get("/alerts/")
    assert page.status_code == 200 and "Token budget at 80 %" in page.content.decode()
    assert GatewayKey.objects.get(pk=key.pk).requests_total == 4


def test_the_engines_usage_is_read_as_prompt_and_completion_tokens():
    from endpoints.gateway.asgi import _stream_usage, _usage_tokens

    whole = b'{"choices": [{"text": "\\"usage\\": 1"}], "usage": {"prompt_tokens": 7, "completion_tokens": 3, '
    whole += b'"total_tokens": 10}, "kv_transfer_params": {"usage": null}}'
    assert _usage_tokens(whole) == (7, 3)
    # What the compiled data path sends back: the answer from its last "usage" key on.
    assert _usage_tokens(b'"usage":{"prompt_tokens":2,"completion_tokens":9,"total_tokens":11}}') == (2, 9)
    assert _usage_tokens(b'{"usage": {"total_tokens": 12}}') == (0, 12)  # a total alone: completion
    assert _usage_tokens(b'{"choices": []}') == (0, 0)
    stream = b'data: {"choices": [{"delta": {}}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 4, '
    stream += b'"completion_tokens": 3, "total_tokens": 7}}\n\ndata: [DONE]\n\n'
    assert _stream_usage(stream) == (4, 3)


@pytest.mark.django_db(transaction=True)
def test_one_usage_row_where_the_key_or_the_endpoint_is_null_and_earlier_duplicates_merged():
    """A unique index treats NULLs as distinct, so two gateways creating the row of a keyless or endpointless
    request at the same moment made two rows. Partial unique constraints make it one; the migration adds the
    duplicates made before it into the first row."""
    from django.core.management import call_command
    from django.db import IntegrityError, connection, transaction
    from django.db.migrations.executor import MigrationExecutor

    from console.models import Team

    before = [("endpoints", "0022_tuning_team_owner")]
    call_command("migrate", verbosity=0)
    team = Team.default_id()
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    executor.loader.build_graph()
    old = executor.loader.project_state(before).apps.get_model("endpoints", "UsageHour")
    hour = datetime(2026, 12, 6, 10, tzinfo=UTC)
    for endpoint_id in (None, None, 7, 7):
        old.objects.create(hour=hour, team_id=team, endpoint_id=endpoint_id, model="m", requests=1, prompt_tokens=10)
    call_command("migrate", verbosity=0)
    rows = [(r.endpoint_id, r.requests, r.prompt_tokens) for r in UsageHour.objects.order_by("pk")]
    assert rows == [(None, 2, 20), (7, 2, 20)]
    for endpoint_id in (None, 7):
        with pytest.raises(IntegrityError), transaction.atomic():
            UsageHour.objects.create(hour=hour, team_id=team, endpoint_id=endpoint_id, model="m")


KILLED_GATEWAY = """
import os, signal, sys
from datetime import datetime, UTC
from endpoints.gateway.usage_journal import UsageJournal
journal = UsageJournal(sys.argv[1], "killed")
hour = datetime(2026, 12, 6, 10, tzinfo=UTC)
row = (hour, int(sys.argv[2]), None, "gone-key", 7, "tiny", "")
for status in (200, 200, 429):
    journal.record(row=row, status=status, prompt=10, completion=5)
journal.rotate()  # a flush that never reached the database
journal.record(row=row, status=200, prompt=10, completion=5)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.django_db
def test_a_killed_gateways_journal_is_stored_once_by_another(tmp_path):
    """A gateway killed with usage not yet stored: its journal (two segments, the second still open) is stored by
    the next flush of another gateway of the host, exactly once: a segment whose usage was stored but whose file
    survived (a gateway killed between the two) is deleted, not stored again. Everything of the killed journal goes
    (segments, lock, mark)."""
    import shutil
    import subprocess
    import sys

    from console.models import Team
    from endpoints.gateway import usage_journal
    from endpoints.gateway.asgi import Gateway
    from endpoints.gateway.models import UsageJournalMark
    from endpoints.gateway.usage_journal import UsageJournal
    from tests.support import ROOT

    team = Team.default_id()
    killed = subprocess.run([sys.executable, "-c", KILLED_GATEWAY, str(tmp_path), str(team)], cwd=ROOT, check=False)
    assert killed.returncode == -signal.SIGKILL
    assert len(usage_journal.segments_of(tmp_path, "killed")) == 2
    gateway = Gateway()
    gateway.journal = UsageJournal(tmp_path, "alive")
    gateway.store_orphaned_journals()
    rows = list(UsageHour.objects.values_list("requests", "errors", "prompt_tokens", "completion_tokens", "key_name"))
    assert rows == [(4, 1, 40, 20, "gone-key")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alive.000000000001.jsonl", "alive.lock"]
    assert not UsageJournalMark.objects.exists()

    # Killed between storing a segment and deleting its file: the mark says it is stored.
    half = UsageJournal(tmp_path, "half")
    hour = datetime(2026, 12, 6, 11, tzinfo=UTC)
    half.record(row=(hour, team, None, "k", 7, "tiny", ""), status=200, prompt=1, completion=1)
    half.rotate()
    [(seq, path)] = half.segments()
    shutil.copy(path, tmp_path / "kept")
    services.store_journal(journal="half", segments=half.segments())
    (tmp_path / "kept").rename(path)  # the unlink that never happened
    os.close(half.fd)
    os.close(half.lock_fd)  # killed: the lock is let go, its file stays
    gateway.store_orphaned_journals()
    assert UsageHour.objects.get(hour=hour).requests == 1  # once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alive.000000000001.jsonl", "alive.lock"]


IN_FLIGHT_GATEWAY = """
import os, signal, sys
from datetime import datetime, UTC
from endpoints.gateway.usage_journal import UsageJournal
journal = UsageJournal(sys.argv[1], "in-flight")
hour = datetime(2026, 12, 6, 10, tzinfo=UTC)
row = lambda endpoint: (hour, int(sys.argv[2]), None, "k", endpoint, "tiny", "")
settled, across, retried, left, forgotten = (journal.ticket() for _ in range(5))
for ticket in (settled, across, retried, left, forgotten):
    journal.dispatched(ticket, row=row(7))
journal.record(row=row(7), status=200, prompt=10, completion=5, ticket=settled)
journal.forget(forgotten)
journal.rotate()  # a flush, whose segment the test stores as the gateway did
journal.dispatched(retried, row=row(8))  # its replica could not be reached: another endpoint's
journal.record(row=row(7), status=200, prompt=10, completion=5, ticket=across)
journal.rotate()  # a flush that never reached the database
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.django_db
def test_the_requests_in_flight_on_a_killed_gateway_are_stored_as_interrupted(tmp_path):
    """A request sent to a replica is journaled as in flight until it is settled; each new segment starts with the
    tickets still open. A gateway killed with two requests in flight, both dispatched before a segment the gateway
    stored itself: both are stored as interrupted requests (no tokens, not errors) with the row of their last
    dispatch; settled and forgotten requests are not."""
    import subprocess
    import sys

    from console.models import Team
    from endpoints.gateway import usage_journal
    from endpoints.gateway.asgi import Gateway
    from endpoints.gateway.usage_journal import UsageJournal
    from tests.support import ROOT

    team = Team.default_id()
    killed = subprocess.run([sys.executable, "-c", IN_FLIGHT_GATEWAY, str(tmp_path), str(team)], cwd=ROOT, check=False)
    assert killed.returncode == -signal.SIGKILL
    first, *_ = usage_journal.segments_of(tmp_path, "in-flight")
    services.store_journal(journal="in-flight", segments=[first])  # the gateway's own flush: in flight stays so
    assert list(UsageHour.objects.values_list("endpoint_id", "requests", "interrupted")) == [(7, 1, 0)]
    gateway = Gateway()
    gateway.journal = UsageJournal(tmp_path, "alive")
    gateway.store_orphaned_journals()
    rows = UsageHour.objects.order_by("endpoint_id").values_list(
        "endpoint_id", "requests", "errors", "interrupted", "prompt_tokens", "completion_tokens"
    )
    assert list(rows) == [(7, 3, 0, 1, 20, 10), (8, 1, 0, 1, 0, 0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alive.000000000001.jsonl", "alive.lock"]


def test_a_segment_line_of_the_release_before_tickets_is_read(tmp_path):
    """A host's journal may hold lines of a gateway of the release before tickets (ten fields, no ticket)."""
    from endpoints.gateway.usage_journal import read_segment

    segment = tmp_path / "old.000000000001.jsonl"
    segment.write_text(
        '["2026-12-06T10:00:00+00:00", 1, 2, "k", 7, "tiny", "", 200, 10, 5]\n'
        '{"open": 3, "row": ["2026-12-06T10:00:00+00:00", 1, 2, "k", 7, "tiny", ""]}\n'
        '["2026-12-06T10:00:00+00:00", 1, 2, "k", 7, "tiny", "", 200, 10, 5, 3]\n'
        '["2026-12-06T10:00:00+00:00", 1, 2, "k", 7, "ti'  # cut short by a power cut
    )
    in_flight: dict = {}
    usage = read_segment(segment, in_flight=in_flight)
    row = (datetime(2026, 12, 6, 10, tzinfo=UTC), 1, 2, "k", 7, "tiny", "")
    assert dict(usage.usage) == {
        row: {"requests": 2, "errors": 0, "interrupted": 0, "prompt_tokens": 20, "completion_tokens": 10}
    }
    assert in_flight == {}
