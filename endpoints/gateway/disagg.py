"""The two requests of a disaggregated (prefill/decode) request, as the gateway relays it (Gateway.proxy_disaggregated
in endpoints/gateway/asgi.py), the way vLLM's and vllm-ascend's proxies do:

- vLLM: tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (send_request_to_service, _handle_completions),
  the proxy docs/features/nixl_connector_usage.md starts;
- vllm-ascend v0.23.0: examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py
  (build_prefill_request, assign_instances), "adapted from" the former.

The prefill replica gets the client's request with one output token, no stream, and kv_transfer_params asking it to
keep the KV for a remote decode (do_remote_decode); its answer's kv_transfer_params (where its connector says where
the KV is: NIXL's and Mooncake's engine id, host, port and block ids; null from ExampleConnector, whose decode side
finds the KV by the prompt) go into the client's request as it was, which the decode replica answers (streamed if
asked). min_tokens leave the prefill's request (vLLM's proxy: "not supported for P"; one token is all it makes) and
stay in the decode's.

Pure: no I/O."""

from __future__ import annotations

import json

#: What the prefill request asks of its replica's connector (both proxies send exactly these).
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(payload: dict) -> bytes:
    """The prefill replica's request: the client's, for one token, whole, its KV kept for the decode side."""
    body = {k: v for k, v in payload.items() if k not in _PREFILL_DROPS}
    body.update(kv_transfer_params=dict(PREFILL_KV_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


def kv_params_of(answer: bytes) -> dict | None:
    """The kv_transfer_params of a prefill replica's whole answer (None where its connector gives none);
    ValueError if the answer is no JSON object."""
    data = json.loads(answer)
    if not isinstance(data, dict):
        raise ValueError("the prefill answer is not a JSON object")
    params = data.get("kv_transfer_params")
    return params if isinstance(params, dict) and params else None


def decode_body(payload: dict, kv_params: dict | None) -> bytes:
    """The decode replica's request: the client's own, with the prefill's kv_transfer_params where it gave some."""
    body = dict(payload)
    body.pop("kv_transfer_params", None)  # a client's own would point the decode side at KV it never made
    if kv_params:
        body["kv_transfer_params"] = kv_params
    return json.dumps(body).encode()
