"""The environment doctor: is this host ready to serve? The checks of an Ascend environment preparation
guide (vllm-ascend's installation page), in its order, plus what the console itself needs here:

npu-smi answers and every chip is healthy; driver and firmware versions; the CANN toolkit and its
environment (workers/cann.py, shared with `make engine`'s preflight); Python; the engine environment
(vLLM, and on Ascend vllm-ascend/torch/torch-npu/CANN against the compatibility matrix); torch-npu
imports in the engine python; Docker/Podman and the image when the node runs its replicas in containers
(its engine runtime, or ENGINE_RUNTIME=container); free disk in the artifact
store; the database and Redis; this host's clock against the database server's.

Each check is ok / warning / failed with the fix in one line. `manage.py doctor` prints them for the host
it runs on; the node agent runs them at start and every DOCTOR_INTERVAL_SECONDS and keeps the report on
its Node, so each node's page shows that node's own host. Probes of the engine run in the engine python
(the console never imports vLLM or torch-npu itself)."""

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.db import connection
from django.utils import timezone

from workers import cann
from workers.container_cli import client_environment, image_id, short_image_id
from workers.engine_info import (
    EngineSite,
    compat_findings,
    detect_platform,
    matrix_row,
    probe_engine,
    probe_torch_npu,
)
from workers.jobs.context import free_bytes
from workers.jobs.queues import redis_connection
from workers.npu_smi import NpuSmiError, parse_info, parse_key_values, run_npu_smi

OK, WARNING, FAILED = "ok", "warning", "failed"
# The installation page of the release the Makefile pins (its tag names the docs a fix points to).
DOCS_TAG = "v0.23.0"
CLOCK_SKEW_WARN_SECONDS = 2.0
CONTAINER_RUNTIMES = ("docker", "podman")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warning | failed
    detail: str  # what was found
    fix: str = ""  # one line: what to do about it ("" when ok)


def _missing(name: str, problem: cann.Missing) -> Check:
    return Check(name, FAILED, f"{problem.piece} is missing", f"{problem.detail} See {problem.page(tag=DOCS_TAG)}")


# --- the accelerator ---------------------------------------------------------------------------------


def check_npu_smi(*, timeout: float) -> tuple[Check, dict | None]:
    """`npu-smi info` answers and lists chips that are all healthy. Returns the parsed table too."""
    name = "npu-smi and chip health"
    hardware = cann.INSTALL_PAGE.format(tag=DOCS_TAG) + cann.HARDWARE
    try:
        table = parse_info(run_npu_smi(["info"], timeout=timeout))
    except NpuSmiError as exc:
        if "not found" in str(exc):
            return Check(name, FAILED, str(exc), f"install the Ascend HDK driver and firmware ({hardware})"), None
        return Check(
            name,
            FAILED,
            str(exc),
            "run `npu-smi info` as this user to see why; reinstall or reload the Ascend driver, and make "
            f"/dev/davinci* readable by this user ({hardware})",
        ), None
    chips = table["chips"]
    if not chips:
        return Check(
            name,
            FAILED,
            "npu-smi info lists no chips",
            "check the driver sees the cards (`npu-smi info -l`) and reinstall the Ascend driver",
        ), table
    sick = [c for c in chips if str(c.get("health") or "").upper() != "OK"]
    if sick:
        said = "; ".join(f"NPU {c['npu']} chip {c['chip']} health is {c.get('health') or 'unknown'}" for c in sick)
        first = sick[0]
        return Check(
            name,
            FAILED,
            said,
            f"read the alarm with `npu-smi info -t health -i {first['npu']} -c {first['chip']}`, then reset "
            f"the chip (`npu-smi set -t reset -i {first['npu']} -c {first['chip']}`) or have it replaced; "
            "until then serve on the healthy chips",
        ), table
    names = sorted({c.get("name") or "?" for c in chips})
    return Check(name, OK, f"{len(chips)} chips ({', '.join(names)}), all healthy"), table


