"""A relay against a hostile member: what a client that never reads makes the relay hold, and
what a flood toward dead destinations leaves of honest client-to-client delivery.

    python benchmarks/relay_hostile.py [--messages 400] [--size-kib 256] [--requests 100]

The relay R runs in a process of its own, so that its RSS is its alone; the clients and the
flooder run in this one. All on tcp loopback with CurveZMQ. Two rows of JSON:

- `never_reads`: client C sends client D `--messages` one-way messages of `--size-kib` each
  through R. D's node has stopped reading its connection to R, and its ZeroMQ receive queue
  holds one message, so ZeroMQ reads no more from the socket and TCP pushes back on R. The
  row gives R's RSS growth (after the sends, less before), the bytes R handed to ZeroMQ for D
  (`$relayed`), R's own count of what it holds for D, and R's refusals. Target: R grows by at
  most `RelayConfig.max_queued_bytes` plus 16 MiB (whatever else its allocator keeps).
- `flood`: a member sends R `$relay` messages of 1 KiB, about 1,000 a second, toward a member
  whose record names a closed port, toward a client that is gone, and toward client C2, while
  client C1 sends C2 `--requests` requests through R one after another, 20 ms apart (2 s
  timeout each). The row gives the share answered, and R's refusals by cause. Target: at
  least 0.95.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import time
from typing import Any

from procmem import rss_mb  # a sibling script module (benchmarks/ is not a package)

from starling.node.relay import RelayConfig

RSS_SLACK_MB = 16.0
DELIVERY_TARGET = 0.95


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def _config() -> Any:
    from starling.node import NodeConfig
    from starling.node.swim import Liveness

    return NodeConfig(liveness=Liveness(probe_interval_s=0.2, suspicion_base_s=3.0),
                      reach_timeout_s=0.5)


def relay_process(conn: Any) -> None:
    """R: start, say its address, then answer "report" with its RSS, status and bytes sent."""
    from starling.node import Node

    node = Node(config=_config()).start("tcp://127.0.0.1:0")
    conn.send((node.address, node.peer_id))
    while True:
        command = conn.recv()
        if command == "stop":
            break
        status = node.status()
        stats = status["stats"]
        conn.send({"rss_mb": rss_mb(), "relaying": status.get("relaying", {}), "rejected": stats["rejected"],
                   "bytes_sent": stats["bytes_sent"], "bytes_received": stats["bytes_received"]})
    node.close()


class Relay:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=relay_process, args=(child,), daemon=True)
        self.process.start()
        self.address, self.peer_id = self.conn.recv()

    def report(self) -> dict[str, Any]:
        self.conn.send("report")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.process.join(10)


def _wait(cond: Any, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _node(listen: str | None, join: str, config: Any = None, **start: Any) -> Any:
    from starling.node import Node

    return Node(config=config or _config()).start(listen, [join], **start)


def _attached(client: Any, relay_id: str) -> None:
    if not _wait(lambda: relay_id in client.status()["meta"].get("$via", "")):
        raise RuntimeError(f"{client.peer_id} never named the relay in $via")


def never_reads(messages: int, size: int) -> dict[str, Any]:
    from dataclasses import replace

    from starling.node.transport import TransportConfig

    r = Relay()
    c = _node(None, r.address)
    # D's ZeroMQ reads ahead of the node at most one message: past that TCP pushes back on R
    d = _node(None, r.address, replace(_config(), transport=TransportConfig(recv_hwm=1)))
    try:
        _attached(d, r.peer_id)
        _wait(lambda: d.peer_id in c.live_peers())
        transport = d._transport

        async def stop_reading() -> None:
            transport._tasks.pop(r.peer_id).cancel()

        d.run(stop_reading())
        before = r.report()
        chunk = os.urandom(size)
        for i in range(messages):
            c.send(d.peer_id, "note", i, payload=[chunk]).result(30)

        def read_all() -> bool:  # R has read every message C sent it, refused or forwarded
            return r.report()["bytes_received"].get(c.peer_id, {}).get("$relay", 0) >= messages * size

        _wait(read_all, timeout_s=60)
        time.sleep(1.0)  # ZeroMQ's I/O threads settle
        after = r.report()
        handed = after["bytes_sent"].get(d.peer_id, {}).get("$relayed", 0)
        growth = after["rss_mb"] - before["rss_mb"]
        bound_mb = RelayConfig().max_queued_bytes / 2**20
        return {"row": "never_reads", "messages": messages, "message_kib": size // 1024,
                "sent_mib": round(messages * size / 2**20, 1), "relay_rss_growth_mb": round(growth, 1),
                "relay_handed_mib": round(handed / 2**20, 2), "relaying": after["relaying"],
                "rejected": after["rejected"], "target_mb": bound_mb + RSS_SLACK_MB,
                "met": growth <= bound_mb + RSS_SLACK_MB}
    finally:
        c.close()
        d.close()
        r.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flood(requests: int) -> dict[str, Any]:
    from dataclasses import replace

    r = Relay()
    relay_id = r.peer_id
    no_relay = replace(_config(), offer_relay=False)
    # a member whose record names a port nobody listens on: R cannot dial it
    x = _node("tcp://127.0.0.1:0", r.address, no_relay, advertise=f"tcp://127.0.0.1:{_closed_port()}")
    a = _node("tcp://127.0.0.1:0", r.address, no_relay)  # the flooder
    c1, c2, gone = (_node(None, r.address) for _ in range(3))
    c2.on("echo", lambda msg: msg.body)
    nodes = [x, a, c1, c2, gone]
    try:
        for c in (c1, c2, gone):
            _attached(c, relay_id)
        _wait(lambda: {c2.peer_id, x.peer_id} <= set(a.live_peers()) and c2.peer_id in c1.live_peers())
        gone.close()
        junk = os.urandom(1024)
        stop = asyncio.Event()

        async def run_flood() -> int:
            sent = 0
            while not stop.is_set():
                for dest in (x.peer_id, gone.peer_id, c2.peer_id):
                    try:
                        await a._asend_raw(relay_id, "$relay", [dest, os.urandom(12)], [junk], wait=False)
                        sent += 1
                    except Exception:
                        pass
                await asyncio.sleep(0.003)
            return sent

        flooding = a.submit(run_flood())
        time.sleep(1.0)  # long enough for the dead destinations to hold all 64 forward slots, were sends to wait
        answered = 0
        t0 = time.monotonic()
        for i in range(requests):
            try:
                answered += c1.request(c2.peer_id, "echo", i, timeout_s=2.0).body == i
            except Exception:
                pass
            time.sleep(0.02)  # spread over the flood
        elapsed = time.monotonic() - t0

        async def halt() -> None:
            stop.set()

        a.run(halt())
        report = r.report()
        share = answered / requests
        return {"row": "flood", "requests": requests, "answered": answered, "share": round(share, 3),
                "seconds": round(elapsed, 2), "flood_messages": flooding.result(10),
                "relaying": report["relaying"], "rejected": report["rejected"], "target": DELIVERY_TARGET,
                "met": share >= DELIVERY_TARGET}
    finally:
        for node in nodes:
            node.close()
        r.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=400)
    p.add_argument("--size-kib", type=int, default=256)
    p.add_argument("--requests", type=int, default=100)
    args = p.parse_args()
    emit(never_reads(args.messages, args.size_kib * 1024))
    emit(flood(args.requests))


if __name__ == "__main__":
    main()
