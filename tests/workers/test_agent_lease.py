"""One agent per node: the agent's lease on its Node row (workers.agent.loop.NodeAgent.claim). A second agent
for a node whose agent beats (a second service, a hand-run agent beside it, a cloned host with the same
name) waits for the lease to run out and then refuses; one restarted after a crash on the same host takes
over at once; one that went silent and was replaced stops; a clean exit hands the node on at once."""

import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from tests.support.agents import start_agent, stop_agent, wait_for
from workers.agent import NodeAgent
from workers.agent.loop import NodeHeld, host_boot_id
from workers.models import Node


def agent(tmp_path, name="lease-node") -> NodeAgent:
    return NodeAgent(name, engine_python=str(tmp_path / "no-engine" / "python"))  # no engine to probe: fast


def held_elsewhere(name="lease-node", *, boot_id="another-boot", pid=4242, age_s=0.0) -> Node:
    return Node.objects.create(
        name=name,
        hostname="clone-of-this-host",
        agent_instance=uuid.uuid4(),
        agent_boot_id=boot_id,
        agent_pid=pid,
        last_heartbeat=timezone.now() - timedelta(seconds=age_s),
    )


@pytest.mark.django_db
def test_a_node_whose_agent_beats_elsewhere_is_refused_by_name(tmp_path):
    holder = held_elsewhere()
    second = agent(tmp_path)
    with pytest.raises(
        NodeHeld,
        match=r"node lease-node is run by another agent \(pid 4242 on clone-of-this-host, "
        r"heartbeat 0 s ago\): stop that agent, or give this one another --node",
    ):
        second.claim(second.node_facts())
    node = Node.objects.get(pk=holder.pk)
    assert node.agent_instance == holder.agent_instance and node.hostname == "clone-of-this-host"  # nothing written


@pytest.mark.django_db
def test_a_silent_agents_node_is_taken_once_it_is_offline_and_the_silent_one_then_stops(tmp_path, settings):
    settings.NODE_OFFLINE_SECONDS, settings.AGENT_HEARTBEAT_SECONDS = 1, 0.2
    first = agent(tmp_path)
    first.register()
    Node.objects.filter(name="lease-node").update(agent_boot_id="another-boot")  # as if on another host
    second = agent(tmp_path)
    with pytest.raises(NodeHeld):
        second.claim(second.node_facts())
    node = second.register()  # waits for the first's heartbeat to age past NODE_OFFLINE_SECONDS
    assert node.agent_instance == second.instance and node.agent_boot_id == host_boot_id()

    first.heartbeat()  # back from its silence: the node is the other's now
    assert first.lease_lost and first.stopping
    assert Node.objects.get(pk=node.pk).agent_instance == second.instance
    first.release()  # its clean exit does not free the other's lease
    assert Node.objects.get(pk=node.pk).agent_instance == second.instance
    second.heartbeat()
    assert not second.lease_lost


