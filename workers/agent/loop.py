"""The node agent's loop. Modelled on healthchecks' sendalerts: a long-running loop, a SIGTERM
flag, race-safe `update()` writes. Processes run in their own sessions, so the agent can stop,
crash or be upgraded without taking them down; a new agent re-adopts them (see supervisor)."""

import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.utils import DatabaseError, IntegrityError, InterfaceError
from django.utils import timezone

from workers import nudges
from workers.agent.supervisor import LeaseLost, Supervisor
from workers.agent.workloads import registered_workloads
from workers.doctor import host_report
from workers.engine_info import (
    EngineSite,
    cached_engine_cli,
    cann_version,
    compat_warnings,
    detect_platform,
    engine_cli,
    engine_fingerprint,
    probe_engine,
)
from workers.host_stats import cpu_core_ids, numa_core_sets
from workers.models import Node
from workers.telemetry.collect import collect_node

log = logging.getLogger("console.agent")

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class NodeHeld(Exception):
    """Another agent runs this node (Node.held_by_another_agent): a second service, a hand-run agent beside
    it, or a cloned host with the same name. Two agents would fight over the same replicas."""


def host_boot_id() -> str:
    """This boot of this host and this PID namespace ('' where the kernel does not say): tells a crashed agent
    whose PID can be checked from here from an agent elsewhere, including one in another container of this
    host (the same boot, other PIDs: a DaemonSet's pods have their own PID namespace)."""
    try:
        return f"{BOOT_ID.read_text().strip()}/pidns:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


