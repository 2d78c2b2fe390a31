"""A simulated swarm fits its process's descriptors and sockets or is refused up front; a node
out of sockets closes idle ones, and one with none to close stops loudly: its peers see it go,
and the run ends with an error.

The failures are real: a lowered RLIMIT_NOFILE, or a ZeroMQ context that may hold only a few
sockets (the limit a process hits when something else holds its descriptors). Each runs in a
fresh interpreter, since both limits are per process."""
from __future__ import annotations

import math
import resource
import subprocess
import sys
import textwrap

import pytest
from cli_zygote import cli_popen
from conftest import wait_until

from starling.node import Node, NodeConfig, PeerStatus
from starling.node.swim import Liveness
from starling.runtime.capacity import (
    WIRED_CONNECTIONS,
    CapacityError,
    default_cap,
    fds_per_peer,
    plan_capacity,
    sockets_per_peer,
)


def run_python(code: str, *, nofile: int | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout_s, preexec_fn=limit)


def test_descriptor_arithmetic_matches_the_measured_costs():
    """One per socket, two per wired connection (both ends here), two per monitor, one listener."""
    assert fds_per_peer(10, "inproc", monitors=False) == 11
    assert fds_per_peer(10, "inproc", monitors=True) == 31
    assert fds_per_peer(10, "tcp", monitors=False) == 32
    assert fds_per_peer(10, "ipc", monitors=True) == 52
    assert sockets_per_peer(10, monitors=True) == 31


def test_the_cap_is_the_largest_that_fits_and_a_swarm_that_cannot_fit_is_refused():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    plan = plan_capacity(8, 8, "inproc", monitors=False, max_dealers=None)
    assert plan.max_dealers == 64 and plan.fds_per_peer == 8  # 7 peers: 7 DEALERs at most
    assert plan.fd_limit == (hard if hard != resource.RLIM_INFINITY else plan.fd_limit)
    with pytest.raises(CapacityError, match=r"ZeroMQ sockets|file descriptors"):
        plan_capacity(40_000, 40_000, "tcp", monitors=True, max_dealers=64)
    with pytest.raises(CapacityError, match="max_dealers must be >= 1"):
        plan_capacity(4, 4, "inproc", monitors=False, max_dealers=0)


def test_a_wired_swarms_cap_keeps_its_connections_in_budget_but_never_below_its_fingers():
    """Over tcp or ipc a connection costs about 82 KB (`benchmarks/socket_memory.py`): past 128
    peers the simulator's own cap keeps peers x cap within WIRED_CONNECTIONS, and a member
    keeps at least a socket for each of its log2(n) fingers; inproc keeps the full cap."""
    assert default_cap(8, "tcp") == default_cap(128, "ipc") == 64  # a small swarm is a full mesh, as before
    assert default_cap(1024, "inproc") == default_cap(65536, "inproc") == 64
    assert default_cap(256, "tcp") == 32 and default_cap(1024, "tcp") == 10 and default_cap(4096, "ipc") == 12
    for n in (129, 300, 512, 1000, 1024, 2048, 4096, 65536):
        cap, fingers = default_cap(n, "tcp"), math.ceil(math.log2(n))
        assert cap >= fingers and (n * cap <= WIRED_CONNECTIONS or cap == fingers), (n, cap)
    # what the plan picks when the descriptors allow it, and a cap asked for still wins
    assert plan_capacity(16, 1024, "tcp", monitors=True, max_dealers=None).max_dealers == 10
    assert plan_capacity(16, 1024, "tcp", monitors=True, max_dealers=20).max_dealers == 20


@pytest.mark.slow
def test_a_swarm_that_cannot_fit_is_refused_before_any_node_starts():
    result = run_python("""
        from starling.node.loop import NetworkThread
        from starling.runtime import SimConfig, SimError, Simulation
        try:
            Simulation(SimConfig(peers=64, protocol="gossip", task="quadratic", steps=2, transport="tcp")).run()
        except SimError as exc:
            print("refused:", exc)
        print("network thread started:", NetworkThread._instance is not None)
    """, nofile=600)
    assert "refused: 64 peers in one process" in result.stdout, result.stdout + result.stderr
    assert "(ulimit -n 600)" in result.stdout and "--processes" in result.stdout
    assert "network thread started: False" in result.stdout


