"""The API for programs (issue 39, "API for programs"): the schema and docs reach token holders, the API's
errors are JSON (401, 404, 413), and the schema is valid OpenAPI by a standard validator."""

import json

import pytest
from django.test import Client
from openapi_spec_validator import validate

from console.api import api


def _bearer(api_client) -> dict:
    return {"Authorization": f"Bearer {api_client.token}"}


# --- 1. the schema and docs for token holders -----------------------------------------------------------


@pytest.mark.django_db
def test_openapi_schema_and_docs_are_served_to_a_bearer_token(viewer, api_for):
    token = _bearer(api_for(viewer))
    schema = Client().get("/api/v1/openapi.json", headers=token)
    assert schema.status_code == 200, (schema.status_code, schema.get("Location"))
    assert "/api/v1/models" in schema.json()["paths"]
    docs = Client().get("/api/v1/docs", headers=token)
    assert docs.status_code == 200 and b"swagger-ui-bundle.js" in docs.content


@pytest.mark.django_db
def test_openapi_schema_and_docs_stay_closed_to_anonymous_and_bad_tokens(outsider):
    for path in ("/api/v1/openapi.json", "/api/v1/docs"):
        for headers in ({}, {"Authorization": "Bearer lmc_not-a-real-token"}):
            response = Client().get(path, headers=headers)
            assert response.status_code == 401, (path, headers, response.status_code)
            assert response["Content-Type"].startswith("application/json")
            assert "Authentication required" in response.json()["detail"]
    held_no_role = Client()
    held_no_role.force_login(outsider)
    assert held_no_role.get("/api/v1/openapi.json").status_code == 403


# --- 2. JSON 401 and 404 on API paths -------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/models", "/api/v1/docs", "/api/v1/openapi.json", "/api/v1/no-such-thing"])
def test_api_paths_without_credentials_get_json_401_never_a_login_redirect(path):
    response = Client().get(path)
    assert response.status_code == 401, (path, response.status_code, response.get("Location"))
    assert response.json()["detail"].startswith("Authentication required")


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/no-such-thing", "/api/v1/models/1/nope", "/api/v1/", "/api/v2/models"])
def test_unknown_api_paths_get_json_404(path, viewer, api_for):
    response = Client().get(path, headers=_bearer(api_for(viewer)))
    assert response.status_code == 404
    assert response["Content-Type"].startswith("application/json")
    assert response.json() == {"detail": "Not found."}


@pytest.mark.django_db
def test_a_missing_object_and_an_unknown_path_answer_alike(viewer, api_for):
    client = api_for(viewer)
    assert client.get("/api/v1/models/999999").json() == {"detail": "Not found."}


@pytest.mark.django_db
def test_pages_keep_their_html_404(as_viewer):
    response = as_viewer.get("/no-such-page/")
    assert response.status_code == 404 and not response["Content-Type"].startswith("application/json")


# --- 3. a body over the upload limit: JSON 413 ----------------------------------------------------------


@pytest.mark.django_db
def test_a_body_over_the_upload_limit_gets_json_413(operator, api_for, settings, caplog):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    client = Client()
    body = json.dumps({"name": "big", "content": "x" * 5000})
    with caplog.at_level("ERROR"):
        response = client.post(
            "/api/v1/calibration-datasets",
            data=body,
            content_type="application/json",
            headers=_bearer(api_for(operator)),
        )
    assert response.status_code == 413, response.content[:300]
    detail = response.json()["detail"]
    assert "1000 bytes" in detail and "DATA_UPLOAD_MAX_MEMORY_SIZE" in detail
    assert not [r for r in caplog.records if r.exc_info], "no traceback in the log"


@pytest.mark.django_db
def test_a_body_over_the_upload_limit_from_anonymous_is_still_401(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    response = Client().post("/api/v1/models", data=json.dumps({"x": "y" * 5000}), content_type="application/json")
    assert response.status_code == 401


# --- 4. the schema is valid OpenAPI ---------------------------------------------------------------------


@pytest.mark.django_db
def test_openapi_schema_passes_a_standard_validator(viewer, api_for):
    """What a client generator reads: the schema served to a token, valid OpenAPI 3 by openapi-spec-validator,
    the same document as the API object's, with the bearer scheme its routes name."""
    served = Client().get("/api/v1/openapi.json", headers=_bearer(api_for(viewer)))
    assert served.status_code == 200, served.status_code
    schema = served.json()
    validate(schema)  # raises OpenAPIValidationError naming the part that is wrong
    assert schema["openapi"].startswith("3.") and schema == json.loads(json.dumps(api.get_openapi_schema()))
    assert schema["components"]["securitySchemes"]["BearerToken"] == {"type": "http", "scheme": "bearer"}
