"""Telemetry charts in a real headless Chromium (Debian's, driven by Playwright): the node page
draws its Plotly charts from the series API and updates them live, without a reload, when
new points arrive; the range buttons reload them; the Overview's fleet cards show up."""

import os
import time

import pytest
from django.utils import timezone

from tests.support import FAKE_NPU_SMI
from tests.support.browser import browser, login, page  # noqa: F401
from workers.models import Node
from workers.telemetry import collect, services
from workers.telemetry.services import Reading

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]
FAKE_DIR = FAKE_NPU_SMI


def _points(el_id):
    return f"(document.getElementById('{el_id}') || {{dataset: {{}}}}).dataset"


def test_node_chart_updates_live_and_switches_range(page, viewer, monkeypatch):  # noqa: F811
    monkeypatch.setenv("PATH", f"{FAKE_DIR}{os.pathsep}{os.environ['PATH']}")
    node = Node.objects.create(name="npu-host", hostname="npu-host", platform="ascend", last_heartbeat=timezone.now())
    collect.collect_node(node)  # 8 NPUs from the fake npu-smi, and this host
    now = int(time.time())
    key = f"n{node.pk}.d0.dev.temp_c"
    for ts in range(now - 300, now, 10):
        services.store([Reading(key, "dev.temp_c", 40 + (ts % 7), "°C", node_id=node.pk, device=0, label="NPU 0")], ts)

    login(page, viewer)
    page.goto(f"/nodes/{node.pk}/")
    chart = f"chart-node-{node.pk}-temp"
    data = _points(chart)
    page.wait_for_function(f"Number({data}.updates) >= 1 && Number({data}.points) > 0")
    assert page.locator(f"#{chart} .main-svg").count() >= 1  # Plotly drew it
    before = int(page.get_attribute(f"#{chart}", "data-points"))
    last = int(page.get_attribute(f"#{chart}", "data-last"))

    # New readings arrive (as the agent would store them): the chart grows without a reload.
    # The reading must land in a later chart bucket than the newest one (collect_node stored one
    # a moment ago), or it is averaged into that bucket and no point is added.
    from django.db.models import Max

    from workers.telemetry.models import Point
    from workers.telemetry.selectors import plan

    step = plan("1h")[1]
    newest = Point.objects.filter(series__key=key).aggregate(Max("ts"))["ts__max"]
    while int(time.time()) // step <= newest // step:
        time.sleep(0.2)
    services.store([Reading(key, "dev.temp_c", 88.0, "°C", node_id=node.pk, device=0, label="NPU 0")], time.time())
    page.wait_for_function(f"Number({data}.points) >= {before + 1}", timeout=45_000)  # polls every 5 s; CI is busy
    assert int(page.get_attribute(f"#{chart}", "data-last")) > last
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # no reload

    # Another range: a full reload of every chart at that range.
    page.click(".tm-ranges button[data-range='15m']")
    page.wait_for_function(f"{data}.range === '15m'")
    assert page.get_attribute(".tm-ranges button[data-range='15m']", "aria-pressed") == "true"
    assert page.js_errors == []
    if os.environ.get("TELEMETRY_SCREENSHOTS"):  # for a person checking the layout
        page.wait_for_timeout(1000)
        page.screenshot(path=os.path.join(os.environ["TELEMETRY_SCREENSHOTS"], "node.png"), full_page=True)


def test_overview_shows_fleet_cards_and_a_chart_per_node(page, viewer):  # noqa: F811
    node = Node.objects.create(name="cpu-host", hostname="cpu-host", platform="cpu", last_heartbeat=timezone.now())
    collect.collect_node(node)
    login(page, viewer)
    page.goto("/")
    page.wait_for_selector("#fleet-nodes")
    assert page.inner_text("#fleet-nodes").replace(" ", "") == "1/1"
    chart = f"chart-overview-node-{node.pk}"
    page.wait_for_function(f"Number({_points(chart)}.updates) >= 1")
    assert page.js_errors == []
    if os.environ.get("TELEMETRY_SCREENSHOTS"):
        page.screenshot(path=os.path.join(os.environ["TELEMETRY_SCREENSHOTS"], "overview.png"), full_page=True)
