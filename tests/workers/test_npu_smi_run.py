"""Tests for workers.npu_smi's ``-t``/``-m``/``-l`` parsers, `manage.py parse_npu_smi`, and running and
collecting through the fake npu-smi."""

import io
import json
import os
import subprocess
import sys
import time

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.support.npu_smi import FAKE_DIR, FIXTURES, ROOT, fixture
from workers.npu_smi import (
    NpuSmiParseError,
    NpuSmiUnavailable,
    collect,
    parse_chip_map,
    parse_info,
    parse_key_values,
    parse_npu_list,
    run_npu_smi,
    runner,
)

# --------------------------------------------------------------------------- -t, -m, -l


def test_usages_910B():
    kv = parse_key_values(fixture("info_-t_usages_-i_0_910B.txt"))
    assert kv["npu_id"] == 0 and kv["chip_count"] == 1 and kv["mcu"] is None
    (chip,) = kv["chips"]
    assert chip == {
        "ddr_capacity_mb": 15171,
        "ddr_usage_rate_pct": 3,
        "ddr_hugepages_total_page": 0,
        "ddr_hugepages_usage_rate_pct": 0,
        "hbm_capacity_mb": 32768,
        "hbm_usage_rate_pct": 0,
        "aicore_usage_rate_pct": 0,
        "aicpu_usage_rate_pct": 0,
        "ctrlcpu_usage_rate_pct": 9,
        "ddr_bandwidth_usage_rate_pct": 0,
        "hbm_bandwidth_usage_rate_pct": 0,
        "chip_id": 0,  # printed AFTER the chip's values by npu-smi
    }


def test_usages_310P_two_chips():
    kv = parse_key_values(fixture("info_-t_usages_-i_1_310P.txt"))
    assert kv["npu_id"] == 1 and kv["chip_count"] == 2
    assert [c["chip_id"] for c in kv["chips"]] == [0, 1]
    assert [c["ddr_capacity_mb"] for c in kv["chips"]] == [44280, 43693]
    assert [c["ctrlcpu_usage_rate_pct"] for c in kv["chips"]] == [2, 3]
    assert [c["ddr_bandwidth_usage_rate_pct"] for c in kv["chips"]] == [51, 51]
    assert kv["chips"][0]["vectorcore_usage_rate_pct"] == 0
    assert kv["chips"][0]["dvpp_jpegd_usage_rate_pct"] == 0
    assert "hbm_capacity_mb" not in kv["chips"][0]  # 310P has no HBM


def test_common_910B_with_mcu_section():
    kv = parse_key_values(fixture("info_-t_common_-i_0_910B.txt"))
    assert kv["npu_id"] == 0 and kv["chip_count"] == 1
    assert kv["chips"] == [
        {
            "chip_id": 0,
            "memory_usage_rate_pct": 6,
            "hbm_usage_rate_pct": 0,
            "aicore_usage_rate_pct": 0,
            "aicore_freq_mhz": 1000,
            "aicore_cur_freq_mhz": 1000,
            "aicore_count": 32,
            "temperature_c": 46,
            "npu_real_time_power_w": 69.0,
        }
    ]
    assert kv["mcu"] == {"chip_name": "mcu", "temperature_c": 48, "npu_real_time_power_w": 45.2}


def test_common_310P():
    kv = parse_key_values(fixture("info_-t_common_-i_1_310P.txt"))
    assert kv["npu_id"] == 1 and kv["chip_count"] == 2
    assert [c["chip_id"] for c in kv["chips"]] == [0, 1]
    assert [c["temperature_c"] for c in kv["chips"]] == [60, 59]
    assert [c["aicore_cur_freq_mhz"] for c in kv["chips"]] == [960, 960]
    assert kv["mcu"]["npu_real_time_power_w"] == 45.2


