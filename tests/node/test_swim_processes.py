"""SWIM between real processes: a SIGKILLed one is declared dead by members that watch no
connection; a starved one (SIGSTOP, then SIGCONT) is suspected, refutes, and is never dead; a
join through a starved seed greets it once."""
from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import tempfile

import pytest
from cli_zygote import cli_popen
from conftest import DEATH_SEEN_WITHIN_S, statuses, wait_until

from starling.node.node import Node, NodeConfig
from starling.node.swim import Liveness
from starling.node.transport import TransportConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Suspicions last 5 s at least: a stopped process has that long, once suspected, to refute.
LIVENESS = Liveness(probe_interval_s=0.2, suspicion_base_s=5.0)
FLAGS = ["--probe-interval-s", "0.2", "--suspicion-s", "5"]
# The members in this test process learn deaths only from probes and claims: no socket monitor.
PROBES_ONLY = NodeConfig(liveness=LIVENESS, request_timeout_s=5.0, transport=TransportConfig(monitor_connections=False))


def spawn(*args: str) -> tuple[subprocess.Popen, str]:
    proc = cli_popen([sys.executable, "-m", "starling.cli.main", "node", "start", *FLAGS, *args],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # printed once joined
    if "join with:" not in line:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"node did not start: {line!r}")
    return proc, line.rsplit("join with:", 1)[1].strip()


def _peer_of(node, address: str) -> str:
    host = address.split("#")[0]
    return next(p.id for p in node.peers if host in p.addresses)


def test_a_sigkilled_process_is_declared_dead_by_members_that_watch_no_connection(make_node, procs):
    seed, seed_addr = spawn()
    procs.append(seed)
    victim, victim_addr = spawn("--join", seed_addr)
    procs.append(victim)
    a = make_node("tcp", join=[seed_addr], config=PROBES_ONLY)
    b = make_node("tcp", join=[seed_addr], config=PROBES_ONLY)
    assert wait_until(lambda: len(a.live_peers()) == 3 and len(b.live_peers()) == 3, timeout_s=60), statuses(a)
    vid = _peer_of(a, victim_addr)
    victim.send_signal(signal.SIGKILL)
    for n in (a, b):
        assert wait_until(lambda n=n: statuses(n)[vid] == "dead", timeout_s=DEATH_SEEN_WITHIN_S), statuses(n)
    assert all(s == "alive" for p, s in statuses(a).items() if p != vid)


def _seed_and_two_members(make_node, procs, config: NodeConfig):
    """A node process (the seed) and two members in this process that see each other through it;
    the seed's process, its address and id, and the members."""
    seed, seed_addr = spawn()
    procs.append(seed)
    a = make_node("tcp", join=[seed_addr], config=config)
    b = make_node("tcp", join=[seed_addr], config=config)
    assert wait_until(lambda: len(a.live_peers()) == 2 and len(b.live_peers()) == 2, timeout_s=60)
    return seed, seed_addr, _peer_of(a, seed_addr), a, b


def test_a_stopped_process_is_suspected_refutes_when_it_runs_again_and_is_never_dead(make_node, procs):
    seed, _, sid, a, b = _seed_and_two_members(make_node, procs, PROBES_ONLY)
    seen: list[str] = []
    for n in (a, b):
        n.on_peer_change(lambda ch: seen.append(ch.new.value) if ch.peer_id == sid else None)
    seed.send_signal(signal.SIGSTOP)
    try:  # starved: its probes go unanswered, and a member claims it suspect
        assert wait_until(lambda: "suspect" in seen, timeout_s=LIVENESS.suspicion_base_s + 10)
    finally:
        seed.send_signal(signal.SIGCONT)
    for n in (a, b):  # it heard the claim and refuted it with a higher liveness incarnation
        assert wait_until(lambda n=n: statuses(n)[sid] == "alive", timeout_s=30), statuses(n)
    assert "dead" not in seen


# A member that only learns a death from its dropped connection, with a probe timeout far longer
# than the test waits: it can only be quick if the refused reconnects decide.
PATIENT = NodeConfig(liveness=Liveness(probe_interval_s=30.0, suspicion_base_s=120.0, probe_timeout_s=60.0),
                     request_timeout_s=5.0)


@pytest.mark.parametrize("listen", ["tcp", "ipc"])
def test_a_sigkilled_process_is_dead_once_its_address_refuses_to_reconnect(make_node, procs, listen):
    a = make_node(listen, config=PATIENT)
    where = ["--listen", f"ipc://{tempfile.mkdtemp(prefix='starling-')}/victim"] if listen == "ipc" else []
    victim, victim_addr = spawn("--join", a.address, *where)
    procs.append(victim)
    assert wait_until(lambda: len(a.live_peers()) == 1, timeout_s=60), statuses(a)
    vid = _peer_of(a, victim_addr)
    assert wait_until(lambda: a._outbox.transport.is_open(vid))  # the connection a watches
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    # the kernel refuses the reconnects at once (0.1 s, then 0.2 s later): dead long before the
    # 60 s the probe would wait, and before any suspicion could run out
    assert wait_until(lambda: statuses(a)[vid] == "dead", timeout_s=15), statuses(a)
    assert a.stats.refused_deaths == 1


