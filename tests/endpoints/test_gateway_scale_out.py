"""Several gateways behind a real HAProxy (Debian's haproxy, started here with the configuration the deployment uses,
endpoints/gateway/balancer.py): one key's per-minute limit holds across all of them (the shared counters in Redis,
endpoints/gateway/limits.py), and a gateway killed mid-run costs the clients nothing (the load balancer retries on
the others). docs/gateway-scale-out.md."""

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from django.db.models import F, Sum

from endpoints.gateway import services
from endpoints.gateway.balancer import haproxy_config
from endpoints.gateway.models import Budget, UsageHour
from tests.support import ROOT
from tests.support.agents import wait_for
from tests.support.gateway import FakeReplica, GatewayProc, chat, free_port, make_endpoint


class Balancer:
    """HAProxy in front of `gateways`, with deploy's configuration."""

    def __init__(self, tmp_path: Path, gateways: list[GatewayProc]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp_path / "haproxy.cfg"
        config.write_text(
            haproxy_config(bind=f"127.0.0.1:{self.port}", servers=[f"127.0.0.1:{g.port}" for g in gateways])
        )
        self.proc = subprocess.Popen(
            ["haproxy", "-W", "-db", "-f", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Its output read as it comes: the test waits for HAProxy's own word that a server is down.
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.2)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.decode(errors="replace"))

    def output(self) -> str:
        if self.proc.poll() is not None:
            self.reader.join(timeout=10)
        return "".join(self.lines)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)


@pytest.fixture
def pool(worker_env, tmp_path):
    """pool(n): n gateway processes (the compiled data path where built) behind HAProxy."""
    made = []

    def start(n: int):
        # Behind the load balancer every connection comes from its address: no per-address cap at the gateways.
        gateways = [GatewayProc(worker_env, {"GATEWAY_MAX_CONNECTIONS_PER_ADDRESS": "0"}) for _ in range(n)]
        made.extend(gateways)
        balancer = Balancer(tmp_path, gateways)
        made.append(balancer)
        return gateways, balancer

    yield start
    for thing in reversed(made):
        thing.stop()


