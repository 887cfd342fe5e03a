"""The usage page in Debian's Chromium: a team Admin of two teams picks a team, sees its Plotly charts (tokens
stacked by key, requests and errors, accelerator-hours) drawn from the page's data, sets a budget through the form
(refused, with the error beside its field, then saved, with its usage bar), and the key's budgets load on its page;
axe finds no violation on any of them."""

from datetime import timedelta

import pytest
from django.utils import timezone

from console.models import Team, TeamMembership
from console.roles import ADMIN
from endpoints.gateway.models import Budget, UsageHour
from endpoints.gateway.services import key_create
from endpoints.models import Endpoint, EndpointEvent, Replica
from models_registry.models import Artifact, Model
from tests.e2e.test_accessibility import _axe_violations, _settled
from tests.support.accounts import make_user
from tests.support.browser import browser, login, page, screenshot  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_usage_page_charts_budgets_and_axe(page, cpu_node):  # noqa: F811
    research = Team.objects.create(name="Research", slug="research")
    Team.objects.create(name="Serving", slug="serving")
    ana = make_user("ana", None)
    for team in Team.objects.exclude(slug=Team.DEFAULT_SLUG):
        TeamMembership.objects.create(team=team, user=ana, role=ADMIN)
    keys = [key_create(name=name, team_id=research.pk)[0] for name in ("chat-app", "=evil<b>")]
    model = Model.objects.create(name="demo", team=research)
    artifact = Artifact.objects.create(model=model, format="hf", dtype="float32", path="/models/demo")
    endpoint = Endpoint.objects.create(
        name="demo", artifact=artifact, node=cpu_node, served_model_name="demo", team=research
    )
    Replica.objects.create(endpoint=endpoint, index=0, node=cpu_node, devices=[0, 1], pid=1)
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    EndpointEvent.objects.create(
        endpoint=endpoint, replica_index=0, kind="started", message="", created_at=hour - timedelta(hours=3)
    )
    for back in range(4):
        for n, key in enumerate(keys):
            UsageHour.objects.create(
                hour=hour - timedelta(hours=back),
                team=research,
                key=key,
                key_name=key.name,
                endpoint_id=endpoint.pk,
                endpoint_name="demo",
                model="demo",
                requests=3 + n,
                errors=n,
                prompt_tokens=50 * (back + 1),
                completion_tokens=20,
            )

    login(page, ana)
    page.goto("/usage/")
    page.select_option("#id_team", str(research.pk))
    with page.expect_navigation():
        page.click("#usage-filter button[type=submit]")
    assert "Usage of team Research" in page.inner_text("h1")
    for chart in ("tokens", "requests", "accelerators"):
        page.wait_for_selector(f"#chart-usage-{chart}[data-drawn='1'] .main-svg")
    legend = page.locator("#chart-usage-tokens g.legend").text_content() or ""
    assert "chat-app" in legend and "=evil<b>" in legend  # a key's name shows as typed
    assert page.locator("#usage-table tbody tr").count() == 2
    _settled(page)
    assert _axe_violations(page) == []

    page.fill("#id_tokens", "0")
    with page.expect_navigation():
        page.click("#team-budget-form button[type=submit]")
    assert page.locator("#id_tokens-errors").is_visible()
    assert _axe_violations(page) == []
    page.fill("#id_tokens", "1000")
    page.select_option("#id_mode", "soft")
    with page.expect_navigation():
        page.click("#team-budget-form button[type=submit]")
    used = sum(u.prompt_tokens + u.completion_tokens for u in UsageHour.objects.filter(hour__gte=hour.replace(hour=0)))
    assert page.get_attribute("#team-budget-table progress", "value") == str(min(used, 1000))
    assert Budget.objects.get(team=research).mode == "soft"
    screenshot(page, "usage")

    page.goto(f"/gateway/keys/{keys[0].pk}/")
    page.wait_for_selector("#key-budget-form")
    page.fill("#id_tokens", "5000")
    page.select_option("#id_period", "month")
    with page.expect_navigation():
        page.click("#key-budget-form button[type=submit]")
    page.wait_for_selector("#key-budget-table progress")
    _settled(page)
    assert _axe_violations(page) == []
    assert Budget.objects.get(key=keys[0]).tokens == 5000
    assert not page.js_errors, page.js_errors
