"""The Ascend 950 `npu-smi info -m` chip map (`Slot ID` / `Chip Phy-ID`, no `Chip Logic ID`), the A3
five-column map, and a 950 host collected end to end through the fake npu-smi. The 950 sample is written
from the documented layout (tests/fixtures/npu-smi/SOURCES.md says where from): no real capture exists yet."""

import pytest

from tests.support.npu_smi import fixture
from workers.npu_smi import NpuSmiParseError, collect, parse_chip_map

SAMPLE_950 = "info_-m_950PR_8npu_from_documented_layout.txt"


def test_chip_map_950_wide_layout():
    rows = parse_chip_map(fixture(SAMPLE_950))
    assert len(rows) == 8
    assert rows[0] == {"npu": 0, "chip": 0, "logic_id": 0, "name": "Ascend950PR", "slot": 1, "phy_id": 0}
    assert rows[7] == {"npu": 7, "chip": 0, "logic_id": 7, "name": "Ascend950PR", "slot": 8, "phy_id": 7}
    # No Chip Logic ID column: the logical id (what ASCEND_RT_VISIBLE_DEVICES counts) is the NPU ID.
    assert [r["logic_id"] for r in rows] == [r["npu"] for r in rows] == list(range(8))


def test_chip_map_950_single_spaced_header():
    # The spelling other projects' tests use (one space between the header names).
    rows = parse_chip_map("NPU ID Slot ID Chip ID Chip Phy-ID Chip Name\n5 22 0 5 Ascend950PR\n")
    assert rows == [{"npu": 5, "chip": 0, "logic_id": 5, "name": "Ascend950PR", "slot": 22, "phy_id": 5}]


def test_chip_map_a3_has_logic_and_phy_ids():
    # Atlas A3 (two dies per NPU) prints both ids; the logic id wins, the MCU keeps None.
    text = (
        "NPU ID                         Chip ID                        Chip Logic ID                  "
        "Chip Phy-ID                    Chip Name\n"
        "0                              0                              0                              "
        "0                              Ascend910\n"
        "0                              1                              1                              "
        "1                              Ascend910\n"
        "0                              2                              -                              "
        "-                              Mcu\n"
    )
    rows = parse_chip_map(text)
    assert [(r["npu"], r["chip"], r["logic_id"], r["phy_id"]) for r in rows] == [
        (0, 0, 0, 0),
        (0, 1, 1, 1),
        (0, 2, None, None),
    ]
    assert "slot" not in rows[0]


def test_old_layouts_keep_their_shape():
    rows = parse_chip_map(fixture("info_-m_910B4_8npu.txt"))
    assert rows[0] == {"npu": 0, "chip": 0, "logic_id": 0, "name": "Ascend 910B4"}


@pytest.mark.parametrize("garbage", ["NPU ID  Slot ID  Chip ID  Chip Name\n0 1 0 Ascend950PR\n", "Slot ID\n"])
def test_chip_map_without_any_id_column_is_refused(garbage):
    with pytest.raises(NpuSmiParseError):
        parse_chip_map(garbage)


def test_collect_on_a_950_host(fake_npu_smi):
    fake_npu_smi.set(map=SAMPLE_950)
    result = collect(timeout=15)
    assert not [e for e in result["errors"] if e["command"] == "npu-smi info -m"]
    assert [c["logic_id"] for c in result["chips"]] == list(range(8))
    assert result["chip_map"][3]["phy_id"] == 3
