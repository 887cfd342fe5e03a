"""What a profile says when there is little to say (issue 39, probe findings): a replica that ran no request in
the window leaves a trace without operator events, which is not a failure: the profile says that no request ran,
keeps the trace and suggests the load option; a profile where no advice rule fires says that nothing crossed a
threshold and names the largest share, instead of an empty list."""

import json

import pytest
from django.utils import timezone

from endpoints.models import Endpoint, Profile, Replica
from endpoints.profiling import analysis, storage
from endpoints.profiling.jobs import _collect
from models_registry.models import Artifact, Model
from workers.jobs.context import JobContext
from workers.models import Job, Node

SPAN = {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": 1, "tid": 1, "ts": 0, "dur": 1000}
IDLE = [SPAN, {"ph": "X", "cat": "user_annotation", "name": "idle", "pid": 1, "tid": 1, "ts": 10, "dur": 5}]
# One compute thread: 500 µs matmul, 400 µs of an operator no pattern knows, 100 µs idle: no rule fires.
QUIET = [
    SPAN,
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 0, "dur": 500},
    {"ph": "X", "cat": "cpu_op", "name": "vllm::custom_sampler", "pid": 1, "tid": 2, "ts": 500, "dur": 400},
]


@pytest.fixture
def served(db, tmp_path, settings):
    settings.ENDPOINT_PROFILE_ROOT = tmp_path / "profiles"
    node = Node.objects.create(
        name="cpu-host", hostname="cpu-host", address="127.0.0.1", platform="cpu", last_heartbeat=timezone.now()
    )
    weights = tmp_path / "models" / "demo"
    weights.mkdir(parents=True)
    artifact = Artifact.objects.create(
        model=Model.objects.create(name="demo"), format="hf", dtype="bfloat16", path=str(weights)
    )
    endpoint = Endpoint.objects.create(
        name="demo", artifact=artifact, node=node, served_model_name="demo", max_model_len=1024, state="ready"
    )
    Replica.objects.create(endpoint=endpoint, index=0, node=node, state="ready", port=8231)
    return endpoint


def _collect_trace(served, tmp_path, events, *, load=None):
    source = tmp_path / "source"
    source.mkdir()
    (source / "rank0.1.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    profile = Profile.objects.create(
        endpoint=served, endpoint_name=served.name, replica_index=0, duration_s=5, status="recording", load=load or {}
    )
    job = Job.objects.create(kind="profile", queue="node-cpu-host", rq_id=f"p{profile.pk}", status=Job.Status.RUNNING)
    _collect(profile, served, served.replica_set.get(), source, {"seconds": 5.0}, timezone.now(), JobContext(job))
    profile.refresh_from_db()
    return profile


@pytest.mark.django_db
def test_an_idle_window_says_no_request_ran_keeps_the_trace_and_suggests_the_load(served, tmp_path, as_viewer):
    profile = _collect_trace(served, tmp_path, IDLE)
    assert profile.state == "succeeded", profile.error
    assert "no operator events" not in profile.display_error
    assert [f["name"] for f in profile.files] == ["rank0.1.pt.trace.json"]
    assert (storage.profile_dir(profile.pk) / "rank0.1.pt.trace.json").is_file()
    [row] = profile.advice
    assert row["rule"] == "no-requests"
    assert "No request ran" in row["text"] and "5 s" in row["text"] and "load" in row["text"]
    page = as_viewer.get(f"/profiles/{profile.pk}/").content.decode()
    assert "No request ran" in page and "rank0.1.pt.trace.json" in page


@pytest.mark.django_db
def test_an_idle_window_under_the_consoles_load_points_at_the_load(served, tmp_path):
    profile = _collect_trace(served, tmp_path, IDLE, load={"num_prompts": 8})
    [row] = profile.advice
    assert row["rule"] == "no-requests" and "the console's load" in row["text"] and "job" in row["text"]


@pytest.mark.django_db
def test_no_rule_fired_says_so_and_names_the_largest_share(served, tmp_path, as_viewer):
    profile = _collect_trace(served, tmp_path, QUIET)
    assert profile.state == "succeeded"
    [row] = profile.advice
    assert row["rule"] == "none"
    assert row["figure"] == "largest share: matrix multiply 50.0 % of the traced time"
    assert "No figure crossed a rule's threshold" in row["text"]
    assert "matrix multiply 50.0 %" in as_viewer.get(f"/profiles/{profile.pk}/").content.decode()


def test_quiet_advice_names_the_largest_share_and_each_threshold():
    result = {
        "breakdown": [
            {"category": analysis.MATMUL, "seconds": 0.25, "share": 0.25},
            {"category": analysis.HOST_IDLE, "seconds": 0.2, "share": 0.2},
            {"category": analysis.MEMORY, "seconds": 0.28, "share": 0.28},
        ]
    }
    assert analysis.advice(result) == []  # the rules table itself: unchanged
    row = analysis.quiet_advice(result)
    assert row["figure"] == "largest share: memory and element-wise 28.0 % of the traced time"
    assert "memory and element-wise at 28.0 %, under the memory-bound rule's 30 %" in row["text"]