class NodeAgent:
    def __init__(self, node_name: str, *, engine_python: str | None = None, address: str | None = None):
        self.node_name = node_name
        self.engine_python = engine_python or settings.ENGINE_PYTHON
        self.address = address or settings.NODE_ADDRESS
        self.supervisor = Supervisor(node_name)
        self.stopping = False
        self.node: Node | None = None
        self.last_heartbeat = 0.0
        self.last_devices = 0.0
        self._device_thread: threading.Thread | None = None
        self.last_doctor: float | None = None  # None: not yet, run at start (monotonic time may be small)
        self._doctor_thread: threading.Thread | None = None
        self.engine_cli_fingerprint: str | None = None  # the engine whose parser Node.engine_cli holds
        self.engine_site_seen: EngineSite | None = None  # where Node.engine was read
        self.busy = False
        self.instance = uuid.uuid4()  # this agent's lease on the node (Node.agent_instance)
        self.boot_id = host_boot_id()
        self.lease_lost = False
        self.released = False
        self._lease_lock = threading.Lock()  # heartbeat() against release(): see heartbeat
        self.pass_started: float | None = None  # monotonic start of the running reconcile pass

    # --- registration and heartbeat -----------------------------------------------------
    def engine_site(self) -> EngineSite:
        """Where this node's replicas' engine is: the image they run in when the node's engine runtime (set
        on its page) is Docker or Podman, else the agent's engine python."""
        node = Node.objects.filter(name=self.node_name).first()
        if node is not None and node.containerised:
            return EngineSite(runtime=node.engine_runtime, image=node.engine_image())
        return EngineSite(python=self.engine_python)

    def engine_facts(self, site: EngineSite, platform: str) -> tuple[dict, list[str]]:
        """(Node.engine, Node.compat_warnings) of the engine at the site."""
        engine = probe_engine(site)
        # A container's CANN is its image's, built to match its vllm-ascend: the host's says nothing of it.
        cann = cann_version() if platform == "ascend" and not site.containerised else None
        if cann:
            engine["cann"] = cann
        warnings = compat_warnings(engine, cann=cann) if platform == "ascend" else []
        if engine.get("error"):
            warnings.insert(0, engine["error"])
        return engine, warnings

    def register(self) -> Node:
        """Take the node's lease and write what this host is. Waits while another agent holds it, for as long
        as a silent one takes to go offline (NODE_OFFLINE_SECONDS), then refuses (NodeHeld)."""
        facts = self.node_facts()
        deadline = time.monotonic() + settings.NODE_OFFLINE_SECONDS + settings.AGENT_HEARTBEAT_SECONDS
        while True:
            try:
                return self.claim(facts)
            except NodeHeld as held:
                if self.stopping or time.monotonic() >= deadline:
                    raise
                log.warning("%s; waiting for its lease to run out", held)
                time.sleep(min(settings.AGENT_HEARTBEAT_SECONDS, max(deadline - time.monotonic(), 0.1)))

    def claim(self, facts: dict) -> Node:
        try:
            return self._claim(facts)
        except IntegrityError:  # another agent created the node's row meanwhile: its lease is checked now
            return self._claim(facts)

    def _claim(self, facts: dict) -> Node:
        with transaction.atomic():
            held = Node.objects.select_for_update().filter(name=self.node_name).first()
            if held is not None and held.held_by_another_agent(
                instance=self.instance, boot_id=self.boot_id, pid_alive=psutil.pid_exists
            ):
                age = (timezone.now() - held.last_heartbeat).total_seconds()
                raise NodeHeld(
                    f"node {self.node_name} is run by another agent (pid {held.agent_pid} on "
                    f"{held.hostname or 'an unnamed host'}, heartbeat {age:.0f} s ago): stop that agent, "
                    "or give this one another --node"
                )
            now = timezone.now()
            # The host's interfaces for multi-node collectives (NODE_INTERFACES); endpoints checks them at launch.
            node_settings = {
                **(held.settings if held is not None else {}),
                "interfaces": dict(settings.NODE_INTERFACES),
            }
            fields = {
                **facts,
                "settings": node_settings,
                "agent_pid": os.getpid(),
                "agent_started_at": now,
                "last_heartbeat": now,
                "agent_instance": self.instance,
                "agent_boot_id": self.boot_id,
            }
            if held is None:  # a new node: the unique name refuses a second creator (claim then tries again)
                with transaction.atomic():
                    node = Node.objects.create(name=self.node_name, **fields)
            else:  # the locked row: no other agent's claim can slip in between the check and this write
                Node.objects.filter(pk=held.pk).update(**fields)
                node = Node.objects.get(pk=held.pk)
        self.node = node
        self.released = False
        return node

    def node_facts(self) -> dict:
        """What the node's row says of this host and its engine (probed once per start: seconds)."""
        platform = detect_platform()
        site = self.engine_site()
        engine, warnings = self.engine_facts(site, platform)
        self.engine_site_seen = site
        # The parser of this very engine when it was probed before, else {} (the console then holds the
        # node to its fixed allow-list) until check_engine_cli has probed it, off the loop.
        cli = {} if engine.get("error") else cached_engine_cli(engine_fingerprint(site, engine)) or {}
        self.engine_cli_fingerprint = cli.get("fingerprint")
        cores = cpu_core_ids()
        return {
            "hostname": socket.gethostname(),
            "address": self.address,
            "platform": platform,
            "engine_python": self.engine_python,
            "engine": engine,
            "engine_cli": cli,
            "compat_warnings": warnings,
            "host": {
                "cpus": psutil.cpu_count(),
                "memory_bytes": psutil.virtual_memory().total,
                "cpu_cores": cores,
                "numa_cores": numa_core_sets(cores),
            },
        }

    def heartbeat(self) -> None:
        """Only while the lease is this agent's: one that went silent past NODE_OFFLINE_SECONDS may have been
        replaced meanwhile, and then stops (the replicas are the new agent's to run). Under the lock that
        release() takes: the long-pass beat (another thread) must not find the lease released and stop."""
        with self._lease_lock:
            if self.released:
                return
            now = timezone.now()
            if Node.objects.filter(pk=self.node.pk, agent_instance=self.instance).update(
                last_heartbeat=now, agent_pid=os.getpid()
            ):
                self.node.last_heartbeat = now
                return
            self.lose_lease()

    def still_held(self) -> None:
        """Past AGENT_PASS_STUCK_SECONDS the agent beats no more, but still looks: a pass that comes unstuck
        after another agent took the node over must start and stop nothing (the supervisor's fence)."""
        with self._lease_lock:
            if self.released or Node.objects.filter(pk=self.node.pk, agent_instance=self.instance).exists():
                return
            self.lose_lease()

    def lose_lease(self) -> None:
        self.supervisor.fence()
        self.lease_lost = self.stopping = True
        if Node.objects.filter(pk=self.node.pk).exists():
            log.error(
                "another agent took node %s over while this one was silent; this agent stops and leaves the "
                "replicas to it",
                self.node_name,
            )
        else:
            log.error(
                "node %s was deleted; this agent stops (started again, it registers the node anew)", self.node_name
            )

    def release(self) -> None:
        """On a clean exit: the next agent (a restart, an upgrade) need not wait for the lease to run out."""
        with self._lease_lock:
            self.released = True
            # The pid too: a row naming no lease but a pid that beats is an agent of a release before the lease.
            Node.objects.filter(pk=self.node.pk, agent_instance=self.instance).update(
                agent_instance=None, agent_pid=None
            )

    def collect_telemetry(self) -> None:
        """Devices, host and workload readings. Runs off the main loop: a hung npu-smi or a
        slow /metrics must not stall reconciliation."""
        close_old_connections()
        try:
            collect_node(self.node)
        except Exception as exc:  # never let telemetry kill the agent
            log.exception("telemetry")
            Node.objects.filter(pk=self.node.pk).update(telemetry_error=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            close_old_connections()

    def check_host(self) -> None:
        """The environment doctor's checks of this host, kept on the Node for its page, then the engine's
        parser. Off the main loop: importing torch-npu or vLLM in the engine python takes seconds."""
        close_old_connections()
        try:
            node = Node.objects.get(pk=self.node.pk)  # its engine runtime may have changed on its page
            container = {"runtime": node.engine_runtime, "image": node.engine_image()} if node.containerised else {}
            Node.objects.filter(pk=self.node.pk).update(
                doctor=host_report(engine_python=self.engine_python, **container)
            )
        except Exception:  # never let the doctor kill the agent
            log.exception("doctor")
        try:
            self.check_engine_cli()
        except Exception:
            log.exception("engine parser probe")
        finally:
            close_old_connections()

    def check_engine_cli(self) -> None:
        """Report the flags and VLLM_* variables the engine's vLLM knows (Node.engine_cli): at start, and
        again whenever the engine changes under the agent (the venv's link repointed, vLLM reinstalled at
        another release); the doctor's interval sets how soon that is seen. Gathers only: which flags a
        launch may use on this node is endpoints' decision. A containerised node's engine is its image's
        (probed in a container of it), and changes with the node's runtime or image too."""
        site = self.engine_site()
        # Read again each time (package metadata, a fraction of a second on the host): a venv upgraded in place
        # (`make engine` at another release) keeps its path, an image's tag may point elsewhere now, and the
        # node's page, the quantize form's schemes and benchmark records read these versions.
        engine, warnings = self.engine_facts(site, self.node.platform)
        Node.objects.filter(pk=self.node.pk).update(engine=engine, compat_warnings=warnings)
        self.engine_site_seen = site
        if engine.get("error"):  # no vLLM there any more: nothing to check launches against
            if self.engine_cli_fingerprint is not None:
                Node.objects.filter(pk=self.node.pk).update(engine_cli={})
                self.engine_cli_fingerprint = None
            return
        fingerprint = engine_fingerprint(site, engine)
        if fingerprint == self.engine_cli_fingerprint:
            return
        cli = engine_cli(site, engine)
        Node.objects.filter(pk=self.node.pk).update(engine_cli=cli)
        self.engine_cli_fingerprint = fingerprint  # a failed probe too: tried again when the engine changes
        if cli.get("error"):
            log.warning(
                "engine parser probe: %s; launches on %s are checked against the fixed allow-list only",
                cli["error"],
                self.node_name,
            )
        else:
            log.info("engine parser: vLLM %s, %d options", cli["vllm"], len(cli["options"]))

    def reconcile(self) -> None:
        self.pass_started = time.monotonic()
        try:
            busy = [
                workload.reconcile(node=self.node, supervisor=self.supervisor) for workload in registered_workloads()
            ]
        finally:
            self.pass_started = None
        self.busy = any(busy)

    def beat_during_long_passes(self) -> None:
        """The heartbeat while a pass runs long (serial stops of grace + 5 s each, a slow container CLI): the
        node would otherwise look offline, paging NODE_OFFLINE alerts and letting another agent take its lease.
        Only up to AGENT_PASS_STUCK_SECONDS into a pass: an agent stuck past that is not running its node, and
        its node should go offline. Between passes the loop beats itself."""
        while not self.stopping:
            time.sleep(settings.AGENT_HEARTBEAT_SECONDS)
            started = self.pass_started
            if started is None:
                continue
            running = time.monotonic() - started
            if running < settings.AGENT_HEARTBEAT_SECONDS:
                continue
            try:
                if running <= settings.AGENT_PASS_STUCK_SECONDS:
                    self.heartbeat()
                else:
                    self.still_held()
            except (DatabaseError, InterfaceError) as exc:
                log.warning("heartbeat during a long pass: %s", exc)
            finally:
                close_old_connections()

    # --- the loop ----------------------------------------------------------------------
    def doctor_due(self) -> bool:
        """The doctor's checks and the engine probes (check_host) are due: at start, every
        DOCTOR_INTERVAL_SECONDS, and as soon as the node's engine moved (its runtime or image changed on its
        page), so that launches are not checked against the engine it had."""
        if self._doctor_thread is not None and self._doctor_thread.is_alive():
            return False
        if self.last_doctor is None or time.monotonic() - self.last_doctor >= settings.DOCTOR_INTERVAL_SECONDS:
            return True
        return self.engine_site() != self.engine_site_seen

    def run(self, *, once: bool = False) -> None:
        self.register()
        log.info(
            "agent %s up: platform %s, engine %s", self.node_name, self.node.platform, self.node.engine.get("vllm")
        )
        if not once:
            threading.Thread(target=self.beat_during_long_passes, name="heartbeat", daemon=True).start()
        pubsub = None
        while not self.stopping:
            try:
                close_old_connections()
                if time.monotonic() - self.last_heartbeat >= settings.AGENT_HEARTBEAT_SECONDS:
                    self.heartbeat()
                    self.last_heartbeat = time.monotonic()
                    if self.lease_lost:  # not one more pass: the replicas are another agent's now
                        break
                if time.monotonic() - self.last_devices >= settings.TELEMETRY_INTERVAL_SECONDS and (
                    self._device_thread is None or not self._device_thread.is_alive()
                ):
                    self.last_devices = time.monotonic()
                    self._device_thread = threading.Thread(target=self.collect_telemetry, daemon=True)
                    self._device_thread.start()
                if self.doctor_due():
                    self.last_doctor = time.monotonic()
                    self._doctor_thread = threading.Thread(target=self.check_host, daemon=True)
                    self._doctor_thread.start()
                self.reconcile()
            except LeaseLost:  # found in the middle of a pass (the heartbeat thread's look): it ends there
                break
            except (DatabaseError, InterfaceError) as exc:  # InterfaceError: a connection closed under it
                # The database is down for a while: keep the processes running, retry.
                log.warning("database unavailable (%s); endpoints keep running, retrying", exc)
                close_old_connections()
            if once:
                return
            pubsub = self.wait_for_nudge(pubsub)
        if not self.lease_lost:
            try:
                self.release()
            except (DatabaseError, InterfaceError) as exc:  # the lease runs out on its own
                log.warning("could not release node %s's lease: %s", self.node_name, exc)

    def wait_for_nudge(self, pubsub):
        """Sleep until the reconcile interval passes or someone publishes a nudge."""
        # While something is starting, look twice a second: ready should show within ~0.5 s.
        interval = 0.5 if self.busy else settings.AGENT_RECONCILE_SECONDS
        try:
            if pubsub is None:
                pubsub = nudges.subscribe(self.node_name)
            deadline = time.monotonic() + interval
            while not self.stopping and time.monotonic() < deadline:
                if pubsub.get_message(timeout=min(0.5, max(deadline - time.monotonic(), 0.01))):
                    break
            return pubsub
        except Exception as exc:  # Redis down: fall back to plain polling
            log.debug("nudges unavailable: %s", exc)
            time.sleep(interval)
            return None
