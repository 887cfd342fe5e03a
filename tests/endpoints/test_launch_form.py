"""The launch page (its sections, the recipe picker), its "Show command" preview (endpoints.views
.endpoint_launch_preview), the form's config inputs combined into their configs, and "Save as recipe" on the
endpoint page. The page in a browser: tests/e2e/test_launch_recipes_browser.py."""

import re

import pytest

from console.models import AuditEvent
from endpoints.endpoint_spec import EndpointSpec
from endpoints.forms import EndpointLaunchForm
from endpoints.launch_page import SECTIONS, launch_errors
from endpoints.models import Endpoint, Recipe
from endpoints.services import endpoint_create

PREVIEW = "/endpoints/launch/preview"


def _form(artifact, node, **extra):
    return {"name": "prev", "artifact": str(artifact.pk), "node": str(node.pk), **extra}


# ---------------------------------------------------------------- the form's config inputs


def _spec(**data) -> EndpointSpec:
    form = EndpointLaunchForm(data)
    assert form.is_valid(), form.errors
    return form.spec()


def test_the_config_inputs_make_one_speculative_and_one_compilation_config():
    spec = _spec(
        name="a",
        speculative_method="eagle3",
        num_speculative_tokens="3",
        draft_artifact="7",
        speculative='{"prompt_lookup_max": 4}',
        cudagraph_mode="FULL_DECODE_ONLY",
        cudagraph_capture_sizes="1, 2,4 8",
        compilation='{"mode": 3}',
    )
    assert spec.speculative == {
        "prompt_lookup_max": 4,
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "draft_artifact": 7,
    }
    assert spec.compilation == {
        "mode": 3,
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [1, 2, 4, 8],
    }
    # Each alone, the JSON box blank; nothing given: no config at all (a recipe's stands).
    assert _spec(speculative_method="ngram").speculative == {"method": "ngram"}
    assert _spec(cudagraph_capture_sizes="1,2").compilation == {"cudagraph_capture_sizes": [1, 2]}
    blank = _spec(name="a", speculative="", compilation="  ", speculative_method="", cudagraph_mode="")
    assert blank.speculative is None and blank.compilation is None
    assert "speculative" not in blank.given() and "compilation" not in blank.given()
    # The same key in the JSON box, the same value: fine.
    assert _spec(speculative_method="mtp", speculative='{"method": "mtp"}').speculative == {"method": "mtp"}


def test_a_key_given_twice_differently_or_a_bad_input_is_refused_at_its_field():
    form = EndpointLaunchForm({"speculative_method": "eagle", "speculative": '{"method": "mtp"}'})
    assert not form.is_valid()
    assert form.errors["speculative_method"] == ["method is also in the JSON box below, as 'mtp': give it once."]
    form = EndpointLaunchForm({"cudagraph_capture_sizes": "1,two", "speculative_method": "medusa"})
    assert not form.is_valid()
    assert form.errors["cudagraph_capture_sizes"] == ["Capture sizes are whole numbers, e.g. 1,2,4,8."]
    assert "speculative_method" in form.errors  # not one of the page's methods
    form = EndpointLaunchForm({"speculative": "[1]", "speculative_method": "mtp"})
    assert not form.is_valid() and list(form.errors) == ["speculative"]  # the box's own error, said once


def test_async_scheduling_off_is_given_and_blank_is_not():
    assert _spec(async_scheduling="off").given()["async_scheduling"] is False
    assert _spec(async_scheduling="on").async_scheduling is True
    assert "async_scheduling" not in _spec(async_scheduling="").given()
    assert "enforce_eager" not in _spec().given()  # an unticked box is not given: a recipe's value stands
    # ... unless the launch page sent it, whose boxes are all shown (a recipe's filled in): then it is "off".
    shown = _spec(boxes_shown="1", trust_remote_code="on").given()
    assert shown["enforce_eager"] is False and shown["profiling"] is False and shown["trust_remote_code"] is True
    assert "boxes_shown" not in shown


def test_refusals_go_under_the_field_they_name():
    from django.core.exceptions import ValidationError

    errors = launch_errors(
        ValidationError(
            {
                "speculative": ["speculative.draft_artifact: no artifact '99'.", "speculative: bad key x"],
                "autoscale.min_replicas": ["A whole number from 0 to 64, not -1."],
            }
        )
    )
    assert errors == {
        "draft_artifact": ["speculative.draft_artifact: no artifact '99'."],
        "speculative": ["speculative: bad key x"],
        "autoscale_min_replicas": ["autoscale.min_replicas: A whole number from 0 to 64, not -1."],
    }


