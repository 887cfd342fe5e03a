import logging
import signal
import socket

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from workers.agent import NodeAgent
from workers.agent.loop import NodeHeld


class Command(BaseCommand):
    help = (
        "Run the node agent for this host: register the node, keep its heartbeat, and start, "
        "supervise and stop its endpoint replicas. Stopping the agent leaves them running."
    )

    def add_arguments(self, parser):
        parser.add_argument("--node", default=settings.NODE_NAME or socket.gethostname())
        parser.add_argument("--engine-python", default=settings.ENGINE_PYTHON)
        parser.add_argument("--address", default=settings.NODE_ADDRESS)

    def handle(self, *args, node, engine_python, address, **options):
        logging.getLogger("console.agent").setLevel(logging.INFO)
        agent = NodeAgent(node, engine_python=engine_python, address=address)

        def _stop(signum, frame):
            agent.stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        try:
            agent.run()
        except NodeHeld as held:
            raise CommandError(str(held)) from held
        if agent.lease_lost:
            raise CommandError(f"node {node} was taken over by another agent; its endpoints keep running under it")
        self.stdout.write(f"agent {node} stopped; its endpoints keep running")
