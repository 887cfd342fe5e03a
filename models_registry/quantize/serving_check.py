"""The quantize job's serving check needs a real vLLM server on a checkpoint.  Serving knows how to
start one (the endpoint command builder) and registers a launcher here from its AppConfig.ready();
the registry never imports serving.

A launcher is called as ``launcher(model_dir, *, engine_python, served_model_name, max_model_len,
enforce_eager, timeout, work_root)`` (``work_root``: the folder to make the server's working directory in,
the job's staging) and returns a context manager whose ``__enter__`` gives an object with ``base_url``
and ``api_key`` (the bearer key the server wants) once the server answers its health check (raising
:class:`~models_registry.quantize.calibrate.QuantizeError` when it cannot), and whose ``__exit__`` stops it.
The entered object may carry ``kernel_note``: why the engine's kernels on this host may score the checkpoint
worse than the checkpoint itself is (shown when the served figure fails the gate).
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

EngineLauncher = Callable[..., AbstractContextManager[Any]]

NOT_REGISTERED = (
    "No vLLM launcher is registered (the endpoints app is not installed), so the quantized "
    "checkpoint cannot be served for the serving check; turn the serving check off."
)

_launcher: EngineLauncher | None = None


def register(launcher: EngineLauncher) -> None:
    global _launcher
    _launcher = launcher


def launcher() -> EngineLauncher | None:
    return _launcher
