"""Teams and the work done on a team's objects (issue 37): jobs, evaluations and tunings are their team's (a job
takes its target's or endpoint's team; an evaluation and a tuning their endpoint's); another team's is a 404 on
pages and API paths and left out of lists and the overview; a job about no team's object stays everyone's. The
migrations that give existing rows a team, reversed and applied again."""

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from console.models import Team
from endpoints.tuning.models import Tuning
from evaluations.models import Evaluation
from models_registry.services import artifact_hash_enqueue
from tests.conftest import ApiClient, _client_for
from tests.console.test_teams import two_teams  # noqa: F401 (a fixture)
from workers.jobs.models import Job


def _work_of(objects: dict) -> dict:
    """A job on the artifact (through the service, which gives it the artifact's team), an evaluation and a
    tuning of the endpoint."""
    job = artifact_hash_enqueue(artifact=objects["artifact"])
    evaluation = Evaluation.objects.create(
        endpoint=objects["endpoint"], endpoint_name=objects["endpoint"].name, tasks=["arc_easy"], status="succeeded"
    )
    tuning = Tuning.objects.create(
        endpoint=objects["endpoint"], endpoint_name=objects["endpoint"].name, slo={"ttft_p99_ms": 2000}
    )
    return {"job": job, "evaluation": evaluation, "tuning": tuning}


def test_jobs_evaluations_and_tunings_of_another_team_are_404_and_left_out(two_teams):  # noqa: F811
    ours, theirs = _work_of(two_teams["ours"]), _work_of(two_teams["theirs"])
    assert ours["job"].team_id == two_teams["research"].pk and theirs["job"].team == two_teams["default"]
    assert ours["evaluation"].team_id == ours["tuning"].team_id == two_teams["research"].pk
    nobodys = Job.objects.create(kind="hash_artifact", queue="default", rq_id="no-team")  # a node's, say
    ana = _client_for(two_teams["ana"])
    for work, mine in ((theirs, False), (ours, True)):
        paths = [
            f"/jobs/{work['job'].pk}/",
            f"/jobs/{work['job'].pk}/status",
            f"/evaluations/{work['evaluation'].pk}/",
            f"/tunings/{work['tuning'].pk}/",
            f"/tunings/{work['tuning'].pk}/status",
        ]
        for path in paths:
            assert ana.get(path).status_code == (200 if mine else 404), path
        for path in (
            f"/api/v1/jobs/{work['job'].pk}",
            f"/api/v1/evaluations/{work['evaluation'].pk}",
            f"/api/v1/tunings/{work['tuning'].pk}",
        ):
            assert ana.get(path).status_code == (200 if mine else 404), path
    assert ana.post(f"/jobs/{theirs['job'].pk}/cancel").status_code == 404
    assert ana.post(f"/tunings/{theirs['tuning'].pk}/apply").status_code == 404
    assert ApiClient(two_teams["ana"]).post(f"/api/v1/jobs/{theirs['job'].pk}/cancel").status_code == 404
    assert Job.objects.get(pk=theirs["job"].pk).status == Job.Status.QUEUED  # untouched
    assert ana.get(f"/jobs/{nobodys.pk}/").status_code == 200

    jobs = {j["id"]: j["team"] for j in ana.get("/api/v1/jobs").json()}
    assert jobs == {ours["job"].pk: two_teams["research"].pk, nobodys.pk: None}
    assert ana.get(f"/api/v1/evaluations/{ours['evaluation'].pk}").json()["team"] == two_teams["research"].pk
    assert ana.get(f"/api/v1/tunings/{ours['tuning'].pk}").json()["team"] == two_teams["research"].pk
    listed = ana.get("/jobs/").content.decode()
    assert f"/jobs/{ours['job'].pk}/" in listed and f"/jobs/{theirs['job'].pk}/" not in listed
    overview = ana.get("/").content.decode()
    assert f"/jobs/{ours['job'].pk}/" in overview and f"/jobs/{theirs['job'].pk}/" not in overview
    assert [e["id"] for e in ana.get("/api/v1/evaluations").json()] == [ours["evaluation"].pk]
    page = ana.get("/evaluations/").content.decode()
    assert f"/evaluations/{ours['evaluation'].pk}/" in page and f"/evaluations/{theirs['evaluation'].pk}/" not in page
    assert "ep-theirs" not in page  # nor offered in the form
    pair = f"{ours['evaluation'].pk}/compare/{theirs['evaluation'].pk}"
    assert ana.get(f"/api/v1/evaluations/{pair}").status_code == 404
    # Starting work on another team's endpoint: as if it did not exist (the form's own refusal, beside the field).
    started = ana.post("/evaluations/new", {"endpoint": two_teams["theirs"]["endpoint"].pk, "tasks": "arc_easy"})
    assert started.status_code == 400 and "Choose an existing endpoint." in started.content.decode()
    tune = ApiClient(two_teams["ana"]).post(
        "/api/v1/tunings", {"endpoint": two_teams["theirs"]["endpoint"].pk, "space": {}, "slo": {}}
    )
    assert tune.status_code == 400 and "endpoint" in tune.json()["errors"], tune.content
    assert not Evaluation.objects.filter(endpoint=two_teams["theirs"]["endpoint"]).exclude(pk=theirs["evaluation"].pk)


