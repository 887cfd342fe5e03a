"""NVIDIA GPUs through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``).

Pure Python, no Django.  :func:`sample_gpus` returns ``None`` when there is no NVML (package,
driver library or GPU missing), else one dict per GPU with the same field names as the
npu-smi chips where they mean the same thing (``aicore_pct`` is the GPU utilisation)."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_state = {"init": None}  # None: not tried; True: initialised; str: why not


def _init():
    import pynvml  # noqa: PLC0415 - optional

    with _lock:
        if _state["init"] is None:
            try:
                pynvml.nvmlInit()
                _state["init"] = True
            except pynvml.NVMLError as exc:
                _state["init"] = f"NVML unavailable: {exc}"
    return pynvml, _state["init"]


def available() -> bool:
    try:
        _, ok = _init()
    except ImportError:
        return False
    return ok is True


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def sample_gpus() -> list[dict] | None:
    try:
        pynvml, ok = _init()
    except ImportError:
        return None
    if ok is not True:
        return None
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        gpu: dict = {
            "index": index,
            "name": None,
            "health": "OK",
            "aicore_pct": None,
            "temp_c": None,
            "power_w": None,
            "memory_used_mb": None,
            "memory_total_mb": None,
            "bus_id": None,
            "processes": [],
        }

        def read(fn, *args, handle=handle):
            try:
                return fn(handle, *args)
            except pynvml.NVMLError:
                return None

        gpu["name"] = _text(read(pynvml.nvmlDeviceGetName) or "") or None
        util = read(pynvml.nvmlDeviceGetUtilizationRates)
        if util is not None:
            gpu["aicore_pct"] = float(util.gpu)
        gpu["temp_c"] = read(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU)
        power = read(pynvml.nvmlDeviceGetPowerUsage)
        if power is not None:
            gpu["power_w"] = round(power / 1000.0, 1)
        mem = read(pynvml.nvmlDeviceGetMemoryInfo)
        if mem is not None:
            gpu["memory_used_mb"] = round(mem.used / 1024**2)
            gpu["memory_total_mb"] = round(mem.total / 1024**2)
        pci = read(pynvml.nvmlDeviceGetPciInfo)
        if pci is not None:
            gpu["bus_id"] = _text(pci.busId)
        # Pending retired pages or an XID-style failure shows up as a non-OK health.
        pending = read(pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
        if pending:
            gpu["health"] = "Warning"
        for proc in read(pynvml.nvmlDeviceGetComputeRunningProcesses) or []:
            used = getattr(proc, "usedGpuMemory", None)
            gpu["processes"].append({"pid": proc.pid, "memory_mb": round(used / 1024**2) if used else None})
        gpus.append(gpu)
    return gpus
