"""The `profile` job kind: record one replica with vLLM's own profiler, optionally under the
console's own load, collect the trace files and analyse them. Imported by EndpointsConfig.ready().

On the replica's node (its queue): vLLM writes the trace into the replica's profiler directory
(endpoints.profiling.paths), which only that host can read. The sequence is vLLM's own:
POST /start_profile, wait, POST /stop_profile (it returns once the workers have written their
traces), then the files move into the profile's directory through a staging directory, so a
failed job leaves no half-written profile."""

import logging
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from endpoints.bench.client import client_argv, client_environment, engine_python_for
from endpoints.bench.snapshots import telemetry_window
from endpoints.models import Endpoint, Replica
from endpoints.profiling import analysis, storage
from endpoints.profiling.models import Profile, ProfileStatus
from endpoints.profiling.paths import replica_profile_dir
from endpoints.profiling.services import profile_resubmit, replica_records_profiles
from endpoints.telemetry import scrape
from endpoints.vllm_metrics import parse_metrics, window_stats
from models_registry.paths import PathRefused, check_tree
from workers.jobs.children import start_job_child, stop_job_child
from workers.jobs.context import JobCancelled, JobFailed
from workers.jobs.runner import JobRunner

log = logging.getLogger("console.job")
STOP_TIMEOUT_S = 600  # /stop_profile returns after the workers wrote their traces (large ones take a while)
ABANDON_TIMEOUT_S = 10  # a dead job's profiler, stopped from the reaper or a Cancel: the answer is not awaited
LOAD_WARMUP_S = 180  # the load client's start (tokenizer, first requests) before the recording begins


class ProfileRun(JobRunner):
    name = "profile"
    queue = "default"  # a profile goes to its replica's node queue (the trace is written there)
    timeout = 1800

    def run(self, job, ctx) -> dict:
        profile = Profile.objects.filter(job=job).select_related("endpoint").first()
        if profile is None:
            raise JobFailed("This job has no profile (was it deleted?).")
        try:
            return record(profile, ctx)
        except JobCancelled:
            _end(profile, ProfileStatus.FAILED, "Cancelled.")
            raise
        except JobFailed as exc:
            _end(profile, ProfileStatus.FAILED, str(exc))
            raise
        except Exception as exc:
            _end(profile, ProfileStatus.FAILED, f"{type(exc).__name__}: {exc}")
            raise

    def resubmit(self, *, job, user, request=None):
        return profile_resubmit(job=job, user=user, request=request)

    def on_failure(self, job) -> None:
        """A job that died or was reaped: its profile ends failed and keeps no files."""
        for profile in Profile.objects.filter(job=job).exclude(
            status__in=(ProfileStatus.SUCCEEDED, ProfileStatus.FAILED)
        ):
            if profile.status == ProfileStatus.RECORDING:  # the worker died mid-recording: stop the profiler
                replica = (
                    Replica.objects.select_related("node")
                    .filter(endpoint_id=profile.endpoint_id, index=profile.replica_index, port__isnull=False)
                    .first()
                )
                if replica is not None:  # in the reaper's pass or a Cancel's request: not 10 minutes of it
                    _abandon(replica, replica.auth_header, replica_profile_dir(replica), timeout=ABANDON_TIMEOUT_S)
            _end(profile, ProfileStatus.FAILED, job.error or f"The job ended {job.status}.")
            storage.remove_profile_files(profile.pk)

    def result_object(self, job):
        return Profile.objects.filter(job=job).first()


def _end(profile: Profile, status: str, error: str = "") -> None:
    Profile.objects.filter(pk=profile.pk).update(status=status, error=error[:5000], finished_at=timezone.now())


