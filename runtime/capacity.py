"""Will a simulated swarm fit in its processes? File descriptors and ZeroMQ sockets, counted
before any node starts.

Every simulated peer is a real node: one ROUTER, plus one DEALER per peer it talks to, up to
its cap of open DEALERs (`TransportConfig.max_open_dealers`; over the cap the least recently
used idle one closes). Measured with /proc/self/fd (12 nodes that all see each other):
- every ZeroMQ socket holds one descriptor (its mailbox);
- a connection over tcp or ipc holds one at each end, and in a simulation both ends are in
  this machine's processes: two per DEALER;
- a socket monitor (`TransportConfig.monitor_connections`) adds a pair of sockets per DEALER;
- a tcp or ipc ROUTER holds one more, its listening socket.

So a node needs `1 + L + D * (1 + 2M + 2C)` descriptors, with D open DEALERs, L = C = 1 over
tcp or ipc (0 over inproc) and M = 1 with monitors; and `1 + D * (1 + 2M)` of the process's
ZeroMQ sockets (`node.loop.MAX_SOCKETS_PER_PROCESS`). Over tcp or ipc a process also keeps one
descriptor per peer of the swarm in reserve: connections into a node are not capped, and the
seed every peer joins through holds one from each.

A node may pass its cap by a quarter while DEALERs are busy (`node.transport.dealer_ceiling`),
so the plan counts that ceiling, and it leaves a tenth of the room spare (SPARE): a closed
DEALER's descriptors are freed by libzmq's reaper a moment later, and over tcp or ipc the
connections into a process's nodes match the ones out of them only on average. A 256-peer
run over 4 processes planned to the last descriptor reached 19,990 of 20,000 and failed.

Over tcp or ipc each connection also costs memory: about 82 KB with both ends and the
DEALER's monitor, against 18 KB over inproc (`benchmarks/socket_memory.py`: libzmq's stream
engines each hold a receive buffer and a send batch). At a cap of 20, 1024 peers over 8
processes held 2.84-2.87 MB a peer beyond an 8-peer run, and 1.89-1.90 MB at a cap of 10,
which also started in 27 s where 20 took 42-49 s (`benchmarks/scale.py --max-dealers`). So
over tcp or ipc the simulator's own cap keeps the box's connections within WIRED_CONNECTIONS
(n peers times the cap), though never below log2(n): 64 up to 128 peers, 32 at 256, 16 at
512, 10 at 1024, 12 at 4096. A member keeps half its cap open to its fingers on the probe ring
(`node.ring`), which spreads fewer fingers than log2(n) over the ring's scales.

`plan_capacity` raises the soft RLIMIT_NOFILE to the hard limit, picks the DEALER cap (the
one asked for, or the largest up to `default_cap` that fits), and refuses with one line,
saying what to change, a swarm that cannot fit.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from starling.node.loop import MAX_SOCKETS_PER_PROCESS
from starling.node.transport import dealer_ceiling

try:
    import resource
except ImportError:  # not on Windows: no limit to raise, and none we can read
    resource = None  # type: ignore[assignment]

DEFAULT_MAX_DEALERS = 64  # a real node's cap (TransportConfig.max_open_dealers)
MIN_MAX_DEALERS = 4  # below this a peer spends its steps opening and closing sockets
# Descriptors a simulating process holds besides its nodes: torch, the interpreter, the
# network thread's context and event loop, logs, a joiner's state transfer; measured ~60.
RESERVED_FDS = 256
SPARE = 0.1  # of the room left for descriptors freed late and connections that do not balance
WIRED_CONNECTIONS = 8192  # the connections a wired simulation's default cap keeps its swarm to (peers x cap)


class CapacityError(ValueError):
    """The swarm cannot fit in its processes' descriptors or sockets."""


@dataclass(frozen=True)
class Capacity:
    max_dealers: int  # the cap every simulated node runs with
    fds_per_peer: int
    sockets_per_peer: int
    fd_limit: int  # this process's soft RLIMIT_NOFILE after raising it
    peers_per_process: int


def fds_per_peer(dealers: int, transport: str, monitors: bool) -> int:
    wired = transport != "inproc"
    return 1 + int(wired) + dealers * (1 + 2 * int(monitors) + 2 * int(wired))