def test_autoscaling_has_typed_inputs_laid_over_its_json_box():
    """Issue 39: typed inputs where JSON was typed by hand; the rare keys stay in the box, a key in both is refused."""
    spec = _spec(autoscale_min_replicas="0", autoscale_max_replicas="3", autoscale_target_waiting="2.5")
    assert spec.autoscale == {"min_replicas": 0, "max_replicas": 3, "target_waiting": 2.5}
    spec = _spec(autoscale_max_replicas="2", autoscale='{"cooldown_s": 60}')
    assert spec.autoscale == {"max_replicas": 2, "cooldown_s": 60}
    assert _spec().autoscale is None  # nothing given: off
    form = EndpointLaunchForm({"name": "x", "autoscale_max_replicas": "2", "autoscale": '{"max_replicas": 5}'})
    assert not form.is_valid() and "max_replicas is also in the JSON box" in form.errors["autoscale_max_replicas"][0]


def test_the_roles_inputs_make_the_launchs_roles():
    """Prefill/decode disaggregation from the page: each role's replicas, node and devices (endpoints.roles)."""
    spec = _spec(prefill_replicas="1", prefill_devices="0", decode_replicas="2", decode_node="3", decode_devices="1 2")
    assert spec.roles is not None and spec.roles.model_dump() == {
        "prefill": {"replicas": 1, "node": None, "devices": [0]},
        "decode": {"replicas": 2, "node": "3", "devices": [1, 2]},
    }
    assert spec.replicas is None and "replicas" not in spec.given()  # the page no longer fills in Replicas
    assert _spec(prefill_replicas="").roles is None  # none given: no roles (a recipe's stand)
    form = EndpointLaunchForm({"name": "x", "decode_replicas": "1"})
    assert not form.is_valid()
    assert form.errors["prefill_replicas"] == [
        "Give the prefill role too: a disaggregated endpoint has both, or neither."
    ]
    form = EndpointLaunchForm({"name": "x", "prefill_devices": "0,a", "decode_replicas": "1"})
    assert not form.is_valid() and form.errors["prefill_devices"] == ["Devices are numbers, e.g. 0,1."]


def test_a_roles_refusal_goes_under_the_roles_input():
    from django.core.exceptions import ValidationError

    errors = launch_errors(
        ValidationError(
            {
                "roles.decode.devices": ["[0] are the prefill role's on cpu-host: each role has its own devices."],
                "roles.prefill.replicas": ["A whole number from 1 to 32, not 40."],
                "roles.decode": ["Field required"],
            }
        )
    )
    assert errors == {
        "decode_devices": [
            "roles.decode.devices: [0] are the prefill role's on cpu-host: each role has its own devices."
        ],
        "prefill_replicas": ["roles.prefill.replicas: A whole number from 1 to 32, not 40."],
        "decode_replicas": ["roles.decode: Field required"],
    }


@pytest.mark.django_db
def test_a_disaggregated_endpoint_launches_from_the_page(as_operator, cpu_node, tiny_artifact):
    """The roles section (folded) launches one; a refusal of a role's devices opens it, under that input."""
    page = as_operator.get("/endpoints/launch").content.decode()
    assert re.search(r'<details class="card launch-section" id="section-roles">\s*<summary>Disaggregated', page)
    assert re.search(
        rf'<select name="decode_node"[^>]*>.*<option value="{cpu_node.pk}">cpu-host</option>', page, re.DOTALL
    )
    # The shipped PD recipe's roles fill the roles' inputs (static/launch_form.js reads "nested").
    assert '"nested": {"roles": {"prefill": {"replicas": "prefill_replicas", "node": "prefill_node"' in page
    form = {"name": "pd", "artifact": str(tiny_artifact.pk), "prefill_node": str(cpu_node.pk)}
    refused = as_operator.post("/endpoints/launch", {**form, "decode_replicas": "2", "replicas": "1"})
    assert refused.status_code == 400 and "With roles, each role names its replicas" in refused.content.decode()
    response = as_operator.post("/endpoints/launch", {**form, "decode_replicas": "2", "decode_node": str(cpu_node.pk)})
    assert response.status_code == 302, response.content.decode()[-3000:]
    endpoint = Endpoint.objects.get(name="pd")
    assert endpoint.roles == {
        "prefill": {"replicas": 1, "node": "cpu-host", "devices": []},
        "decode": {"replicas": 2, "node": "cpu-host", "devices": []},
    }
    assert [r.role for r in endpoint.replica_set.order_by("index")] == ["prefill", "decode", "decode"]


def test_every_field_is_in_one_section():
    placed = [name for *_, names in SECTIONS for name in names]
    fields = [name for name in EndpointLaunchForm.base_fields if name != "boxes_shown"]  # hidden
    assert sorted(placed) == sorted(fields) and len(placed) == len(set(placed))


# ---------------------------------------------------------------- the page


