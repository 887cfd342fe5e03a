"""`make run`'s processes under supervisord (deploy/supervisord.conf, started as the Makefile does): kill -9 of
any one brings that one back within 30 s, answering, while the others keep running (same pids); a conversion
whose worker was killed mid-run is reaped as failed, its page says so, and its Retry succeeds; Ctrl-C stops
every process. The console runs as on a host: console.settings from the environment, its own DATA_DIR and
SQLite file, the tests' Redis database, free ports."""

import logging
import os
import re
import signal
import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
import pytest
from rq import Worker

from tests.support import ROOT
from tests.support.agents import wait_for
from tests.support.gateway import free_port
from tests.support.tiny_models import build_slow_to_convert_hf

pytestmark = pytest.mark.slow

CONFIG = ROOT / "deploy" / "supervisord.conf"
VENV_BIN = ROOT / ".venv" / "bin"
PASSWORD = "supervised-admin-password"
BACK_WITHIN_S = 30

# The console's processes, told apart by their command lines (deploy/supervisord.conf): its manage.py command
# and first argument, or gunicorn's WSGI module.
SIGNATURES = {
    "web": ("console.wsgi",),
    "worker": ("jobs_worker", "default"),
    "bench": ("jobs_worker", "bench"),
    "convert": ("rqworker", "convert"),
    "reaper": ("jobs_reaper",),
    "agent": ("agent",),
    "telemetry": ("telemetry_prune",),
    "gateway": ("gateway",),
    "controller": ("serving_controller",),
}


def _name_of(argv: list[str]) -> str | None:
    if "console.wsgi" in argv:
        return "web"
    at = next((i for i, arg in enumerate(argv) if arg.endswith("/manage.py") or arg == "manage.py"), None)
    if at is None:  # not a console process (a shell running one has it inside one argument)
        return None
    command = tuple(argv[at + 1 : at + 3])
    return next((name for name, signature in SIGNATURES.items() if command[: len(signature)] == signature), None)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Console:
    """supervisord -n with the Makefile's config and environment, in its own session; every process it
    started (and any that outlived it: its environment names this DATA_DIR) is killed on close."""

    def __init__(self, tmp_path: Path, redis_url: str):
        self.data = tmp_path / "data"
        (self.data / "logs").mkdir(parents=True)
        self.models = tmp_path / "models"
        self.bind = f"127.0.0.1:{free_port()}"
        self.gateway = f"http://127.0.0.1:{free_port()}"
        self.node = f"supervised-{uuid.uuid4().hex[:8]}"
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}  # manage.py's own default
        self.env = {
            **env,
            "DATA_DIR": str(self.data),
            "DATABASE_URL": f"sqlite:///{tmp_path / 'console.sqlite3'}",
            "REDIS_URL": redis_url,
            "CONSOLE_BIND": self.bind,
            "GATEWAY_URL": self.gateway,
            "WORKERS": "1",
            "CONVERT_WORKERS": "1",
            "WEB_WORKERS": "1",
            "NODE_NAME": self.node,
            "MODEL_ROOTS": str(self.models),
            "CONSOLE_ADMIN_PASSWORD": PASSWORD,
            # A killed job is stale after 5 s; the agent beats every second.
            "JOB_HEARTBEAT_SECONDS": "1",
            "JOB_STALE_SECONDS": "5",
            "AGENT_HEARTBEAT_SECONDS": "1",
        }
        self.proc = None

    def manage(self, *args) -> str:
        done = subprocess.run(
            [str(VENV_BIN / "python"), "manage.py", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def start(self):
        # The Makefile's `run` recipe: umask 077, supervisord -n -c deploy/supervisord.conf.
        # Appending, as a terminal or `make run >> file` would: the echo listener reopens supervisord's stdout.
        self.output = open(self.data / "terminal.txt", "ab")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "supervisord"), "-n", "-c", str(CONFIG)],
            cwd=ROOT,
            env=self.env,
            stdout=self.output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=0o077,
        )

    def processes(self, *, killed: tuple[int, ...] = ()) -> dict[str, int]:
        """The console's processes below supervisord, by name (one each): a forked child with its parent's
        command line (an RQ work horse, a gunicorn worker) is its parent's. Pids in `killed` were sent SIGKILL, or
        die with one that was (a gunicorn master's workers): until the kernel has torn the killed one down it is
        neither a zombie nor gone, and its parent's command line may read empty, so a work horse or a gunicorn
        worker it leaves looks like a second worker or a second web; they are left out."""
        found: dict[str, list[int]] = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.pid in killed:
                continue
            try:
                argv, parent = child.cmdline(), child.parent()
                if child.status() == psutil.STATUS_ZOMBIE or (parent and parent.cmdline() == argv):
                    continue
            except psutil.NoSuchProcess:
                continue
            name = _name_of(argv)
            if name:
                found.setdefault(name, []).append(child.pid)
        assert all(len(pids) == 1 for pids in found.values()), found
        return {name: pids[0] for name, pids in found.items()}

    def terminal(self, tail: int = 6000) -> str:
        """What `make run` would have printed: supervisord's log and the processes' lines (the echo listener)."""
        return (self.data / "terminal.txt").read_text(errors="replace")[-tail:]

    def _ours(self) -> list[psutil.Process]:
        mine = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get("DATA_DIR") == str(self.data):
                    mine.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return mine

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        for proc in self._ours():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc is not None:
            self.proc.wait()
            self.output.close()


