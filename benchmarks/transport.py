"""Transport throughput and swarm join time, against bare pyzmq in the same run.

    python benchmarks/transport.py [--size-mb 16] [--messages 20] [--repeats 5] [--nodes 64]
                                   [--quick] [--torch-threads N]

Prints one JSON row per measurement. Targets checked:
- ``tcp_plaintext``: a stream of ``--messages`` tensors of ``--size-mb`` MiB from node B to
  node A over tcp loopback reaches >= 50% of the throughput of a bare pyzmq DEALER->ROUTER
  pair sending the same frames (multipart, ``copy=False``);
- ``tcp_curve``: the same with CurveZMQ on both sides (Starling's default on tcp), >= 70%;
- ``join64``: ``--nodes`` nodes in one process over inproc, all joining through the first,
  until every node sees every other one alive: <= 10 s.

And, with no target: ``small_requests``, microseconds per small request and its reply between
two nodes (5,000 of them, 256 in flight at a time; 500 with ``--quick``); ``idle_waits``, the
share of a core that 8,000 idle waits in awake time (`node.loop.AwakeDeadline`, what a round's
parts wait for their owners with) cost a loop for 3 s (800 and 1 s with ``--quick``), against
the same waits each ticking through an `asyncio.wait` of its own, in the same run;
``socket_churn``, microseconds (wall and CPU) per send past a node's DEALER cap, each opening a
socket and closing another, against the same with every DEALER watched by a monitor.

A stream is timed from the first send until the receiver has every message (Starling:
A's handler sets an event; bare pyzmq: a receiver thread does). Starling and baseline runs
alternate, so both see the same machine load; each side reports the median of
``--repeats`` streams. MBps is 10**6 payload bytes per second (headers not counted).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import zmq
import zmq.asyncio

from starling.node import Message, Node, PeerStatus
from starling.node.loop import AwakeDeadline
from starling.node.security import SecurityMode
from starling.node.transport import Transport, TransportConfig

TOPIC = "bench"
PLAINTEXT_TARGET = 0.5
CURVE_TARGET = 0.7
JOIN_TARGET_S = 10.0
STREAM_TIMEOUT_S = 120.0
JOIN_POLL_INTERVAL_S = 0.05
FULL = {"size_mb": 16.0, "messages": 20, "repeats": 5, "nodes": 64}
QUICK = {"size_mb": 1.0, "messages": 5, "repeats": 2, "nodes": 8}


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


@dataclass(frozen=True)
class Stream:
    """One measured stream: `messages` payloads of `payload_bytes` each."""

    messages: int
    payload_bytes: int

    def mbps(self, seconds: float) -> float:
        return self.messages * self.payload_bytes / seconds / 1e6


# ------------------------------------------------------------------ Starling side
class CountingSink:
    """A handler that sets `done` once it has seen `expected` messages."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self._expected = 0
        self._count = 0
        self.payload_bytes = 0

    def reset(self, expected: int) -> None:
        self._expected, self._count, self.payload_bytes = expected, 0, 0
        self.done.clear()

    def __call__(self, msg: Message) -> None:
        self._count += 1
        self.payload_bytes += sum(p.nbytes for p in msg.payload)
        if self._count >= self._expected:
            self.done.set()


class StarlingPair:
    """Node A (receiver) and node B (sender, joined through A) over tcp loopback."""

    def __init__(self, security: str) -> None:
        self.receiver = Node().start(listen="tcp://127.0.0.1:0", security=security)
        self.sender = Node().start(listen="tcp://127.0.0.1:0", join=[self.receiver.address],
                                   security=security)
        self.sink = CountingSink()
        self.receiver.on(TOPIC, self.sink)

    def run(self, tensor: torch.Tensor, messages: int) -> float:
        """Seconds from the first send until A's handler has all `messages`."""
        self.sink.reset(messages)
        start = time.perf_counter()
        futures = [self.sender.send(self.receiver.peer_id, TOPIC, None, payload=[tensor])
                   for _ in range(messages)]
        if not self.sink.done.wait(STREAM_TIMEOUT_S):
            raise RuntimeError(f"starling stream incomplete after {STREAM_TIMEOUT_S} s")
        elapsed = time.perf_counter() - start
        for fut in futures:
            fut.result(STREAM_TIMEOUT_S)
        expected = messages * tensor.numel() * tensor.element_size()
        if self.sink.payload_bytes != expected:
            raise RuntimeError(f"starling received {self.sink.payload_bytes} payload bytes, expected {expected}")
        return elapsed

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


