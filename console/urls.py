from django.contrib.auth import views as auth_views
from django.urls import include, path
from mozilla_django_oidc import views as oidc

from console import views
from console.api import api
from endpoints import fragments as endpoint_fragments
from endpoints import views as endpoints
from models_registry import views as registry
from workers import views as jobs

urlpatterns = [
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    # Ends the console session, and the provider's too (RP-initiated logout) after an OIDC login: console.sso.
    path("logout/", oidc.OIDCLogoutView.as_view(), name="logout"),
    path("oidc/authenticate/", views.oidc_only(oidc.OIDCAuthenticationRequestView), name="oidc_authentication_init"),
    path("oidc/callback/", views.oidc_only(oidc.OIDCAuthenticationCallbackView), name="oidc_authentication_callback"),
    path("healthz", views.healthz, name="healthz"),
    path("", views.overview, name="overview"),
    path("audit/", views.audit_list, name="audit_list"),
    path("tokens/", views.token_list, name="token_list"),
    path("tokens/create", views.token_create, name="token_create"),
    path("tokens/<int:token_id>/revoke", views.token_revoke, name="token_revoke"),
    path("users/", views.user_list, name="user_list"),
    path("users/create", views.user_create, name="user_create"),
    path("users/<int:user_id>/update", views.user_update, name="user_update"),
    path("models/", registry.model_list, name="model_list"),
    path("models/register", registry.model_register, name="model_register"),
    path("models/<int:model_id>/", registry.model_detail, name="model_detail"),
    path("models/<int:model_id>/delete", registry.model_delete, name="model_delete"),
    path("artifacts/<int:artifact_id>/", registry.artifact_detail, name="artifact_detail"),
    path("artifacts/<int:artifact_id>/jobs", registry.artifact_jobs, name="artifact_jobs"),
    path("artifacts/<int:artifact_id>/convert", registry.artifact_convert, name="artifact_convert"),
    path("artifacts/<int:artifact_id>/delete", registry.artifact_delete, name="artifact_delete"),
    path("artifacts/<int:artifact_id>/served-by", endpoint_fragments.artifact_served_by, name="artifact_served_by"),
    path(
        "artifacts/<int:artifact_id>/capacity-live",
        endpoint_fragments.artifact_capacity_live,
        name="artifact_capacity_live",
    ),
    path("jobs/", jobs.job_list, name="job_list"),
    path("jobs/<int:job_id>/", jobs.job_detail, name="job_detail"),
    path("jobs/<int:job_id>/status", jobs.job_status, name="job_status"),
    path("jobs/<int:job_id>/cancel", jobs.job_cancel, name="job_cancel"),
    path("jobs/<int:job_id>/retry", jobs.job_retry, name="job_retry"),
    path("endpoints/", endpoints.endpoint_list, name="endpoint_list"),
    path("endpoints/launch", endpoints.endpoint_launch, name="endpoint_launch"),
    path("endpoints/launch/preview", endpoints.endpoint_launch_preview, name="endpoint_launch_preview"),
    path("endpoints/<int:endpoint_id>/", endpoints.endpoint_detail, name="endpoint_detail"),
    path("endpoints/<int:endpoint_id>/live", endpoints.endpoint_live, name="endpoint_live"),
    path("endpoints/<int:endpoint_id>/start", endpoints.endpoint_start, name="endpoint_start"),
    path("endpoints/<int:endpoint_id>/stop", endpoints.endpoint_stop, name="endpoint_stop"),
    path("endpoints/<int:endpoint_id>/restart", endpoints.endpoint_restart, name="endpoint_restart"),
    path("endpoints/<int:endpoint_id>/profiling", endpoints.endpoint_profiling, name="endpoint_profiling"),
    path("endpoints/<int:endpoint_id>/routing", endpoints.endpoint_routing, name="endpoint_routing"),
    path("endpoints/<int:endpoint_id>/advisory", endpoints.endpoint_advisory, name="endpoint_advisory"),
    path("endpoints/<int:endpoint_id>/adapters", endpoints.endpoint_adapter, name="endpoint_adapter"),
    path("endpoints/<int:endpoint_id>/delete", endpoints.endpoint_delete, name="endpoint_delete"),
    path("endpoints/<int:endpoint_id>/try", endpoints.endpoint_try, name="endpoint_try"),
    path("endpoints/<int:endpoint_id>/save-recipe", endpoints.endpoint_recipe_save, name="endpoint_recipe_save"),
    path("endpoints/<int:endpoint_id>/profile", endpoints.endpoint_profile_new, name="profile_new"),
    path("benchmarks/new", endpoints.endpoint_bench_new, name="bench_new"),
    path("endpoints/<int:endpoint_id>/tune", endpoints.endpoint_tuning_new, name="tuning_new"),
    path("nodes/", jobs.node_list, name="node_list"),
    path("nodes/<int:node_id>/", jobs.node_detail, name="node_detail"),
    path("nodes/<int:node_id>/replicas", endpoints.node_replicas, name="node_replicas"),
    path("nodes/<int:node_id>/engine-runtime", jobs.node_engine_runtime, name="node_engine_runtime"),
    path("", include("workers.telemetry.urls")),
    path("", include("endpoints.bench.urls")),
    path("", include("models_registry.quantize.urls")),
    path("", include("endpoints.gateway.urls")),
    path("", include("endpoints.profiling.urls")),
    path("", include("evaluations.urls")),
    path("", include("endpoints.tuning.urls")),
    path("", include("endpoints.usage.urls")),
    path("api/v1/", api.urls),
]
