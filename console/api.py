"""REST API under /api/v1/: the same services and role checks as the pages.

Auth (console.api_auth): `Authorization: Bearer <token>` (per-user API tokens) or the
browser session (with CSRF); every route names its role. Errors are JSON:
{"detail": ..., "errors"?: {...}, "link"?: ...}."""

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist, PermissionDenied, RequestDataTooBig, ValidationError
from django.http import Http404
from ninja import NinjaAPI
from ninja.errors import AuthenticationError

from console.api_accounts import router as accounts_router
from console.api_auth import NOT_FOUND, UNAUTHENTICATED, BearerToken, Session, docs_access
from console.api_teams import router as teams_router
from console.exceptions import Conflict, ServiceUnavailable
from console.roles import VIEWER
from console.validation import field_errors
from endpoints.api import router as endpoints_router
from endpoints.bench.api import router as bench_router
from endpoints.gateway.api import router as gateway_router
from endpoints.profiling.api import router as profiling_router
from endpoints.tuning.api import router as tuning_router
from endpoints.usage.api import router as usage_router
from evaluations.api import router as evaluations_router
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
    # The docs and the schema are for Viewers, by API token (a client generator) or session; anonymous: the
    # JSON 401. The docs page loads swagger-ui from ninja's own static files ("ninja" is an installed app).
    docs_decorator=docs_access,
)


def _error(request, status, detail, **extra):
    return api.create_response(request, {"detail": detail, **extra}, status=status)


@api.exception_handler(PermissionDenied)
def _forbidden(request, exc):
    return _error(request, 403, str(exc) or "You do not have the role this needs.")


@api.exception_handler(AuthenticationError)
def _unauthenticated(request, exc):
    return _error(request, 401, UNAUTHENTICATED)


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
@api.exception_handler(Http404)
def _not_found(request, exc):
    return _error(request, 404, NOT_FOUND)


@api.exception_handler(RequestDataTooBig)
def _too_big(request, exc):
    """Django refuses the body before reading it (its Content-Length); the role check ran before."""
    return _error(request, 413, too_big_detail())


def too_big_detail() -> str:
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return f"The request body is larger than {limit} bytes ({limit / 2**20:.1f} MiB, DATA_UPLOAD_MAX_MEMORY_SIZE)."


def _register_routers():
    api.add_router("/", accounts_router)
    api.add_router("/", teams_router)
    api.add_router("/", registry_router)
    api.add_router("/", jobs_router)
    api.add_router("/", endpoints_router)
    api.add_router("/", nodes_router)
    api.add_router("/", telemetry_router)
    api.add_router("/", bench_router)
    api.add_router("/", quantize_router)
    api.add_router("/", gateway_router)
    api.add_router("/", profiling_router)
    api.add_router("/", evaluations_router)
    api.add_router("/", tuning_router)
    api.add_router("/", usage_router)


_register_routers()