@pytest.mark.slow
def test_the_cli_refuses_it_in_one_line():
    result = run_python("""
        import sys
        from starling.cli.main import main
        sys.argv = ["starling", "simulate", "--peers", "64", "--task", "quadratic", "--protocol", "gossip",
                    "--steps", "2", "--transport", "tcp", "--baseline", "none"]
        main()
    """, nofile=600)
    assert result.returncode == 2
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error: 64 peers in one process"), lines


def test_nodes_out_of_sockets_close_idle_ones_and_stay_up():
    """A context that holds 6 sockets: the third node's join needs more than there are. Whoever
    finds none (it depends on when libzmq reaps a closed socket's slot) says so, closes an idle
    socket if it has one, and goes on: within the grace, no node stops."""
    result = run_python("""
        import time
        import starling.node.loop as loop
        loop.MAX_SOCKETS_PER_PROCESS = 6
        loop.NetworkThread.get()
        from starling.node import JoinError, Node, NodeConfig, TransportConfig
        from starling.node.swim import Liveness
        config = NodeConfig(liveness=Liveness(probe_interval_s=0.1, suspicion_base_s=1.0), transport=TransportConfig(monitor_connections=False))
        seed = Node(config=config).start("inproc://fault-0", security="plaintext")
        second = Node(config=config).start("inproc://fault-1", [seed.address], security="plaintext")
        third = Node(config=config)
        try:
            third.start("inproc://fault-2", [seed.address], security="plaintext")
            print("third joined")
        except JoinError as exc:
            print("third refused:", exc)
        time.sleep(1.0)  # beats need sockets too
        for name, node in (("seed", seed), ("second", second), ("third", third)):
            print(name, "fault:", node.fault)
        print("exhausted:", sum(n._transport.exhausted for n in (seed, second, third) if n._transport is not None))
    """)
    out, err = result.stdout, result.stderr
    # somebody ran out, and counted it (or, the joiner, was refused and says why)
    assert int(out.split("exhausted:")[1]) > 0 or "Too many open files" in out, out + err
    assert "seed fault: None" in out and "second fault: None" in out, out + err
    assert "third fault: None" in out or "third refused" in out, out + err


def test_a_node_with_no_socket_to_spare_or_shed_stops_and_its_peer_sees_it_go():
    """A node whose process can open no socket beyond its listening one, and has none idle to
    close: past its grace (none here) it stops with the reason, closed, and a peer sees it go."""
    code = textwrap.dedent("""
        import sys, time
        import starling.node.loop as loop
        loop.MAX_SOCKETS_PER_PROCESS = 1  # the ROUTER
        loop.NetworkThread.get()
        from starling.node import Liveness, Node, NodeConfig, NodeFault, TransportConfig
        # no burst of gossip on news: the joiner's hello is answered before this node first needs
        # a socket to send it anything (a burst on learning it would fault while answering)
        config = NodeConfig(transport=TransportConfig(monitor_connections=False, exhausted_grace_s=0.0),
                            liveness=Liveness(gossip_burst=0))
        node = Node(config=config).start("tcp://127.0.0.1:0", security="plaintext")
        print(node.address, node.peer_id, flush=True)
        deadline = time.monotonic() + 60
        while not (node.fault is not None and node.closed) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("fault:", node.fault, "closed:", node.closed, flush=True)
        try:
            node.check_fault()
        except NodeFault as exc:
            print("NodeFault:", exc, flush=True)
        sys.stdin.read()
    """)
    child = cli_popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    joiner = None
    try:
        address, peer_id = child.stdout.readline().split()
        joiner = Node(config=NodeConfig(liveness=Liveness(probe_interval_s=0.2, suspicion_base_s=2.0))).start(
            "tcp://127.0.0.1:0", [address], security="plaintext")
        faulted = child.stdout.readline()  # its first ping to the joiner needs a socket it cannot have
        assert "fault: cannot open a socket" in faulted and "closed: True" in faulted, faulted
        stopped = child.stdout.readline()
        assert "NodeFault: node " in stopped and "stopped: cannot open a socket" in stopped, stopped
        assert wait_until(lambda: joiner.status_of(peer_id) in (PeerStatus.DEAD, PeerStatus.SUSPECT), timeout_s=30)
    finally:
        if joiner is not None:
            joiner.close()
        child.kill()
        _, err = child.communicate(timeout=30)
    assert "this node stops" in err  # logged at ERROR


