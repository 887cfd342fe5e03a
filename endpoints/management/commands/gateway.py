"""Run the gateway (endpoints/gateway/asgi.py) on GATEWAY_URL's host and port, its HTTP done by the compiled
data path (endpoints/gateway/dataplane/) or by uvicorn and aiohttp in this process (GATEWAY_DATAPLANE)."""

import sys
from urllib.parse import urlsplit

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from endpoints.gateway import dataplane, protocol
from endpoints.gateway.asgi import Gateway


class Command(BaseCommand):
    help = "Run the OpenAI-compatible gateway: keys, limits, routing to ready replicas."

    def add_arguments(self, parser):
        url = urlsplit(settings.GATEWAY_URL)
        parser.add_argument("--host", default=url.hostname or "127.0.0.1")
        # One of a pool behind HAProxy (GATEWAY_INSTANCE k): the port after GATEWAY_URL's k-th.
        parser.add_argument("--port", type=int, default=(url.port or 8100) + settings.GATEWAY_INSTANCE)
        parser.add_argument("--log-level", default="warning")

    def handle(self, *args, host, port, log_level, **options):
        chosen = dataplane.chosen()
        if chosen == "rust" and not dataplane.binary().is_file():
            raise CommandError(
                f"GATEWAY_DATAPLANE=rust, but {dataplane.binary()} is not built: run `make dataplane`, "
                "or set GATEWAY_DATAPLANE=python"
            )
        refusal = protocol.binary_refusal(dataplane.binary()) if dataplane.binary().is_file() else ""
        if chosen == "rust" and refusal:
            raise CommandError(f"GATEWAY_DATAPLANE=rust, but {refusal}, or set GATEWAY_DATAPLANE=python")
        if settings.GATEWAY_DATAPLANE == "auto" and chosen == "python":
            why = refusal or f"{dataplane.binary()} is not built (`make dataplane`)"
            self.stderr.write(
                f"gateway: {why}: serving with the Python data path, which costs about twice the CPU per request"
            )
        cpu = None
        if chosen == "rust":
            try:
                cpu = dataplane.bind_cpu()
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        where = f", on CPU {cpu}" if cpu is not None else ""
        self.stdout.write(
            f"gateway listening on http://{host}:{port}/ (OpenAI API under /v1/; {chosen} data path{where})"
        )
        self.stdout.flush()
        if chosen == "rust":
            import uvloop

            sys.exit(uvloop.run(dataplane.serve(host=host, port=port)))
        import uvicorn

        from endpoints.gateway.guard import GuardedProtocol

        # No proxy-headers middleware (the gateway reads no client address) and no Server header:
        # per-request work that serves nothing here.
        uvicorn.run(
            Gateway(),
            host=host,
            port=port,
            loop="uvloop",
            http=GuardedProtocol,  # httptools, with timeouts and connection caps
            lifespan="on",
            access_log=False,
            log_level=log_level,
            timeout_keep_alive=settings.GATEWAY_IDLE_TIMEOUT_SECONDS,
            backlog=4096,
            proxy_headers=False,
            server_header=False,
        )
