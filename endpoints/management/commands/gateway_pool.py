"""Write what `make run GATEWAYS=N` adds to supervisord for a pool of N gateways behind HAProxy
(docs/gateway-scale-out.md): DATA_DIR/gateways/pool.conf (the gateways 2..N and HAProxy, included by
deploy/supervisord.conf) and DATA_DIR/gateways/haproxy.cfg (endpoints/gateway/balancer.py). With N = 1 both are
removed: the one gateway listens on GATEWAY_URL itself, as before."""

from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from endpoints.gateway.balancer import haproxy_config

PROGRAM = """[program:gateway-{k}]
command={python} {manage} gateway
directory={root}
environment=GATEWAY_INSTANCE="{k}",GATEWAY_MAX_CONNECTIONS_PER_ADDRESS="0"
autorestart=true
startsecs=10
startretries=1000
stopasgroup=true
redirect_stderr=true
stdout_logfile={logs}/gateway-{k}.log
stdout_events_enabled=true
"""

BALANCER = """[program:gateway-balancer]
command={haproxy} -W -db -f {config}
autorestart=true
startretries=1000
stopasgroup=true
redirect_stderr=true
stdout_logfile={logs}/gateway-balancer.log
stdout_events_enabled=true
"""


class Command(BaseCommand):
    help = "Write the supervisord programs and HAProxy configuration of a pool of gateways (make run GATEWAYS=N)."

    def add_arguments(self, parser):
        parser.add_argument("--gateways", type=int, required=True)
        parser.add_argument("--haproxy", default="/usr/sbin/haproxy")

    def handle(self, *args, gateways, haproxy, **options):
        if gateways < 1:
            raise CommandError("--gateways must be 1 or more")
        folder = Path(settings.DATA_DIR) / "gateways"
        pool, config = folder / "pool.conf", folder / "haproxy.cfg"
        if gateways == 1:
            pool.unlink(missing_ok=True)
            config.unlink(missing_ok=True)
            return
        url = urlsplit(settings.GATEWAY_URL)
        host, port = url.hostname or "127.0.0.1", url.port or 8100
        folder.mkdir(parents=True, exist_ok=True)
        config.write_text(
            haproxy_config(bind=f"{host}:{port}", servers=[f"{host}:{port + k}" for k in range(1, gateways + 1)])
        )
        root = Path(settings.BASE_DIR)
        logs = Path(settings.DATA_DIR) / "logs"
        python = root / ".venv" / "bin" / "python"
        programs = [
            PROGRAM.format(k=k, python=python, manage=root / "manage.py", root=root, logs=logs)
            for k in range(2, gateways + 1)
        ]
        pool.write_text("\n".join([*programs, BALANCER.format(haproxy=haproxy, config=config, logs=logs)]))
        self.stdout.write(f"{gateways} gateways on ports {port + 1}-{port + gateways}, HAProxy on {host}:{port}")
