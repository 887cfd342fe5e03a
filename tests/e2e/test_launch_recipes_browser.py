"""The launch page in a real headless Chromium (Debian's, driven by Playwright): picking a recipe fills the form
(static/launch_form.js, from the recipes' specs embedded as JSON), "Show command" swaps in the commands and checks
(htmx, with the CSRF token), Copy puts the command on the clipboard, and Launch records the recipe. The page
fixture fails on any script error or Content-Security-Policy violation.

Set LAUNCH_SCREENSHOT=/path.png for a picture of the page with the preview shown."""

import os

import pytest

from endpoints.models import Endpoint
from tests.support.browser import browser, login, page  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def _value(page, name):  # noqa: F811
    return page.eval_on_selector(f"#launch-form [name={name}]", "el => el.type === 'checkbox' ? el.checked : el.value")


def test_pick_a_recipe_show_its_command_copy_it_and_launch(page, operator, cpu_node, tiny_artifact):  # noqa: F811
    login(page, operator)
    page.goto("/endpoints/launch")
    assert page.locator("fieldset.launch-section legend").all_inner_texts()[:3] == [
        "Model and node",
        "Parallelism",
        "Engine",
    ]
    assert page.is_visible("label[for=id_max_model_len]")
    assert not page.is_visible("#id_extra_args")  # folded under Advanced

    # A recipe with every kind of field: its configs' common keys go to their own inputs, the rest to the boxes.
    page.select_option("#id_recipe", "qwen3-30b-a3b-w8a8-eagle3@1")
    assert _value(page, "tensor_parallel_size") == "4"
    assert _value(page, "speculative_method") == "eagle3" and _value(page, "num_speculative_tokens") == "3"
    assert _value(page, "speculative") == ""  # nothing else in it
    assert _value(page, "cudagraph_mode") == "FULL_DECODE_ONLY" and _value(page, "async_scheduling") == "on"
    assert _value(page, "trust_remote_code") is True and _value(page, "enforce_eager") is False
    assert '"enable_flashcomm1":true' in _value(page, "ascend")
    assert "source: vllm-project/vllm-ascend docs/source/tutorials/models/Qwen3-30B-A3B.md @ v0.23.0" in (
        page.inner_text("#recipe-about")
    )
    # A disaggregated recipe: its roles to the roles' inputs (folded section), its connector to the KV transfer box.
    page.select_option("#id_recipe", "qwen2-5-vl-pd-mooncake@1")
    roles = ("prefill_replicas", "prefill_devices", "decode_replicas", "decode_devices")
    assert [_value(page, name) for name in roles] == ["1", "0", "1", "1"]
    assert '"kv_connector":"MooncakeConnectorV1"' in _value(page, "kv_transfer")
    assert _value(page, "speculative_method") == ""  # the eagle3 recipe's, cleared
    # Another recipe: what the first one set is cleared, then its own values filled.
    page.select_option("#id_recipe", "cpu-demo@1")
    assert _value(page, "max_model_len") == "2048" and _value(page, "max_num_seqs") == "8"
    assert _value(page, "dtype") == "float32" and _value(page, "enforce_eager") is True
    assert _value(page, "extra_args") == '{"--seed":0}'
    for name in (
        "tensor_parallel_size",
        "speculative_method",
        "num_speculative_tokens",
        "cudagraph_mode",
        "ascend",
        *roles,
    ):
        assert _value(page, name) == "", name
    assert _value(page, "trust_remote_code") is False and _value(page, "async_scheduling") == ""
    assert "hardware: any x86-64 CPU host" in page.inner_text("#recipe-about")
    page.fill("#id_name", "demo")

    # Show command: the fragment comes in, the focus goes to it; nothing is launched.
    page.click("#show-command")
    page.wait_for_selector("#preview-command-1")
    command = page.inner_text("#preview-command-1")
    assert "-m vllm.entrypoints.openai.api_server" in command and "--max-model-len 2048" in command
    assert "--dtype float32" in command and "--enforce-eager" in command and "--seed 0" in command
    assert "cpu-host · server" in page.inner_text("#preview-node-1")
    checks = page.locator("#launch-preview .checks li").all_inner_texts()
    assert any(c.startswith("OK model files") for c in checks), checks
    assert page.evaluate("document.activeElement.id") == "preview-heading"
    assert page.is_visible("#launch-preview button.copy-command")
    assert not Endpoint.objects.exists()
    if os.environ.get("LAUNCH_SCREENSHOT"):
        page.screenshot(path=os.environ["LAUNCH_SCREENSHOT"], full_page=True)

    # Copy: onto the clipboard where the browser allows it; else the command is selected for Ctrl+C.
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click("#launch-preview button.copy-command")
    page.wait_for_function("document.querySelector('#launch-preview .copy-status').textContent !== ''")
    status = page.inner_text("#launch-preview .copy-status")
    if status == "Copied.":
        assert page.evaluate("navigator.clipboard.readText()") == command
    else:
        assert status.startswith("Selected") and page.evaluate("String(window.getSelection())") == command

    # A refused field: named in the fragment, linked to its input.
    page.fill("#id_max_model_len", "9")
    page.click("#show-command")
    page.wait_for_selector("#preview-errors")
    assert "Max model length (max_model_len): Enter a whole number between 16 and" in page.inner_text("#preview-errors")
    assert page.get_attribute("#preview-errors a", "href") == "#id_max_model_len"

    # An unticked box is off, over the recipe's on.
    page.fill("#id_max_model_len", "")
    page.uncheck("#id_enforce_eager")
    page.click("#show-command")
    page.wait_for_selector("#preview-command-1")
    assert "--enforce-eager" not in page.inner_text("#preview-command-1")
    page.check("#id_enforce_eager")

    # Launch: the recipe is recorded with the endpoint.
    with page.expect_navigation():
        page.click("#launch-button")
    endpoint = Endpoint.objects.get(name="demo")
    assert endpoint.recipe == "cpu-demo@1" and endpoint.max_model_len == 2048 and endpoint.dtype == "float32"
    assert endpoint.enforce_eager is True
    assert "Launching demo." in page.inner_text(".messages")