@pytest.fixture
def console(tmp_path, settings, redis_conn, caplog):
    caplog.set_level(logging.WARNING, logger="httpx")  # a line per poll would bury a failure's story
    running = Console(tmp_path, settings.REDIS_URL)
    try:
        yield running
    finally:
        running.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _rq_worker_pids(redis_conn) -> set[int]:
    return {w.pid for w in Worker.all(connection=redis_conn)}


def _heartbeat_after(api: httpx.Client, node: str, moment: datetime) -> bool:
    try:
        nodes = api.get("/api/v1/nodes").json()
    except httpx.HTTPError:
        return False
    beats = [datetime.fromisoformat(n["last_heartbeat"]) for n in nodes if n["name"] == node and n["last_heartbeat"]]
    return bool(beats) and beats[0] > moment


def _wait_job(api: httpx.Client, job_id: int, statuses: set[str], timeout: float) -> dict:
    return wait_for(
        lambda: (job := api.get(f"/api/v1/jobs/{job_id}").json())["status"] in statuses and job,
        timeout=timeout,
        interval=0.1,
        what=f"job {job_id} to be {statuses}",
    )


def _login(base: str) -> httpx.Client:
    web = httpx.Client(base_url=base, timeout=30)
    form = web.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    response = web.post("/login/", data={"username": "admin", "password": PASSWORD, "csrfmiddlewaretoken": token})
    assert response.status_code == 302, response.text[:2000]
    return web


