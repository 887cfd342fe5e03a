"""workers.host_stats on this machine: host sample sanity, and a process tree (a parent with a
busy child) summed, then gone."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from workers import host_stats
from workers.host_stats import sample_host, sample_process_tree

PARENT_WITH_BUSY_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
    "time.sleep(60)\n"
)


def test_sample_host_numbers_are_sane(tmp_path):
    first = sample_host()
    second = sample_host(["/", str(tmp_path), "/no/such/path"])
    for s in (first, second):
        assert 0.0 <= s["cpu_pct"] <= 100.0
        assert s["cpu_count"] >= 1
        assert len(s["cpu_pct_per_core"]) == s["cpu_count"]
        assert all(0.0 <= pct <= 100.0 for pct in s["cpu_pct_per_core"])
        assert len(s["load_avg"]) == 3 and all(x >= 0 for x in s["load_avg"])
        mem = s["memory"]
        assert mem["total"] > 0 and 0 < mem["used"] <= mem["total"]
        assert 0 < mem["available"] <= mem["total"] and 0 < mem["pct"] <= 100
        swap = s["swap"]
        assert set(swap) == {"total", "used", "free", "pct"} and swap["used"] <= swap["total"]
        root = s["disks"]["/"]
        assert root["total"] > 0 and root["used"] + root["free"] <= root["total"]
        assert 0 <= root["pct"] <= 100
        assert s["net"]["bytes_sent"] >= 0 and s["net"]["bytes_recv"] >= 0
    assert list(first["disks"]) == ["/"]
    assert second["disks"][str(tmp_path)]["total"] > 0
    assert second["disks"]["/no/such/path"] is None
    assert second["net"]["bytes_recv"] >= first["net"]["bytes_recv"]
    assert second["timestamp"] >= first["timestamp"]


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_process_tree_sums_parent_and_child_then_none():
    parent = subprocess.Popen([sys.executable, "-c", PARENT_WITH_BUSY_CHILD], start_new_session=True)
    try:
        child_pid = _wait_for(lambda: [c.pid for c in psutil.Process(parent.pid).children()])[0]

        first = sample_process_tree(parent.pid)
        assert first["pid"] == parent.pid
        assert first["warm"] is False  # no previous CPU sample for these processes
        time.sleep(0.5)
        second = sample_process_tree(parent.pid)

        assert second["warm"] is True
        assert second["num_processes"] == 2
        assert [p["pid"] for p in second["processes"]] == [parent.pid, child_pid]
        assert second["processes"][1]["ppid"] == parent.pid
        assert second["rss_bytes"] == sum(p["rss_bytes"] for p in second["processes"])
        assert all(p["rss_bytes"] > 1_000_000 for p in second["processes"])  # two Pythons
        assert second["cpu_pct"] == pytest.approx(sum(p["cpu_pct"] for p in second["processes"]), abs=0.2)
        busy = second["processes"][1]["cpu_pct"]
        assert busy > 10.0, busy  # a busy loop, even on 2 cores shared with others
        assert second["processes"][0]["cpu_pct"] < busy  # the parent only sleeps
        cached = {pid for pid, _ in host_stats._proc_cache}
        assert {parent.pid, child_pid} <= cached
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()

    _wait_for(lambda: _gone(child_pid))
    assert sample_process_tree(parent.pid) is None
    cached = {pid for pid, _ in host_stats._proc_cache}
    assert parent.pid not in cached and child_pid not in cached  # pruned


def test_process_tree_of_this_process():
    tree = sample_process_tree(os.getpid())
    assert tree["pid"] == os.getpid() and tree["num_processes"] >= 1
    assert tree["rss_bytes"] > 0


def test_exited_pid_is_none():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert sample_process_tree(proc.pid) is None


def test_cpu_core_ids_takes_one_hyperthread_per_core(tmp_path, monkeypatch):
    from workers.host_stats import cpu_core_ids

    # Linux numbers hyperthreads apart: cpu0/cpu2 are one core, cpu1/cpu3 another (sysfs layout).
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_core_ids(str(tmp_path)) == [0, 1]
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2, 3})  # a cpuset: only the sibling threads
    assert cpu_core_ids(str(tmp_path)) == [2, 3]
    assert cpu_core_ids(str(tmp_path / "missing")) == [2, 3]  # no topology: every allowed CPU
    assert cpu_core_ids() == sorted(set(cpu_core_ids()))  # this host's, sorted


def test_numa_core_sets_follow_the_memory_nodes_this_process_may_use(tmp_path):
    """The cores vLLM's auto binding gives rank N: the N-th allowed memory node's (Mems_allowed_list)."""
    from workers.host_stats import numa_core_sets

    sys_cpu = tmp_path / "cpu"
    for cpu, node in ((0, 0), (1, 0), (2, 1), (3, 1)):
        (sys_cpu / f"cpu{cpu}" / f"node{node}").mkdir(parents=True)  # sysfs links each CPU to its node
    (sys_cpu / "cpu4").mkdir()  # no node link (a kernel without NUMA): node 0, as vLLM reads lscpu's "-"
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nMems_allowed:\t00000003\nMems_allowed_list:\t0-1\n")
    assert numa_core_sets([0, 1, 2, 3, 4], str(sys_cpu), str(status)) == [[0, 1, 4], [2, 3]]
    status.write_text("Mems_allowed_list:\t1\n")  # a cpuset of NUMA node 1's memory only
    assert numa_core_sets([0, 1, 2, 3, 4], str(sys_cpu), str(status)) == [[2, 3]]
    assert numa_core_sets([0, 1], str(sys_cpu), str(tmp_path / "missing")) == []
    from workers.host_stats import cpu_core_ids

    assert sum(numa_core_sets(cpu_core_ids()), []) == cpu_core_ids()  # this host: one node, every core