def test_board_910B():
    kv = parse_key_values(fixture("info_-t_board_-i_0_-c_0_910B.txt"))
    assert kv["npu_id"] == 0
    (chip,) = kv["chips"]
    assert chip["chip_id"] == 0
    assert chip["chip_type"] == "Ascend"
    assert chip["chip_name"] == "xxx"
    assert chip["board_id"] == "0x02"  # hex stays a string
    assert chip["pcb_id"] is None  # NA
    assert chip["bom_id"] == 1
    assert chip["vdie_id"] == "901421D4 02103514 1711E613 6DA7040A 00102001"
    assert chip["pcie_bus_info"] == "0000:81:00.0"
    assert chip["firmware_version"] == "7.1.0.4.218"  # not a float


def test_board_310P():
    kv = parse_key_values(fixture("info_-t_board_-i_1_-c_0_310P.txt"))
    assert kv["npu_id"] == 1
    (chip,) = kv["chips"]
    assert chip["board_id"] == "0x64"
    assert chip["die_id"] == "409921D4 2140A100 E54BDDD4 07CC040A 9B00301F"
    assert chip["firmware_version"] == "7.1.0.4"
    assert chip["chip_position_id"] == 0


def test_key_values_without_chip_id_go_to_top_level():
    kv = parse_key_values("NPU ID : 3\nNPU Real-time Power(W) : NA\nHealth : OK\n")
    assert kv == {"npu_id": 3, "npu_real_time_power_w": None, "health": "OK", "chips": [], "mcu": None}


@pytest.mark.parametrize("garbage", ["", "hello", "foo: bar\n", "+----+\n| a : b |\n"])
def test_key_values_garbage(garbage):
    with pytest.raises(NpuSmiParseError):
        parse_key_values(garbage)


def test_key_values_rejects_default_table():
    with pytest.raises(NpuSmiParseError):
        parse_key_values(fixture("info_910B4_8npu_v25.0.rc1.1_idle.txt"))


def test_chip_map_910B4():
    rows = parse_chip_map(fixture("info_-m_910B4_8npu.txt"))
    assert len(rows) == 16
    assert rows[0] == {"npu": 0, "chip": 0, "logic_id": 0, "name": "Ascend 910B4"}
    assert rows[1] == {"npu": 0, "chip": 1, "logic_id": None, "name": "Mcu"}
    assert rows[14] == {"npu": 7, "chip": 0, "logic_id": 7, "name": "Ascend 910B4"}
    assert [r["logic_id"] for r in rows if r["name"] != "Mcu"] == list(range(8))


def test_chip_map_910B():
    rows = parse_chip_map(fixture("info_-m_910B_8npu.txt"))
    assert len(rows) == 16
    assert {r["name"] for r in rows} == {"Ascend xxx", "Mcu"}
    assert sum(r["logic_id"] is None for r in rows) == 8


def test_chip_map_310P_duo():
    rows = parse_chip_map(fixture("info_-m_310P_duo.txt"))
    assert len(rows) == 12
    chips = [(r["npu"], r["chip"], r["logic_id"]) for r in rows if r["name"] != "Mcu"]
    assert chips == [(1, 0, 0), (1, 1, 1), (2, 0, 2), (2, 1, 3), (4, 0, 4), (4, 1, 5), (5, 0, 6), (5, 1, 7)]
    mcus = [(r["npu"], r["chip"], r["logic_id"]) for r in rows if r["name"] == "Mcu"]
    assert mcus == [(1, 2, None), (2, 2, None), (4, 2, None), (5, 2, None)]


def test_chip_map_reordered_columns():
    text = "Chip Name      Chip Logic ID   NPU ID   Chip ID\nAscend 910B3   -               9        0\n"
    assert parse_chip_map(text) == [{"npu": 9, "chip": 0, "logic_id": None, "name": "Ascend 910B3"}]


@pytest.mark.parametrize("garbage", ["", "hello", "NPU ID : 0\n"])
def test_chip_map_garbage(garbage):
    with pytest.raises(NpuSmiParseError):
        parse_chip_map(garbage)