async def _burst(url: str, raw: str, n: int = 200) -> list[int]:
    """`n` chat requests with the key `raw` at once through `url` (the balancer): their status codes."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        headers = {"Authorization": f"Bearer {raw}"}
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=chat(), headers=headers) for _ in range(n))
        )
    return [a.status_code for a in answers]


@pytest.mark.django_db(transaction=True)
def test_three_gateways_admit_exactly_a_keys_requests_per_minute(pool, admin):
    replica = FakeReplica("r1")
    try:
        make_endpoint("ep-pool", [replica], model="tiny")
        _, raw = services.key_create(name="sixty", rpm_limit=60, actor=admin)
        gateways, balancer = pool(3)
        for g in gateways:
            g.wait_routes("tiny", 1)

        codes = asyncio.run(_burst(balancer.url, raw))
        assert set(codes) <= {200, 429}, sorted(set(codes))
        assert 59 <= codes.count(200) <= 61, codes.count(200)
        assert replica.served == codes.count(200)
    finally:
        replica.stop()


@pytest.mark.django_db(transaction=True)
def test_three_gateways_do_not_overrun_a_token_budget_under_200_concurrent_requests(pool, admin):
    """Each admission reserves its estimate in the budget's counter (atomic in Redis, whichever gateway) and is settled
    to the engine's usage after: the usage can pass the budget by one request's settlement at most (a request whose
    real usage is above its reservation; here never, each uses 10 of the 17 it reserves)."""
    replica = FakeReplica("r1", delay=0.1)
    try:
        make_endpoint("ep-pool", [replica], model="tiny")
        key, raw = services.key_create(name="budgeted", actor=admin)
        Budget.objects.create(key=key, tokens=300, period="day", mode="hard")
        gateways, balancer = pool(3)
        for g in gateways:
            g.wait_routes("tiny", 1)

        codes = asyncio.run(_burst(balancer.url, raw))
        assert set(codes) <= {200, 429}, sorted(set(codes))
        admitted = codes.count(200)
        assert admitted == replica.served and admitted >= 300 // 17, admitted
        deadline = time.monotonic() + 15  # the gateways' flushes (every second here)
        while sum(UsageHour.objects.filter(key=key).values_list("requests", flat=True)) < 200:
            assert time.monotonic() < deadline, "the usage was not recorded"
            time.sleep(0.3)
        used = UsageHour.objects.filter(key=key).aggregate(t=Sum(F("prompt_tokens") + F("completion_tokens")))["t"]
        print(f"admitted {admitted} of 200, {used} tokens used of a budget of 300")
        assert used == 10 * admitted and used <= 300 + 10, used  # 10: one request's settlement
    finally:
        replica.stop()


@pytest.mark.django_db(transaction=True)
def test_a_gateway_killed_mid_run_costs_the_clients_nothing(pool, admin, worker_env):
    replica = FakeReplica("r1", delay=0.2)  # requests in flight at the kill
    journals = Path(worker_env["GATEWAY_USAGE_JOURNAL_DIR"])
    try:
        make_endpoint("ep-pool", [replica], model="tiny")
        _, raw = services.key_create(name="app", actor=admin)
        gateways, balancer = pool(3)
        for g in gateways:
            g.wait_routes("tiny", 1)
        statuses, stop = [], threading.Event()

        def client():
            with httpx.Client(base_url=balancer.url, timeout=60, headers={"Authorization": f"Bearer {raw}"}) as c:
                while not stop.is_set():
                    try:
                        statuses.append(c.post("/v1/chat/completions", json=chat()).status_code)
                    except httpx.HTTPError as exc:
                        statuses.append(type(exc).__name__)

        threads = [threading.Thread(target=client) for _ in range(12)]
        for t in threads:
            t.start()
        wait_for(lambda: len(statuses) >= 36, timeout=60, what="three rounds of the clients' requests")
        before = len(statuses)
        os.killpg(gateways[0].proc.pid, signal.SIGKILL)  # the gateway and its data path, as an OOM kill would
        # Until HAProxy's health checks take the killed gateway out (two missed checks a second apart: balancer.py),
        # its share of new requests finds it gone and is redispatched; then three more rounds on the other two.
        wait_for(lambda: "is DOWN" in balancer.output(), timeout=30, what="HAProxy marking the killed gateway down")
        after_down = len(statuses)
        wait_for(lambda: len(statuses) >= after_down + 36, timeout=60, what="three rounds after it was marked down")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert before > 12 and len(statuses) > before + 12, len(statuses)  # served before and after the kill
        balancer.stop()
        log = [line for line in balancer.output().splitlines() if '"POST ' in line]
        # Every request that reached the load balancer was answered 200, those in flight on the killed gateway after
        # a retry on another one (HAProxy's log: "+1" retries, redispatched).
        assert {s for s in statuses if isinstance(s, int)} == {200}, {s: statuses.count(s) for s in set(statuses)}
        assert any("/+1 " in line for line in log), "no request was retried on another gateway"
        # Except an answer the killed gateway had begun to send (endpoints/gateway/balancer.py: its bytes reached
        # the client, it cannot be sent again): HAProxy logs "SD--" and the client's read fails. None in the runs
        # here since HAProxy buffers each request whole (option http-buffer-request; before it, 2 of 4 runs had a
        # 502 "SH--" not retried and 3-4 connections closed with no line in this log: docs/gateway-scale-out.md).
        cut = [line for line in log if " ---- " not in line]
        assert all(" 200 " in line for line in log if line not in cut), log[:5]
        assert all(" SD-- " in line for line in cut), cut[:5]
        failed = len(statuses) - statuses.count(200)
        assert failed == len(cut) <= len(statuses) // 50, ({s: statuses.count(s) for s in set(statuses)}, cut)
        assert gateways[0].proc.wait(timeout=10) == -signal.SIGKILL
        # The usage recorded against what the replica served. Each gateway journals every request it sends to a
        # replica and every settled one on disk (endpoints/gateway/usage_journal.py) and stores its journal at its
        # flush; the survivors' flushes store what the killed one had journaled but not stored (its lock is free),
        # the requests it had in flight (sent, not settled) as interrupted ones: the replica served them and HAProxy
        # retried them on another gateway, whose answer is recorded as well.
        killed_journal = f"-{gateways[0].proc.pid}-"
        wait_for(
            lambda: not [p for p in journals.iterdir() if killed_journal in p.name],
            timeout=30,
            what="the killed gateway's journal stored by the others",
        )
        for g in gateways[1:]:
            g.stop()  # their last flushes
        rows = UsageHour.objects.filter(key__name="app")
        counts = rows.aggregate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            interrupted=Sum("interrupted"),
            tokens=Sum(F("prompt_tokens") + F("completion_tokens")),
        )
        recorded = counts["requests"] - counts["errors"]
        print(f"served {replica.served}, recorded {recorded} ({counts['interrupted']} interrupted)")
        assert counts["tokens"] == 10 * (recorded - counts["interrupted"])  # an interrupted request's are unknown
        assert counts["interrupted"] >= 1  # the killed gateway's share of the 12 clients' requests
        # Equal, but for a request journaled as sent in the instant before the replica read it.
        assert 0 <= recorded - replica.served <= 1, (replica.served, counts)
        assert list(journals.iterdir()) == []  # every journal stored and gone
    finally:
        replica.stop()


def test_the_shipped_haproxy_configuration_is_the_rendered_one():
    shipped = (ROOT / "deploy" / "haproxy" / "gateway.cfg").read_text()
    assert shipped == haproxy_config(bind="0.0.0.0:8100", servers=[f"127.0.0.1:{8100 + k}" for k in (1, 2, 3)])
    checked = subprocess.run(
        ["haproxy", "-c", "-f", str(ROOT / "deploy" / "haproxy" / "gateway.cfg")], check=False
    )  # make haproxy
    assert checked.returncode == 0


def test_make_run_with_several_gateways_supervises_the_pool_and_haproxy(settings, tmp_path, monkeypatch):
    from django.core.management import call_command
    from supervisor.options import ServerOptions

    settings.DATA_DIR = tmp_path
    settings.GATEWAY_URL = "http://127.0.0.1:8100"
    (tmp_path / "logs").mkdir()  # as make run makes it
    call_command("gateway_pool", gateways=3, haproxy="/usr/sbin/haproxy")
    config = tmp_path / "gateways" / "haproxy.cfg"
    assert subprocess.run(["haproxy", "-c", "-f", str(config)], check=False).returncode == 0
    assert "server gw3 127.0.0.1:8103 check" in config.read_text()
    # deploy/supervisord.conf includes the pool, as `make run GATEWAYS=3` starts it.
    for name, value in {
        "DATA_DIR": str(tmp_path),
        "CONSOLE_BIND": "127.0.0.1:1",
        "WORKERS": "1",
        "CONVERT_WORKERS": "1",
        "WEB_WORKERS": "1",
    }.items():
        monkeypatch.setenv(name, value)
    options = ServerOptions()
    options.realize(["-c", str(ROOT / "deploy" / "supervisord.conf")])
    groups = {g.name: g for g in options.process_group_configs}
    assert {"gateway", "gateway-2", "gateway-3", "gateway-balancer"} <= set(groups)
    assert groups["gateway-3"].process_configs[0].environment["GATEWAY_INSTANCE"] == "3"
    # One gateway: the pool's files go, and supervisord runs the one gateway as before.
    call_command("gateway_pool", gateways=1)
    assert not (tmp_path / "gateways" / "pool.conf").exists() and not config.exists()
    options = ServerOptions()
    options.realize(["-c", str(ROOT / "deploy" / "supervisord.conf")])
    assert "gateway-2" not in {g.name for g in options.process_group_configs}


@pytest.mark.django_db(transaction=True)
def test_with_redis_unreachable_token_limits_fail_closed_and_request_limits_count_per_gateway(fakes, gateway, admin):
    make_endpoint("ep-noredis", [fakes("r")], model="tiny")
    _, free = services.key_create(name="free", actor=admin)
    _, rpm = services.key_create(name="rpm-2", rpm_limit=2, actor=admin)
    _, tpm = services.key_create(name="tpm", tpm_limit=1000, actor=admin)
    gw = gateway(REDIS_URL=f"redis://127.0.0.1:{free_port()}/3")  # nothing listens there
    gw.wait_routes("tiny", 1)
    assert gw.post("/v1/chat/completions", free, chat()).status_code == 200  # no limit: no Redis needed
    refused = gw.post("/v1/chat/completions", tpm, chat())
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "limits_unavailable"
    assert refused.headers["retry-after"] == "1"
    # A request limit is counted by this gateway alone meanwhile: still 2 a minute here.
    assert [gw.post("/v1/chat/completions", rpm, chat()).status_code for _ in range(3)] == [200, 200, 429]
