"""Registering ready replicas in Consul (when CONSUL_HTTP_ADDR is set): each ready replica is a
service instance with an HTTP health check on vLLM's /health and tags for its model and
endpoint; a replica that leaves the ready set is deregistered. Driven by the gateway's
routing-table refresh (the console's registry is the source of truth)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("console.gateway")


def service_id(backend) -> str:
    return f"llm-{backend.endpoint_name}-{backend.replica_index}"


def service_definition(backend, model: str) -> dict:
    parts = urlsplit(backend.url)
    return {
        "ID": service_id(backend),
        "Name": "llm-inference",
        "Address": parts.hostname,
        "Port": parts.port,
        "Tags": [
            f"model={model}",
            f"endpoint={backend.endpoint_name}",
            f"replica={backend.replica_index}",
            f"node={backend.node_name}",
        ],
        "Meta": {"model": model, "endpoint": backend.endpoint_name},
        "Check": {
            "HTTP": f"{backend.url}/health",
            "Interval": "10s",
            "Timeout": "3s",
            "DeregisterCriticalServiceAfter": "10m",
        },
    }


class ConsulSync:
    def __init__(self, address: str, token: str = ""):
        self.address = address.rstrip("/")
        if "://" not in self.address:
            self.address = "http://" + self.address
        headers = {"X-Consul-Token": token} if token else {}
        self.client = httpx.AsyncClient(timeout=3, headers=headers, trust_env=False)
        self.registered: set[str] = set()

    async def sync(self, table) -> None:
        wanted = {}
        for model, backends in table.backends.items():
            for b in backends:
                wanted[service_id(b)] = service_definition(b, model)
        for sid in sorted(set(wanted) - self.registered):
            try:
                r = await self.client.put(f"{self.address}/v1/agent/service/register", json=wanted[sid])
                if r.status_code == 200:
                    self.registered.add(sid)
                else:
                    log.warning("consul: registering %s: HTTP %s %s", sid, r.status_code, r.text[:200])
            except httpx.HTTPError as exc:
                log.warning("consul: registering %s failed: %r", sid, exc)
        for sid in sorted(self.registered - set(wanted)):
            try:
                r = await self.client.put(f"{self.address}/v1/agent/service/deregister/{sid}")
                if r.status_code in (200, 404):
                    self.registered.discard(sid)
            except httpx.HTTPError as exc:
                log.warning("consul: deregistering %s failed: %r", sid, exc)

    async def close(self):
        for sid in sorted(self.registered):
            try:
                await self.client.put(f"{self.address}/v1/agent/service/deregister/{sid}")
            except httpx.HTTPError:
                pass
        self.registered.clear()
        await self.client.aclose()