def test_killed_processes_come_back_alone_and_a_killed_job_is_reaped_and_retried(console, redis_conn):
    # The Makefile's `migrate` target, then `run`.
    console.manage("migrate", "--noinput", "-v", "0")
    console.manage("collectstatic", "--noinput", "-v", "0")
    console.manage("ensure_admin")
    token = console.manage("create_api_token", "admin").strip().splitlines()[-1]
    source_dir = build_slow_to_convert_hf(console.models / "wide")
    console.start()
    base = f"http://{console.bind}"
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def ready(name: str, pid: int, since: datetime) -> bool:
        if name == "web":
            return _answers(f"{base}/healthz")
        if name == "gateway":
            return _answers(f"{console.gateway}/healthz")
        if name in ("worker", "convert", "bench"):
            return pid in _rq_worker_pids(redis_conn)
        if name == "agent":
            return _heartbeat_after(api, console.node, since)
        return True  # the reaper, telemetry and controller answer nothing; the reaper's work is checked below

    def all_up() -> dict[str, int] | None:
        found = console.processes()
        if set(found) == set(SIGNATURES) and all(ready(n, p, started) for n, p in found.items()):
            return found
        return None

    started = datetime.now(UTC)
    try:
        pids = wait_for(all_up, timeout=120, interval=0.5, what="every console process to answer")
    except AssertionError:
        pytest.fail(console.terminal())

    def kill_and_see_it_back(name: str, *extra_pids: int) -> dict[str, int]:
        """kill -9 of `name` (and of extra_pids); it comes back with a new pid and answers within 30 s, and
        every other process keeps its pid throughout."""
        nonlocal pids
        old, others = pids[name], {n: p for n, p in pids.items() if n != name}
        forked = [c.pid for c in psutil.Process(old).children()]  # gunicorn's workers die with their master
        killed_at = datetime.now(UTC)
        for pid in (old, *extra_pids):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + BACK_WITHIN_S

        def back() -> dict[str, int] | None:
            now = console.processes(killed=(old, *extra_pids, *forked))
            assert {n: now.get(n) for n in others} == others, f"{name} took others down: {now} (were {others})"
            new = now.get(name)
            if new and new != old and not any(_alive(p) for p in (old, *forked)) and ready(name, new, killed_at):
                return now
            return None

        try:
            pids = wait_for(back, timeout=deadline - time.monotonic(), interval=0.3, what=f"{name} to come back")
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{console.terminal()}")
        return pids

    # A conversion runs on the convert worker: kill the worker and its work horse (RQ runs the horse in its
    # own session, so both die only as in an OOM kill or a host restart), then the reaper.
    response = api.post("/api/v1/models", json={"name": "wide", "path": str(source_dir)})
    assert response.status_code == 201, response.text
    artifact = response.json()["artifacts"][0]["id"]
    job_id = api.post(f"/api/v1/artifacts/{artifact}/convert", json={"to": "bf16"}).json()["job"]
    _wait_job(api, job_id, {"running"}, timeout=60)
    horses = [c.pid for c in psutil.Process(pids["convert"]).children()]
    assert horses, "the conversion runs in a work horse"
    kill_and_see_it_back("convert", *horses)
    kill_and_see_it_back("reaper")
    # The new reaper fails the job whose heartbeat stopped (stale after JOB_STALE_SECONDS, reaped every 10 s).
    job = _wait_job(api, job_id, {"failed", "succeeded"}, timeout=BACK_WITHIN_S)
    assert job["status"] == "failed", job
    assert "The worker running this job stopped" in job["error"] and "heartbeat" in job["error"], job["error"]

    # The job's page says what happened, and its Retry button runs it again, to success.
    web = _login(base)
    page = web.get(f"/jobs/{job_id}/")
    assert 'data-status="failed"' in page.text and 'id="job-state">failed<' in page.text
    assert "The worker running this job stopped" in page.text and "no heartbeat from" in page.text
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    retried = web.post(f"/jobs/{job_id}/retry", data={"csrfmiddlewaretoken": csrf})
    assert retried.status_code == 302, retried.text[:2000]
    new_id = int(re.search(r"/jobs/(\d+)/", retried.headers["location"]).group(1))
    assert new_id != job_id
    new = _wait_job(api, new_id, {"succeeded", "failed", "cancelled"}, timeout=120)
    assert new["status"] == "succeeded" and new["retry_of"] == job_id, new
    assert f"Retry of</dt><dd><a href=\"/jobs/{job_id}/\"" in web.get(f"/jobs/{new_id}/").text

    # web with a browser's keep-alive connection open on it (its job pages poll every 2 s): a worker that outlived
    # its master would hold the port until its graceful timeout (console/gunicorn_conf.py).
    assert web.get(f"/jobs/{new_id}/status").status_code == 200
    kill_and_see_it_back("web")
    for name in ("worker", "agent", "gateway"):
        kill_and_see_it_back(name)

    # Each process logged to DATA_DIR/logs/NAME.log, and the terminal got supervisord's account of the kills.
    logs = console.data / "logs"
    assert (
        "listening" in (logs / "gateway.log").read_text()
        and "Listening on convert" in (logs / "convert-1.log").read_text()
    )
    terminal = console.terminal(tail=10**7)
    assert "exited: reaper (terminated by SIGKILL; not expected)" in terminal
    assert re.search(r"^gateway +\| gateway listening on", terminal, re.M), "the echo listener prints their lines"

    # Ctrl-C: supervisord stops every process, then exits.
    everything = [psutil.Process(p) for p in console.processes().values()]
    console.proc.send_signal(signal.SIGINT)
    assert console.proc.wait(timeout=60) == 0
    gone, alive = psutil.wait_procs(everything, timeout=5)
    assert not alive and not console._ours(), (alive, console.terminal())