@pytest.mark.django_db
def test_the_launch_page_has_its_sections_labels_flags_and_recipes(as_operator, cpu_node, tiny_artifact):
    page = as_operator.get("/endpoints/launch").content.decode()
    for title in (
        "Model and node",
        "Parallelism",
        "Engine",
        "Speculative decoding",
        "Compilation",
        "Gateway and scaling",
        "Restarts",
    ):
        assert f"<legend>{title}</legend>" in page, title
    assert re.search(r"<details class=\"card launch-section\" id=\"section-advanced\">\s*<summary>Advanced", page)
    # A visible label for each input, its vLLM flag under it.
    assert '<label for="id_max_model_len">Max model length</label>' in page
    assert '<p class="help" id="id_max_model_len-help"><code>--max-model-len</code>' in page
    assert 'aria-describedby="id_max_model_len-help"' in page
    for value in ("mtp", "eagle", "eagle3", "ngram", "suffix", "draft_model"):
        assert f'<option value="{value}">{value}</option>' in page
    for mode in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        assert f'<option value="{mode}">{mode}</option>' in page
    # The draft select lists the launchable artifacts; the recipe picker the recipes, with their source.
    assert re.search(rf'<select name="draft_artifact"[^>]*>.*<option value="{tiny_artifact.pk}">', page, re.DOTALL)
    assert re.search(r'<option value="cpu-demo@1">The demo model on a CPU host[^<]* — source: ', page)
    assert re.search(r'<option value="qwen3-30b-a3b-w8a8-eagle3@1">[^<]*source: Qwen3-30B-A3B.md @ v0.23.0<', page)
    # The recipes' specs as data (json_script), the behaviour in a static file: no inline script (CSP).
    assert '<script id="recipe-data" type="application/json">' in page and '"cpu-demo@1"' in page
    assert re.search(r'<script src="/static/launch_form\.js[^"]*" defer>', page)
    for tag in re.findall(r"<script\b[^>]*>", page):
        assert "src=" in tag or 'type="application/json"' in tag, tag
    assert 'hx-post="/endpoints/launch/preview"' in page and ">Show command</button>" in page


@pytest.mark.django_db
def test_a_launch_with_a_recipe_records_it_and_takes_its_values(as_operator, cpu_node, tiny_artifact):
    response = as_operator.post("/endpoints/launch", _form(tiny_artifact, cpu_node, name="demo", recipe="cpu-demo@1"))
    assert response.status_code == 302, response.content.decode()[-2000:]
    endpoint = Endpoint.objects.get(name="demo")
    assert (endpoint.recipe, endpoint.max_model_len, endpoint.dtype) == ("cpu-demo@1", 2048, "float32")
    assert endpoint.enforce_eager is True  # the recipe's: a bare POST's unticked box is not given
    # From the page (boxes_shown), an unticked box is off over the recipe's on.
    form = _form(tiny_artifact, cpu_node, name="demo-graph", recipe="cpu-demo@1", boxes_shown="1")
    assert as_operator.post("/endpoints/launch", form).status_code == 302
    assert Endpoint.objects.get(name="demo-graph").enforce_eager is False
    # A config refused by the service shows in its section, and what was typed comes back.
    page = as_operator.post(
        "/endpoints/launch", _form(tiny_artifact, cpu_node, name="demo2", speculative='{"model": "/tmp/x"}')
    )
    html = page.content.decode()
    assert page.status_code == 400 and 'id="id_speculative-errors"' in html
    assert 'aria-invalid="true"' in html and "&quot;model&quot;: &quot;/tmp/x&quot;" in html
    section = html[html.index('id="section-speculative"') : html.index('id="section-compilation"')]
    assert "draft_artifact" in section and 'class="error field-error"' in section
    assert '<a href="#id_speculative">' in html  # the summary at the top links to it


# ---------------------------------------------------------------- Show command


@pytest.mark.django_db
def test_show_command_previews_the_launch_and_stores_nothing(as_operator, cpu_node, tiny_artifact):
    audits = AuditEvent.objects.count()
    response = as_operator.post(PREVIEW, _form(tiny_artifact, cpu_node, recipe="cpu-demo@1", max_num_seqs="4"))
    html = response.content.decode()
    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")
    assert "<html" not in html  # a fragment
    assert "The command for prev" in html and "from recipe <strong>cpu-demo@1</strong>" in html
    assert "<h3 id=\"preview-node-1\">cpu-host · server</h3>" in html
    command = re.search(r'<pre class="command" id="preview-command-1"[^>]*>(.*?)</pre>', html, re.DOTALL)[1]
    assert "-m vllm.entrypoints.openai.api_server" in command
    assert f"--model {tiny_artifact.path}" in command
    assert "--max-model-len 2048" in command and "--dtype float32" in command  # the recipe's
    assert "--max-num-seqs 4" in command  # the form's, over the recipe's 8
    assert 'data-copy="preview-command-1">Copy</button>' in html
    assert '<span class="check-level">OK</span> <strong>model files</strong>' in html  # text, not colour alone
    assert "<th scope=\"col\">Variable</th>" in html and "<code>VLLM_CPU_KVCACHE_SPACE</code>" in html
    assert not Endpoint.objects.exists() and AuditEvent.objects.count() == audits


