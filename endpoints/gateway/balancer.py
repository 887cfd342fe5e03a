"""HAProxy in front of several gateway processes (docs/gateway-scale-out.md): the configuration, rendered here for
`manage.py gateway_balancer` (what `make run GATEWAYS=2` runs) and written out as deploy/haproxy/gateway.cfg for
systemd and compose (a test keeps the two equal).

Why these settings (HAProxy 2.6, Debian 12's):
- balance leastconn: a gateway's open connections are its requests in flight (streams included);
- health checks of /healthz every second, down after two misses: a gateway killed stops getting new requests
  within about two seconds;
- retries 3 with redispatch, retry-on conn-failure empty-response response-timeout: a request whose gateway died
  (refused, or the connection dropped before any answer) is sent again to another one. A request a replica had
  begun to answer is not (the answer's bytes reached the client already); one dropped earlier may have reached a
  replica, whose answer then went to nobody: the gateways' counts and usage record only what a client received.
- option http-buffer-request: HAProxy has a request's whole body before it sends it to a gateway, so a request
  whose gateway died can be sent again (without it a kill test lost a request in half its runs: a 502 "SH--" not
  retried, or the client's connection closed; docs/gateway-scale-out.md);
- timeout http-request: a client's whole request head within 10 s (the gateways bound it too, behind the LB);
- per client address at most 256 connections (the gateways see only HAProxy's address: their own per-address cap
  is off behind it, GATEWAY_MAX_CONNECTIONS_PER_ADDRESS=0);
- timeout server 610 s: a long generation streams for up to GATEWAY_READ_TIMEOUT_SECONDS (600 s) between bytes.
"""

from __future__ import annotations

PER_ADDRESS = 256


def haproxy_config(*, bind: str, servers: list[str], per_address: int = PER_ADDRESS, stats_socket: str = "") -> str:
    """The configuration for HAProxy listening on `bind` (host:port) in front of the gateways at `servers`
    (host:port each)."""
    lines = [
        "# HAProxy in front of the gateways (endpoints/gateway/balancer.py renders this; docs/gateway-scale-out.md).",
        "global",
        "    maxconn 8192",
        # Two descriptors a connection: within a 20000 open-files limit (containers).
        "    log stdout format raw local0 info",
        *([f"    stats socket {stats_socket} mode 600 level admin"] if stats_socket else []),
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option log-separate-errors",
        "    http-reuse always",
        "    option http-buffer-request",
        "    timeout connect 2s",
        "    timeout client 610s",
        "    timeout server 610s",
        "    timeout http-request 10s",
        "    timeout http-keep-alive 10s",
        "    timeout queue 10s",
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response response-timeout",
        "",
        "frontend gateway",
        f"    bind {bind}",
        "    stick-table type ip size 100k expire 60s store conn_cur",
        "    tcp-request connection track-sc0 src",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {per_address} }}",
        "    default_backend gateways",
        "",
        "backend gateways",
        "    balance leastconn",
        "    option httpchk GET /healthz",
        "    http-check expect status 200",
        "    default-server inter 1s fall 2 rise 1",
        *(f"    server gw{i} {server} check" for i, server in enumerate(servers, start=1)),
        "",
    ]
    return "\n".join(lines)