def test_npu_list():
    rows = parse_npu_list(fixture("info_-l_910B4_8npu.txt"))
    assert rows == [{"npu": i, "chip_count": 1} for i in range(8)]
    with pytest.raises(NpuSmiParseError):
        parse_npu_list("nothing here")


# --------------------------------------------------------------------------- management command


def test_command_on_fixture():
    out = io.StringIO()
    call_command("parse_npu_smi", str(FIXTURES / "info_910B4_2npu_busy_no_version_line.txt"), stdout=out)
    data = json.loads(out.getvalue())
    assert data == parse_info(fixture("info_910B4_2npu_busy_no_version_line.txt"))
    assert "\n  \"version\": null" in out.getvalue()  # indent=2


def test_command_on_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(fixture("info_310P3_v25.3.rc1.txt")))
    out = io.StringIO()
    call_command("parse_npu_smi", "-", stdout=out)
    data = json.loads(out.getvalue())
    assert data["version"] == "25.3.rc1"
    assert data["chips"][0]["npu"] == 6


def test_command_on_garbage(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("dcmi module initialize failed. ret is -8005\n"))
    with pytest.raises(CommandError, match="not `npu-smi info` output"):
        call_command("parse_npu_smi", "-", stdout=io.StringIO())


def test_command_on_missing_file(tmp_path):
    with pytest.raises(CommandError, match="no such file"):
        call_command("parse_npu_smi", str(tmp_path / "nope.txt"), stdout=io.StringIO())