@pytest.mark.django_db
def test_an_agent_restarted_on_the_same_boot_takes_over_from_its_dead_predecessor_at_once(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    held_elsewhere(boot_id=host_boot_id(), pid=dead.pid)
    restarted = agent(tmp_path)
    assert restarted.claim(restarted.node_facts()).agent_instance == restarted.instance

    # ...but not from a live one on the same boot (a hand-run agent beside the service).
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        Node.objects.filter(name="lease-node").update(agent_instance=uuid.uuid4(), agent_pid=alive.pid)
        with pytest.raises(NodeHeld, match=f"pid {alive.pid}"):
            agent(tmp_path).claim(restarted.node_facts())
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.django_db
def test_a_released_or_offline_lease_is_free(tmp_path, settings):
    holder = held_elsewhere(age_s=settings.NODE_OFFLINE_SECONDS + 1)  # offline: its agent is gone or stuck
    taker = agent(tmp_path)
    taker.claim(taker.node_facts())
    taker.release()
    assert Node.objects.get(pk=holder.pk).agent_instance is None
    other = agent(tmp_path)
    assert other.claim(other.node_facts()).agent_instance == other.instance


@pytest.mark.django_db
def test_an_agent_of_a_release_before_the_lease_that_still_beats_holds_its_node(tmp_path, settings, as_viewer):
    """Rows it wrote name no lease (migration 0011 added it) but its pid, and it beats on: taken for free, its node
    was run by two agents during an upgrade (a DaemonSet's old pod on its way out beside the new one)."""
    old = Node.objects.create(name="lease-node", hostname="h", agent_pid=4242, last_heartbeat=timezone.now())
    assert old.agent_instance is None and old.agent_boot_id == ""
    newer = agent(tmp_path)
    with pytest.raises(NodeHeld, match="pid 4242"):
        newer.claim(newer.node_facts())
    Node.objects.filter(pk=old.pk).update(
        last_heartbeat=timezone.now() - timedelta(seconds=settings.NODE_OFFLINE_SECONDS + 1)
    )
    assert newer.claim(newer.node_facts()).agent_instance == newer.instance  # it stopped: taken once offline
    newer.release()
    released = Node.objects.get(pk=old.pk)
    assert released.agent_instance is None and released.agent_pid is None  # this release's clean exit: free at once
    assert "stopped (it released the node)" in as_viewer.get(f"/nodes/{old.pk}/").content.decode()
    assert agent(tmp_path).claim(newer.node_facts()).agent_pid is not None


@pytest.mark.django_db(transaction=True)
def test_a_second_agent_process_for_a_running_node_exits_with_the_reason(worker_env, tmp_path):
    """Real agent processes: the second waits NODE_OFFLINE_SECONDS (short here) for the first's lease, which
    keeps beating, then exits non-zero naming it; the first's clean exit frees the node for the next."""
    no_engine = {"ENGINE_PYTHON": str(tmp_path / "no-engine" / "python"), "NODE_OFFLINE_SECONDS": "3"}
    first = start_agent(worker_env, "lease-real", extra=no_engine, log_path=tmp_path / "first.log")
    try:
        node = wait_for(
            lambda: Node.objects.filter(name="lease-real", agent_pid=first.pid).first(),
            timeout=60,
            what="the first agent registered",
        )
        second = start_agent(worker_env, "lease-real", extra=no_engine, log_path=tmp_path / "second.log")
        assert second.wait(timeout=60) == 1
        log = (tmp_path / "second.log").read_text()
        assert f"node lease-real is run by another agent (pid {first.pid} on " in log, log
        assert "waiting for its lease to run out" in log
        assert Node.objects.get(pk=node.pk).agent_pid == first.pid and first.poll() is None
    finally:
        stop_agent(first)
    assert first.returncode == 0 and Node.objects.get(pk=node.pk).agent_instance is None
    third = start_agent(worker_env, "lease-real", extra=no_engine, log_path=tmp_path / "third.log")
    try:
        wait_for(
            lambda: Node.objects.filter(name="lease-real", agent_pid=third.pid).exists(),
            timeout=30,
            what="the next agent registered at once",
        )
    finally:
        stop_agent(third)


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_goes_on_through_a_long_pass_but_not_a_stuck_one(tmp_path, settings, monkeypatch):
    """Serial stops (grace + 5 s each) made the node look offline mid-pass; a pass past AGENT_PASS_STUCK_SECONDS
    is stuck, and its node should go offline."""
    import threading
    import time

    from workers.agent import loop as loop_module

    settings.AGENT_HEARTBEAT_SECONDS, settings.AGENT_PASS_STUCK_SECONDS = 0.2, 1.5
    runner = agent(tmp_path)
    node = runner.register()
    beats = []

    class LongPass:
        def reconcile(self, *, node, supervisor):
            beats.append(Node.objects.get(pk=node.pk).last_heartbeat)
            time.sleep(4)  # the pass: 1.5 s of it within the stuck limit, the rest past it
            beats.append(Node.objects.get(pk=node.pk).last_heartbeat)
            return False

    monkeypatch.setattr(loop_module, "registered_workloads", lambda: [LongPass()])
    thread = threading.Thread(target=runner.beat_during_long_passes, daemon=True)
    thread.start()
    try:
        before = Node.objects.get(pk=node.pk).last_heartbeat
        beat_at = []
        watcher = threading.Thread(
            target=lambda: [
                beat_at.append(Node.objects.get(pk=node.pk).last_heartbeat) or time.sleep(0.25) for _ in range(16)
            ],
            daemon=True,
        )
        watcher.start()
        runner.reconcile()
        watcher.join()
    finally:
        runner.stopping = True
        thread.join(timeout=5)
    during = sorted({b for b in beat_at if b > before})
    assert during, "no heartbeat during the pass"
    started = beats[0]
    # Beats within the first 1.5 s of the pass only (a margin for a loaded machine): none in its last 1.4 s.
    assert max(during) - started < timedelta(seconds=2.6), (started, during)
    assert beats[1] == max(during)


@pytest.mark.django_db(transaction=True)  # the loop closes old connections
def test_an_agent_that_finds_its_lease_gone_runs_no_further_pass(tmp_path, monkeypatch):
    from workers.agent import loop as loop_module

    passes = []

    class Workload:
        def reconcile(self, *, node, supervisor):
            passes.append(node.pk)
            return False

    monkeypatch.setattr(loop_module, "registered_workloads", lambda: [Workload()])
    runner = agent(tmp_path)
    runner.register()
    Node.objects.filter(name="lease-node").update(agent_instance=uuid.uuid4())  # taken over while it was silent
    monkeypatch.setattr(runner, "register", lambda: runner.node)  # the loop of an agent registered before
    runner.run(once=True)
    assert runner.lease_lost and passes == []


@pytest.mark.parametrize("stuck_after_s", [30, 0.6], ids=["beating", "past-the-stuck-limit"])
@pytest.mark.django_db(transaction=True)  # the heartbeat thread writes with its own connection
def test_a_pass_under_way_when_the_lease_goes_starts_nothing_and_the_agent_stops(
    tmp_path, settings, monkeypatch, stuck_after_s
):
    """The lease checked between passes only: a pass blocked (a hung container CLI) while another agent took the
    node over went on when it came unstuck, starting replicas beside the new agent's and stopping what it ran.
    Now the supervisor is fenced the moment the heartbeat thread finds the lease gone, beating or (past
    AGENT_PASS_STUCK_SECONDS) only looking, and the pass and the agent end there."""
    import time

    from workers.agent import loop as loop_module
    from workers.agent.handles import LeaseLost, ProcessSpec

    settings.AGENT_HEARTBEAT_SECONDS, settings.AGENT_PASS_STUCK_SECONDS = 0.2, stuck_after_s
    outcome = []

    class TakenOverMidPass:
        def reconcile(self, *, node, supervisor):
            if outcome:
                outcome.append("a second pass")
                return False
            Node.objects.filter(pk=node.pk).update(agent_instance=uuid.uuid4())  # the new agent's claim
            deadline = time.monotonic() + 10
            while not supervisor.fenced and time.monotonic() < deadline:
                time.sleep(0.05)  # the pass, blocked
            try:
                supervisor.start(ProcessSpec(argv=["sleep", "60"], env={}, log_path=tmp_path / "replica.log"))
                outcome.append("started")
            except LeaseLost:
                outcome.append("refused")
                raise
            return False

    monkeypatch.setattr(loop_module, "registered_workloads", lambda: [TakenOverMidPass()])
    runner = agent(tmp_path)
    runner.register()
    monkeypatch.setattr(runner, "register", lambda: runner.node)
    runner.run()  # returns: the agent stops
    assert outcome == ["refused"] and runner.lease_lost and not (tmp_path / "replica.log").exists()


@pytest.mark.django_db
def test_a_node_row_created_by_another_agent_meanwhile_is_checked_not_overwritten(tmp_path, monkeypatch):
    """Two agents registering a new node at once: the unique name refuses the second insert, and its claim then
    finds the first's lease (a row that did not exist could not be locked)."""
    from django.db import IntegrityError

    late = agent(tmp_path)
    facts, real_claim, calls = late.node_facts(), late._claim, []

    def created_meanwhile(given):
        calls.append(1)
        if len(calls) == 1:
            held_elsewhere()  # the other agent's insert commits first
            raise IntegrityError("UNIQUE constraint failed: workers_node.name")
        return real_claim(given)

    monkeypatch.setattr(late, "_claim", created_meanwhile)
    with pytest.raises(NodeHeld):
        late.claim(facts)
    assert len(calls) == 2 and Node.objects.get(name="lease-node").agent_boot_id == "another-boot"


@pytest.mark.django_db
def test_a_beat_after_the_release_does_not_take_the_agent_for_replaced(tmp_path):
    runner = agent(tmp_path)
    runner.register()
    runner.release()
    runner.heartbeat()  # the long-pass thread's last beat, after the main thread's release
    assert not runner.lease_lost and Node.objects.get(name="lease-node").agent_instance is None