def sockets_per_peer(dealers: int, monitors: bool) -> int:
    return 1 + dealers * (1 + 2 * int(monitors))


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    if resource is None:
        return 1 << 30
    unlimited = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == unlimited:
        return 1 << 30
    target = hard if hard != unlimited else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft)


def open_fds() -> int:
    """Descriptors this process holds now (0 where /proc is not there to count them)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def default_cap(swarm: int, transport: str) -> int:
    """The cap a simulated node gets unless one is asked for (before the descriptors have their
    say): DEFAULT_MAX_DEALERS over inproc; over tcp or ipc no more than keeps the swarm within
    WIRED_CONNECTIONS connections, and no fewer than log2(swarm) (at least MIN_MAX_DEALERS)."""
    if transport == "inproc":
        return DEFAULT_MAX_DEALERS
    fingers = max(MIN_MAX_DEALERS, math.ceil(math.log2(max(2, swarm))))
    return max(fingers, min(DEFAULT_MAX_DEALERS, WIRED_CONNECTIONS // max(1, swarm)))


def plan_capacity(peers_per_process: int, swarm: int, transport: str, monitors: bool,
                  max_dealers: int | None, *, processes_hint: int = 0) -> Capacity:
    """The DEALER cap for a swarm of `swarm` peers, `peers_per_process` in each process, that
    fits the descriptors and ZeroMQ sockets of a process; CapacityError (one line, naming the
    limit and what to change) if none does. `max_dealers` None: the largest cap up to
    `default_cap` that fits, and no lower than MIN_MAX_DEALERS."""
    limit = raise_fd_limit()
    room = limit - max(RESERVED_FDS, open_fds() + 64)
    room -= int(room * SPARE)
    if transport != "inproc":
        # Connections into a node are not capped: every peer joins through rank 0 and keeps
        # a socket to it, so the process that holds rank 0 holds up to one more end per peer
        # (a 1024-peer run over 4 processes ran that process out of descriptors, and libzmq
        # aborts when it cannot open one for a connection).
        room -= swarm
    useful = max(1, swarm - 1)  # a node never holds more DEALERs than it has peers

    def held(dealers: int) -> int:  # the most DEALERs a node may hold with this cap
        return min(dealer_ceiling(dealers), useful)

    def fits(dealers: int) -> bool:
        d = held(dealers)
        return (peers_per_process * fds_per_peer(d, transport, monitors) <= room
                and peers_per_process * sockets_per_peer(d, monitors) <= MAX_SOCKETS_PER_PROCESS)

    if max_dealers is not None:
        if max_dealers < 1:
            raise CapacityError(f"max_dealers must be >= 1, got {max_dealers}")
        chosen = max_dealers
    else:
        chosen = next((d for d in range(default_cap(swarm, transport), MIN_MAX_DEALERS - 1, -1) if fits(d)),
                      MIN_MAX_DEALERS)
    if not fits(chosen):
        d = held(chosen)
        need_fds = peers_per_process * fds_per_peer(d, transport, monitors)
        need_sockets = peers_per_process * sockets_per_peer(d, monitors)
        what = (f"{need_fds} file descriptors, and this process may open {room} more (ulimit -n {limit})"
                if need_fds > room else
                f"{need_sockets} ZeroMQ sockets, over the {MAX_SOCKETS_PER_PROCESS} a process may hold")
        per_process = max(1, room // max(1, fds_per_peer(d, transport, monitors)))
        more = -(-swarm // per_process)
        hint = (f"run it in {more} or more processes (--processes {more})" if more > max(1, processes_hint)
                else "use fewer peers per process")
        lower = next((k for k in range(chosen - 1, 0, -1) if fits(k)), None)
        cap = f", lower the socket cap (--max-dealers {lower})" if lower is not None else ""
        raise CapacityError(
            f"{peers_per_process} peers in one process with up to {d} open sockets to others each "
            f"(a cap of {chosen}, passed by a quarter while sockets are busy) need {what}: "
            f"{hint}{cap}, or raise the hard limit (ulimit -Hn)")
    d = held(chosen)
    return Capacity(chosen, fds_per_peer(d, transport, monitors), sockets_per_peer(d, monitors), limit,
                    peers_per_process)
