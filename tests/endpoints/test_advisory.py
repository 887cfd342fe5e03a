"""Advisory mode ("show, don't act"): with Endpoint.advisory on, the serving controller's autoscaler and rollout
evaluators make the same decisions against the real database, record each one (with its figures) as an endpoint event
and change nothing: no scale, no new replica, no canary share moved, no audit row, no telemetry point. Turned off,
the next pass acts as before. The API and the endpoint page turn it on and show the decisions."""

import time

import pytest

from console.models import AuditEvent
from endpoints.autoscale import UP
from endpoints.gateway.controller import evaluate_autoscaling, evaluate_rollouts
from endpoints.gateway.models import GatewayEndpoint
from endpoints.gateway.rollout import ROLLBACK
from endpoints.models import Endpoint, EndpointEvent, Replica
from tests.endpoints.test_autoscale import autoscaled, store_waiting
from tests.endpoints.test_gateway_rollout import backdate, flush, rollout_pair  # noqa: F401 (fixture)
from workers.telemetry.models import Point


@pytest.mark.django_db
def test_advisory_autoscaling_records_the_decision_with_its_figures_and_scales_nothing(
    ascend_node, tiny_artifact, settings
):
    settings.TELEMETRY_INTERVAL_SECONDS = 10
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=2)
    Endpoint.objects.filter(pk=endpoint.pk).update(advisory=True)
    now = 1_800_000_000
    for index in (0, 1):
        store_waiting(endpoint, replica=index, start=now - 30, seconds=30, value=3)
    points_before = Point.objects.count()
    [(_, decision, applied)] = evaluate_autoscaling(now)
    assert (decision.action, decision.wanted, applied) == (UP, 3, False)
    endpoint.refresh_from_db()
    assert endpoint.replicas == 2 and endpoint.scaled_at is None and endpoint.autoscale_wanted is None
    assert Replica.objects.filter(endpoint=endpoint).count() == 2
    assert not EndpointEvent.objects.filter(endpoint=endpoint, kind="autoscale").exists()
    assert not AuditEvent.objects.filter(action="endpoint.scale").exists()
    assert Point.objects.count() == points_before  # not even the scaling chart's readings
    [advice] = EndpointEvent.objects.filter(endpoint=endpoint, kind="advisory-autoscale")
    assert advice.message.startswith("advisory: would scale up 2 → 3 replica(s):")
    assert "waiting_avg_up 6.0" in advice.message and "nothing changed" in advice.message
    # The same advice on the next pass is not a second event.
    evaluate_autoscaling(now + 10)
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind="advisory-autoscale").count() == 1
    # Advisory off: the controller acts on the same figures.
    Endpoint.objects.filter(pk=endpoint.pk).update(advisory=False)
    [(_, decision, applied)] = evaluate_autoscaling(now + 20)
    assert applied and Endpoint.objects.get(pk=endpoint.pk).replicas == 3


@pytest.mark.django_db
def test_advisory_rollouts_record_a_rollback_with_its_figures_and_move_nothing(rollout_pair):  # noqa: F811
    blue, green = rollout_pair
    Endpoint.objects.filter(pk=blue.pk).update(advisory=True)
    backdate(blue, 5)
    flush(green, n=60, latency=0.8)  # P99 800 ms > 500 ms
    flush(blue, n=500, latency=0.05)
    before = GatewayEndpoint.objects.get(endpoint=blue)
    audits = AuditEvent.objects.count()
    [(gw, decision, applied)] = evaluate_rollouts(now=time.time() + 1)
    assert decision.action == ROLLBACK and not applied
    after = GatewayEndpoint.objects.get(endpoint=blue)
    assert (after.serving, after.canary_percent, after.rollout_auto, after.canary_set_at, after.staged_id) == (
        before.serving,
        before.canary_percent,
        before.rollout_auto,
        before.canary_set_at,
        before.staged_id,
    )
    assert AuditEvent.objects.count() == audits
    assert not EndpointEvent.objects.filter(endpoint=blue, kind="rollout").exists()
    [advice] = EndpointEvent.objects.filter(endpoint=blue, kind="advisory-rollout")
    assert advice.message.startswith(f"advisory: would rollback {green.name} to 0 %:")
    assert "P99 latency 800 ms > 500 ms" in advice.message and "live 500 requests" in advice.message
    # Still advisory: the pair is evaluated again, the same advice is not repeated; off, it rolls back.
    evaluate_rollouts(now=time.time() + 2)
    assert EndpointEvent.objects.filter(endpoint=blue, kind="advisory-rollout").count() == 1
    Endpoint.objects.filter(pk=blue.pk).update(advisory=False)
    [(_, decision, applied)] = evaluate_rollouts(now=time.time() + 3)
    assert decision.action == ROLLBACK and applied


@pytest.mark.django_db
def test_advisory_is_set_by_patch_audited_and_shown_on_the_endpoint_page(
    operator, api_for, as_operator, as_viewer, ascend_node, tiny_artifact
):
    endpoint = autoscaled(ascend_node, tiny_artifact, replicas=1)
    api = api_for(operator)
    refused = api.patch(f"/api/v1/endpoints/{endpoint.pk}", {"advisory": "yes"})
    assert refused.status_code in (400, 422) and "advisory" in refused.content.decode()
    assert not Endpoint.objects.get(pk=endpoint.pk).advisory
    on = api.patch(f"/api/v1/endpoints/{endpoint.pk}", {"advisory": True})
    assert on.status_code == 200 and on.json()["advisory"] is True
    assert AuditEvent.objects.get(action="endpoint.update").changes == {"advisory": [False, True]}
    EndpointEvent.objects.create(
        endpoint=endpoint,
        kind="advisory-autoscale",
        message="advisory: would scale up 1 → 2 replica(s): figures (advisory mode: nothing changed)",
    )
    page = as_viewer.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert "would scale up 1 → 2 replica(s)" in page and 'id="advisory-form"' not in page
    assert as_viewer.post(f"/endpoints/{endpoint.pk}/advisory", {"advisory": "0"}).status_code == 403
    off = as_operator.post(f"/endpoints/{endpoint.pk}/advisory", {"advisory": "0"})
    assert off.status_code == 302 and not Endpoint.objects.get(pk=endpoint.pk).advisory
    bad = as_operator.post(f"/endpoints/{endpoint.pk}/advisory", {"advisory": "maybe"})
    assert bad.status_code == 302 and not Endpoint.objects.get(pk=endpoint.pk).advisory
