"""The key check on every path of a replica's vLLM API server, not only on vLLM's own ``/v1``.

vLLM's ``--api-key`` guards the path prefixes ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only
(vllm/entrypoints/serve/middleware/authenticate.py ``GUARDED_PREFIX``, vLLM 0.32.0). Everything else
is served to anyone who reaches the port: ``POST /invocations`` runs the same completions and chats
(vLLM issue #58144: the SageMaker routes are mounted unconditionally), and ``/generative_scoring``,
``/scale_elastic_ep`` and, on a profiling endpoint, ``/start_profile`` answer too. A
replica on a multi-node cluster listens on its node's address, so that would be a way past the
gateway's keys, limits and accounting.

The console starts each replica's server with ``--middleware llm_console_replica_guard.ReplicaKeyGuard``
(vLLM's own extension point: vllm/entrypoints/serve/middleware/register.py imports the class and
adds it with ``app.add_middleware``, so it is the outermost layer) in a working directory holding a copy
of this module (endpoints.launch.make_work_dir), which ``python -m`` puts first on ``sys.path``. The class
then wants the replica's key (``VLLM_API_KEY``, the same one vLLM checks on ``/v1``) on every request
except ``GET``/``HEAD`` of ``/health`` and ``/metrics``, which the agent's checks and Prometheus read
without one, and ``POST`` of ``/tokenize`` and ``/detokenize``, which run the tokenizer only: vLLM's
benchmark client calls them without a key to align its random prompts to the server's token counts
(vllm/benchmarks/serve.py ``_align_prompts_to_server_tokenizer``), and refused it would send prompts of
other lengths.

Runs inside the engine's interpreter: standard library only, no console code, no vLLM import.
Written by hand: vLLM offers no option to guard every path, and a plain ASGI class is all
``--middleware`` takes.
"""

import hmac
import os

_READS = frozenset({"/health", "/metrics"})
OPEN = {"GET": _READS, "HEAD": _READS, "POST": frozenset({"/tokenize", "/detokenize"})}
_REFUSAL = b'{"error": "Unauthorized"}'


class ReplicaKeyGuard:
    def __init__(self, app):
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:  # fail closed: a replica without its key must not start serving
            raise RuntimeError("llm_console_replica_guard: VLLM_API_KEY is not set")
        self.app = app
        self._key = key.encode()

    def _authorised(self, headers) -> bool:
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self._key)

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            return await self.app(scope, receive, send)
        if kind == "http" and scope["path"] in OPEN.get(scope["method"], ()):
            return await self.app(scope, receive, send)
        if self._authorised(scope.get("headers", ())):
            return await self.app(scope, receive, send)
        if kind == "websocket":  # closing before the accept makes the server answer 403
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_REFUSAL)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _REFUSAL})