# ------------------------------------------------------------------ bare pyzmq side
class BarePair:
    """A bare DEALER->ROUTER pair on tcp loopback; a thread drains the ROUTER."""

    def __init__(self, curve: bool) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.dealer = self.context.socket(zmq.DEALER)
        for sock in (self.router, self.dealer):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.RCVHWM, 1000)
        if curve:
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            self.router.curve_server = True
            self.router.curve_publickey = server_public
            self.router.curve_secretkey = server_secret
            self.dealer.curve_serverkey = server_public
            self.dealer.curve_publickey = client_public
            self.dealer.curve_secretkey = client_secret
        self.router.bind("tcp://127.0.0.1:*")
        self.dealer.connect(self.router.get(zmq.LAST_ENDPOINT).decode())
        self._expected = 0
        self._received_bytes = 0
        self._go = threading.Semaphore(0)
        self._done = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._drain, name="bare-router", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            self._go.acquire()
            if self._stop:
                return
            received = 0
            for _ in range(self._expected):
                frames = self.router.recv_multipart(copy=False)
                received += sum(len(f.buffer) for f in frames[2:])  # [route, header, payload]
            self._received_bytes = received
            self._done.set()

    def run(self, tensor: torch.Tensor, messages: int) -> float:
        """Seconds from the first send until the ROUTER thread has all `messages`."""
        payload = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        self._expected = messages
        self._done.clear()
        self._go.release()
        start = time.perf_counter()
        for _ in range(messages):
            self.dealer.send_multipart([TOPIC.encode(), payload], copy=False)
        if not self._done.wait(STREAM_TIMEOUT_S):
            raise RuntimeError(f"bare pyzmq stream incomplete after {STREAM_TIMEOUT_S} s")
        elapsed = time.perf_counter() - start
        expected = messages * payload.nbytes
        if self._received_bytes != expected:
            raise RuntimeError(f"pyzmq received {self._received_bytes} payload bytes, expected {expected}")
        return elapsed

    def close(self) -> None:
        self._stop = True
        self._go.release()
        self._thread.join(5)
        self.dealer.close(0)
        self.router.close(0)
        self.context.term()


# ------------------------------------------------------------------ measurements
def alternate(a: Callable[[], float], b: Callable[[], float], repeats: int) -> Iterator[tuple[float, float]]:
    """Run `a` and `b` in turns, so both see the same machine load."""
    for _ in range(repeats):
        yield a(), b()