@pytest.mark.django_db(transaction=True)
def test_the_work_team_migrations_are_reversible(cpu_node):
    before = [
        ("evaluations", "0001_initial"),
        ("endpoints", "0020_usage_and_budgets"),
        ("workers", "0012_telemetry_endpoint_id_not_a_foreign_key"),
        ("models_registry", "0005_team_owner"),
    ]
    call_command("migrate", verbosity=0)
    research = Team.objects.create(name="Research", slug="research")
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    executor.loader.build_graph()
    old = executor.loader.project_state(before).apps
    model = old.get_model("models_registry", "Model").objects.create(name="kept", team_id=research.pk)
    artifact = old.get_model("models_registry", "Artifact").objects.create(
        model=model, format="hf", path="/m", team_id=research.pk
    )
    endpoint = old.get_model("endpoints", "Endpoint").objects.create(
        name="kept-ep", artifact=artifact, node_id=cpu_node.pk, team_id=research.pk
    )
    old.get_model("evaluations", "Evaluation").objects.create(endpoint=endpoint, endpoint_name="kept-ep", label="a")
    old.get_model("evaluations", "Evaluation").objects.create(endpoint_name="gone", label="b")
    old.get_model("endpoints", "Tuning").objects.create(endpoint=endpoint, endpoint_name="kept-ep")
    job = old.get_model("workers", "Job")
    job.objects.create(kind="bench", queue="bench", rq_id="bench", params={"endpoint": endpoint.pk})
    job.objects.create(kind="node", queue="default", rq_id="nothing")
    call_command("migrate", verbosity=0)
    default = Team.objects.get(slug=Team.DEFAULT_SLUG)
    assert Evaluation.objects.get(label="a").team == research and Evaluation.objects.get(label="b").team == default
    assert Tuning.objects.get(endpoint_name="kept-ep").team == research
    assert Job.objects.get(rq_id="bench").team == research and Job.objects.get(rq_id="nothing").team is None
    executor = MigrationExecutor(connection)
    executor.migrate(before)  # back: the columns go, the rows stay
    executor.loader.build_graph()
    assert executor.loader.project_state(before).apps.get_model("evaluations", "Evaluation").objects.count() == 2
    call_command("migrate", verbosity=0)
    assert Evaluation.objects.get(label="a").team == research