def check_driver_firmware(table: dict, *, timeout: float) -> Check:
    """The driver's version (npu-smi's header) and the first chip's firmware (`npu-smi info -t board`)."""
    name = "driver and firmware"
    first = table["chips"][0]
    firmware = None
    try:
        board = parse_key_values(
            run_npu_smi(["info", "-t", "board", "-i", str(first["npu"]), "-c", str(first["chip"])], timeout=timeout)
        )
        firmware = next((c.get("firmware_version") for c in board.get("chips") or []), board.get("firmware_version"))
    except NpuSmiError:
        pass  # reported below as unknown
    detail = f"driver {table.get('version') or 'unknown'}, firmware {firmware or 'unknown'}"
    if table.get("version") and firmware:
        return Check(name, OK, detail)
    return Check(
        name,
        WARNING,
        detail,
        "npu-smi did not report both versions: check /usr/local/Ascend/driver/version.info and "
        "/usr/local/Ascend/firmware/version.info, and reinstall the HDK driver and firmware as one release",
    )


def check_cann() -> tuple[Check, str | None]:
    """The toolkit set_env.sh points at, its environment, kernels and NNAL. Returns the CANN version too."""
    name = "CANN toolkit and environment"
    problem, home = cann.check_cann(os.environ, None)
    version = cann.toolkit_version(home) if home else None
    if problem:
        return _missing(name, problem), version
    return Check(
        name,
        OK,
        f"CANN {version} at {home}; set_env.sh sourced (LD_LIBRARY_PATH, ASCEND_OPP_PATH), kernels and NNAL present",
    ), version


def check_torch_npu(engine_python: str) -> Check:
    name = "torch-npu imports"
    found = probe_torch_npu(engine_python)
    if found.get("error"):
        return Check(
            name,
            FAILED,
            f"`import torch_npu` in {engine_python} failed: {found['error']}",
            "a missing lib*.so means CANN's (and NNAL's) set_env.sh were not sourced before the agent "
            "started; a missing module means the engine environment lacks torch-npu: `make engine`",
        )
    if not found.get("npus"):
        return Check(
            name,
            FAILED,
            f"torch-npu {found.get('torch_npu')} imports but sees no NPUs",
            "check ASCEND_RT_VISIBLE_DEVICES is unset or right and /dev/davinci* are readable by this user",
        )
    return Check(name, OK, f"torch-npu {found.get('torch_npu')} imports and sees {found['npus']} NPUs")


# --- Python and the engine ---------------------------------------------------------------------------


def check_python(engine: dict) -> Check:
    console = ".".join(map(str, sys.version_info[:3]))
    found = f"console Python {console}, engine Python {engine.get('python') or 'unknown'}"
    row = matrix_row(engine.get("vllm_ascend"))
    if row and row["python"] and engine.get("python"):
        (low, high), have = row["python"], tuple(int(p) for p in engine["python"].split(".")[:2])
        if not low <= have < high:
            needs = f">= {low[0]}.{low[1]}, < {high[0]}.{high[1]}"
            return Check(
                "Python",
                FAILED,
                f"{found}: vllm-ascend {engine['vllm_ascend']} needs {needs}",
                "rebuild the engine with `make engine PYTHON=python3.11`",
            )
    return Check("Python", OK, found)


def check_engine(
    engine: dict, *, platform: str, engine_python: str, cann_version: str | None, image: str = ""
) -> Check:
    """The engine's versions against the compatibility matrix; with ``image``, the engine is that image's
    (its CANN is built in: no host CANN to match)."""
    name = ("vLLM and vllm-ascend" if platform == "ascend" else "vLLM") + (" (in the image)" if image else "")
    if engine.get("error"):
        fix = (
            f"pull an image with vLLM (replicas run {image}) or set the node's engine image on its page"
            if image
            else f"run `make engine` on this node (ENGINE_PYTHON={engine_python})"
        )
        return Check(name, FAILED, engine["error"], fix)
    found = ", ".join(
        f"{key.replace('_', '-')} {engine[key]}"
        for key in ("vllm", "vllm_ascend", "torch", "torch_npu")
        if engine.get(key)
    )
    if platform != "ascend" or image:
        return Check(name, OK, found + (f" in {image}" if image else ""))
    findings = compat_findings(engine, cann=cann_version)
    if not findings:
        return Check(name, OK, f"{found}, CANN {cann_version}: the compatibility matrix's row")
    status = FAILED if any(f.blocking for f in findings) else WARNING
    first = next(f for f in findings if f.blocking or status == WARNING)
    return Check(name, status, " ".join(f.message for f in findings), first.fix)


