"""The replica key guard (endpoints/replica_guard/llm_console_replica_guard.py), the ASGI middleware each
replica's vLLM server loads with ``--middleware``: vLLM's own ``--api-key`` guards /v1, /v2, /inference and
/cohere only (vllm/entrypoints/serve/middleware/authenticate.py, 0.32.0), and /invocations serves the same
completions without a key (vLLM issue #58144). Driven here as the ASGI server would; the end-to-end test
(tests/e2e/test_endpoints_e2e.py) checks it inside a real replica."""

import ast
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from endpoints.commands import GUARD_DIR, CommandSpecError, guarded_argv
from endpoints.commands.guard import GUARD_MIDDLEWARE

KEY = "rk_" + "ab" * 32
MODULE, CLASS = GUARD_MIDDLEWARE.rsplit(".", 1)
SOURCE = Path(GUARD_DIR) / f"{MODULE}.py"


def load_guard():
    spec = importlib.util.spec_from_file_location(MODULE, SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, CLASS)


@pytest.fixture
def guard(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["path"] if "path" in scope else scope["type"])
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"served"})

    return load_guard()(app), calls


def call(middleware, *, path="/invocations", method="POST", kind="http", authorization=None):
    headers = [(b"content-type", b"application/json")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    scope = {"type": kind, "path": path, "headers": headers}
    if kind == "http":
        scope["method"] = method
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return sent


@pytest.mark.parametrize(
    "path",
    [
        "/invocations",
        "/generative_scoring",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/v1/completions",
        "/health/../invocations",
        "/docs",
    ],
)
def test_every_path_wants_the_replicas_key(guard, path):
    middleware, calls = guard
    for authorization in (None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"):
        start, body = call(middleware, path=path, authorization=authorization)
        assert start["status"] == 401 and (b"www-authenticate", b"Bearer") in start["headers"]
        assert json.loads(body["body"]) == {"error": "Unauthorized"}
    assert calls == []  # nothing reached vLLM
    for authorization in (f"Bearer {KEY}", f"bearer {KEY}"):  # the scheme is case-insensitive (RFC 7235)
        start, body = call(middleware, path=path, authorization=authorization)
        assert start["status"] == 200 and body["body"] == b"served"
    assert calls == [path, path]


def test_health_and_metrics_stay_open_to_reads_and_the_tokenizer_to_posts(guard):
    # vLLM's benchmark client aligns its random prompts through /tokenize and /detokenize without a key.
    middleware, calls = guard
    for path in ("/health", "/metrics"):
        for method in ("GET", "HEAD"):
            assert call(middleware, path=path, method=method)[0]["status"] == 200
        assert call(middleware, path=path, method="POST")[0]["status"] == 401
    for path in ("/tokenize", "/detokenize"):
        assert call(middleware, path=path, method="POST")[0]["status"] == 200
        assert call(middleware, path=path, method="GET")[0]["status"] == 401
    assert call(middleware, path="/metrics/extra", method="GET")[0]["status"] == 401
    assert calls == ["/health", "/health", "/metrics", "/metrics", "/tokenize", "/detokenize"]


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted(guard):
    middleware, calls = guard
    assert call(middleware, path="/v1/realtime", kind="websocket") == [{"type": "websocket.close", "code": 1008}]
    assert calls == []
    call(middleware, path="/v1/realtime", kind="websocket", authorization=f"Bearer {KEY}")
    assert calls == ["/v1/realtime"]


def test_lifespan_passes_through(guard):
    middleware, calls = guard
    asyncio.run(middleware({"type": "lifespan"}, None, None))
    assert calls == ["lifespan"]


def test_a_server_without_its_key_does_not_start(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        load_guard()(lambda scope, receive, send: None)


def test_the_module_is_alone_in_its_directory_and_needs_only_the_standard_library():
    # It runs in the engine's interpreter, whose sys.path starts at the server's working directory, which holds
    # a copy of it (endpoints.launch.make_work_dir): nothing else of the console may become importable there,
    # and it can rely on nothing but the standard library.
    assert sorted(p.name for p in Path(GUARD_DIR).iterdir() if p.name != "__pycache__") == [SOURCE.name]
    tree = ast.parse(SOURCE.read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and imported <= sys.stdlib_module_names


def test_only_the_console_names_a_middleware():
    server = ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert guarded_argv(server) == [*server, "--middleware", GUARD_MIDDLEWARE]
    with pytest.raises(CommandSpecError, match="--middleware already"):
        guarded_argv(["python", "-m", "vllm.entrypoints.openai.api_server", "--middleware", "evil.Thing"])


def test_each_server_runs_in_a_writable_directory_of_its_own_holding_the_module(tmp_path):
    """Not the console's code directory (read-only under deploy/systemd, and CANN writes fusion_result.json
    and its dumps into the working directory): made 0700, the module copied in, and copied again whole when
    the console's differs (an upgrade); what the engine wrote there is left."""
    from endpoints.launch import make_work_dir

    work = make_work_dir(tmp_path / "work" / "endpoints" / "qwen" / "replica-0")
    assert (work.stat().st_mode & 0o777) == 0o700 and [p.name for p in work.iterdir()] == [SOURCE.name]
    assert (work / SOURCE.name).read_bytes() == SOURCE.read_bytes()
    (work / SOURCE.name).write_text("# an older console's guard\n")
    (work / "fusion_result.json").write_text("{}")  # CANN's
    assert make_work_dir(work) == work
    assert (work / SOURCE.name).read_bytes() == SOURCE.read_bytes()
    assert sorted(p.name for p in work.iterdir()) == ["fusion_result.json", SOURCE.name]
