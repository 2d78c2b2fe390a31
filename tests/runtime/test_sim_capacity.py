"""A simulated swarm fits its process's descriptors and sockets or is refused up front, and a
node whose socket fails stops loudly: its peers see it go, and the run ends with an error.

The failures are real: a lowered RLIMIT_NOFILE, or a ZeroMQ context that may hold only a few
sockets (the limit a process hits when something else holds its descriptors). Each runs in a
fresh interpreter, since both limits are per process."""
from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest

from starling.runtime.capacity import CapacityError, fds_per_peer, plan_capacity, sockets_per_peer


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


def test_a_node_whose_socket_fails_stops_and_its_peers_see_it_go():
    """A context that holds 6 sockets: the third node's join needs one more than there are.
    Which node finds none depends on when libzmq reaps a closed socket's slot: the seed
    (opening its DEALER to the joiner) or the joiner (opening its bootstrap DEALER). Either
    one stops with the reason, closed; if it is the seed, the second node sees it go."""
    result = run_python("""
        import time
        import starling.node.loop as loop
        loop.MAX_SOCKETS_PER_PROCESS = 6
        loop.NetworkThread.get()
        from starling.node import JoinError, Node, NodeConfig, NodeFault, PeerStatus, TransportConfig
        from starling.node.membership import Liveness
        config = NodeConfig(liveness=Liveness(0.1, 0.5, 1.0), transport=TransportConfig(monitor_connections=False))
        seed = Node(config=config).start("inproc://fault-0", security="plaintext")
        second = Node(config=config).start("inproc://fault-1", [seed.address], security="plaintext")
        third = Node(config=config)
        try:
            third.start("inproc://fault-2", [seed.address], security="plaintext")
            print("third joined")
        except JoinError as exc:
            print("third refused:", exc)
        for name, node in (("seed", seed), ("third", third)):
            if node.fault is not None:
                print(name, "fault:", node.fault, "closed:", node.closed)
                try:
                    node.check_fault()
                except NodeFault as exc:
                    print(name, "NodeFault:", exc)
        if seed.fault is not None:
            deadline = time.monotonic() + 10
            while second.status_of(seed.peer_id) is PeerStatus.ALIVE and time.monotonic() < deadline:
                time.sleep(0.02)
            print("second sees the seed:", second.status_of(seed.peer_id).value)
        second.check_fault()
        print("second fine")
    """)
    out = result.stdout
    assert "third refused:" in out and "Too many open files" in out, out + result.stderr
    faulted = [name for name in ("seed", "third") if f"{name} fault: cannot open a socket to" in out]
    assert len(faulted) == 1, out
    (name,) = faulted
    assert f"{name} fault: cannot open a socket" in out and "closed: True" in out, out
    assert f"{name} NodeFault: node " in out and "stopped: cannot open a socket" in out, out
    if name == "seed":
        assert "second sees the seed: suspect" in out or "second sees the seed: dead" in out, out
    assert "second fine" in out and "this node stops" in result.stderr  # logged at ERROR


def test_a_socket_failure_ends_the_run_with_an_error_not_a_hang():
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
    assert "SimError: peer " in out and "node stopped: cannot open a socket" in out, out + result.stderr
    assert "Too many open files" in out
    assert float(out.split("seconds:")[1]) < 60


def test_membership_traffic_per_process_is_bounded_by_the_sized_liveness():
    from starling.node.membership import Liveness
    from starling.runtime.simconfig import DIGEST_ENTRIES_PER_S, SIM_LIVENESS, SimConfig, sim_liveness

    assert sim_liveness(4, 4) == SIM_LIVENESS and sim_liveness(32, 32) == SIM_LIVENESS
    for local, swarm in ((128, 128), (512, 512), (1024, 1024), (256, 1024)):
        lv = sim_liveness(local, swarm)
        assert local * lv.fanout * swarm / lv.heartbeat_interval_s <= DIGEST_ENTRIES_PER_S * 1.0001
        assert (lv.suspect_timeout_s, lv.dead_timeout_s) == (6 * lv.heartbeat_interval_s, 12 * lv.heartbeat_interval_s)
    assert sim_liveness(256, 1024).heartbeat_interval_s == sim_liveness(1024, 1024).heartbeat_interval_s / 4
    sized = SimConfig(peers=1024, task="quadratic", protocol="gossip", processes=4, transport="tcp").sized_for_swarm()
    assert sized.liveness == sim_liveness(256, 1024) and sized.ready_timeout_s >= 10 * sized.liveness.heartbeat_interval_s
    mine = Liveness(0.5, 2.0, 4.0)
    assert SimConfig(peers=1024, liveness=mine).sized_for_swarm().liveness is mine


def test_the_summary_names_the_socket_cap_and_heartbeat_the_run_used():
    from starling.runtime import SimConfig, Simulation

    summary = Simulation(SimConfig(peers=3, protocol="gossip", task="quadratic", steps=2)).run().summary
    assert summary["max_dealers"] == 64 and summary["heartbeat_s"] == 0.25
    capped = Simulation(SimConfig(peers=3, protocol="gossip", task="quadratic", steps=2, max_dealers=1)).run()
    assert capped.summary["max_dealers"] == 1 and all(p.status == "finished" for p in capped.peers)
