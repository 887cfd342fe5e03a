"""Tests for workers.npu_smi's default-table parser (``npu-smi info``); the other views, running and
`manage.py parse_npu_smi` are in test_npu_smi_run.py."""

import pytest

from tests.support.npu_smi import FIXTURES, fixture
from workers.npu_smi import CHIP_KEYS, PROCESS_KEYS, NpuSmiParseError, parse_info


def col(parsed, key):
    return [c[key] for c in parsed["chips"]]


def assert_shape(parsed):
    assert set(parsed) == {"version", "chips", "processes"}
    for chip in parsed["chips"]:
        assert tuple(chip) == CHIP_KEYS
    for proc in parsed["processes"]:
        assert tuple(proc) == PROCESS_KEYS


# --------------------------------------------------------------------------- fixtures: default table

DEFAULT_TABLE_FIXTURES = sorted(p.name for p in FIXTURES.glob("info_*.txt") if not p.name.startswith("info_-"))


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
        "0000:C1:00.0",
        "0000:C2:00.0",
        "0000:81:00.0",
        "0000:82:00.0",
        "0000:01:00.0",
        "0000:02:00.0",
        "0000:41:00.0",
        "0000:42:00.0",
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
        "0000:C1:00.0",
        "0000:81:00.0",
        "0000:41:00.0",
        "0000:01:00.0",
        "0000:C2:00.0",
        "0000:82:00.0",
        "0000:42:00.0",
        "0000:02:00.0",
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
    assert p["chips"] == [
        {
            "npu": 6,
            "chip": 0,
            "device_id": 0,
            "name": "310P3",
            "health": "OK",
            "power_w": None,
            "temp_c": 50,
            "aicore_pct": 0,
            "hugepages_used": 0,
            "hugepages_total": 0,
            "memory_used_mb": 1839,
            "memory_total_mb": 21525,
            "hbm_used_mb": None,
            "hbm_total_mb": None,
            "bus_id": "0000:84:00.0",
        }
    ]
    assert p["processes"] == []


def test_310_atlas300():
    p = parse_info(fixture("info_310_atlas300_v23.0.0.txt"))
    assert p["version"] == "23.0.0"
    assert p["chips"] == [
        {
            "npu": 0,
            "chip": 0,
            "device_id": 0,
            "name": "310",
            "health": "OK",
            "power_w": 12.8,
            "temp_c": 61,
            "aicore_pct": 0,
            "hugepages_used": 0,
            "hugepages_total": 969,
            "memory_used_mb": 577,
            "memory_total_mb": 7759,
            "hbm_used_mb": None,
            "hbm_total_mb": None,
            "bus_id": "0000:01:00.0",
        }
    ]
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
"""  # noqa: E501  (npu-smi's own table width)


def test_reordered_columns_and_extra_columns():
    p = parse_info(REORDERED_EXTRA)
    assert_shape(p)
    assert p["version"] == "26.0.rc1"
    assert p["chips"] == [
        {
            "npu": 3,
            "chip": 0,
            "device_id": None,
            "name": "910B3",
            "health": "Warning",
            "power_w": 93.3,
            "temp_c": 51,
            "aicore_pct": 7,
            "hugepages_used": 12,
            "hugepages_total": 1024,
            "memory_used_mb": 10,
            "memory_total_mb": 15000,
            "hbm_used_mb": 3403,
            "hbm_total_mb": 65536,
            "bus_id": "0000:42:00.0",
        }
    ]
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
        (2, 0, 0),
        (2, 1, 1),
        (3, 0, 2),
        (3, 1, 3),
    ]
    assert col(p, "power_w") == [None] * 4
    assert col(p, "temp_c") == [70, 69, 69, 67]
    assert col(p, "health") == ["OK", "OK", "OK", "Critical"]
    assert col(p, "aicore_pct") == [0, 3, 0, 0]
    assert col(p, "memory_used_mb") == [1417, 1516, 1666, 35270]
    assert col(p, "memory_total_mb") == [44216, 43757, 44216, 43757]
    assert col(p, "hbm_used_mb") == [None] * 4
    assert p["processes"] == [{"npu": 3, "chip": 1, "pid": 3277562, "name": "mindie_llm_back", "memory_mb": 14513}]


def test_310P_duo_pasted_without_separator_lines():
    text = "\n".join(line for line in DUO_310P.replace("{second}", "Device  ").splitlines() if not line.startswith("+"))
    p = parse_info(text)
    assert [(c["npu"], c["chip"], c["device_id"]) for c in p["chips"]] == [
        (2, 0, 0),
        (2, 1, 1),
        (3, 0, 2),
        (3, 1, 3),
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
    assert p["processes"] == [{"npu": 0, "chip": 0, "pid": 2066378, "name": "python", "memory_mb": 5120}]


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
    for key in (
        "power_w",
        "temp_c",
        "aicore_pct",
        "hugepages_used",
        "hugepages_total",
        "memory_used_mb",
        "memory_total_mb",
        "hbm_used_mb",
        "hbm_total_mb",
    ):
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


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "   \n\n",
        "hello world",
        "bash: npu-smi: command not found",
        "dcmi module initialize failed. ret is -8005\n",
        "<html><body><table><tr><td>NPU</td></tr></table></body></html>",
        "| a | b |\n| 1 | 2 |\n",
        # only a process table, no device table
        (
            "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |\n"
            "| 0       0                 | 1406630       | mindie_llm_back          | 21835                   |\n"
        ),
    ],
)
def test_garbage_is_rejected(garbage):
    with pytest.raises(NpuSmiParseError) as exc:
        parse_info(garbage)
    assert "not `npu-smi info` output" in str(exc.value)
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    "name",
    [
        "info_-m_910B_8npu.txt",
        "info_-t_usages_-i_0_910B.txt",
        "info_-l_910B4_8npu.txt",
    ],
)
def test_other_npu_smi_outputs_are_not_a_default_table(name):
    with pytest.raises(NpuSmiParseError):
        parse_info(fixture(name))


def test_parse_info_rejects_non_text():
    with pytest.raises(NpuSmiParseError):
        parse_info(b"bytes")  # type: ignore[arg-type]