def test_command_exit_status(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("not a table\n")
    proc = subprocess.run(
        [sys.executable, "manage.py", "parse_npu_smi", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "not `npu-smi info` output" in proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------- fake npu-smi, run, collect


def test_fake_is_executable():
    assert os.access(FAKE_DIR / "npu-smi", os.X_OK)
    assert (FAKE_DIR / "npu-smi").read_text().startswith("#!/usr/bin/env python3\n")


def test_run_npu_smi_replays_fixtures(fake_npu_smi):
    assert run_npu_smi(["info"], timeout=10) == fixture("info_910B4_8npu_v25.0.rc1.1_idle.txt")
    assert run_npu_smi(["info", "-m"], timeout=10) == fixture("info_-m_910B4_8npu.txt")
    assert run_npu_smi(["info", "-t", "usages", "-i", "5"], timeout=10) == fixture("info_-t_usages_-i_0_910B.txt")
    assert run_npu_smi(["info", "-t", "common", "-i", "0"], timeout=10) == fixture("info_-t_common_-i_0_910B.txt")
    assert run_npu_smi(["info", "-t", "board", "-i", "0", "-c", "0"], timeout=10) == fixture(
        "info_-t_board_-i_0_-c_0_910B.txt"
    )


def test_run_npu_smi_unknown_args(fake_npu_smi):
    with pytest.raises(NpuSmiUnavailable, match=r"exited with status 1: .*invalid parameter"):
        run_npu_smi(["info", "--bogus"], timeout=10)


def test_run_npu_smi_rejects_shell_string(fake_npu_smi):
    with pytest.raises(TypeError):
        run_npu_smi("info; rm -rf /", timeout=1)  # type: ignore[arg-type]


def test_run_npu_smi_timeout_kills(fake_npu_smi):
    fake_npu_smi.set(hang="30")
    start = time.monotonic()
    with pytest.raises(NpuSmiUnavailable, match="timed out"):
        run_npu_smi(["info"], timeout=0.5)
    assert time.monotonic() - start < 5


def test_npu_smi_gets_the_allow_listed_environment_not_the_consoles(tmp_path, monkeypatch):
    """npu-smi runs with the host's paths and the driver's variables, like every child process, and none of
    the console's settings or secrets (it got the agent's whole environment before)."""
    printenv = tmp_path / "npu-smi"
    printenv.write_text("#!/bin/sh\nenv\n")
    printenv.chmod(0o755)
    monkeypatch.setenv("DATABASE_URL", "postgres://console:db-secret@db/console")
    monkeypatch.setenv("SECRET_KEY", "django-secret")
    monkeypatch.setenv("ASCEND_HOME_PATH", "/usr/local/Ascend/ascend-toolkit/latest")
    seen = dict(
        line.split("=", 1)
        for line in run_npu_smi(["info"], timeout=10, binary=str(printenv)).splitlines()
        if "=" in line
    )
    assert "DATABASE_URL" not in seen and "SECRET_KEY" not in seen and "REDIS_URL" not in seen
    assert seen["ASCEND_HOME_PATH"] == "/usr/local/Ascend/ascend-toolkit/latest" and seen["PATH"] == os.environ["PATH"]


def test_run_npu_smi_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(runner, "FALLBACK_PATHS", ())
    with pytest.raises(NpuSmiUnavailable, match="not found"):
        run_npu_smi(["info"], timeout=1)


def test_collect_enriches_chips(fake_npu_smi):
    result = collect(timeout=20)
    assert result["errors"] == []
    assert len(result["chips"]) == 8
    assert result["version"] == "25.0.rc1.1"
    assert len(result["chip_map"]) == 16
    for chip in result["chips"]:
        assert chip["logic_id"] == chip["npu"]
        assert chip["usage"]["hbm_capacity_mb"] == 32768
        assert chip["usage"]["ctrlcpu_usage_rate_pct"] == 9
        assert "chip_id" not in chip["usage"]


def test_collect_310P(fake_npu_smi):
    fake_npu_smi.set(default="info_310P3_v25.3.rc1.txt")
    result = collect(timeout=20)
    assert result["errors"] == []
    (chip,) = result["chips"]
    assert chip["npu"] == 6
    assert chip["logic_id"] is None  # the 310P -m sample has no NPU 6
    assert chip["usage"]["ddr_capacity_mb"] == 44280


def test_collect_runs_concurrently(fake_npu_smi, tmp_path):
    # 1 (info) + 1 (-m) + 8 (-t usages) calls of 0.5 s each. Whether they ran at once is read from the calls
    # themselves (each logs when it slept), not from a wall-clock total a loaded machine can stretch.
    calls = tmp_path / "calls.jsonl"
    fake_npu_smi.set(hang="0.5", calls=calls)
    result = collect(timeout=20)
    assert result["errors"] == []
    assert all(c["usage"] for c in result["chips"])
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    usages = sorted((c for c in logged if c["argv"][:3] == ["info", "-t", "usages"]), key=lambda c: c["began"])
    assert len(usages) == 8, logged
    # One after another, each began after the one before ended; run at once, some began while another slept.
    assert any(later["began"] < earlier["ended"] for earlier, later in zip(usages, usages[1:], strict=False)), usages


def test_collect_hung_npu_smi_returns_within_timeout(fake_npu_smi):
    fake_npu_smi.set(hang="60")
    start = time.monotonic()
    result = collect(timeout=1.0)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed  # the 1 s timeout ended it, far from the 60 s hang (whatever the machine's load)
    assert result["chips"] == [] and result["processes"] == []
    commands = {e["command"] for e in result["errors"]}
    assert commands == {"npu-smi info", "npu-smi info -m"}
    assert all("timed out" in e["error"] for e in result["errors"])


def test_collect_missing_npu_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(runner, "FALLBACK_PATHS", ())
    start = time.monotonic()
    result = collect(timeout=5)
    assert time.monotonic() - start < 2
    assert result["chips"] == []
    assert result["errors"] and all("not found" in e["error"] for e in result["errors"])


def test_collect_reports_unparseable_output(fake_npu_smi):
    fake_npu_smi.set(default="info_-m_910B_8npu.txt")
    result = collect(timeout=20)
    assert result["chips"] == []
    assert [e["command"] for e in result["errors"]] == ["npu-smi info"]
    assert "not `npu-smi info` output" in result["errors"][0]["error"]