def _post(url: str, headers: dict, timeout: float) -> None:
    request = urllib.request.Request(url, data=b"", method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if response.status != 200:
            raise OSError(f"{url} answered {response.status}")


def _healthy(replica: Replica) -> str:
    """'' when the replica still serves, else why not (its row's state, or /health's answer)."""
    replica.refresh_from_db(fields=["state", "state_reason", "pid", "port"])
    if replica.state != Endpoint.State.READY or not replica.port:
        return f"it is {replica.state} now" + (f" ({replica.state_reason})" if replica.state_reason else "")
    try:
        with urllib.request.urlopen(f"{replica.url}/health", timeout=10) as response:
            return "" if response.status == 200 else f"/health answered {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"/health failed: {getattr(exc, 'reason', exc)}"


def _clear(directory: Path) -> None:
    """Leftovers of an earlier recording that did not finish (the replica died, the job was killed)."""
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _snapshot(replica: Replica, served_name: str):
    text, _ = scrape(replica.port, timeout=5)
    if text is None:
        return None
    try:
        return parse_metrics(text, model_name=served_name)
    except ValueError:
        return None


def _config(endpoint: Endpoint, replica: Replica) -> dict:
    artifact = endpoint.artifact
    setup = " ".join(x for x in (str(artifact), endpoint.quantization or "", endpoint.dtype or "") if x)
    return {
        "setup": setup,
        "artifact": artifact.pk,
        "artifact_name": str(artifact),
        "dtype": endpoint.dtype or "auto",
        "quantization": endpoint.quantization or None,
        "tensor_parallel_size": endpoint.tensor_parallel_size,
        "max_num_seqs": endpoint.max_num_seqs,
        "max_model_len": endpoint.max_model_len,
        "enforce_eager": endpoint.enforce_eager,
        "node": replica.node.name,
        "platform": replica.node.platform,
        "devices": replica.devices,
        "replica": replica.index,
    }


class _Load:
    """vLLM's benchmark client against the replica for the length of the recording (the
    benchmark form's settings); stopped once the recording ends."""

    def __init__(self, *, endpoint: Endpoint, replica: Replica, workload: dict):
        try:  # the client reads the tokenizer files itself, as a benchmark's does (endpoints.bench.client)
            check_tree(endpoint.artifact.path)
        except PathRefused as exc:
            raise JobFailed(f"No load for the recording: {exc}") from exc
        self.dir = tempfile.TemporaryDirectory(prefix="profile-load-")
        argv = client_argv(
            python=engine_python_for(replica.node),
            base_url=replica.url,
            model=endpoint.served_model_name,
            tokenizer=endpoint.artifact.path,
            workload=workload,
            result_dir=Path(self.dir.name),
        )
        env = client_environment({"OPENAI_API_KEY": replica.api_key})
        self.log_path = Path(self.dir.name) / "client.log"
        self.out = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = start_job_child(argv, cwd=self.dir.name, env=env, stdout=self.out, stderr=subprocess.STDOUT)

    def died(self) -> str:
        if self.proc.poll() is None:
            return ""
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
        return f"the load client exited with {self.proc.returncode}: " + " | ".join(tail)[-800:]

    def stop(self) -> None:
        stop_job_child(self.proc, grace=5)
        self.out.close()
        self.dir.cleanup()


def _wait_for_load(load: _Load, replica: Replica, served_name: str, ctx) -> None:
    """Until the replica runs requests of the load (the client loads a tokenizer first)."""
    deadline = time.monotonic() + LOAD_WARMUP_S
    while time.monotonic() < deadline:
        ctx.check_cancelled()
        why = load.died()
        if why:
            raise JobFailed(f"No load for the recording: {why}")
        snap = _snapshot(replica, served_name)
        if snap is not None and (snap.running or 0) > 0:
            return
        time.sleep(0.5)
    raise JobFailed(f"The load client sent no request within {LOAD_WARMUP_S} s.")


def record(profile: Profile, ctx) -> dict:
    endpoint = Endpoint.objects.select_related("artifact", "node").filter(pk=profile.endpoint_id).first()
    if endpoint is None:
        raise JobFailed(f"Endpoint {profile.endpoint_name} was deleted.")
    replica = endpoint.replica_set.select_related("node").filter(index=profile.replica_index).first()
    if replica is None or replica.state != Endpoint.State.READY or not replica.port:
        raise JobFailed(
            f"{endpoint.name}#{profile.replica_index} is not serving now "
            f"(state: {replica.state if replica else 'gone'})."
        )
    if not replica_records_profiles(replica):
        raise JobFailed(f"{endpoint.name}#{replica.index} runs without vLLM's profiler: enable profiling first.")
    source = replica_profile_dir(replica)
    if not source.is_dir():
        raise JobFailed(
            f"The replica's profiler directory {source} is not on this host: the job must run on "
            f"{replica.node.name}'s worker."
        )
    _clear(source)
    served = endpoint.served_model_name
    headers = replica.auth_header
    profile.status, profile.started_at, profile.config = (
        ProfileStatus.RECORDING,
        timezone.now(),
        _config(endpoint, replica),
    )
    profile.save(update_fields=["status", "started_at", "config"])
    load = None
    try:
        if profile.load:
            ctx.progress(2, f"starting the load on {endpoint.name}#{replica.index}")
            load = _Load(endpoint=endpoint, replica=replica, workload=profile.load)
            _wait_for_load(load, replica, served, ctx)
        window, started_at = _record_window(profile, replica, served, headers, load, ctx)
    except BaseException:
        _abandon(replica, headers, source)
        raise
    finally:
        if load is not None:
            load.stop()
    return _collect(profile, endpoint, replica, source, window, started_at, ctx)


def _record_window(profile: Profile, replica: Replica, served: str, headers: dict, load, ctx):
    where = f"{profile.endpoint_name}#{replica.index}"
    first = _snapshot(replica, served)
    try:
        _post(f"{replica.url}/start_profile", headers, timeout=60)
    except (urllib.error.URLError, OSError) as exc:
        raise JobFailed(f"{where} refused /start_profile: {getattr(exc, 'reason', exc)}") from exc
    started, started_at = time.monotonic(), timezone.now()
    peaks = {"kv_cache_usage": None, "running": None, "waiting": None}
    while (elapsed := time.monotonic() - started) < profile.duration_s:
        ctx.progress(5 + 55 * elapsed / profile.duration_s, None)
        time.sleep(min(1.0, profile.duration_s - elapsed))
        why = _healthy(replica)
        if why:
            raise JobFailed(f"{where} stopped serving during the recording: {why}. Its partial trace was removed.")
        if load is not None and (why := load.died()):
            log.warning("%s", why)
        snap = _snapshot(replica, served)
        for key, peak in list(peaks.items()):
            value = getattr(snap, key, None) if snap is not None else None
            if value is not None:
                peaks[key] = value if peak is None else max(value, peak)
    ctx.progress(60, f"stopping the profiler of {where} (vLLM writes the trace)")
    try:
        _post(f"{replica.url}/stop_profile", headers, timeout=STOP_TIMEOUT_S)
    except (urllib.error.URLError, OSError) as exc:
        why = _healthy(replica) or str(getattr(exc, "reason", exc))
        raise JobFailed(f"{where} did not finish its trace: {why}. Its partial trace was removed.") from exc
    seconds = time.monotonic() - started
    last = _snapshot(replica, served)
    window = {"seconds": round(seconds, 3), **{f"{k}_peak": v for k, v in peaks.items()}}
    if first is not None and last is not None:
        stats = window_stats(first, last, seconds)
        window.update(
            {k: stats.get(k) for k in ("requests", "qps", "generation_tokens_per_s", "prompt_tokens_per_s", "errors")}
        )
    return window, started_at


def _abandon(replica: Replica, headers: dict, source: Path, *, timeout: float = STOP_TIMEOUT_S) -> None:
    """The recording failed or was cancelled: stop the profiler if the replica still answers, and
    remove whatever it wrote, so no half-written trace stays behind. Past `timeout` the request is left
    (vLLM's route runs on to the stop all the same); what it writes after is cleared by the replica's
    next profile, which empties the directory first."""
    try:
        _post(f"{replica.url}/stop_profile", headers, timeout=timeout)
    except (urllib.error.URLError, OSError):
        pass
    if source.is_dir():
        _clear(source)


def _collect(
    profile: Profile, endpoint: Endpoint, replica: Replica, source: Path, window: dict, started_at, ctx
) -> dict:
    Profile.objects.filter(pk=profile.pk).update(status=ProfileStatus.ANALYSING, window=window)
    ctx.progress(65, "collecting the trace files")
    destination = storage.profile_dir(profile.pk)
    staging = ctx.staging_dir(destination)
    try:
        for entry in sorted(source.iterdir()):
            shutil.move(str(entry), staging / entry.name)
    finally:
        _clear(source)
    if dropped := storage.drop_npu_raw_data(staging):
        ctx.log.info(
            "dropped torch_npu's raw data beside its analysed output: %.1f MiB (PROFILE_KEEP_NPU_RAW_DATA keeps it)",
            dropped / 2**20,
        )
    files = [
        {"name": str(p.relative_to(staging)), "bytes": p.stat().st_size}
        for p in sorted(staging.rglob("*"))
        if p.is_file() and not p.is_symlink()
    ]
    total = sum(f["bytes"] for f in files)
    if not files:
        raise JobFailed("vLLM wrote no trace file (the replica's log says why).")
    if total > settings.PROFILE_MAX_BYTES:
        raise JobFailed(
            f"The trace takes {total / 2**20:.0f} MiB, over PROFILE_MAX_BYTES "
            f"({settings.PROFILE_MAX_BYTES / 2**20:.0f} MiB): record a shorter window."
        )
    ctx.progress(75, f"analysing {len(files)} file(s), {total / 2**20:.1f} MiB")
    try:
        result = analysis.analyse([staging], tensor_parallel_size=endpoint.tensor_parallel_size)  # finds the traces
    except analysis.NoOperatorEvents as exc:  # an idle replica: not a failure, the trace is kept
        ctx.log.info("%s", exc)
        result = {"breakdown": [], "top_ops": [], "traced_seconds": None}
        rows = [analysis.idle_advice(window.get("seconds") or profile.duration_s, under_load=bool(profile.load))]
    except ValueError as exc:
        raise JobFailed(f"The trace could not be read: {exc}") from exc
    else:
        context = {
            "kv_cache_usage_peak": window.get("kv_cache_usage_peak"),
            "tensor_parallel_size": endpoint.tensor_parallel_size,
            "max_num_seqs": endpoint.max_num_seqs,
            "enforce_eager": endpoint.enforce_eager,
            "artifact": endpoint.artifact_id,
        }
        rows = analysis.advice(result, context=context) or [analysis.quiet_advice(result)]
    ctx.commit_staging(staging, destination)
    finished = timezone.now()
    telemetry = telemetry_window(endpoint, replica, started_at, finished)
    Profile.objects.filter(pk=profile.pk).update(
        status=ProfileStatus.SUCCEEDED,
        error="",
        files=files,
        total_bytes=total,
        traced_seconds=result.get("traced_seconds"),
        breakdown=result.get("breakdown") or [],
        top_ops=result.get("top_ops") or [],
        advice=rows,
        telemetry=telemetry,
        finished_at=finished,
    )
    shares = ", ".join(f"{row['category']} {100 * row['share']:.0f} %" for row in result.get("breakdown") or [])
    log.info("%s#%s: %s", profile.endpoint_name, replica.index, shares)
    return {"profile": profile.pk, "files": len(files), "bytes": total, "breakdown": result.get("breakdown") or []}
