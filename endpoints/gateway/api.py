"""API of the gateway: application keys (Admin) and blue-green moves, canary shares and SLO-gated
rollouts (Operator)."""

from ninja import Router, Schema
from pydantic import ConfigDict

from console.api_auth import api_route
from console.roles import ADMIN, OPERATOR
from endpoints.gateway import selectors, services
from endpoints.gateway.models import GatewayKey
from endpoints.selectors import endpoint_get

router = Router(tags=["gateway"])


class KeyIn(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    name: str
    models: list[str] = []
    endpoints: list[str] = []
    expires_days: float | None = None
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    team: int | None = None  # a team where the caller is an Admin; none: console.teams.team_for_new


class LimitsIn(Schema):
    """A limit left out is kept; null removes it."""

    model_config = ConfigDict(extra="forbid")

    rpm_limit: int | None = None
    tpm_limit: int | None = None


class StageIn(Schema):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is refused, not dropped

    staged: int
    drain_seconds: int | None = None


class CanaryIn(Schema):
    model_config = ConfigDict(extra="forbid")
    percent: int  # 1-99 of the requests to the staged side; 0 ends the canary


class EngineHeadersIn(Schema):
    model_config = ConfigDict(extra="forbid")
    allowed: bool  # the clients' X-data-parallel-rank and X-Vllm-Priority reach the replicas


class RolloutIn(Schema):
    """The pair's SLO-gated rollout; fields left out keep their value, null clears a threshold."""

    model_config = ConfigDict(extra="forbid")
    p99_ms: int | None = None  # P99 latency threshold (ms)
    error_pct: float | None = None  # error rate threshold (%)
    ttft_p99_ms: int | None = None  # TTFT P99 threshold (ms)
    window_seconds: int | None = None
    steps: list[int] | str | None = None  # shares (%), rising, ending at 100
    auto: bool | None = None


def key_json(k: GatewayKey) -> dict:
    return {
        "id": k.pk,
        "name": k.name,
        "team": k.team_id,
        "prefix": k.prefix,
        "models": k.models_scope,
        "endpoints": k.endpoints_scope,
        "rpm_limit": k.rpm_limit,
        "tpm_limit": k.tpm_limit,
        "active": k.is_active,
        "expires_at": k.expires_at.isoformat() if k.expires_at else None,
        "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
        "last_used_at": k.last_used_at.isoformat() if k.last_used_at else None,
        "requests_total": k.requests_total,
        "tokens_total": k.tokens_total,
        "errors_total": k.errors_total,
    }


def pair_json(gw) -> dict:
    return {
        "endpoint": gw.endpoint.name,
        "staged": gw.staged.name if gw.staged else None,
        "serving": gw.serving,
        "canary_percent": gw.canary_percent,
        "rollout": rollout_json(gw),
        "drain_seconds": gw.drain_seconds,
        "switched_at": gw.switched_at.isoformat() if gw.switched_at else None,
        "stop_idle_at": gw.stop_idle_at.isoformat() if gw.stop_idle_at else None,
    }


def rollout_json(gw) -> dict:
    return {
        "p99_ms": gw.slo_p99_ms,
        "error_pct": gw.slo_error_pct,
        "ttft_p99_ms": gw.slo_ttft_p99_ms,
        "window_seconds": gw.rollout_window_seconds,
        "steps": gw.rollout_steps,
        "auto": gw.rollout_auto,
        "canary_set_at": gw.canary_set_at.isoformat() if gw.canary_set_at else None,
    }


@api_route(router, "GET", "/gateway/keys", role=ADMIN)
def list_keys(request):
    return [key_json(k) for k in selectors.key_list(user=request.user)]


@api_route(router, "POST", "/gateway/keys", role=ADMIN, response={201: dict})
def create_key(request, data: KeyIn):
    key, raw = services.key_create(
        name=data.name,
        models=data.models,
        endpoints=data.endpoints,
        expires_days=data.expires_days,
        rpm_limit=data.rpm_limit,
        tpm_limit=data.tpm_limit,
        team_id=data.team,
        actor=request.user,
        request=request,
    )
    return 201, {**key_json(key), "key": raw}


@api_route(router, "GET", "/gateway/keys/{key_id}", role=ADMIN)
def get_key(request, key_id: int):
    key = selectors.key_get(key_id, user=request.user)
    # Per-minute usage lives in the telemetry store (requests, tokens, errors, latency): the series API charts it.
    return {
        **key_json(key),
        "usage_series": (
            f"/api/v1/telemetry/series?gateway_key={key.pk}&metric=gk.requests_pm,gk.tokens_pm,gk.errors_pm"
        ),
    }


@api_route(router, "POST", "/gateway/keys/{key_id}/revoke", role=ADMIN)
def revoke_key(request, key_id: int):
    return key_json(
        services.key_revoke(key=selectors.key_get(key_id, user=request.user), actor=request.user, request=request)
    )


@api_route(router, "POST", "/gateway/keys/{key_id}/limits", role=ADMIN)
def key_limits(request, key_id: int, data: LimitsIn):
    key = selectors.key_get(key_id, user=request.user)
    given = {"rpm_limit": key.rpm_limit, "tpm_limit": key.tpm_limit, **data.model_dump(exclude_unset=True)}
    return key_json(
        services.key_update_limits(
            key=key, rpm_limit=given["rpm_limit"], tpm_limit=given["tpm_limit"], actor=request.user, request=request
        )
    )


@api_route(router, "POST", "/gateway/endpoints/{endpoint_id}/stage", role=OPERATOR)
def stage(request, endpoint_id: int, data: StageIn):
    endpoint = endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    staged = services.staged_endpoint(data.staged)
    return pair_json(
        services.stage(
            endpoint=endpoint, staged=staged, drain_seconds=data.drain_seconds, actor=request.user, request=request
        )
    )


@api_route(router, "POST", "/gateway/endpoints/{endpoint_id}/switch", role=OPERATOR)
def switch(request, endpoint_id: int):
    return pair_json(
        services.switch(
            endpoint=endpoint_get(endpoint_id, user=request.user, role=OPERATOR), actor=request.user, request=request
        )
    )


@api_route(router, "POST", "/gateway/endpoints/{endpoint_id}/rollback", role=OPERATOR)
def rollback(request, endpoint_id: int):
    return pair_json(
        services.rollback(
            endpoint=endpoint_get(endpoint_id, user=request.user, role=OPERATOR), actor=request.user, request=request
        )
    )


@api_route(router, "POST", "/gateway/endpoints/{endpoint_id}/canary", role=OPERATOR)
def canary(request, endpoint_id: int, data: CanaryIn):
    """A share of the requests (percent) to the staged deployment, the rest to the live one."""
    return pair_json(
        services.set_canary(
            endpoint=endpoint_get(endpoint_id, user=request.user, role=OPERATOR),
            percent=data.percent,
            actor=request.user,
            request=request,
        )
    )


@api_route(router, "POST", "/gateway/endpoints/{endpoint_id}/engine-headers", role=OPERATOR)
def engine_headers(request, endpoint_id: int, data: EngineHeadersIn):
    """Whether the clients' vLLM routing headers (X-data-parallel-rank, X-Vllm-Priority) reach the replicas."""
    gw = services.set_engine_headers(
        endpoint=endpoint_get(endpoint_id, user=request.user, role=OPERATOR),
        allowed=data.allowed,
        actor=request.user,
        request=request,
    )
    return {"endpoint": endpoint_id, "engine_headers": gw.engine_headers}


@api_route(router, "POST", "/gateway/endpoints/{endpoint_id}/rollout", role=OPERATOR)
def rollout(request, endpoint_id: int, data: RolloutIn):
    """SLO thresholds, window, step plan and automatic rollout (`manage.py serving_controller` applies it)."""
    endpoint = endpoint_get(endpoint_id, user=request.user, role=OPERATOR)
    current = rollout_json(services.endpoint_settings(endpoint))
    given = {**current, **data.model_dump(exclude_unset=True)}
    return pair_json(
        services.set_rollout(
            endpoint=endpoint,
            p99_ms=given["p99_ms"],
            error_pct=given["error_pct"],
            ttft_p99_ms=given["ttft_p99_ms"],
            window_seconds=given["window_seconds"],
            steps=given["steps"],
            auto=bool(given["auto"]),
            actor=request.user,
            request=request,
        )
    )
