"""The Content-Security-Policy in a real Chromium (issue 19, finding 12): pages that the other
browser tests do not open, here the API docs (swagger-ui from the console's own static files),
render with no CSP violation (the `page` fixture fails the test on any) and no script error."""

import pytest

from tests.support.browser import browser, login, page  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_api_docs_render_under_the_csp_from_local_assets(page, viewer, live_server):  # noqa: F811
    login(page, viewer)
    elsewhere = []
    page.on(
        "request",
        lambda request: None if request.url.startswith((live_server.url, "data:")) else elsewhere.append(request.url),
    )
    page.goto("/api/v1/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "LLM inference console API" in page.inner_text(".swagger-ui .info .title")
    page.wait_for_selector(".opblock-tag")  # the operations, from /api/v1/openapi.json
    assert not page.js_errors and not elsewhere, (page.js_errors, elsewhere)
