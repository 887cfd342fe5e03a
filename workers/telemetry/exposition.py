"""The console's gauges in the Prometheus text format (prometheus_client builds the text):
the latest fresh reading of every device, host, endpoint, gateway and gateway-key series, plus node up,
endpoint ready and firing alerts, and each NPU's reading under npu-exporter's names (npu_exporter.py).
deploy/grafana/llm-console-dashboard.json charts these names; tests check it uses no other."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from workers.models import Node
from workers.telemetry.models import Alert, Series
from workers.telemetry.npu_exporter import npu_chip_families
from workers.telemetry.selectors import fresh_cutoff, key_id
from workers.telemetry.sources import endpoint_names, served_facts

# metric -> (exposed name, help, extra labels)
EXPOSED = {
    "dev.util_pct": ("console_device_utilization_percent", "AI-core (NPU) or GPU utilisation", {}),
    "dev.mem_used_mb": ("console_device_memory_used_megabytes", "HBM / GPU memory in use", {}),
    "dev.mem_pct": ("console_device_memory_used_percent", "HBM / GPU memory in use, percent of total", {}),
    "dev.temp_c": ("console_device_temperature_celsius", "Accelerator temperature", {}),
    "dev.power_w": ("console_device_power_watts", "Accelerator power draw", {}),
    "dev.health": ("console_device_health", "Health: 0 OK, 1 Warning, 2 Alarm, 3 Critical, 4 Missing", {}),
    "host.cpu_pct": ("console_host_cpu_percent", "Host CPU use, all cores", {}),
    "host.mem_pct": ("console_host_memory_used_percent", "Host memory in use", {}),
    "host.load1": ("console_host_load1", "Host 1-minute load average", {}),
    "host.disk_pct": ("console_host_disk_used_percent", "Disk in use where the console keeps its data", {}),
    "proc.cpu_pct": ("console_replica_cpu_percent", "CPU of a replica's vLLM processes (100 = one core)", {}),
    "proc.rss_bytes": ("console_replica_rss_bytes", "Resident memory of a replica's vLLM processes", {}),
    "ep.qps": ("console_endpoint_requests_per_second", "Finished requests per second", {}),
    "ep.p50_s": (
        "console_endpoint_latency_seconds",
        "End-to-end request latency over the last window",
        {"quantile": "0.5"},
    ),
    "ep.p90_s": ("console_endpoint_latency_seconds", "", {"quantile": "0.9"}),
    "ep.p99_s": ("console_endpoint_latency_seconds", "", {"quantile": "0.99"}),
    "ep.ttft_p50_s": ("console_endpoint_ttft_seconds", "Time to first token over the last window", {"quantile": "0.5"}),
    "ep.ttft_p99_s": ("console_endpoint_ttft_seconds", "", {"quantile": "0.99"}),
    "ep.gen_tps": ("console_endpoint_generation_tokens_per_second", "Generated tokens per second", {}),
    "ep.running": ("console_endpoint_requests_running", "Requests being processed", {}),
    "ep.waiting": ("console_endpoint_requests_waiting", "Requests waiting", {}),
    "ep.kv_cache_pct": ("console_endpoint_kv_cache_used_percent", "KV-cache in use", {}),
    "ep.prefix_hit_pct": (
        "console_endpoint_prefix_cache_hit_percent",
        "Prompt tokens found in the prefix cache over the last window",
        {},
    ),
    "ep.spec_accept_pct": (
        "console_endpoint_spec_decode_acceptance_percent",
        "Speculative decoding: draft tokens accepted / proposed over the last window",
        {},
    ),
    "ep.spec_mean_len": (
        "console_endpoint_spec_decode_mean_accepted_length",
        "Speculative decoding: 1 + accepted tokens / drafts over the last window (tokens per target-model step)",
        {},
    ),
    "ep.error_rate": (
        "console_endpoint_error_ratio",
        "Errors / requests over the last window (failed scrapes and health checks count)",
        {},
    ),
    # The gateway's figures per endpoint and per key (endpoints/gateway/services.py store_gateway_stats).
    "gw.qps": ("console_gateway_requests_per_second", "Requests per second through the gateway", {}),
    "gw.p50_s": ("console_gateway_latency_seconds", "Gateway request latency over the last flush", {"quantile": "0.5"}),
    "gw.p99_s": ("console_gateway_latency_seconds", "", {"quantile": "0.99"}),
    "gw.ttft_p50_s": ("console_gateway_ttft_seconds", "Time to first token through the gateway", {"quantile": "0.5"}),
    "gw.ttft_p99_s": ("console_gateway_ttft_seconds", "", {"quantile": "0.99"}),
    "gw.error_rate": ("console_gateway_error_ratio", "5xx answers / requests through the gateway", {}),
    "gw.inflight": ("console_gateway_requests_in_flight", "Requests the gateway has sent and not yet had answered", {}),
    "gk.requests_pm": ("console_gateway_key_requests_per_minute", "Requests per minute of a gateway key", {}),
    "gk.tokens_pm": ("console_gateway_key_tokens_per_minute", "Tokens per minute of a gateway key", {}),
    "gk.errors_pm": ("console_gateway_key_errors_per_minute", "4xx/5xx answers per minute to a gateway key", {}),
    "gk.p50_s": ("console_gateway_key_latency_seconds", "Request latency of a gateway key", {"quantile": "0.5"}),
    "gk.p99_s": ("console_gateway_key_latency_seconds", "", {"quantile": "0.99"}),
    "gk.ttft_p50_s": ("console_gateway_key_ttft_seconds", "Time to first token of a gateway key", {"quantile": "0.5"}),
    "gk.ttft_p99_s": ("console_gateway_key_ttft_seconds", "", {"quantile": "0.99"}),
}


def _labels(s: Series, endpoints: dict[int, str]) -> dict[str, str]:
    labels = {}
    if s.node_id:
        labels["node"] = s.node.name
    if s.device is not None:
        labels["device"] = str(s.device)
    if s.endpoint_id:
        labels["endpoint"] = endpoints.get(s.endpoint_id, f"endpoint {s.endpoint_id}")
    if s.replica is not None:
        labels["replica"] = str(s.replica)
    if s.metric.startswith("gk."):  # keyed gk<id>.<metric>, labelled with the key's name (names may repeat)
        labels["key_id"] = key_id(s)
        labels["key"] = s.label
    return labels


class _Collector:
    def __init__(self, fresh_after: int, hidden_keys: set[str], hidden_endpoints: set[int]):
        self.fresh_after, self.hidden_keys, self.hidden_endpoints = fresh_after, hidden_keys, hidden_endpoints

    def collect(self):
        families: dict[str, tuple[GaugeMetricFamily, list[str]]] = {}
        label_order = ["node", "device", "endpoint", "replica", "key_id", "key", "quantile"]
        series = list(
            Series.objects.filter(metric__in=list(EXPOSED), last_ts__gte=self.fresh_after)
            .select_related("node")
            .order_by("metric", "key")
        )
        endpoints = endpoint_names({s.endpoint_id for s in series if s.endpoint_id})
        rows: dict[str, list] = {}
        for s in series:
            if s.metric.startswith("gk.") and key_id(s) in self.hidden_keys:  # another team's key
                continue
            if s.endpoint_id in self.hidden_endpoints:  # another team's endpoint
                continue
            name, help_text, extra = EXPOSED[s.metric]
            labels = {**_labels(s, endpoints), **extra}
            rows.setdefault(name, []).append((labels, s.last_value, help_text))
        for name, items in rows.items():
            names = [n for n in label_order if any(n in labels for labels, _, _ in items)]
            help_text = next((h for _, _, h in items if h), name)
            family = GaugeMetricFamily(name, help_text, labels=names)
            for labels, value, _ in items:
                family.add_metric([labels.get(n, "") for n in names], value)
            families[name] = (family, names)
        up = GaugeMetricFamily(
            "console_node_up", "1 when the node's agent has a fresh heartbeat", labels=["node", "platform"]
        )
        for node in Node.objects.all():
            up.add_metric([node.name, node.platform], 1.0 if node.online else 0.0)
        ready = GaugeMetricFamily(
            "console_endpoint_ready", "1 when every replica is ready", labels=["endpoint", "state"]
        )
        for ep in served_facts():
            if ep.id in self.hidden_endpoints:
                continue
            ready.add_metric([ep.name, ep.state], 1.0 if ep.ready else 0.0)
        firing = GaugeMetricFamily(
            "console_alerts_firing",
            "Alerts firing now",
            value=Alert.objects.filter(state=Alert.State.FIRING).exclude(endpoint_id__in=self.hidden_endpoints).count(),
        )
        yield up
        yield ready
        yield firing
        for family, _ in families.values():
            yield family
        yield from npu_chip_families(self.fresh_after)


def exposition(hidden_keys: set[str] = frozenset(), hidden_endpoints: set[int] = frozenset()) -> bytes:
    """`hidden_keys`, `hidden_endpoints`: gateway keys (ids) and endpoints of teams the reader does not see; their
    series, labels, readiness and alerts are left out."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(fresh_cutoff(), hidden_keys, hidden_endpoints))
    return generate_latest(registry)