def check_container_runtime(runtime: str | None = None, *, image: str = "", timeout: float = 20) -> Check | None:
    """Only when replicas are to run in containers: the node's engine runtime ("docker"/"podman", set on
    its page) or, without one, ENGINE_RUNTIME=container (either will do). The CLI's daemon must answer,
    and the image the replicas run must be here already: they start with --pull=never. None otherwise."""
    name = "container runtime"
    wanted = runtime or settings.ENGINE_RUNTIME
    if wanted not in (*CONTAINER_RUNTIMES, "container"):
        return None
    if wanted == "container":
        found = next((shutil.which(r) for r in CONTAINER_RUNTIMES if shutil.which(r)), None)
        if found is None:
            return Check(
                name,
                FAILED,
                "ENGINE_RUNTIME=container but neither docker nor podman is on PATH",
                "install Docker or Podman on this node, or unset ENGINE_RUNTIME",
            )
    else:
        found = shutil.which(wanted)
        if found is None:
            return Check(
                name,
                FAILED,
                f"this node's replicas run under {wanted}, which is not on PATH",
                f"install {wanted} on this node, or set its engine runtime back to process on the node's page",
            )
    binary = Path(found).name
    try:
        result = subprocess.run(
            [found, "info"], capture_output=True, text=True, timeout=timeout, env=client_environment()
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        result, said = None, str(exc)
    if result is None or result.returncode != 0:
        said = said if result is None else ((result.stderr or result.stdout).strip().splitlines() or ["no output"])[-1]
        return Check(
            name,
            FAILED,
            f"`{binary} info` failed: {said}",
            f"start the {binary} daemon/service and let this user use it",
        )
    if image:
        found_id = image_id(found, image, timeout=timeout)
        if not found_id:
            return Check(
                name,
                WARNING,
                f"{binary} answers ({found}), but the image {image} is not on this node",
                f"{binary} pull {image} (replicas start with --pull=never)",
            )
        return Check(name, OK, f"{binary} answers ({found}); {image} is here ({short_image_id(found_id)})")
    return Check(name, OK, f"{binary} answers ({found})")


# --- the console's own dependencies ------------------------------------------------------------------


def check_artifact_store() -> Check:
    store = Path(settings.ARTIFACT_STORE)
    free, keep = free_bytes(store), settings.ARTIFACT_STORE_MIN_FREE_BYTES
    found = f"{free / 1e9:.1f} GB free at {store} (jobs keep {keep / 1e9:.1f} GB free)"
    if free < keep:
        return Check(
            "artifact store disk",
            FAILED,
            found,
            "free space there or point ARTIFACT_STORE at a larger disk: conversions and quantizations are "
            "refused below ARTIFACT_STORE_MIN_FREE_BYTES",
        )
    return Check("artifact store disk", OK, found)


def _db_epoch() -> float:
    """The database server's clock, in seconds since the epoch (SQLite: this host's)."""
    query = {
        "postgresql": "SELECT EXTRACT(EPOCH FROM clock_timestamp())",
        "mysql": "SELECT UNIX_TIMESTAMP(NOW(6))",
    }.get(connection.vendor, "SELECT (julianday('now') - 2440587.5) * 86400.0")
    with connection.cursor() as cursor:
        cursor.execute(query)
        return float(cursor.fetchone()[0])


def _database_shown() -> str:
    db = settings.DATABASES["default"]
    where = f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or ''}".rstrip(":")
    return f"{connection.vendor} {db['NAME']}" + ("" if connection.vendor == "sqlite" else f" at {where}")