def test_quantize_speed_and_profile_comparisons_keep_to_the_users_teams(two_teams):  # noqa: F811
    from endpoints.profiling.models import Profile
    from models_registry.models import Artifact

    theirs, ours = two_teams["theirs"], two_teams["ours"]
    Artifact.objects.filter(pk=theirs["artifact"].pk).update(accuracy={"perplexity": {"value": 9.0}})
    Profile.objects.filter(pk__in=[theirs["profile"].pk, ours["profile"].pk]).update(status="succeeded")
    ana = _client_for(two_teams["ana"])
    api = ApiClient(two_teams["ana"])
    assert ana.get(f"/artifacts/{theirs['artifact'].pk}/speed").status_code == 404
    assert ana.get(f"/artifacts/{ours['artifact'].pk}/speed").status_code == 200
    assert api.get(f"/api/v1/artifacts/{theirs['artifact'].pk}/accuracy").status_code == 404
    assert api.post(f"/api/v1/artifacts/{theirs['artifact'].pk}/quantize", {}).status_code == 404
    assert ana.post(f"/artifacts/{theirs['artifact'].pk}/quantize").status_code == 404
    assert not Job.objects.filter(kind="quantize").exists()
    page = ana.get(f"/profiles/{ours['profile'].pk}/").content.decode()
    assert f"/profiles/{theirs['profile'].pk}/" not in page and "ep-theirs" not in page


def test_calibration_datasets_are_the_uploaders_teams_and_the_built_in_ones_everyones(two_teams, admin):  # noqa: F811
    from models_registry.quantize import services as quantize_services

    def upload(name, user):  # evaluation sets need no minimum of samples
        text = "\n\n".join(f"A paragraph of plain prose, number {i}." for i in range(4))
        return quantize_services.dataset_create(
            name=name, content=text, user=user, filename="x.txt", purpose="evaluation"
        )

    ours, theirs = upload("ours-set", two_teams["ana"]), upload("theirs-set", admin)
    assert ours.team_id == two_teams["research"].pk and theirs.team == two_teams["default"]
    ana = _client_for(two_teams["ana"])
    api = ApiClient(two_teams["ana"])
    listed = {d["name"]: d["team"] for d in api.get("/api/v1/calibration-datasets").json()}
    assert "theirs-set" not in listed and listed["ours-set"] == two_teams["research"].pk
    assert listed["default-calibration"] is None  # built in: everyone's
    assert "theirs-set" not in ana.get("/calibration/").content.decode()
    assert ana.get(f"/calibration/{theirs.pk}").status_code == 404
    assert ana.get(f"/calibration/{ours.pk}").status_code == 200
    assert api.get(f"/api/v1/calibration-datasets/{theirs.pk}").status_code == 404
    assert ana.post(f"/calibration/{theirs.pk}/delete").status_code == 404
    # Quantizing with another team's set: as a set that does not exist.
    refused = api.post(f"/api/v1/artifacts/{two_teams['ours']['artifact'].pk}/quantize", {"evaluation": "theirs-set"})
    assert refused.status_code == 400 and "No calibration dataset" in refused.content.decode(), refused.content


def test_the_node_page_names_only_the_users_teams_replicas(two_teams, cpu_node, admin):  # noqa: F811
    """A node is shared, its endpoints are not: another team's replica shows that its cores are taken and its
    state, not its endpoint's name, link, port or messages. The console Admin sees every replica named."""
    from django.urls import reverse

    from endpoints.models import Replica

    for side, port in (("ours", 8301), ("theirs", 8302)):
        Replica.objects.create(
            endpoint=two_teams[side]["endpoint"],
            node=cpu_node,
            index=0,
            state="ready",
            port=port,
            state_reason=f"reason-of-{side}",
        )
    ana = _client_for(two_teams["ana"])
    listed = ana.get(reverse("node_replicas", args=[cpu_node.pk])).content.decode()
    assert "ep-ours#0" in listed and "port 8301" in listed and "reason-of-ours" in listed
    assert "ep-theirs" not in listed and "8302" not in listed and "reason-of-theirs" not in listed
    assert listed.count("another team's replica") == 1
    admin_client = _client_for(admin)
    everything = admin_client.get(reverse("node_replicas", args=[cpu_node.pk])).content.decode()
    assert "ep-ours#0" in everything and "ep-theirs#0" in everything and "another team" not in everything


