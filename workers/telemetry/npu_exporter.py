"""NPU readings under the names Ascend's npu-exporter gives them (``npu_chip_info_*``), so dashboards and
alerts written for npu-exporter work on the console's /metrics. Values come from each NPU's latest
``npu-smi`` reading (``Device.latest``), and only what ``npu-smi info`` really prints is exposed.

Upstream: MindCluster npu-exporter v7.3.2 (github.com/Ascend/mind-cluster, tag v7.3.2, commit c0e7a19):
names and HELP texts from component/npu-exporter/collector/metrics/collector_for_npu.go (utilization,
temperature, power, health_status), collector_for_hbm.go (hbm_used_memory, hbm_total_memory) and
collector_for_ddr.go (used_memory, total_memory; not reported on 910B/910A3, which have no DDR); the label
set is ``CardLabel`` (collector/common/metrics_collector.go, constants.go); units and the health codes from
docs/en/scheduling/api/npu_exporter/01_prometheus_metrics_api.md: utilisation %, temperature °C, power W,
memory MB, health 1 healthy / 0 unhealthy. All are gauges stamped with the reading's time, as npu-exporter
stamps them with its cache time.

Label values, from what npu-smi prints:
- ``id``: the chip's physical id where the table has a ``Chip Device`` / ``Chip Phy-ID`` column (npu-exporter's
  ``id`` is the phy id), else the NPU ID (its docs: "id: NPU ID"); if that is not unique on a node, the
  console's device index (the logic id).
- ``model_name``: npu-smi's Name column (e.g. ``910B4``). npu-exporter writes "Name-Type-Version" from
  ``npu-smi info -t board``, which the agent does not run each pass, so the type and version are not there.
- ``pcie_bus_info``: the Bus-Id column. ``vdie_id`` is empty (only ``-t board`` prints it);
  ``namespace``, ``pod_name``, ``container_name`` are empty, as npu-exporter leaves them for host processes.
- ``node``: the console's node name. npu-exporter has no such label: deployments add the host as a target
  label (MindCluster's sample prometheus.yaml maps the Kubernetes node name to ``job``); the console is one
  target for every node, so it says the node itself, under the same ``node`` label as its own metrics.

Not exposed, since npu-smi's table does not give them: voltage, AI-core frequency, HBM temperature and
bandwidth, network health, error codes, vdie ids. A device missing from npu-smi's latest answer has no
reading (npu-exporter drops the chip too); ``console_device_health`` says 4 (Missing) for it."""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from workers.models import Device
from workers.telemetry.collect import npu_utilization

CARD_LABELS = ["id", "model_name", "vdie_id", "pcie_bus_info", "namespace", "pod_name", "container_name", "node"]

# name -> (HELP as npu-exporter writes it, value from one npu-smi chip)
CHIP_GAUGES = {
    "npu_chip_info_utilization": ("the ai core utilization", npu_utilization),
    "npu_chip_info_temperature": ("the npu temperature", lambda chip: chip.get("temp_c")),
    "npu_chip_info_power": ("the npu power", lambda chip: chip.get("power_w")),
    "npu_chip_info_health_status": (
        "the npu health status",
        lambda chip: (1 if chip["health"].strip().upper() == Device.HEALTH_OK else 0) if chip.get("health") else None,
    ),
    # HBM (910 series); npu-smi prints no HBM column on 310/310P.
    "npu_chip_info_hbm_used_memory": (
        "the npu hbm used memory",
        lambda chip: chip.get("hbm_used_mb") if chip.get("hbm_total_mb") else None,
    ),
    "npu_chip_info_hbm_total_memory": ("the npu hbm total memory", lambda chip: chip.get("hbm_total_mb") or None),
    # DDR: npu-smi's Memory-Usage(MB), "0 / 0" on chips without DDR.
    "npu_chip_info_used_memory": (
        "the npu used memory",
        lambda chip: chip.get("memory_used_mb") if chip.get("memory_total_mb") else None,
    ),
    "npu_chip_info_total_memory": ("the npu total memory", lambda chip: chip.get("memory_total_mb") or None),
}


def _chip_ids(devices: list[Device]) -> dict[int, str]:
    """Device pk -> the ``id`` label (see the module's docstring), unique within each node."""
    ids: dict[int, str] = {}
    by_node: dict[int, list[Device]] = {}
    for device in devices:
        by_node.setdefault(device.node_id, []).append(device)
    for node_devices in by_node.values():
        wanted = {
            d.pk: d.latest.get("device_id") if d.latest.get("device_id") is not None else d.latest.get("npu")
            for d in node_devices
        }
        unique = None not in wanted.values() and len(set(wanted.values())) == len(wanted)
        ids.update({d.pk: str(wanted[d.pk] if unique else d.index) for d in node_devices})
    return ids


def npu_chip_families(fresh_after: int) -> list[GaugeMetricFamily]:
    """The ``npu_chip_info_*`` families of every NPU with a reading newer than ``fresh_after`` (Unix s)."""
    devices = [
        d
        for d in Device.objects.filter(kind="npu")
        .exclude(health=Device.HEALTH_MISSING)
        .select_related("node")
        .order_by("node__name", "index")
        if (d.latest or {}).get("ts", 0) >= fresh_after
    ]
    ids = _chip_ids(devices)
    families = {
        name: GaugeMetricFamily(name, help_text, labels=CARD_LABELS) for name, (help_text, _) in CHIP_GAUGES.items()
    }
    for device in devices:
        chip = device.latest
        labels = [
            ids[device.pk],
            chip.get("name") or device.name,
            "",
            chip.get("bus_id") or device.bus_id,
            "",
            "",
            "",
            device.node.name,
        ]
        for name, (_, value_of) in CHIP_GAUGES.items():
            value = value_of(chip)
            if value is not None:
                families[name].add_metric(labels, float(value), timestamp=chip["ts"])
    return [family for family in families.values() if family.samples]