@pytest.mark.django_db
def test_show_command_names_the_bad_field(as_operator, cpu_node, tiny_artifact):
    html = as_operator.post(PREVIEW, _form(tiny_artifact, cpu_node, max_model_len="9")).content.decode()
    assert "The launch would be refused" in html
    assert '<a href="#id_max_model_len">Max model length</a></strong> (<code>max_model_len</code>)' in html
    assert "Enter a whole number between 16 and" in html
    html = as_operator.post(PREVIEW, _form(tiny_artifact, cpu_node, gpu_memory_utilization="lots")).content.decode()
    assert '<a href="#id_gpu_memory_utilization">Device memory share</a>' in html and "Between 0.1 and 0.99." in html
    html = as_operator.post(PREVIEW, _form(tiny_artifact, cpu_node, recipe="no-such")).content.decode()
    assert '<a href="#id_recipe">Recipe</a>' in html and "No recipe &#x27;no-such&#x27;" in html
    assert not Endpoint.objects.exists()


@pytest.mark.django_db
def test_show_command_is_an_operators_post(as_viewer, as_operator, cpu_node, tiny_artifact):
    assert as_viewer.post(PREVIEW, _form(tiny_artifact, cpu_node)).status_code == 403
    assert as_operator.get(PREVIEW).status_code == 405


@pytest.mark.django_db
def test_show_command_needs_the_csrf_token(operator, cpu_node, tiny_artifact):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    assert client.post(PREVIEW, _form(tiny_artifact, cpu_node)).status_code == 403


# ---------------------------------------------------------------- Save as recipe


@pytest.fixture
def endpoint(operator, cpu_node, tiny_artifact):
    return endpoint_create(
        spec=EndpointSpec(
            name="web",
            artifact=tiny_artifact.pk,
            node=cpu_node.name,
            max_model_len=1024,
            max_num_seqs=4,
            extra_args={"--seed": 1},
        ),
        user=operator,
    )


@pytest.mark.django_db
def test_save_as_recipe_from_the_endpoint_page(as_operator, as_viewer, endpoint):
    page = as_operator.get(f"/endpoints/{endpoint.pk}/").content.decode()
    assert f'action="/endpoints/{endpoint.pk}/save-recipe"' in page and '<label for="recipe-name">' in page
    url = f"/endpoints/{endpoint.pk}/save-recipe"
    response = as_operator.post(url, {"name": "my-small", "title": "small and seeded"}, follow=True)
    assert "Saved recipe my-small@1 from web" in response.content.decode()
    row = Recipe.objects.get(name="my-small")
    assert (row.version, row.title, row.spec["max_model_len"], row.spec["extra_args"]) == (
        1,
        "small and seeded",
        1024,
        {"--seed": 1},
    )
    assert AuditEvent.objects.filter(action="recipe.save").count() == 1
    as_operator.post(url, {"name": "my-small"})
    assert list(Recipe.objects.filter(name="my-small").values_list("version", flat=True)) == [2, 1]
    # The launch page's picker offers it, newest version, saying where it came from.
    launch = as_operator.get("/endpoints/launch").content.decode()
    assert '<option value="my-small@2">my-small — cpu — saved from endpoint web</option>' in launch
    # Refused: the page again, the error under the field, what was typed kept; nothing saved.
    bad = as_operator.post(url, {"name": "Bad Name!", "title": "kept"})
    html = bad.content.decode()
    assert bad.status_code == 400 and '<div id="recipe-name-errors"><p class="error field-error">' in html
    assert 'value="Bad Name!"' in html and 'value="kept"' in html and "The recipe was not saved" in html
    shipped = as_operator.post(url, {"name": "cpu-demo"})
    assert (
        shipped.status_code == 400 and "cpu-demo is a shipped recipe: choose another name." in shipped.content.decode()
    )
    assert Recipe.objects.count() == 2
    assert as_viewer.post(url, {"name": "v"}).status_code == 403
    assert as_operator.get(url).status_code == 405
    assert Recipe.objects.count() == 2


@pytest.mark.django_db
def test_a_refused_draft_is_named_at_its_own_select(as_operator, ascend_node, tiny_artifact):
    html = as_operator.post(
        PREVIEW,
        _form(tiny_artifact, ascend_node, devices="0", speculative_method="draft_model", draft_artifact="99999"),
    ).content.decode()
    assert '<a href="#id_draft_artifact">Draft model or head</a>' in html, html
    assert "speculative.draft_artifact: no artifact" in html