def test_a_busy_device_is_refused_naming_only_the_launching_teams_endpoint(  # noqa: F811
    two_teams, ascend_node, tiny_artifact, operator
):
    """The devices refusal names the endpoint that holds a device only where it is of the team the launch is for:
    another team's is "another team's endpoint" (its name is its team's, as on the node page). Nothing is made."""
    from endpoints.models import Endpoint
    from models_registry.models import Artifact, Model

    def launch(user, name, artifact):
        spec = {"name": name, "artifact": artifact.pk, "node": str(ascend_node.pk), "devices": [0]}
        return ApiClient(user).post("/api/v1/endpoints", spec)

    assert launch(operator, "theirs-npu", tiny_artifact).status_code == 201  # the default team's
    research_model = Model.objects.create(name="tiny-research", team=two_teams["research"])
    research_copy = Artifact.objects.create(
        model=research_model,
        format="hf",
        dtype="float32",
        path=tiny_artifact.path,
        inspection=tiny_artifact.inspection,
    )
    refused = launch(two_teams["ana"], "ours-npu", research_copy)
    detail = refused.json()["detail"]
    assert refused.status_code == 400 and "In use by another endpoint: 0 (another team's endpoint)" in detail, detail
    assert "theirs-npu" not in refused.content.decode()
    assert not Endpoint.objects.filter(name="ours-npu").exists()
    # Within the team the holder is named (tests/endpoints/test_endpoints.py: "In use by another endpoint: 0 (a)").
    again = launch(operator, "theirs-npu-2", tiny_artifact)
    assert again.status_code == 400 and "0 (theirs-npu)" in again.json()["detail"]


def test_the_node_pages_device_panel_names_only_the_users_teams_endpoints(two_teams, ascend_node, admin):  # noqa: F811
    """The accelerators' processes on a shared node: another team's process shows its device and memory, not the
    endpoint it serves (name, link); the console Admin sees every one named."""
    from django.urls import reverse

    from workers.models import Device

    processes = [
        {"pid": 101 + i, "name": "vllm", "memory_mb": 2048, "endpoint_id": two_teams[side]["endpoint"].pk}
        | {"endpoint": two_teams[side]["endpoint"].name, "replica": 0}
        for i, side in enumerate(("ours", "theirs"))
    ]
    Device.objects.filter(node=ascend_node, index=0).update(latest={"processes": processes})
    url = reverse("telemetry_node_panel", args=[ascend_node.pk])
    ana = _client_for(two_teams["ana"])
    panel = ana.get(url).content.decode()
    assert "ep-ours#0" in panel and "pid 102 vllm (2,048 MB)" in panel
    assert "ep-theirs" not in panel and f"/endpoints/{two_teams['theirs']['endpoint'].pk}/" not in panel
    assert panel.count("another team's endpoint") == 1
    admin_client = _client_for(admin)
    everything = admin_client.get(url).content.decode()
    assert "ep-ours#0" in everything and "ep-theirs#0" in everything and "another team" not in everything
    # The API's node answer shows the same: the process, not the endpoint.
    api_node = ApiClient(two_teams["ana"]).get(f"/api/v1/nodes/{ascend_node.pk}").json()
    [device] = [d for d in api_node["devices"] if d["index"] == 0]
    theirs = two_teams["theirs"]["endpoint"]
    assert device["latest"]["processes"] == [
        processes[0],
        {"pid": 102, "name": "vllm", "memory_mb": 2048, "other_team": True},
    ]
    assert theirs.name not in str(ApiClient(two_teams["ana"]).get("/api/v1/nodes").json())
    assert (
        ApiClient(admin).get(f"/api/v1/nodes/{ascend_node.pk}").json()["devices"][0]["latest"]["processes"] == processes
    )