@pytest.mark.slow
def test_a_run_out_of_sockets_finishes_or_ends_with_an_error_never_hangs():
    result = run_python("""
        import time
        import starling.node.loop as loop
        loop.MAX_SOCKETS_PER_PROCESS = 40
        loop.NetworkThread.get()
        loop.MAX_SOCKETS_PER_PROCESS = 32768  # the simulator's plan reads the usual limit
        from starling.runtime import SimConfig, SimError, Simulation
        started = time.monotonic()
        try:
            Simulation(SimConfig(peers=8, protocol="gossip", task="quadratic", steps=20, max_dealers=7)).run()
            print("finished")
        except SimError as exc:
            print("SimError:", exc)
        print("seconds:", time.monotonic() - started)
    """)
    out = result.stdout
    # its nodes close idle sockets and go on; one that has none to close stops, and says why: while
    # training, or (on a starved box, where the peers still start as the first ones open connections)
    # at the start, when a joiner cannot open the socket it would listen on
    stopped = "SimError: peer " in out and "node stopped: cannot open a socket" in out
    not_started = "SimError: a peer could not join: cannot open a socket to listen on" in out
    assert "finished" in out or ((stopped or not_started) and "Too many open files" in out), out + result.stderr
    assert float(out.split("seconds:")[1]) < 60