# Members whose suspicions run out within seconds: the stopped process is dead to them soon.
QUICK_DEATHS = NodeConfig(liveness=Liveness(probe_interval_s=0.2, suspicion_base_s=1.0), request_timeout_s=5.0,
                          transport=TransportConfig(monitor_connections=False))


def test_a_process_stopped_until_declared_dead_is_taken_back_alive_by_every_member_when_it_runs_again(
        make_node, procs):
    seed, seed_addr, sid, a, b = _seed_and_two_members(make_node, procs, QUICK_DEATHS)
    seen: dict[str, list[str]] = {"a": [], "b": []}
    for name, n in (("a", a), ("b", b)):
        n.on_peer_change(lambda ch, name=name: seen[name].append(ch.new.value) if ch.peer_id == sid else None)
    seed.send_signal(signal.SIGSTOP)
    try:  # starved past its suspicion: both members declare it dead
        assert wait_until(lambda: statuses(a)[sid] == "dead" and statuses(b)[sid] == "dead",
                          timeout_s=DEATH_SEEN_WITHIN_S), (statuses(a), statuses(b))
    finally:
        seed.send_signal(signal.SIGCONT)
    # it runs again, hears of its death and refutes it: every member takes it back, and it still
    # lets newcomers in
    for n in (a, b):
        assert wait_until(lambda n=n: statuses(n)[sid] == "alive", timeout_s=30), statuses(n)
    assert seen["a"][-1] == seen["b"][-1] == "alive" and "dead" in seen["a"] and "dead" in seen["b"]
    c = make_node("tcp", join=[seed_addr], config=QUICK_DEATHS)
    assert wait_until(lambda: all(len(n.live_peers()) == 3 for n in (a, b, c)), timeout_s=60), \
        (statuses(a), statuses(b), statuses(c))
    assert seed.poll() is None


def test_a_member_that_ran_behind_while_a_suspect_had_its_last_chance_gives_no_verdict(make_node, procs):
    """Before a verdict a member probes the suspect itself once more. If its own process ran
    behind while it waited for that answer (`Swarm.loop_lag`, as the event loop's watchdog
    measures it), the answer may be sitting unread: no verdict, and another probe. The stopped
    process is taken back alive once it runs again, never dead."""
    seed, seed_addr = spawn()
    procs.append(seed)
    a = make_node("tcp", join=[seed_addr], config=QUICK_DEATHS)
    assert wait_until(lambda: len(a.live_peers()) == 1, timeout_s=60), statuses(a)
    sid = _peer_of(a, seed_addr)
    seen: list[str] = []
    a.on_peer_change(lambda ch: seen.append(ch.new.value) if ch.peer_id == sid else None)
    swarm, measured = a._swarm, a._swarm.loop_lag
    last_probes: set[float] = set()

    def probed_again() -> bool:
        suspicion = swarm._suspicions.get(sid)
        if suspicion is not None and isinstance(suspicion.last_probe, float):
            last_probes.add(suspicion.last_probe)
        return len(last_probes) >= 2 or "dead" in seen

    seed.send_signal(signal.SIGSTOP)
    try:
        assert wait_until(lambda: statuses(a)[sid] == "suspect", timeout_s=30), statuses(a)
        swarm.loop_lag = lambda since: 2.0  # from here on, this process is 2 s behind
        assert wait_until(probed_again, timeout_s=DEATH_SEEN_WITHIN_S)
        assert "dead" not in seen and statuses(a)[sid] == "suspect"
    finally:
        seed.send_signal(signal.SIGCONT)
    assert wait_until(lambda: statuses(a)[sid] == "alive", timeout_s=30), statuses(a)
    swarm.loop_lag = measured
    assert "dead" not in seen


def test_a_join_through_a_seed_that_answers_late_greets_it_once(procs):
    """A seed that cannot answer yet (a loaded box; here SIGSTOP) keeps a hello waiting for many
    of the joiner's rejoin intervals. The rejoin check leaves a seed alone while a hello to it
    is out: a second hello would cost the seed another table to page, queued behind the first."""
    seed, seed_addr = spawn()
    procs.append(seed)
    joiner = Node(config=NodeConfig(liveness=LIVENESS, request_timeout_s=5.0, join_timeout_s=60.0,
                                    rejoin_interval_s=0.1))
    ticks: list[float] = []
    joiner._swarm.ticks.append(ticks.append)  # the probe loop's, each period, as the rejoin check's
    seed.send_signal(signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            joined = pool.submit(joiner.start, "tcp://127.0.0.1:0", [seed_addr])
            assert wait_until(lambda: len(ticks) >= 10, timeout_s=30)  # ten probe periods behind the hello
            assert not joined.done()
        finally:
            seed.send_signal(signal.SIGCONT)
        try:
            joined.result(timeout=60)
            assert joiner.stats.snapshot()["messages_sent_by_topic"].get("$hello") == 1
        finally:
            joiner.close()
