"""``--profiler-config``: vLLM's own profiler, switched on at launch and driven later through the
server's ``POST /start_profile`` and ``POST /stop_profile``.

vLLM 0.32 reads one JSON object (vllm/config/profiler.py, ``ProfilerConfig``; the CLI parses it with
``TypeAdapter(ProfilerConfig).validate_json`` in vllm/engine/arg_utils.py ``_compute_kwargs``). The
``VLLM_TORCH_PROFILER_DIR`` variable it replaces is deprecated (and on the environment deny-list).
The console sets::

    {"profiler": "torch", "torch_profiler_dir": <dir>, "torch_profiler_with_stack": false,
     "ignore_frontend": true}

Python stacks and the API server's own (front-end) CPU profiler are off: they cost the most, and the
analysis reads the workers' operators only. ``torch_profiler_use_gzip`` keeps its default (true).
Until ``/start_profile`` arrives no profiler runs (the workers build theirs on the first start:
vllm/v1/worker/gpu_worker.py ``profile``), so an enabled but idle replica pays next to nothing.

What each platform writes into ``<dir>`` per profile (``<worker>`` is vLLM's rank suffix,
``dp0_pp0_tp0_dcp0_ep0_rank0``-like, from vllm/distributed/utils.py ``get_worker_rank_suffix``,
prefixed ``<profile_prefix>_`` when ``/start_profile`` names one):

- cpu, cuda (vLLM's ``TorchProfilerWrapper``, vllm/profiler/wrapper.py): torch's
  ``tensorboard_trace_handler`` writes ``<worker>.<time_ns>.pt.trace.json.gz`` (Chrome trace,
  gzip), and ``_write_profiler_table`` writes ``<worker>.profiler_out.txt`` (the key-averages table,
  by device time where a device was recorded, else by CPU time). With ``ignore_frontend`` there is
  no front-end trace.
- ascend (vllm-ascend v0.23.0, vllm_ascend/profiler/torch_npu_profiler.py lines 38-76, built by
  vllm_ascend/worker/worker.py ``profile`` lines 940-968 from the same ``ProfilerConfig``): a
  ``torch_npu.profiler.profile`` with activities CPU + NPU, ``with_modules`` =
  ``torch_profiler_with_stack`` (so off), and a fixed ``_ExperimentalConfig`` (export type Text,
  profiler level Level1, ``aic_metrics`` PipeUtilization, no L2 cache, ``data_simplification``);
  ``torch_profiler_use_gzip`` is not read. torch_npu's ``tensorboard_trace_handler`` makes one
  directory per profile, ``<worker>_<UTC %Y%m%d%H%M%S + ms>_ascend_pt/`` (Ascend/pytorch,
  torch_npu/profiler/_profiler_path_creator.py ``create_prof_dir``), and analyses it when the profile stops
  (``analyse_flag`` defaults true) into ``ASCEND_PROFILER_OUTPUT/`` (``kernel_details.csv``,
  ``op_statistic.csv``, ``operator_details.csv``, ``step_trace_time.csv``, ``trace_view.json``, ...:
  vllm-ascend's docs/source/developer_guide/performance_and_debug/service_profiling_guide.md).
  (Both vllm-ascend files are vendored in tests/fixtures/ascend/, SOURCES.md, and the test of this
  construction reads them.) vllm-ascend needs no variable beyond the flag; it refuses to build the profiler when
  ``MSMONITOR_USE_DAEMON`` is set (not on the console's environment allow-list, so never set).

torch_npu's PathManager accepts only paths of letters, digits, ``. _ - / ~``, whitespace and CJK, and
no symbolic link as the last component (torch_npu/utils/_path_manager.py
``_input_path_common_check``); the directory is held to that, without whitespace or ``~``, on every
platform.
"""

from __future__ import annotations

import json
import re
from typing import Any

from endpoints.commands.checks import CommandSpecError

PROFILER_FLAG = "--profiler-config"

_MAX_DIR_LEN = 1024
_DIR_RE = re.compile(r"/[A-Za-z0-9._/-]*")


def check_profiler_dir(value: Any) -> str:
    """An absolute, normalised directory path of letters, digits and ``. _ - /``."""
    if not isinstance(value, str) or not value:
        raise CommandSpecError(f"profiler_dir must be an absolute directory path, got {value!r}")
    if "\x00" in value or not value.isprintable():
        raise CommandSpecError("profiler_dir must not contain NUL or control characters")
    if len(value) > _MAX_DIR_LEN:
        raise CommandSpecError(f"profiler_dir is longer than {_MAX_DIR_LEN} characters")
    if not _DIR_RE.fullmatch(value):
        raise CommandSpecError(
            "profiler_dir must be an absolute path of letters, digits and . _ - / (torch_npu's profiler "
            f"refuses other characters, and ':' or ',' cannot be bind-mounted); got {value!r}"
        )
    if any(part in (".", "..") for part in value.split("/")) or "//" in value:
        raise CommandSpecError(f"profiler_dir must be a normalised path (no '.', '..' or '//'), got {value!r}")
    return value


def profiler_config(profiler_dir: str) -> dict:
    """The ProfilerConfig fields the console sets (the rest keep vLLM's defaults)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": check_profiler_dir(profiler_dir),
        "torch_profiler_with_stack": False,
        "ignore_frontend": True,
    }


def profiler_args(profiler_dir: str | None) -> list[str]:
    """``["--profiler-config", <json>]``, or nothing when profiling is off. Ascend takes the same flag:
    vllm-ascend's NPU worker reads the same ProfilerConfig."""
    if profiler_dir is None:
        return []
    return [PROFILER_FLAG, json.dumps(profiler_config(profiler_dir), separators=(",", ":"))]


def profiler_dir_in(argv: list[str]) -> str | None:
    """The profile directory a vLLM argv (build_command's) writes into, or None (for the container's mount)."""
    if PROFILER_FLAG not in argv:
        return None
    try:
        config = json.loads(argv[argv.index(PROFILER_FLAG) + 1])
    except (IndexError, ValueError):
        raise CommandSpecError(f"{PROFILER_FLAG} in the vLLM argv has no JSON object") from None
    if not isinstance(config, dict):
        raise CommandSpecError(f"{PROFILER_FLAG} in the vLLM argv is not a JSON object")
    return check_profiler_dir(config.get("torch_profiler_dir"))
