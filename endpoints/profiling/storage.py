"""Where profiles keep their trace files, and the disk caps (PROFILE_MAX_BYTES per profile,
PROFILE_TOTAL_MAX_BYTES for all of them)."""

import shutil
from pathlib import Path

from django.conf import settings


def profiles_root() -> Path:
    return Path(settings.ENDPOINT_PROFILE_ROOT) / "profiles"


def profile_dir(profile_id: int) -> Path:
    return profiles_root() / str(int(profile_id))


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under path (links are not followed: they count as nothing)."""
    if not path.exists():
        return 0
    if path.is_file() and not path.is_symlink():
        return path.stat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def used_bytes() -> int:
    """What every kept profile (and any staging left by a job that died) takes on disk."""
    return tree_bytes(profiles_root())


def drop_npu_raw_data(root: Path) -> int:
    """Remove torch_npu's raw data from every ``*_ascend_pt`` result under root whose analysis output
    (``ASCEND_PROFILER_OUTPUT/trace_view.json``) is there, unless PROFILE_KEEP_NPU_RAW_DATA; returns the bytes removed.

    vllm-ascend (v0.23.0 vllm_ascend/profiler/torch_npu_profiler.py) records with
    ``data_simplification=True`` and torch_npu analyses at stop (``tensorboard_trace_handler``'s
    ``analyse_flag`` defaults to True), but since torch_npu v7.0.RC1 simplification keeps ``FRAMEWORK/``
    and ``PROF_*/{device_*,host}/data`` beside the output (torch_npu/profiler/analysis/_profiling_parser.py
    ``simplify_data``). The console's analysis reads ``ASCEND_PROFILER_OUTPUT/trace_view.json`` and
    MindStudio Insight the output's files; only a re-analysis with torch_npu needs the raw data, which is
    often the larger part and would count against PROFILE_MAX_BYTES. A result without the output keeps
    everything (nothing else can be read from it). Links are neither followed nor removed."""
    if settings.PROFILE_KEEP_NPU_RAW_DATA:
        return 0
    removed = 0
    for result in sorted(root.rglob("*_ascend_pt")):
        output = result / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"
        if result.is_symlink() or not result.is_dir() or not output.is_file():
            continue
        for raw in [result / "FRAMEWORK", *sorted(result.glob("PROF_*"))]:
            if raw.is_dir() and not raw.is_symlink():
                before = tree_bytes(raw)
                # What cannot be removed (a root-owned file from a container) stays, and counts.
                shutil.rmtree(raw, ignore_errors=True)
                removed += before - tree_bytes(raw)
    return removed


def remove_profile_files(profile_id: int) -> None:
    shutil.rmtree(profile_dir(profile_id), ignore_errors=True)
