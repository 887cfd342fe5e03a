"""The replica log on the endpoint page is for Operators (issue 39, probe finding): an Operator may turn on
VLLM_LOGGING_LEVEL=DEBUG or --enable-log-requests, which log prompts, so a Viewer sees that a log exists but
not its lines (the page, its live fragment and the API)."""

import pytest
from django.utils import timezone

from endpoints.launch import endpoint_log_root
from endpoints.models import Endpoint, Replica
from models_registry.models import Artifact, Model
from workers.models import Node

PROMPT = "Received request cmpl-1: prompt: 'the patient's diagnosis is SECRET-PROMPT-7'"
CRASH = "RuntimeError: engine died while serving SECRET-PROMPT-9"


@pytest.fixture
def logged(db, tmp_path, settings):
    settings.DATA_DIR = tmp_path / "data"
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
    log = endpoint_log_root() / "demo" / "replica-0.log"
    log.parent.mkdir(parents=True)
    log.write_text(f"INFO starting\n{PROMPT}\n")
    Replica.objects.create(endpoint=endpoint, index=0, node=node, state="ready", port=8231, log_path=str(log))
    Replica.objects.create(endpoint=endpoint, index=1, node=node, state="failed", last_log=f"INFO x\n{CRASH}\n")
    return endpoint


@pytest.mark.django_db
def test_viewers_see_that_a_log_exists_but_not_its_lines(logged, as_viewer):
    for path in (f"/endpoints/{logged.pk}/", f"/endpoints/{logged.pk}/live"):
        page = as_viewer.get(path).content.decode()
        assert "SECRET-PROMPT" not in page, path
        assert 'id="endpoint-log-hidden"' in page and "Operator" in page, path
        assert "Replica 1 failed" in page, path  # that its last lines were kept, not the lines


@pytest.mark.django_db
def test_operators_see_the_log_lines(logged, as_operator):
    for path in (f"/endpoints/{logged.pk}/", f"/endpoints/{logged.pk}/live"):
        page = as_operator.get(path).content.decode()
        assert "SECRET-PROMPT-7" in page and "SECRET-PROMPT-9" in page, path
        assert 'id="endpoint-log-hidden"' not in page


@pytest.mark.django_db
def test_the_api_returns_no_log_lines(logged, viewer, api_for):
    body = api_for(viewer).get(f"/api/v1/endpoints/{logged.pk}").content.decode()
    assert "SECRET-PROMPT" not in body