def check_database_and_clock(*, clock: Callable[[], float] = time.time) -> list[Check]:
    """The database answers, and this host's clock agrees with the database server's. Nodes compare their
    times through the database (heartbeats, job staleness), so each node's skew against it is what matters."""
    try:
        before = clock()
        server = _db_epoch()
        local = (before + clock()) / 2
    except Exception as exc:  # any driver error means the same thing here: unreachable
        return [
            Check(
                "database",
                FAILED,
                f"{_database_shown()}: {type(exc).__name__}: {exc}".strip(),
                "check DATABASE_URL and that the database server is up and reachable from this host",
            )
        ]
    checks = [Check("database", OK, f"{_database_shown()} answers")]
    skew, fail_at = local - server, settings.NODE_OFFLINE_SECONDS / 2
    found = f"this host's clock is {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} the database server's"
    if connection.vendor == "sqlite":
        found += " (SQLite: the same host)"
    fix = (
        "sync this host and the database server with NTP (chrony, or `timedatectl set-ntp true`): heartbeats "
        "and job staleness compare their times"
    )
    if abs(skew) >= fail_at:
        checks.append(Check("clock skew", FAILED, found, fix))
    elif abs(skew) >= CLOCK_SKEW_WARN_SECONDS:
        checks.append(Check("clock skew", WARNING, found, fix))
    else:
        checks.append(Check("clock skew", OK, found))
    return checks


def _redis_shown() -> str:
    """REDIS_URL without its password."""
    parts = urlsplit(settings.REDIS_URL)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def check_redis() -> Check:
    try:
        redis_connection().ping()
    except Exception as exc:  # RedisError or a socket error: unreachable either way
        return Check(
            "Redis",
            FAILED,
            f"{_redis_shown()}: {exc}",
            "start Redis or fix REDIS_URL: jobs queue there and agents are nudged through it",
        )
    return Check("Redis", OK, f"{_redis_shown()} answers")


# --- the report --------------------------------------------------------------------------------------


def host_platform(engine: dict) -> str:
    """detect_platform, except that an Ascend host whose npu-smi is gone still counts as Ascend (the CANN
    environment or vllm-ascend says so): that is exactly the failure to report."""
    found = detect_platform()
    if (
        found == "cpu"
        and not os.environ.get("NODE_PLATFORM")
        and (engine.get("vllm_ascend") or cann.toolkit_home(os.environ))
    ):
        return "ascend"
    return found


def run_checks(
    *, engine_python: str, clock: Callable[[], float] = time.time, runtime: str | None = None, image: str = ""
) -> tuple[str, list[Check]]:
    """(this host's platform, its checks in the order of the preparation guide). runtime/image: the node's
    engine runtime and the image its replicas run in, when the node runs them in containers: then the engine
    checked is the image's (probed in a container of it), not the host's venv, which such a host may lack."""
    in_image = image if runtime in CONTAINER_RUNTIMES and image else ""
    engine = probe_engine(EngineSite(runtime=runtime, image=image) if in_image else engine_python)
    platform = host_platform(engine)
    checks: list[Check] = []
    cann_version = None
    if platform == "ascend":
        timeout = settings.TELEMETRY_NPU_SMI_TIMEOUT_SECONDS
        npu_smi, table = check_npu_smi(timeout=timeout)
        checks.append(npu_smi)
        if table and table["chips"]:
            checks.append(check_driver_firmware(table, timeout=timeout))
        cann_check, cann_version = check_cann()
        checks.append(cann_check)
    checks.append(check_python(engine))
    checks.append(
        check_engine(engine, platform=platform, engine_python=engine_python, cann_version=cann_version, image=in_image)
    )
    if platform == "ascend" and not in_image:  # in a container, torch-npu sees the chips a replica is given
        checks.append(check_torch_npu(engine_python))
    container = check_container_runtime(runtime, image=image)
    if container:
        checks.append(container)
    checks.append(check_artifact_store())
    checks.extend(check_database_and_clock(clock=clock))
    checks.append(check_redis())
    return platform, checks


def overall(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    return FAILED if FAILED in statuses else WARNING if WARNING in statuses else OK


def host_report(
    *, engine_python: str, clock: Callable[[], float] = time.time, runtime: str | None = None, image: str = ""
) -> dict:
    """What Node.doctor keeps and `manage.py doctor --json` prints."""
    platform, checks = run_checks(engine_python=engine_python, clock=clock, runtime=runtime, image=image)
    return {
        "status": overall(checks),
        "checked_at": timezone.now().isoformat(),
        "hostname": socket.gethostname(),
        "platform": platform,
        "engine_python": engine_python,
        "checks": [asdict(c) for c in checks],
    }