def throughput(bench: str, curve: bool, stream: Stream, repeats: int, target: float) -> dict[str, Any]:
    tensor = torch.randn(stream.payload_bytes // 4)
    starling = StarlingPair(security="curve" if curve else "plaintext")
    bare = BarePair(curve=curve)
    try:
        # Warm up: connections, CURVE handshakes, allocator.
        starling.run(tensor, 2)
        bare.run(tensor, 2)
        pairs = list(alternate(lambda: starling.run(tensor, stream.messages),
                               lambda: bare.run(tensor, stream.messages), repeats))
    finally:
        starling.close()
        bare.close()
    starling_mbps = stream.mbps(statistics.median(s for s, _ in pairs))
    baseline_mbps = stream.mbps(statistics.median(b for _, b in pairs))
    ratio = starling_mbps / baseline_mbps
    return {
        "bench": bench, "size_mb": stream.payload_bytes / 2**20, "messages": stream.messages,
        "repeats": repeats, "torch_threads": torch.get_num_threads(), "starling_MBps": round(starling_mbps, 1),
        "baseline_MBps": round(baseline_mbps, 1),
        "ratio": round(ratio, 3), "target": target, "met": ratio >= target,
    }


def small_requests(count: int, repeats: int, in_flight: int = 256) -> dict[str, Any]:
    """Microseconds per small request and its reply between two nodes (CurveZMQ over tcp
    loopback), `count` of them at most `in_flight` at a time, the median of `repeats` runs: what
    a message costs a node where the bytes are few (membership's probes, pulls and gossip)."""
    pair = StarlingPair(security="curve")
    pair.receiver.on("echo", lambda msg: {"n": msg.body["n"]})
    peer = pair.receiver.peer_id

    async def burst() -> None:
        for start in range(0, count, in_flight):
            replies = await asyncio.gather(*(pair.sender.arequest(peer, "echo", {"n": n}, timeout_s=60)
                                             for n in range(start, min(start + in_flight, count))))
            if [r.body["n"] for r in replies] != list(range(start, min(start + in_flight, count))):
                raise RuntimeError("a reply did not answer its request")

    try:
        pair.sender.run(burst())  # warm up: the connection, the handshake
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pair.sender.run(burst())
            times.append(time.perf_counter() - t0)
    finally:
        pair.close()
    return {"bench": "small_requests", "requests": count, "in_flight": in_flight, "repeats": repeats,
            "us_per_request": round(statistics.median(times) / count * 1e6, 1)}


async def _tick_by_tick(deadline: AwakeDeadline, fut: asyncio.Future[Any]) -> Any:
    """The baseline of `idle_waits`: an awake-time wait that ticks through an `asyncio.wait` of
    its own each tick (a future, its callbacks and a timer, every tick), as the loop's waits
    did before they shared one timer callback a tick."""
    loop = asyncio.get_running_loop()
    while not fut.done():
        if deadline.expired():
            raise asyncio.TimeoutError
        step = min(deadline.tick_s, deadline.left, deadline.wall_left())
        t0 = loop.time()
        await asyncio.wait({fut}, timeout=step)
        deadline.left -= min(loop.time() - t0, step + deadline.tick_s)
    return fut.result()


def idle_waits(count: int, seconds: float) -> dict[str, Any]:
    """The share of a core that `count` idle awake-time waits cost this process's loop over
    `seconds`: `AwakeDeadline.wait`, then the same waits ticking one `asyncio.wait` each
    (`_tick_by_tick`), in the same run. Each wait is then given its result, and must return it."""
    async def share(wait: Callable[[AwakeDeadline, asyncio.Future[Any]], Any]) -> float:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(count)]
        tasks = [asyncio.ensure_future(wait(AwakeDeadline(10 * seconds + 30), f)) for f in futs]
        await asyncio.sleep(0.2)  # every wait armed
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
        for n, fut in enumerate(futs):
            fut.set_result(n)
        if await asyncio.gather(*tasks) != list(range(count)):
            raise RuntimeError("a wait did not return its own result")
        return used

    now = asyncio.run(share(lambda deadline, fut: deadline.wait(fut)))
    before = asyncio.run(share(_tick_by_tick))
    return {"bench": "idle_waits", "waits": count, "seconds": seconds,
            "core_share": round(now, 3), "core_share_before": round(before, 3),
            "ratio": round(now / before, 3) if before > 0 else None}


class _WatchEveryDealer(Transport):
    """The baseline of `socket_churn`: a socket monitor on every DEALER a node opens, as
    before only the DEALERs it keeps open past its cap were watched."""

    def watches(self, key: str) -> bool:
        return True


