"""Helpers and fixtures for the browser tests: Debian's Chromium driven by Playwright's
Python API against pytest-django's live_server.

Playwright's own browser downloads are never used: the tests launch /usr/bin/chromium
(`apt-get install chromium`) and skip, saying so, where it is absent (fail in CI: tests.support.needs).

Import the fixtures into a test module: `from tests.support.browser import browser, page  # noqa: F401`.
"""

import os
import re
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.accounts import PASSWORD
from tests.support.jobs import start_worker
from tests.support.needs import missing

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
#: Where the browser tests keep their screenshots (kept after the run, for people and CI artifacts to look at).
SCREENSHOTS = Path(
    os.environ.get("TEST_SCREENSHOTS", Path(__file__).resolve().parents[2] / "var" / "test-artifacts" / "screenshots")
)
LAUNCH_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 15_000  # any one step; long waits (a conversion) pass their own


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module (starting it costs seconds).

    Playwright's sync API keeps an asyncio loop running in this thread while it is started,
    and Django refuses ORM calls from a thread with a running loop; the tests' own ORM use
    (fixtures, assertions) is plain synchronous code, so it is allowed for the module's
    lifetime only. The live server runs in its own thread and is unaffected."""
    if not CHROMIUM.exists():
        missing(f"{CHROMIUM} not found: install Debian's chromium (`make browser`) to run browser tests")
    from playwright.sync_api import sync_playwright

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        pw = sync_playwright().start()
        try:
            chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
            try:
                yield chromium
            finally:
                chromium.close()
        finally:
            pw.stop()


@pytest.fixture
def page(browser, live_server):
    """A fresh browser context (own cookies) on the live server; `page.goto("/models/")` works."""
    context = browser.new_context(base_url=live_server.url, viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors
    page.wait_for_function = lambda expression, **kw: _wait_for_function(page, expression, **kw)
    # Chromium reports what the Content-Security-Policy refused on the console: none may be.
    csp_violations = []
    page.on("console", lambda msg: csp_violations.append(msg.text) if "Content Security Policy" in msg.text else None)
    try:
        yield page
        assert not csp_violations, "CSP violations:\n" + "\n".join(csp_violations)
    finally:
        context.close()


def _wait_for_function(page, expression, *, arg=None, timeout=None, polling=None):
    """page.wait_for_function without eval in the page: Playwright's own builds its predicate with
    `new Function`, which the console's Content-Security-Policy refuses (no 'unsafe-eval');
    page.evaluate goes through the DevTools protocol, which the policy does not govern."""
    from playwright.sync_api import Error, TimeoutError

    deadline = time.monotonic() + (TIMEOUT_MS if timeout is None else timeout) / 1000
    interval = polling if isinstance(polling, (int, float)) else 100
    while True:
        try:
            value = page.evaluate(expression, arg)
        except Error as exc:  # a navigation destroyed the context: ask the next page
            if "context was destroyed" not in str(exc) and "navigat" not in str(exc):
                raise
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"wait_for_function: {expression} still false after {timeout or TIMEOUT_MS} ms")
        page.wait_for_timeout(interval)


def screenshot(page, name: str) -> Path:
    """The whole page as SCREENSHOTS/<name>.png (overwritten by the next run); its path."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / (re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") + ".png")
    page.screenshot(path=str(path), full_page=True)
    return path


def login(page, user, password=PASSWORD):
    """Log in through the login page, as a person would."""
    response = page.goto("/login/")
    assert response.ok, f"GET /login/: {response.status}\n{page.inner_text('body')[:2000]}"
    page.fill("input[name=username]", user.username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_selector("header.topbar")  # only rendered for a logged-in user
    assert user.username in page.inner_text("header.topbar .who")


def demo_gguf_in(root: Path) -> Path:
    """A copy of the real demo GGUF inside a model root (the registry only reads files there)."""
    from tests.support.demo import GGUF_NAME, demo_gguf

    target = root / GGUF_NAME
    shutil.copyfile(demo_gguf(), target)
    return target


@contextmanager
def rq_worker(worker_env, settings, model_root, *queues):
    """A real RQ worker subprocess on the test database, store and model root; killed after,
    with the work horse it may still have (RQ runs the horse in a session of its own).
    Its output is drained as it comes (a full pipe would stall it) and kept in `proc.output`."""
    env = {**worker_env, "ARTIFACT_STORE": str(settings.ARTIFACT_STORE), "MODEL_ROOTS": str(model_root)}
    proc = start_worker(env, *queues)
    proc.output = bytearray()
    drain = threading.Thread(
        target=lambda: [proc.output.extend(chunk) for chunk in iter(proc.stdout.readline, b"")], daemon=True
    )
    drain.start()
    try:
        yield proc
    finally:
        from workers.models import Job

        horses = list(Job.objects.filter(status__in=Job.ACTIVE, pid__isnull=False).values_list("pid", flat=True))
        for pid in horses:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        drain.join(timeout=5)


def worker_output(proc, limit=4000) -> str:
    """The end of what a worker printed, for failure messages."""
    return bytes(proc.output).decode(errors="replace")[-limit:]


def wait_until(predicate, timeout=30.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()
