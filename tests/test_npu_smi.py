"""Tests for workers.npu_smi (npu-smi parsing/running) and `manage.py parse_npu_smi`."""

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from workers import npu_smi
from workers.npu_smi import (
    CHIP_KEYS,
    PROCESS_KEYS,
    NpuSmiParseError,
    NpuSmiUnavailable,
    collect,
    parse_chip_map,
    parse_info,
    parse_key_values,
    parse_npu_list,
    run_npu_smi,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "npu-smi"
FAKE_DIR = ROOT / "tests" / "fake_npu_smi"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def col(parsed, key):
    return [c[key] for c in parsed["chips"]]


def assert_shape(parsed):
    assert set(parsed) == {"version", "chips", "processes"}
    for chip in parsed["chips"]:
        assert tuple(chip) == CHIP_KEYS
    for proc in parsed["processes"]:
        assert tuple(proc) == PROCESS_KEYS


# --------------------------------------------------------------------------- fixtures: default table

DEFAULT_TABLE_FIXTURES = sorted(
    p.name for p in FIXTURES.glob("info_*.txt") if not p.name.startswith("info_-")
)


def test_every_default_table_fixture_is_covered():
    assert DEFAULT_TABLE_FIXTURES == [
        "info_310P3_v25.3.rc1.txt",
        "info_310_atlas300_v23.0.0.txt",
        "info_910B4_2npu_busy_no_version_line.txt",
        "info_910B4_8npu_v25.0.rc1.1_idle.txt",
        "info_910B_8npu_v24.1.0_no_process_table.txt",
        "info_910ProB_8npu_v24.1.0_idle.txt",
    ]


@pytest.mark.parametrize("name", DEFAULT_TABLE_FIXTURES)
def test_default_table_fixture_shape(name):
    parsed = parse_info(fixture(name))
    assert_shape(parsed)
    assert parsed["chips"]
    # Values are real numbers, not strings.
    for chip in parsed["chips"]:
        assert isinstance(chip["npu"], int) and isinstance(chip["chip"], int)
        assert chip["temp_c"] is None or isinstance(chip["temp_c"], int)
        assert chip["power_w"] is None or isinstance(chip["power_w"], float)


def test_910B4_8npu_idle():
    p = parse_info(fixture("info_910B4_8npu_v25.0.rc1.1_idle.txt"))
    assert p["version"] == "25.0.rc1.1"
    assert len(p["chips"]) == 8
    assert col(p, "npu") == list(range(8))
    assert col(p, "chip") == [0] * 8
    assert col(p, "device_id") == [None] * 8  # second row has only "Chip"
    assert col(p, "name") == ["910B4"] * 8
    assert col(p, "health") == ["OK"] * 8
    assert col(p, "power_w") == [87.2, 82.7, 82.7, 89.1, 84.5, 84.8, 87.1, 81.6]
    assert col(p, "temp_c") == [33, 33, 33, 34, 39, 37, 38, 37]
    assert col(p, "aicore_pct") == [0] * 8
    assert col(p, "hugepages_used") == [0] * 8
    assert col(p, "hugepages_total") == [0] * 8
    assert col(p, "memory_used_mb") == [0] * 8
    assert col(p, "memory_total_mb") == [0] * 8
    assert col(p, "hbm_used_mb") == [2654] * 7 + [2653]
    assert col(p, "hbm_total_mb") == [32768] * 8
    assert col(p, "bus_id") == [
        "0000:C1:00.0", "0000:C2:00.0", "0000:81:00.0", "0000:82:00.0",
        "0000:01:00.0", "0000:02:00.0", "0000:41:00.0", "0000:42:00.0",
    ]
    assert p["processes"] == []


def test_910ProB_8npu_idle():
    p = parse_info(fixture("info_910ProB_8npu_v24.1.0_idle.txt"))
    assert p["version"] == "24.1.0"
    assert len(p["chips"]) == 8
    assert col(p, "name") == ["910ProB"] * 8
    assert col(p, "health") == ["OK"] * 8
    assert col(p, "power_w") == [78.0, 75.8, 78.2, 76.5, 78.8, 77.0, 83.0, 77.3]
    assert col(p, "temp_c") == [38, 38, 39, 39, 38, 38, 40, 38]
    assert col(p, "memory_used_mb") == [2387, 1840, 2512, 1645, 1520, 2639, 2143, 2088]
    assert col(p, "memory_total_mb") == [13553, 15665, 15665, 15567, 13553, 15665, 15665, 15567]
    assert col(p, "hbm_used_mb") == [18, 8, 5, 4, 10, 14, 3, 2]
    assert col(p, "hbm_total_mb") == [32768] * 8
    assert col(p, "bus_id") == [
        "0000:C1:00.0", "0000:81:00.0", "0000:41:00.0", "0000:01:00.0",
        "0000:C2:00.0", "0000:82:00.0", "0000:42:00.0", "0000:02:00.0",
    ]
    assert p["processes"] == []


def test_910B_8npu_no_process_table():
    p = parse_info(fixture("info_910B_8npu_v24.1.0_no_process_table.txt"))
    assert p["version"] == "24.1.0"
    assert len(p["chips"]) == 8
    assert col(p, "name") == ["910B"] * 8
    assert col(p, "power_w") == [70.0, 66.9, 69.8, 67.2, 68.9, 66.3, 70.1, 65.6]
    assert col(p, "temp_c") == [34, 34, 34, 33, 33, 34, 34, 33]
    assert col(p, "memory_used_mb") == [1197, 2411, 2306, 2472, 2904, 1694, 1987, 1777]
    assert col(p, "memory_total_mb") == [13553, 15665, 15665, 15567, 13553, 15665, 15665, 15567]
    assert col(p, "hbm_used_mb") == [1365, 4, 4, 3, 3, 5, 5, 4]
    assert col(p, "hbm_total_mb") == [32768] * 8
    assert col(p, "bus_id")[0] == "0000:C1:00.0"
    assert col(p, "bus_id")[7] == "0000:02:00.0"
    assert p["processes"] == []


def test_910B4_2npu_busy_no_version_line():
    p = parse_info(fixture("info_910B4_2npu_busy_no_version_line.txt"))
    assert p["version"] is None
    assert len(p["chips"]) == 2
    c0, c1 = p["chips"]
    assert (c0["npu"], c0["chip"], c0["name"], c0["health"]) == (0, 0, "910B4", "OK")
    assert (c0["power_w"], c0["temp_c"]) == (88.2, 30)
    # "26838/ 32768": no space before the slash, still one used/total column.
    assert (c0["hbm_used_mb"], c0["hbm_total_mb"]) == (26838, 32768)
    assert c0["bus_id"] == "0000:C1:00.0"
    assert (c1["npu"], c1["power_w"], c1["temp_c"]) == (1, 87.0, 31)
    assert (c1["hbm_used_mb"], c1["hbm_total_mb"]) == (2000, 32768)
    assert c1["bus_id"] == "0000:C2:00.0"
    assert p["processes"] == [
        {"npu": 0, "chip": 0, "pid": 1406630, "name": "mindie_llm_back", "memory_mb": 21835},
        {"npu": 0, "chip": 0, "pid": 60575, "name": "python", "memory_mb": 2122},
    ]


def test_310P3_power_na_no_hbm():
    p = parse_info(fixture("info_310P3_v25.3.rc1.txt"))
    assert p["version"] == "25.3.rc1"
    assert p["chips"] == [{
        "npu": 6, "chip": 0, "device_id": 0, "name": "310P3", "health": "OK",
        "power_w": None, "temp_c": 50, "aicore_pct": 0,
        "hugepages_used": 0, "hugepages_total": 0,
        "memory_used_mb": 1839, "memory_total_mb": 21525,
        "hbm_used_mb": None, "hbm_total_mb": None, "bus_id": "0000:84:00.0",
    }]
    assert p["processes"] == []


def test_310_atlas300():
    p = parse_info(fixture("info_310_atlas300_v23.0.0.txt"))
    assert p["version"] == "23.0.0"
    assert p["chips"] == [{
        "npu": 0, "chip": 0, "device_id": 0, "name": "310", "health": "OK",
        "power_w": 12.8, "temp_c": 61, "aicore_pct": 0,
        "hugepages_used": 0, "hugepages_total": 969,
        "memory_used_mb": 577, "memory_total_mb": 7759,
        "hbm_used_mb": None, "hbm_total_mb": None, "bus_id": "0000:01:00.0",
    }]
    assert p["processes"] == []


# --------------------------------------------------------------------------- constructed layouts

REORDERED_EXTRA = """\
+-----------------------------------------------------------------------------------------------------------------+
| npu-smi 26.0.rc1                 Version: 26.0.rc1                                                              |
+---------------------------+---------------+---------------+-----------------------------------------------------+
| Name           NPU        | Health        | Fan(%)        | Temp(C)     Voltage(V)    Power(W)    Hugepages-Usage(page) |
| Chip                      | Bus-Id        | Extra         | HBM-Usage(MB)     AICore(%)   Memory-Usage(MB)          |
+===========================+===============+===============+=====================================================+
| 910B3          3          | Warning       | 40            | 51          0.85          93.3        12   / 1024         |
| 0                         | 0000:42:00.0  | x             | 3403 / 65536      7           10   / 15000              |
+===========================+===============+===============+=====================================================+
+---------------------------+---------------+---------------+-----------------------------------------------------+
| Process memory(MB)        | Process name  | Chip          | Process id          NPU                             |
+===========================+===============+===============+=====================================================+
| 3000                      | vllm          | 0             | 4242                3                               |
+===========================+===============+===============+=====================================================+
"""


def test_reordered_columns_and_extra_columns():
    p = parse_info(REORDERED_EXTRA)
    assert_shape(p)
    assert p["version"] == "26.0.rc1"
    assert p["chips"] == [{
        "npu": 3, "chip": 0, "device_id": None, "name": "910B3", "health": "Warning",
        "power_w": 93.3, "temp_c": 51, "aicore_pct": 7,
        "hugepages_used": 12, "hugepages_total": 1024,
        "memory_used_mb": 10, "memory_total_mb": 15000,
        "hbm_used_mb": 3403, "hbm_total_mb": 65536, "bus_id": "0000:42:00.0",
    }]
    assert p["processes"] == [{"npu": 3, "chip": 0, "pid": 4242, "name": "vllm", "memory_mb": 3000}]


DUO_310P = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc3                 Version: 23.0.rc3                                                     |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    {second}                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 2       310P3                 | OK              | NA           70                0     / 0             |
| 0       0                     | 0000:01:00.0    | 0            1417 / 44216                            |
+-------------------------------+-----------------+------------------------------------------------------+
| 2       310P3                 | OK              | NA           69                0     / 0             |
| 1       1                     | 0000:01:00.0    | 3            1516 / 43757                            |
+===============================+=================+======================================================+
| 3       310P3                 | OK              | NA           69                0     / 0             |
| 0       2                     | 0000:03:00.0    | 0            1666 / 44216                            |
+-------------------------------+-----------------+------------------------------------------------------+
| 3       310P3                 | Critical        | NA           67                0     / 0             |
| 1       3                     | 0000:03:00.0    | 0            35270/ 43757                            |
+===============================+=================+======================================================+
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Chip                  | Process id      | Process name             | Process memory(MB)        |
+===============================+=================+======================================================+
| 3       1                     | 3277562         | mindie_llm_back          | 14513                     |
+===============================+=================+======================================================+
| No running processes found in NPU 2                                                                    |
+===============================+=================+======================================================+
"""


@pytest.mark.parametrize("second", ["Device", "Phy-ID"])
def test_310P_duo_two_chips_per_npu(second):
    text = DUO_310P.replace("{second}", second.ljust(len("{second}")))
    p = parse_info(text)
    assert_shape(p)
    assert [(c["npu"], c["chip"], c["device_id"]) for c in p["chips"]] == [
        (2, 0, 0), (2, 1, 1), (3, 0, 2), (3, 1, 3),
    ]
    assert col(p, "power_w") == [None] * 4
    assert col(p, "temp_c") == [70, 69, 69, 67]
    assert col(p, "health") == ["OK", "OK", "OK", "Critical"]
    assert col(p, "aicore_pct") == [0, 3, 0, 0]
    assert col(p, "memory_used_mb") == [1417, 1516, 1666, 35270]
    assert col(p, "memory_total_mb") == [44216, 43757, 44216, 43757]
    assert col(p, "hbm_used_mb") == [None] * 4
    assert p["processes"] == [
        {"npu": 3, "chip": 1, "pid": 3277562, "name": "mindie_llm_back", "memory_mb": 14513}
    ]


def test_310P_duo_pasted_without_separator_lines():
    text = "\n".join(
        line for line in DUO_310P.replace("{second}", "Device  ").splitlines()
        if not line.startswith("+")
    )
    p = parse_info(text)
    assert [(c["npu"], c["chip"], c["device_id"]) for c in p["chips"]] == [
        (2, 0, 0), (2, 1, 1), (3, 0, 2), (3, 1, 3),
    ]
    assert col(p, "temp_c") == [70, 69, 69, 67]
    assert len(p["processes"]) == 1


ASCEND_950 = """\
+-------------------------------------------------------------------------------------------------+
| npu-smi 25.7.rc1                                 Version: 25.7.rc1                              |
+--------+------------------+---------------+-----------------------------------------------------+
| NPU ID | Name             | Health        | Power(W)    Temp(C)           Hugepages-Usage(page) |
|        |                  | Bus-Id        | NPU Util(%) Memory-Usage(MB)  HBM-Usage(MB)         |
+========+==================+===============+=====================================================+
| 0      | Ascend950PR      | OK            | 187.1       46                0     / 0             |
|        |                  | 0000:01:00.0  | 12          0    / 0          6620  / 131072        |
+========+==================+===============+=====================================================+
| 1      | Ascend950PR      | Alarm         | 197.9       48                0     / 0             |
|        |                  | NA            | 100         0    / 0          90633 / 131072        |
+========+==================+===============+=====================================================+
+---------------------------+---------------+-----------------------------------------------------+
| NPU ID                    | Process id    | Process name             | Process memory(MB)       |
+===========================+===============+=====================================================+
| 0                         | 2066378       | python                   | 5120                     |
+===========================+===============+=====================================================+
| No running processes found in NPU 1                                                             |
+===========================+===============+=====================================================+
"""


def test_ascend_950_layout():
    p = parse_info(ASCEND_950)
    assert_shape(p)
    assert p["version"] == "25.7.rc1"
    assert [(c["npu"], c["chip"]) for c in p["chips"]] == [(0, 0), (1, 0)]
    assert col(p, "name") == ["Ascend950PR", "Ascend950PR"]
    assert col(p, "health") == ["OK", "Alarm"]
    assert col(p, "power_w") == [187.1, 197.9]
    assert col(p, "temp_c") == [46, 48]
    assert col(p, "aicore_pct") == [12, 100]  # from "NPU Util(%)"
    assert col(p, "hbm_used_mb") == [6620, 90633]
    assert col(p, "hbm_total_mb") == [131072, 131072]
    assert col(p, "memory_used_mb") == [0, 0]
    assert col(p, "bus_id") == ["0000:01:00.0", None]  # "NA" -> None
    assert p["processes"] == [
        {"npu": 0, "chip": 0, "pid": 2066378, "name": "python", "memory_mb": 5120}
    ]


WIDE_WITH_CONTAINER_PID = """\
+------------------------------------------------------------------------------------------------------------------+
| npu-smi 25.5.0                   Version: 25.5.0                                                                 |
+---------------------------+---------------+----------------------------------------------------------------------+
| NPU   Name                | Health        | Power(W)             Temp(C)                 Hugepages-Usage(page)   |
| Chip                      | Bus-Id        | AICore(%)            Memory-Usage(MB)        HBM-Usage(MB)           |
+===========================+===============+======================================================================+
| 0     910B2               | OK            | 90.0                 44                      0    / 0                |
| 0                         | 0000:C1:00.0  | 35                   0    / 0                41842/ 65536            |
+===========================+===============+======================================================================+
| 1     910B2               | OK            | -                    -                       -                       |
| 0                         | 0000:C2:00.0  | -                    -                       -                       |
+===========================+===============+======================================================================+
+---------------------------+---------------+----------------------------------------------------------------------+
| NPU     Chip              | Process id    | Process name       | Process memory(MB)    | Process id in container |
+===========================+===============+======================================================================+
| 0       0                 | 1732754       | python             | 150                   | NA                      |
| 0       0                 | 1732755       | sglangschedul      | 41000                 | 77                      |
+===========================+===============+======================================================================+
| No running processes found in NPU 1                                                                              |
+===========================+===============+======================================================================+
"""


def test_wide_table_with_container_pid_and_dashes():
    p = parse_info(WIDE_WITH_CONTAINER_PID)
    assert_shape(p)
    c0, c1 = p["chips"]
    assert (c0["power_w"], c0["temp_c"], c0["aicore_pct"]) == (90.0, 44, 35)
    assert (c0["hbm_used_mb"], c0["hbm_total_mb"]) == (41842, 65536)
    # "-" means "not available" -> None everywhere.
    for key in ("power_w", "temp_c", "aicore_pct", "hugepages_used", "hugepages_total",
                "memory_used_mb", "memory_total_mb", "hbm_used_mb", "hbm_total_mb"):
        assert c1[key] is None, key
    assert c1["bus_id"] == "0000:C2:00.0"
    # The pid is the host "Process id", not "Process id in container".
    assert p["processes"] == [
        {"npu": 0, "chip": 0, "pid": 1732754, "name": "python", "memory_mb": 150},
        {"npu": 0, "chip": 0, "pid": 1732755, "name": "sglangschedul", "memory_mb": 41000},
    ]


def test_container_pid_column_first_is_not_taken_as_pid():
    text = WIDE_WITH_CONTAINER_PID.replace(
        "| Process id    | Process name       | Process memory(MB)    | Process id in container |",
        "| Process id in container | Process name       | Process memory(MB)    | Process id    |",
    ).replace(
        "| 1732754       | python             | 150                   | NA                      |",
        "| NA                      | python             | 150                   | 1732754       |",
    )
    p = parse_info(text)
    assert p["processes"][0] == {"npu": 0, "chip": 0, "pid": 1732754, "name": "python", "memory_mb": 150}


def test_single_spaced_headers_and_empty_cell():
    text = """\
| NPU Name | Health | Power(W) Temp(C) Hugepages-Usage(page) |
| Chip Device | Bus-Id | AICore(%) Memory-Usage(MB) HBM-Usage(MB) |
| 5 910B3 | OK |          33       0 / 0 |
| 0 7 | 0000:41:00.0 | 1 10 / 20 30 / 40 |
"""
    p = parse_info(text)
    assert p["version"] is None
    (c,) = p["chips"]
    assert (c["npu"], c["chip"], c["device_id"], c["name"]) == (5, 0, 7, "910B3")
    # Power cell is empty: the remaining values still land under their headers.
    assert (c["power_w"], c["temp_c"], c["hugepages_used"], c["hugepages_total"]) == (None, 33, 0, 0)
    assert (c["aicore_pct"], c["memory_used_mb"], c["memory_total_mb"]) == (1, 10, 20)
    assert (c["hbm_used_mb"], c["hbm_total_mb"]) == (30, 40)


def test_npu_row_without_chip_row_still_yields_a_chip():
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 4     910B4               | OK            | 80.5        40                0    / 0             |
+===========================+===============+====================================================+
"""
    (c,) = parse_info(text)["chips"]
    assert (c["npu"], c["chip"], c["power_w"], c["bus_id"]) == (4, 0, 80.5, None)


def test_indented_output_is_accepted():
    text = "\n".join("    " + line for line in fixture("info_310P3_v25.3.rc1.txt").splitlines())
    assert parse_info(text) == parse_info(fixture("info_310P3_v25.3.rc1.txt"))


@pytest.mark.parametrize("garbage", [
    "",
    "   \n\n",
    "hello world",
    "bash: npu-smi: command not found",
    "dcmi module initialize failed. ret is -8005\n",
    "<html><body><table><tr><td>NPU</td></tr></table></body></html>",
    "| a | b |\n| 1 | 2 |\n",
    # only a process table, no device table
    "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |\n"
    "| 0       0                 | 1406630       | mindie_llm_back          | 21835                   |\n",
])
def test_garbage_is_rejected(garbage):
    with pytest.raises(NpuSmiParseError) as exc:
        parse_info(garbage)
    assert "not `npu-smi info` output" in str(exc.value)
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("name", [
    "info_-m_910B_8npu.txt", "info_-t_usages_-i_0_910B.txt", "info_-l_910B4_8npu.txt",
])
def test_other_npu_smi_outputs_are_not_a_default_table(name):
    with pytest.raises(NpuSmiParseError):
        parse_info(fixture(name))


def test_parse_info_rejects_non_text():
    with pytest.raises(NpuSmiParseError):
        parse_info(b"bytes")  # type: ignore[arg-type]


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
    assert kv["chips"] == [{
        "chip_id": 0,
        "memory_usage_rate_pct": 6,
        "hbm_usage_rate_pct": 0,
        "aicore_usage_rate_pct": 0,
        "aicore_freq_mhz": 1000,
        "aicore_cur_freq_mhz": 1000,
        "aicore_count": 32,
        "temperature_c": 46,
        "npu_real_time_power_w": 69.0,
    }]
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
    assert chip["board_id"] == "0x02"          # hex stays a string
    assert chip["pcb_id"] is None              # NA
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
    assert chips == [(1, 0, 0), (1, 1, 1), (2, 0, 2), (2, 1, 3),
                     (4, 0, 4), (4, 1, 5), (5, 0, 6), (5, 1, 7)]
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
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "not `npu-smi info` output" in proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------- fake npu-smi, run, collect

@pytest.fixture
def fake_npu_smi(monkeypatch):
    """Put tests/fake_npu_smi first on PATH; returns a setter for its env."""
    monkeypatch.setenv("PATH", f"{FAKE_DIR}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_NPU_SMI_DIR", str(FIXTURES))
    monkeypatch.setenv("FAKE_NPU_SMI_DEFAULT", "info_910B4_8npu_v25.0.rc1.1_idle.txt")
    monkeypatch.delenv("FAKE_NPU_SMI_HANG", raising=False)
    monkeypatch.delenv("FAKE_NPU_SMI_MAP", raising=False)
    monkeypatch.setattr(npu_smi, "FALLBACK_PATHS", ())
    return monkeypatch


def test_fake_is_executable():
    assert os.access(FAKE_DIR / "npu-smi", os.X_OK)
    assert (FAKE_DIR / "npu-smi").read_text().startswith("#!/usr/bin/env python3\n")


def test_run_npu_smi_replays_fixtures(fake_npu_smi):
    assert run_npu_smi(["info"], timeout=10) == fixture("info_910B4_8npu_v25.0.rc1.1_idle.txt")
    assert run_npu_smi(["info", "-m"], timeout=10) == fixture("info_-m_910B4_8npu.txt")
    assert run_npu_smi(["info", "-t", "usages", "-i", "5"], timeout=10) == fixture("info_-t_usages_-i_0_910B.txt")
    assert run_npu_smi(["info", "-t", "common", "-i", "0"], timeout=10) == fixture("info_-t_common_-i_0_910B.txt")
    assert run_npu_smi(["info", "-t", "board", "-i", "0", "-c", "0"], timeout=10) == fixture("info_-t_board_-i_0_-c_0_910B.txt")


def test_run_npu_smi_unknown_args(fake_npu_smi):
    with pytest.raises(NpuSmiUnavailable, match=r"exited with status 1: .*invalid parameter"):
        run_npu_smi(["info", "--bogus"], timeout=10)


def test_run_npu_smi_rejects_shell_string(fake_npu_smi):
    with pytest.raises(TypeError):
        run_npu_smi("info; rm -rf /", timeout=1)  # type: ignore[arg-type]


def test_run_npu_smi_timeout_kills(fake_npu_smi):
    fake_npu_smi.setenv("FAKE_NPU_SMI_HANG", "30")
    start = time.monotonic()
    with pytest.raises(NpuSmiUnavailable, match="timed out"):
        run_npu_smi(["info"], timeout=0.5)
    assert time.monotonic() - start < 5


def test_run_npu_smi_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(npu_smi, "FALLBACK_PATHS", ())
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
    fake_npu_smi.setenv("FAKE_NPU_SMI_DEFAULT", "info_310P3_v25.3.rc1.txt")
    result = collect(timeout=20)
    assert result["errors"] == []
    (chip,) = result["chips"]
    assert chip["npu"] == 6
    assert chip["logic_id"] is None  # the 310P -m sample has no NPU 6
    assert chip["usage"]["ddr_capacity_mb"] == 44280


def test_collect_runs_concurrently(fake_npu_smi):
    # 1 (info) + 1 (-m) + 8 (-t usages) calls of 0.5 s each: ~5 s one after another.
    fake_npu_smi.setenv("FAKE_NPU_SMI_HANG", "0.5")
    start = time.monotonic()
    result = collect(timeout=20)
    elapsed = time.monotonic() - start
    assert result["errors"] == []
    assert all(c["usage"] for c in result["chips"])
    assert elapsed < 3.5, elapsed


def test_collect_hung_npu_smi_returns_within_timeout(fake_npu_smi):
    fake_npu_smi.setenv("FAKE_NPU_SMI_HANG", "60")
    start = time.monotonic()
    result = collect(timeout=1.0)
    elapsed = time.monotonic() - start
    assert elapsed < 4, elapsed
    assert result["chips"] == [] and result["processes"] == []
    commands = {e["command"] for e in result["errors"]}
    assert commands == {"npu-smi info", "npu-smi info -m"}
    assert all("timed out" in e["error"] for e in result["errors"])


def test_collect_missing_npu_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(npu_smi, "FALLBACK_PATHS", ())
    start = time.monotonic()
    result = collect(timeout=5)
    assert time.monotonic() - start < 2
    assert result["chips"] == []
    assert result["errors"] and all("not found" in e["error"] for e in result["errors"])


def test_collect_reports_unparseable_output(fake_npu_smi):
    fake_npu_smi.setenv("FAKE_NPU_SMI_DEFAULT", "info_-m_910B_8npu.txt")
    result = collect(timeout=20)
    assert result["chips"] == []
    assert [e["command"] for e in result["errors"]] == ["npu-smi info"]
    assert "not `npu-smi info` output" in result["errors"][0]["error"]
