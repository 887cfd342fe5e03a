"""REST API under /api/v1/: the same services and role checks as the pages.

Auth (console.api_auth): `Authorization: Bearer <token>` (per-user API tokens) or the
browser session (with CSRF); every route names its role. Errors are JSON: {"detail": ..., "errors"?: {...}, "link"?: ...}."""

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ObjectDoesNotExist, PermissionDenied, ValidationError
from ninja import NinjaAPI
from ninja.errors import AuthenticationError

from console.api_accounts import router as accounts_router
from console.api_auth import BearerToken, Session
from console.exceptions import Conflict, ServiceUnavailable
from console.roles import VIEWER
from console.validation import field_errors
from endpoints.api import router as endpoints_router
from endpoints.bench.api import router as bench_router
from endpoints.gateway.api import router as gateway_router
from endpoints.profiling.api import router as profiling_router
from models_registry.api import router as registry_router
from models_registry.quantize.api import router as quantize_router
from workers.api import router as jobs_router
from workers.api_nodes import router as nodes_router
from workers.telemetry.api import router as telemetry_router

api = NinjaAPI(
    title="LLM inference console API",
    version="1",
    urls_namespace="api",
    # A safety net: routes declared with api_route() name their own role.
    auth=[BearerToken(VIEWER), Session(VIEWER)],
    docs_url="/docs",
    openapi_url="/openapi.json",
    # The docs and the schema are for logged-in users (anonymous: the login page); the docs page
    # loads swagger-ui from ninja's own static files ("ninja" is an installed app), not a CDN.
    docs_decorator=login_required,
)


def _error(request, status, detail, **extra):
    return api.create_response(request, {"detail": detail, **extra}, status=status)


@api.exception_handler(PermissionDenied)
def _forbidden(request, exc):
    return _error(request, 403, str(exc) or "You do not have the role this needs.")


@api.exception_handler(AuthenticationError)
def _unauthenticated(request, exc):
    return _error(request, 401, "Authentication required: send 'Authorization: Bearer <API token>' or log in.")


@api.exception_handler(ValidationError)
def _invalid(request, exc):
    if hasattr(exc, "error_dict"):
        errors = field_errors(exc)
        detail = "; ".join(f"{f}: {' '.join(m)}" if f != "__all__" else " ".join(m) for f, m in errors.items())
        return _error(request, 400, detail, errors=errors)
    return _error(request, 400, " ".join(exc.messages))


@api.exception_handler(Conflict)
def _conflict(request, exc):
    return _error(request, 409, exc.message, link=exc.link, id=exc.object_id)


@api.exception_handler(ServiceUnavailable)
def _unavailable(request, exc):
    response = _error(request, 503, str(exc))
    response["Retry-After"] = "10"
    return response


@api.exception_handler(ObjectDoesNotExist)
def _not_found(request, exc):
    return _error(request, 404, "Not found.")


def _register_routers():
    api.add_router("/", accounts_router)
    api.add_router("/", registry_router)
    api.add_router("/", jobs_router)
    api.add_router("/", endpoints_router)
    api.add_router("/", nodes_router)
    api.add_router("/", telemetry_router)
    api.add_router("/", bench_router)
    api.add_router("/", quantize_router)
    api.add_router("/", gateway_router)
    api.add_router("/", profiling_router)


_register_routers()