def socket_churn(sends: int, peers: int = 64, cap: int = 8) -> dict[str, Any]:
    """Microseconds per send past a node's DEALER cap, wall and CPU (this process's, libzmq's
    I/O threads included), where each send opens a socket and closes an idle one: a transport
    capped at `cap` that knows `peers` real ROUTERs over tcp (half its cap pinned, as a
    failure detector's fingers are) sends `sends` small messages to the others in turn;
    against the same with every DEALER watched by a monitor (`_WatchEveryDealer`),
    alternating, in the same run. Also the monitors each held at the end."""
    context = zmq.asyncio.Context()
    routers = [context.socket(zmq.ROUTER) for _ in range(peers)]
    ports = []
    for router in routers:
        router.setsockopt(zmq.LINGER, 0)
        ports.append(router.bind_to_random_port("tcp://127.0.0.1"))
    pinned = frozenset(f"p{i}" for i in range(cap // 2))
    others = [f"p{i}" for i in range(cap // 2, peers)]

    async def run(kind: type[Transport]) -> tuple[float, float, int]:
        async def receiver(inbound: Any) -> None:
            pass

        transport = kind(context, mode=SecurityMode.PLAINTEXT, curve_public_z85=b"", curve_secret_z85=b"",
                         zap_domain="bench", config=TransportConfig(max_open_dealers=cap, linger_ms=0),
                         receiver=receiver)
        try:
            for i, port in enumerate(ports):
                transport.connect(f"p{i}", [f"tcp://127.0.0.1:{port}"], None)
            transport.pin(pinned)
            for key in pinned:  # the fingers' DEALERs open first and stay
                await transport.send(key, [b"x"], timeout_s=5.0)
            t0, cpu0 = time.perf_counter(), time.process_time()
            for n in range(sends):
                await transport.send(others[n % len(others)], [b"x"], timeout_s=5.0)
            return ((time.perf_counter() - t0) / sends, (time.process_time() - cpu0) / sends,
                    len(transport._monitors))
        finally:
            await transport.close(0)

    now, before, cpu, cpu_before, watched, watched_before = [], [], [], [], 0, 0
    try:
        for _ in range(3):
            t, c, watched = asyncio.run(run(Transport))
            now.append(t)
            cpu.append(c)
            t, c, watched_before = asyncio.run(run(_WatchEveryDealer))
            before.append(t)
            cpu_before.append(c)
    finally:
        for router in routers:
            router.close(0)
        context.term()
    us, us_before = statistics.median(now) * 1e6, statistics.median(before) * 1e6
    cpu_us, cpu_us_before = statistics.median(cpu) * 1e6, statistics.median(cpu_before) * 1e6
    return {"bench": "socket_churn", "sends": sends, "peers": peers, "cap": cap,
            "us_per_send": round(us, 1), "us_per_send_before": round(us_before, 1),
            "cpu_us_per_send": round(cpu_us, 1), "cpu_us_per_send_before": round(cpu_us_before, 1),
            "cpu_ratio": round(cpu_us / cpu_us_before, 2),
            "monitors_open": watched, "monitors_open_before": watched_before}


def alive_counts(nodes: list[Node]) -> list[int]:
    return [sum(p.status is PeerStatus.ALIVE for p in n.peers) for n in nodes]


def join_swarm(count: int, target_s: float) -> dict[str, Any]:
    """Seconds from the first node's start until all `count` nodes see `count - 1` alive peers.

    Gives up (met: false) once 3x the target has passed, even mid-way through the joins.
    """
    tag = f"{time.monotonic_ns():x}"
    nodes = [Node() for _ in range(count)]  # keypairs are made before the clock starts
    started: list[Node] = []
    counts = [0]
    try:
        start = time.perf_counter()
        deadline = start + 3 * target_s
        first = nodes[0].start(listen=f"inproc://bench-join-{tag}-0")
        started.append(first)
        for index, node in enumerate(nodes[1:], start=1):
            if time.perf_counter() > deadline:
                break
            started.append(node.start(listen=f"inproc://bench-join-{tag}-{index}", join=[first.address]))
        all_started_s = time.perf_counter() - start
        while True:
            counts = alive_counts(started)
            now = time.perf_counter()
            if (len(started) == count and min(counts) == count - 1) or now > deadline:
                break
            time.sleep(JOIN_POLL_INTERVAL_S)
        converged = len(started) == count and min(counts) == count - 1
        seconds = now - start
    finally:
        for node in started:
            node.close()
    return {
        "bench": f"join{count}", "nodes": count, "seconds": round(seconds, 3),
        "nodes_started": len(started), "all_started_s": round(all_started_s, 3), "converged": converged,
        "min_alive_seen": min(counts), "target_s": target_s, "met": converged and seconds <= target_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=None, help="tensor size in MiB (16)")
    parser.add_argument("--messages", type=int, default=None, help="messages per timed stream (20)")
    parser.add_argument("--repeats", type=int, default=None, help="streams per side; the median is reported (5)")
    parser.add_argument("--nodes", type=int, default=None, help="nodes in the join benchmark (64)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 MiB, 5 messages, 2 repeats, 8 nodes unless given")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for this process (default: torch's own choice)")
    args = parser.parse_args()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.size_mb <= 0 or args.messages < 1 or args.repeats < 1 or args.nodes < 2:
        parser.error("need --size-mb > 0, --messages >= 1, --repeats >= 1, --nodes >= 2")
    stream = Stream(args.messages, int(args.size_mb * 2**20) // 4 * 4)

    emit(throughput("tcp_plaintext", False, stream, args.repeats, PLAINTEXT_TARGET))
    emit(throughput("tcp_curve", True, stream, args.repeats, CURVE_TARGET))
    emit(join_swarm(args.nodes, JOIN_TARGET_S))
    emit(small_requests(500 if args.quick else 5000, args.repeats))
    emit(idle_waits(800, 1.0) if args.quick else idle_waits(8000, 3.0))
    emit(socket_churn(200 if args.quick else 2000))


if __name__ == "__main__":
    main()
