"""What one open connection between two simulated nodes costs in memory, by transport.

    python benchmarks/socket_memory.py [--connections 1000]

A simulated node holds a DEALER to each peer it talks to, up to its socket cap, and every
other node's DEALER to it lands on its ROUTER: in a simulation both ends of each connection
are in this machine's processes. This opens `--connections` DEALER->ROUTER connections in one
process as the nodes do (each DEALER to a ROUTER of its own, a message sent and read on each,
a socket monitor on the DEALERs of the wired transports, as the simulator's nodes keep), and
prints one JSON row per transport: kb_per_connection, the growth of this process's resident
memory per connection, both ends and the monitor included; and over_inproc, that figure over
the same run's inproc one. A wired connection's cost is mostly libzmq's: each end's stream
engine holds a receive buffer and a send batch (8 KiB each, with their message bookkeeping),
which inproc has no use for and which pyzmq's build of libzmq cannot shrink (its
ZMQ_IN_BATCH_SIZE and ZMQ_OUT_BATCH_SIZE are draft options). So the socket cap sets most of
what a simulated peer costs over tcp or ipc beyond its peer table: see
`benchmarks/scale.py --max-dealers`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procmem import rss_mb

TRANSPORTS = ("inproc", "ipc", "tcp")


def measure(transport: str, connections: int, ipc_dir: str) -> dict[str, Any]:
    import zmq

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 8 * connections + 64)
    routers: list[Any] = []
    dealers: list[Any] = []
    monitors: list[Any] = []
    try:
        before = rss_mb()
        for i in range(connections):
            router = ctx.socket(zmq.ROUTER)
            routers.append(router)
            if transport == "tcp":
                endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
            else:
                endpoint = f"inproc://socket-memory-{i}" if transport == "inproc" else f"ipc://{ipc_dir}/{i}"
                router.bind(endpoint)
            dealer = ctx.socket(zmq.DEALER)
            dealers.append(dealer)
            if transport != "inproc":
                monitors.append(dealer.get_monitor_socket())
            dealer.connect(endpoint)
        for dealer in dealers:
            dealer.send(b"x" * 100)
        deadline = time.monotonic() + 60
        for router in routers:  # every connection carried a message: both ends' engines are up
            if not router.poll(max(0, int(1000 * (deadline - time.monotonic())))):
                raise RuntimeError(f"{transport}: a connection carried nothing within 60 s")
            router.recv_multipart()
        after = rss_mb()
    finally:
        for sock in (*monitors, *dealers, *routers):
            sock.close(linger=0)
        ctx.term()
    return {"transport": transport, "connections": connections,
            "kb_per_connection": round((after - before) * 1024 / connections, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--one", choices=TRANSPORTS, help=argparse.SUPPRESS)  # a child's single measurement
    args = parser.parse_args(argv)
    if args.connections < 1:
        parser.error("--connections must be at least 1")
    if args.one:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        with tempfile.TemporaryDirectory(prefix="starling-socket-memory-") as ipc_dir:
            print(json.dumps(measure(args.one, args.connections, ipc_dir)), flush=True)
        return 0
    rows = []
    for transport in TRANSPORTS:  # each in a fresh process: no heap freed by another to reuse
        out = subprocess.run([sys.executable, __file__, "--one", transport, "--connections", str(args.connections)],
                             capture_output=True, text=True, check=True, timeout=600).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]["kb_per_connection"]
    for row in rows:
        row["over_inproc"] = round(row["kb_per_connection"] / base, 2) if base > 0 else None
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
