"""Progress callbacks: ``progress(pct, stage)`` clamped to 0..100, and transformers' own progress
bars redirected to a callback (the from_pretrained paths report through them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

ProgressFn = Callable[[float, str], None]


def _noop_progress(pct: float, stage: str) -> None:
    return None


def clamped_progress(progress: ProgressFn | None) -> ProgressFn:
    if progress is None:
        return _noop_progress

    def call(pct: float, stage: str) -> None:
        progress(float(max(0.0, min(100.0, pct))), stage)

    return call


# ----------------------------------------------------------------------------------------------
# progress from inside transformers (used only by the from_pretrained fallback of gguf_to_hf)
# ----------------------------------------------------------------------------------------------

_hook_local = threading.local()
_hook_lock = threading.Lock()
_hooks_installed = False


class _ProgressIterable:
    """Stands in for a tqdm bar: iterates and reports each step to the active callback."""

    def __init__(self, iterable, desc: str, total: int | None, callback):
        self.iterable = iterable
        self.desc = desc
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.callback = callback

    def __iter__(self):
        for i, item in enumerate(self.iterable):
            self.callback(self.desc, i, self.total)
            yield item
        self.callback(self.desc, self.total or 0, self.total)

    def __len__(self):
        return self.total or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):  # update(), close(), set_postfix() ... are no-ops
        return lambda *a, **k: None


def _install_tqdm_hooks() -> None:
    global _hooks_installed
    with _hook_lock:
        if _hooks_installed:
            return
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging

        previous_hook = None

        def hf_hook(factory, args, kwargs):
            callback = getattr(_hook_local, "callback", None)
            if callback is not None:
                iterable = args[0] if args else kwargs.get("iterable")
                return _ProgressIterable(iterable, kwargs.get("desc", ""), kwargs.get("total"), callback)
            if previous_hook is not None:
                return previous_hook(factory, args, kwargs)
            return factory(*args, **kwargs)

        if hasattr(hf_logging, "set_tqdm_hook"):
            previous_hook = hf_logging.set_tqdm_hook(hf_hook)

        original_tqdm = getattr(gguf_utils, "tqdm", None)
        if original_tqdm is not None:

            def gguf_tqdm(*args, **kwargs):
                callback = getattr(_hook_local, "callback", None)
                if callback is not None:
                    iterable = args[0] if args else kwargs.get("iterable")
                    return _ProgressIterable(iterable, kwargs.get("desc", ""), kwargs.get("total"), callback)
                return original_tqdm(*args, **kwargs)

            gguf_utils.tqdm = gguf_tqdm
        _hooks_installed = True


def silent_progress(desc: str, i: int, total: int | None) -> None:
    return None


@contextlib.contextmanager
def transformers_progress(callback):
    """Within the block, transformers' progress bars (in this thread) call ``callback(desc, i, total)``."""
    _install_tqdm_hooks()
    previous = getattr(_hook_local, "callback", None)
    _hook_local.callback = callback
    try:
        yield
    finally:
        _hook_local.callback = previous