def test_the_sized_liveness_keeps_a_boxs_probes_near_its_rate():
    """Every peer probes one other a period, so a box of the swarm's peers sends swarm / period
    probes a second: past SIM_PROBES_PER_S the period grows with the swarm, and the timeouts
    with it, so a slow period is never taken for a dead peer; urgent gossip slows with it."""
    from starling.node.swim import Liveness
    from starling.runtime.simconfig import SIM_LIVENESS, SIM_PROBES_PER_S, SimConfig, sim_liveness

    def timing(lv: Liveness) -> tuple[float, ...]:
        return lv.probe_interval_s, lv.ack_timeout_s, lv.suspicion_base_s, lv.probe_timeout_s

    def gossip_per_s(lv: Liveness, swarm: int) -> float:  # the box's urgent gossip messages a second, at most
        return swarm * lv.gossip_fanout / lv.gossip_interval_s

    assert sim_liveness(4, 4) == SIM_LIVENESS and sim_liveness(16, 16) == SIM_LIVENESS
    small = int(SIM_PROBES_PER_S * SIM_LIVENESS.probe_interval_s)  # the largest swarm the base period suits
    for local, swarm in ((small, small), (small // 4, small), (small - 50, small - 50)):
        lv = sim_liveness(local, swarm)
        assert timing(lv) == timing(SIM_LIVENESS)
        assert lv.gossip_interval_s >= SIM_LIVENESS.gossip_interval_s
        assert gossip_per_s(lv, swarm) <= lv.gossip_fanout * SIM_PROBES_PER_S * 1.0001
    intervals = []
    for local, swarm in ((small + 1, small + 1), (512, 512), (1024, 1024), (256, 1024), (4096, 4096)):
        lv = sim_liveness(local, swarm)
        assert lv.probe_interval_s == pytest.approx(swarm / SIM_PROBES_PER_S)
        assert swarm / lv.probe_interval_s <= SIM_PROBES_PER_S * 1.0001  # the box's probes a second
        assert lv.suspicion_base_s >= 3 * lv.probe_interval_s
        assert lv.ack_timeout_s >= SIM_LIVENESS.ack_timeout_s and lv.probe_timeout_s >= SIM_LIVENESS.probe_timeout_s
        assert gossip_per_s(lv, swarm) <= lv.gossip_fanout * SIM_PROBES_PER_S * 1.0001
        # progress is signed and gossiped as news no more often per period than at the base period
        assert lv.meta_interval_s / lv.probe_interval_s == pytest.approx(
            SIM_LIVENESS.meta_interval_s / SIM_LIVENESS.probe_interval_s)
        intervals.append(lv.probe_interval_s)
    assert intervals == sorted(intervals)
    # the processes of a run share one box: the period follows the whole swarm
    assert sim_liveness(256, 1024) == sim_liveness(1024, 1024)
    sized = SimConfig(peers=1024, task="quadratic", protocol="gossip", processes=4, transport="tcp").sized_for_swarm()
    assert sized.liveness == sim_liveness(256, 1024) and sized.ready_timeout_s >= 10 * sized.liveness.probe_interval_s
    assert SimConfig(peers=4).sized_for_swarm().liveness == SIM_LIVENESS
    mine = Liveness(probe_interval_s=0.5, suspicion_base_s=4.0)
    assert SimConfig(peers=1024, liveness=mine).sized_for_swarm().liveness is mine


def test_the_summary_names_the_socket_cap_and_probe_interval_the_run_used():
    from starling.runtime import SimConfig, Simulation
    from starling.runtime.simconfig import SIM_LIVENESS

    summary = Simulation(SimConfig(peers=3, protocol="gossip", task="quadratic", steps=2)).run().summary
    assert summary["max_dealers"] == 64 and summary["probe_interval_s"] == SIM_LIVENESS.probe_interval_s == 0.5
    capped = Simulation(SimConfig(peers=3, protocol="gossip", task="quadratic", steps=2, max_dealers=1)).run()
    assert capped.summary["max_dealers"] == 1 and all(p.status == "finished" for p in capped.peers)


def test_a_rounds_owners_fit_the_sockets_every_simulated_node_may_hold():
    # a part holds a socket to its owner until the owner's group closes: a run whose nodes may
    # hold few sockets caps the owners of a round below them, unless it names max_owners itself
    from starling.protocols.base import MAX_OWNERS
    from starling.runtime import SimConfig

    few = SimConfig(peers=1000, protocol="diloco", max_dealers=5)
    assert few.protocol_options()["max_owners"] == 3  # 5, passed by one while busy, less 3 spared
    assert few.protocol_config().max_owners == 3
    many = SimConfig(peers=8, protocol="allreduce", max_dealers=64)
    assert many.protocol_options()["max_owners"] == MAX_OWNERS
    named = SimConfig(peers=8, protocol="sketch-dp", max_dealers=5, options={"max_owners": 7})
    assert named.protocol_options()["max_owners"] == 7
    assert "max_owners" not in SimConfig(peers=8, protocol="gossip", max_dealers=5).protocol_options()
    # and a big swarm's rounds no more than the box carries: members x owners near 2048 parts
    from starling.runtime.simconfig import SIM_MIN_OWNERS, SIM_PARTS_PER_ROUND

    assert SimConfig(peers=256, protocol="allreduce", max_dealers=64).protocol_options()["max_owners"] == 8
    assert SIM_PARTS_PER_ROUND // 1024 < SIM_MIN_OWNERS
    assert SimConfig(peers=1024, protocol="allreduce", max_dealers=64).protocol_options()["max_owners"] == SIM_MIN_OWNERS
    from starling.protocols.base import ProtocolError

    with pytest.raises(ProtocolError, match="max_owners must be >= 0"):
        SimConfig(peers=8, protocol="allreduce", options={"max_owners": -1}).protocol_config()


def test_a_simulation_that_stretches_its_probe_period_says_so_in_its_summary():
    from starling.runtime import SimConfig, liveness_note
    from starling.runtime.simconfig import SIM_LIVENESS, SIM_PROBES_PER_S

    big = SimConfig(peers=1024, processes=8, transport="ipc", protocol="gossip", task="quadratic").sized_for_swarm()
    summary = {"peers": 1024, **big.describe()}
    assert summary["probe_interval_s"] == 1024 / SIM_PROBES_PER_S > SIM_LIVENESS.probe_interval_s
    assert summary["probe_interval_scaled_from_s"] == SIM_LIVENESS.probe_interval_s
    assert f"probe period {1024 // SIM_PROBES_PER_S} s, not 0.5 s" in liveness_note(summary)
    small = SimConfig(peers=4).sized_for_swarm().describe()
    assert "probe_interval_scaled_from_s" not in small and liveness_note(small) is None
    mine = SimConfig(peers=1024, processes=8, transport="ipc", liveness=Liveness(probe_interval_s=8.0)).describe()
    assert "probe_interval_scaled_from_s" not in mine  # the user's own period is not the simulator's doing
