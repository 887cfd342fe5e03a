import copy
import json

import pytest

from evaluations.services import results_rows
from tests.support import FIXTURES

RECORDED = FIXTURES / "evaluations" / "demo_f32_default_suite.results.json"


@pytest.fixture
def recorded_summary() -> dict:
    """lm-eval's figures for the demo on the default suite, as evaluations/harness.py wrote them (see the README)."""
    return json.loads(RECORDED.read_text())


@pytest.fixture
def recorded_rows(recorded_summary) -> list[dict]:
    return results_rows(recorded_summary)


def changed(rows: list[dict], **values) -> list[dict]:
    """A copy of recorded rows with some metrics' values replaced: {"acc,none": 0.4}."""
    out = copy.deepcopy(rows)
    for row in out:
        if row["metric"] in values:
            row["value"] = values[row["metric"]]
    return out


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A directory an evaluation accepts as the artifact's tokenizer (the job's lm-eval reads it; these tests stop
    before that)."""
    path = tmp_path / "hf-model"
    path.mkdir()
    (path / "tokenizer.json").write_text("{}")
    (path / "config.json").write_text("{}")
    return path
