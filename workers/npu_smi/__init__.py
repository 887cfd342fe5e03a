"""Parse the output of Huawei's ``npu-smi`` tool and run it safely.

This parser is hand-written because no library parses npu-smi output: the tool
only prints human-oriented tables and ``key : value`` lists, and there is no
JSON/XML mode or Python binding for it.  The code here is pure Python (no
Django imports) so agents and tests can use it anywhere.

Public API
----------
``parse_info(text) -> dict``
    The default ``npu-smi info`` table.  Returns exactly::

        {"version": str | None,
         "chips": [{"npu", "chip", "device_id", "name", "health", "power_w",
                    "temp_c", "aicore_pct", "hugepages_used", "hugepages_total",
                    "memory_used_mb", "memory_total_mb", "hbm_used_mb",
                    "hbm_total_mb", "bus_id"}, ...],
         "processes": [{"npu", "chip", "pid", "name", "memory_mb"}, ...]}

    Columns are located by their header names, never by fixed offsets, so
    reordered/extra columns, ``Chip Device``/``Chip Phy-ID``/plain ``Chip``
    second rows, tables without an HBM column (310/310P), 310P duo cards (one
    row pair per chip), Ascend 950 layouts (``NPU ID`` / ``NPU Util(%)`` in
    their own ``|`` blocks), process tables with a ``Process id in container``
    column, a missing version line and pasted output without the ``+---+``
    separator lines are all understood.  ``NA`` and ``-`` become ``None``.
    Numbers are ``int`` when written without a decimal point, else ``float``
    (``70.0`` stays ``70.0``).  ``chip`` is 0 when the layout has no chip
    column.  Text that is not npu-smi output raises :class:`NpuSmiParseError`.

``parse_key_values(text) -> dict``
    ``npu-smi info -t usages|common|board|... -i N [-c C]``.  Keys are the
    npu-smi labels in snake_case with the unit appended (``%`` -> ``pct``)::

        "HBM Capacity(MB)"        -> "hbm_capacity_mb"
        "HBM Usage Rate(%)"       -> "hbm_usage_rate_pct"
        "DDR Capacity(MB)"        -> "ddr_capacity_mb"
        "DDR Usage Rate(%)"       -> "ddr_usage_rate_pct"
        "Memory Usage Rate(%)"    -> "memory_usage_rate_pct"
        "Aicore Usage Rate(%)"    -> "aicore_usage_rate_pct"
        "Aicore curFreq(MHZ)"     -> "aicore_cur_freq_mhz"
        "Temperature(C)"          -> "temperature_c"
        "NPU Real-time Power(W)"  -> "npu_real_time_power_w"
        "PCIe Bus Info"           -> "pcie_bus_info"

    Values: integers/decimals become numbers, ``NA``/``-`` become ``None``,
    everything else (``0x02``, ``7.1.0.4.218``, bus ids) stays a string.
    Result shape::

        {"npu_id": 0, "chip_count": 1,           # header keys, when printed
         "chips": [{"chip_id": 0, ...}, ...],    # one dict per chip
         "mcu": {"chip_name": "mcu", ...} | None}

    Keys that belong to no chip (e.g. ``-t power`` without ``Chip ID``) are
    put at the top level.  Use ``parse_npu_list`` for ``-l`` (it repeats
    ``NPU ID``).  ``Chip ID`` is accepted both before the chip's
    values (``-t common``) and after them (``-t usages`` prints it last).

``parse_chip_map(text) -> list[dict]``
    ``npu-smi info -m``: ``[{"npu", "chip", "logic_id", "name"}]``; MCU rows
    have ``logic_id`` ``None`` (npu-smi prints ``-``).  The Ascend 950 layout
    (``NPU ID  Slot ID  Chip ID  Chip Phy-ID  Chip Name``, no ``Chip Logic ID``)
    adds ``slot`` and ``phy_id``; its ``logic_id`` is the NPU ID.

``parse_npu_list(text) -> list[dict]``
    ``npu-smi info -l``: ``[{"npu": 0, "chip_count": 1}, ...]``.

``run_npu_smi(args, *, timeout, binary=None) -> str``
    Runs npu-smi with an argv list (never a shell).  Raises
    :class:`NpuSmiUnavailable` when the binary is missing, exits non-zero or
    runs past ``timeout`` (its whole process group is killed).

``collect(*, timeout=8.0, binary=None) -> dict``
    Runs ``info`` and ``info -m`` concurrently, then ``info -t usages -i N``
    for every NPU, all within one deadline.  Returns ``parse_info``'s dict
    where every chip also has ``logic_id`` (from ``-m``, else ``None``) and
    ``usage`` (that chip's ``-t usages`` dict without ``chip_id``, else
    ``None``), plus ``chip_map`` (list) and ``errors``
    (``[{"command": "npu-smi info", "error": "..."}]``).  Never raises for a
    missing/hung/broken npu-smi; never blocks much longer than ``timeout``.
"""

from .errors import NpuSmiError, NpuSmiParseError, NpuSmiUnavailable
from .key_values import parse_chip_map, parse_key_values, parse_npu_list
from .runner import FALLBACK_PATHS, collect, run_npu_smi
from .table import CHIP_KEYS, PROCESS_KEYS, parse_info

__all__ = [
    "NpuSmiError",
    "NpuSmiParseError",
    "NpuSmiUnavailable",
    "parse_info",
    "parse_key_values",
    "parse_chip_map",
    "parse_npu_list",
    "run_npu_smi",
    "collect",
    "CHIP_KEYS",
    "PROCESS_KEYS",
    "FALLBACK_PATHS",
]
