"""Tuning an artifact on a node, without an endpoint (issue 38: "given an endpoint or an artifact and node"): the
trials start from the launch the artifact would have there (endpoint_create's checks and defaults, rolled back),
the job runs on that node's queue and replays the recorded trial figures (tests/fixtures/tuning/trials.json, as
tests/endpoints/test_tuning.py does), the best is given as a launch spec (nothing to apply to), and bad input is
refused by field with nothing stored."""

import pytest

from console.models import AuditEvent
from endpoints.models import Endpoint
from endpoints.tuning import jobs, search
from endpoints.tuning.models import Tuning
from endpoints.tuning.services import base_of, trial_spec
from tests.endpoints.test_tuning import BODY, replay_trial
from tests.support.jobs import run_queued_jobs
from workers.jobs.models import Job

ARTIFACT_BODY = {**BODY, "workload": {"num_prompts": 32, "input_len": 128, "output_len": 64, "max_concurrency": 16}}


@pytest.mark.django_db(transaction=True)
def test_an_artifact_on_a_node_is_tuned_from_its_launch_defaults_and_the_best_is_a_launch_spec(
    operator, api_for, cpu_node, tiny_artifact, redis_conn, monkeypatch
):
    monkeypatch.setattr(jobs, "run_trial", replay_trial)
    api = api_for(operator)
    body = {"artifact": tiny_artifact.pk, "node": cpu_node.name, **ARTIFACT_BODY}
    created = api.post("/api/v1/tunings", body)
    assert created.status_code == 202, created.content
    got = created.json()
    assert got["endpoint"] is None and got["artifact"] == tiny_artifact.pk and got["node"] == "cpu-host"
    assert got["subject"] == f"{tiny_artifact} on cpu-host"
    # The base: what a launch of the artifact there would be (no endpoint was left behind by the check).
    base = got["base_spec"]
    assert base["artifact"] == tiny_artifact.pk and base["node"] == "cpu-host" and base["max_model_len"]
    assert not Endpoint.objects.exists()
    job = Job.objects.get(pk=got["job"])
    assert job.queue.endswith("cpu-host"), job.queue  # the node's queue: the benchmark client reads it there
    assert api.post("/api/v1/tunings", body).status_code == 409  # one tuning of the artifact on the node at a time
    audit = AuditEvent.objects.get(action="tuning.create")
    assert audit.changes["artifact"] == tiny_artifact.pk and audit.changes["node"] == "cpu-host"

    run_queued_jobs()
    done = api.get(f"/api/v1/tunings/{got['id']}").json()
    assert done["state"] == "succeeded", done
    assert done["trials"][0]["kind"] == "baseline" and done["trials"][0]["params"] == {}
    best = done["best"]
    assert best is not None and best["spec"]["artifact"] == tiny_artifact.pk and best["spec"]["node"] == "cpu-host"
    if "max_num_seqs" in best["params"]:
        assert best["spec"]["max_num_seqs"] == best["params"]["max_num_seqs"]
    if "enable_prefix_caching" in best["params"]:
        assert best["spec"]["extra_args"]["--enable-prefix-caching"] == best["params"]["enable_prefix_caching"]
    # Nothing to apply to: the answer says what to do instead, and changes nothing.
    refused = api.post(f"/api/v1/tunings/{got['id']}/apply", {})
    assert refused.status_code == 409 and "not an endpoint" in refused.content.decode(), refused.content
    assert not AuditEvent.objects.filter(action="tuning.apply").exists()


@pytest.mark.django_db
def test_a_trial_replica_of_an_artifact_tuning_is_the_base_spec_with_the_trial_settings(
    operator, api_for, cpu_node, tiny_artifact
):
    created = api_for(operator).post("/api/v1/tunings", {"artifact": tiny_artifact.pk, "node": "cpu-host", **BODY})
    assert created.status_code == 202, created.content
    tuning = Tuning.objects.get(pk=created.json()["id"])
    spec = trial_spec(
        base_of(tuning), name="tune9-1", params={"max_num_seqs": 16, "enable_prefix_caching": False}, space=SPACE0
    )
    assert (spec.name, spec.served_model_name, spec.replicas, spec.artifact, spec.node) == (
        "tune9-1",
        "tune9-1",
        1,
        tiny_artifact.pk,
        "cpu-host",
    )
    assert spec.max_num_seqs == 16 and spec.extra_args == {"--enable-prefix-caching": False}


SPACE0 = search.Space(choices={})


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"endpoint": "live"}, "endpoint"),  # an endpoint and an artifact: one or the other
        ({"node": None}, "node"),
        ({"node": "elsewhere"}, "node"),
        ({"artifact": 9999}, "artifact"),
        ({"artifact": None}, "artifact"),
        ({"workload": {"input_len": 100_000}}, "workload.input_len"),  # over the launch's max_model_len
    ],
)
def test_an_artifact_tuning_refuses_bad_input_naming_the_field_and_stores_nothing(
    operator, api_for, cpu_node, tiny_artifact, change, field
):
    body = {"artifact": tiny_artifact.pk, "node": "cpu-host", **BODY, **change}
    response = api_for(operator).post("/api/v1/tunings", body)
    assert response.status_code == 400, response.content
    assert field in response.json()["errors"], response.json()
    assert not Tuning.objects.exists() and not Job.objects.exists() and not Endpoint.objects.exists()
    assert not AuditEvent.objects.filter(action="tuning.create").exists()


@pytest.mark.django_db
def test_the_result_page_of_an_artifact_tuning_names_it_and_offers_no_apply(
    operator, api_for, as_operator, cpu_node, tiny_artifact
):
    created = api_for(operator).post("/api/v1/tunings", {"artifact": tiny_artifact.pk, "node": "cpu-host", **BODY})
    tuning = Tuning.objects.get(pk=created.json()["id"])
    Tuning.objects.filter(pk=tuning.pk).update(
        status="succeeded", best={"number": 0, "params": {"max_num_seqs": 16}, "metrics": {"output_throughput": 1.0}}
    )
    page = as_operator.get(f"/tunings/{tuning.pk}/")
    text = page.content.decode()
    assert page.status_code == 200 and f"{tiny_artifact} on cpu-host" in text
    assert 'id="tuning-apply"' not in text
