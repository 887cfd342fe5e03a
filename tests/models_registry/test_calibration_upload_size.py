"""A calibration set's upload is refused by its size before it is read (issue 39, probe finding): the page
checks the upload's .size against the limit and names it; the API's JSON body is bounded by Django's
DATA_UPLOAD_MAX_MEMORY_SIZE before it is read (a JSON 413: tests/console/test_api_for_programs.py) and its text
by the same limit in characters."""

import json

import pytest
from django.core.files.uploadedfile import InMemoryUploadedFile, SimpleUploadedFile

from models_registry.quantize.models import CalibrationDataset

LIMIT = 4096


@pytest.fixture
def small_limit(settings):
    settings.QUANTIZE_MAX_DATASET_CHARS = LIMIT
    settings.QUANTIZE_MIN_SAMPLES = 1


def _jsonl(size: int) -> bytes:
    line = json.dumps({"text": "a calibration sample of plain words " * 3}).encode() + b"\n"
    return (line * (size // len(line) + 1))[:size]


@pytest.mark.django_db
def test_page_upload_over_the_limit_is_refused_before_it_is_read(small_limit, as_operator, monkeypatch):
    upload = SimpleUploadedFile("big.jsonl", _jsonl(LIMIT + 1000), content_type="application/jsonl")
    reads = []

    def read(self):  # File.read is a property handing out the file's read; the test client reads `upload`
        if self is not upload:
            reads.append(self.name)
        return self.file.read

    monkeypatch.setattr(InMemoryUploadedFile, "read", property(read))
    page = as_operator.post("/calibration/upload", {"name": "big", "file": upload}, follow=True).content.decode()
    assert reads == [], "the upload was read before its size was checked"
    assert not CalibrationDataset.objects.filter(name="big").exists()
    assert f"at most {LIMIT} bytes" in page and "QUANTIZE_MAX_DATASET_CHARS" in page and "5.0 KiB" in page


@pytest.mark.django_db
def test_page_upload_within_the_limit_is_read_and_kept(small_limit, as_operator):
    lines = b"".join(_jsonl(LIMIT).splitlines(keepends=True)[:-1])  # whole lines only
    upload = SimpleUploadedFile("ok.jsonl", lines, content_type="application/jsonl")
    as_operator.post("/calibration/upload", {"name": "ok", "file": upload})
    assert CalibrationDataset.objects.get(name="ok").sample_count == lines.count(b"\n")


@pytest.mark.django_db
def test_api_text_over_the_limit_names_it(small_limit, operator, api_for):
    response = api_for(operator).post("/api/v1/calibration-datasets", {"name": "big", "content": "x" * (LIMIT + 1)})
    assert response.status_code == 400
    assert f"characters: at most {LIMIT} " in response.json()["detail"]
    assert "QUANTIZE_MAX_DATASET_CHARS" in response.json()["detail"]
