"""Relayed against direct transfers between peers behind real NAT routers (network namespaces).

    python benchmarks/nat.py [--rate-mbit 100] [--mib 16] [--repeats 3]

Needs root, `ip netns`, veth, a bridge and `iptables` (MASQUERADE). The lab (`NatLab`, also
used by tests/node/test_netns_nat.py) is:

    public namespace: a bridge, 10.77.0.1 and 10.77.0.2 (the two public peers)
    router 1: 10.77.0.11 on the bridge, 192.168.1.1 inside; MASQUERADE out   home 1: 192.168.1.2
    router 2: 10.77.0.12 on the bridge, 192.168.2.1 inside; MASQUERADE out   home 2: 192.168.2.2

Nothing in the public namespace routes to the homes' addresses, and the routers forward no
port inward: a home peer can dial out, nobody can dial in. With `--rate-mbit`, each router's
two links to the bridge are shaped with `tc tbf` (a home's upload and download).

Four real processes: P1 (public, the relay), P2 (public, no relay: it serves a blob), H1
(home 1, fetches), H2 (home 2, serves the same blob). H1 fetches the blob (1 MiB chunks,
4 in flight, each verified) from P2 (direct: down the connection H1 opened) and from H2
(relayed through P1, sealed end to end). Prints one JSON row per repeat and a summary with:

- ``relayed_over_direct``: median relayed throughput over median direct (target >= 0.45);
- ``framing_overhead``: the bytes H2 handed the relay (`$relay`, headers, nonce and tag
  included) over the bytes of the same messages sent directly (target <= 2%).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

PUBLIC = "10.77.0"
BLOB = "bench16"
ECHO = "echo"
RELAY_TARGET, FRAMING_TARGET = 0.45, 0.02


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def lab_unavailable() -> str | None:
    """Why the lab cannot be built here (None if it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 iptables)"
    name = f"snprobe{os.getpid() % 100000}"
    try:
        _sh("ip", "netns", "add", name)
        _sh("ip", "netns", "exec", name, "iptables", "-t", "nat", "-L")
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"cannot make a network namespace with NAT here: {detail}"
    finally:
        _sh("ip", "netns", "del", name, check=False)
    return None


@dataclass
class NatLab:
    """The namespaces and links above, made on `up()` and removed on `down()`."""

    rate_mbit: float | None = None
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:4])
    made: list[str] = field(default_factory=list)

    def ns(self, role: str) -> str:
        return f"sn{self.tag}{role}"

    @property
    def public_hosts(self) -> tuple[str, str]:
        return f"{PUBLIC}.1", f"{PUBLIC}.2"

    @staticmethod
    def home_host(i: int) -> str:
        return f"192.168.{i}.2"

    def up(self) -> NatLab:
        pub = self.ns("pub")
        self._netns(pub)
        self._in(pub, "ip", "link", "add", "br0", "type", "bridge")
        self._in(pub, "ip", "addr", "add", f"{PUBLIC}.1/24", "dev", "br0")
        self._in(pub, "ip", "addr", "add", f"{PUBLIC}.2/24", "dev", "br0")
        for dev in ("lo", "br0"):
            self._in(pub, "ip", "link", "set", dev, "up")
        for i in (1, 2):
            router, home = self.ns(f"r{i}"), self.ns(f"h{i}")
            self._netns(router)
            self._netns(home)
            up_dev, br_dev, in_dev, home_dev = (f"sn{self.tag}u{i}", f"sn{self.tag}b{i}", f"sn{self.tag}i{i}",
                                                f"sn{self.tag}h{i}")
            _sh("ip", "link", "add", up_dev, "netns", router, "type", "veth", "peer", "name", br_dev, "netns", pub)
            _sh("ip", "link", "add", in_dev, "netns", router, "type", "veth", "peer", "name", home_dev, "netns", home)
            self._in(pub, "ip", "link", "set", br_dev, "master", "br0")
            self._in(pub, "ip", "link", "set", br_dev, "up")
            self._in(router, "ip", "addr", "add", f"{PUBLIC}.1{i}/24", "dev", up_dev)
            self._in(router, "ip", "addr", "add", f"192.168.{i}.1/24", "dev", in_dev)
            self._in(home, "ip", "addr", "add", f"{self.home_host(i)}/24", "dev", home_dev)
            for ns, devs in ((router, ("lo", up_dev, in_dev)), (home, ("lo", home_dev))):
                for dev in devs:
                    self._in(ns, "ip", "link", "set", dev, "up")
            self._in(home, "ip", "route", "add", "default", "via", f"192.168.{i}.1")
            self._in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._in(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", up_dev, "-j", "MASQUERADE")
            # a home router lets replies in, never a new connection
            self._in(router, "iptables", "-A", "FORWARD", "-i", up_dev, "-m", "state", "--state",
                     "ESTABLISHED,RELATED", "-j", "ACCEPT")
            self._in(router, "iptables", "-A", "FORWARD", "-i", up_dev, "-j", "DROP")
            if self.rate_mbit:
                for ns, dev in ((router, up_dev), (pub, br_dev)):
                    self._in(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                             "burst", "256kb", "latency", "100ms")
        return self

    def _netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self.made.append(name)

    def _in(self, ns: str, *args: str) -> None:
        _sh("ip", "netns", "exec", ns, *args)

    def exec_prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(role)]

    def can_connect(self, role: str, host: str, port: int, timeout_s: float = 2.0) -> bool:
        """Whether a TCP connect from namespace `role` to host:port succeeds."""
        code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                f"{timeout_s}).close()\nexcept OSError:\n sys.exit(1)")
        done = subprocess.run([*self.exec_prefix(role), sys.executable, "-c", code, host, str(port)],
                              capture_output=True, timeout=timeout_s + 30)
        return done.returncode == 0

    def down(self) -> None:
        for name in reversed(self.made):
            _sh("ip", "netns", "del", name, check=False)
        self.made.clear()

    def __enter__(self) -> NatLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


class Worker:
    """One `benchmarks/nat.py --worker` process in a namespace, read line by line."""

    def __init__(self, lab: NatLab, role: str, *args: str) -> None:
        here = os.path.abspath(__file__)
        self.proc = subprocess.Popen([*lab.exec_prefix(role), sys.executable, here, "--worker", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None if os.environ.get("NAT_BENCH_DEBUG") else subprocess.DEVNULL)
        self._pending = b""  # read from the pipe, not yet a whole line

    def line(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """The worker's next JSON line. Read from the descriptor, not a buffered file: lines that
        arrive together would sit in the file's buffer while select() waits on the empty pipe."""
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no line from worker within {timeout_s} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"worker exited ({self.proc.wait()})")
            self._pending += chunk
        text, self._pending = self._pending.split(b"\n", 1)
        return json.loads(text)

    def stop(self) -> dict[str, Any] | None:
        """Close its stdin: it prints its node's stats and leaves. Returns the stats."""
        stats = None
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            while stats is None:
                stats = self.line(timeout_s=10).get("stats")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        return stats


def _worker(argv: list[str]) -> None:
    """A node that serves a blob or fetches it; JSON lines on stdout; stops when stdin closes."""
    p = argparse.ArgumentParser()
    p.add_argument("--listen")
    p.add_argument("--join", action="append", default=[])
    p.add_argument("--no-relay", action="store_true")
    p.add_argument("--serve-mib", type=int, default=0)
    p.add_argument("--fetch", action="append", default=[])  # peer ids to fetch from, in turn
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--key", help="identity file (a throwaway identity without)")
    p.add_argument("--ask", action="append", default=[])  # peer ids to send an echo request, before fetching
    a = p.parse_args(argv)
    from starling.node.node import Node, NodeConfig

    node = Node(config=NodeConfig(offer_relay=not a.no_relay, join_deadline_s=60.0)).start(a.listen, a.join, key=a.key)
    node.on(ECHO, lambda msg: {"echo": msg.body, "from": node.peer_id})
    if a.serve_mib:
        blob = os.urandom(a.serve_mib << 20)
        node.serve_blob(BLOB, lambda: blob)
    print(json.dumps({"id": node.peer_id, "address": node.address, "reachable": node.reachable}), flush=True)
    deadline = time.monotonic() + 60
    while len(node.live_peers()) < a.peers - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    for peer in a.ask:
        nonce = os.urandom(8).hex()
        # asked again after a loss, as an application would: a client that has only just joined
        # may not have reached its relay yet, and a relay drops what it cannot deliver at once
        for attempt in range(3):
            try:
                reply = node.request(peer, ECHO, nonce, timeout_s=10).body
                break
            except Exception:
                if attempt == 2:
                    raise
        print(json.dumps({"asked": peer, "answered": reply["from"], "echoed": reply["echo"] == nonce}), flush=True)
    for peer in a.fetch:
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            _, data = node.fetch_blob(BLOB, peers=[peer])
            print(json.dumps({"from": peer, "bytes": len(data), "s": time.perf_counter() - t0}), flush=True)
    print(json.dumps({"event": "done"}), flush=True)
    sys.stdin.read()
    print(json.dumps({"stats": node.stats.snapshot()}), flush=True)
    node.leave()


def run(rate_mbit: float | None, mib: int, repeats: int) -> dict[str, Any]:
    # a terminated run still removes its namespaces (the `finally` below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lab = NatLab(rate_mbit=rate_mbit).up()
    workers: list[Worker] = []
    try:
        h1, h2 = lab.home_host(1), lab.home_host(2)
        p1 = Worker(lab, "pub", "--listen", f"tcp://{lab.public_hosts[0]}:0")
        workers.append(p1)
        seed = p1.line()
        p2 = Worker(lab, "pub", "--listen", f"tcp://{lab.public_hosts[1]}:0", "--join", seed["address"],
                    "--no-relay", "--serve-mib", str(mib))
        workers.append(p2)
        served_direct = p2.line()
        s2 = Worker(lab, "h2", "--listen", f"tcp://{h2}:0", "--join", seed["address"], "--serve-mib", str(mib))
        workers.append(s2)
        served_relayed = s2.line()
        fetcher = Worker(lab, "h1", "--listen", f"tcp://{h1}:0", "--join", seed["address"], "--repeats",
                         str(repeats), "--fetch", served_direct["id"], "--fetch", served_relayed["id"])
        workers.append(fetcher)
        me = fetcher.line()
        rows = []
        while True:
            row = fetcher.line(timeout_s=600)
            if row.get("event") == "done":
                break
            row["path"] = "direct" if row["from"] == served_direct["id"] else "relayed"
            row["mbit_s"] = row["bytes"] * 8 / row["s"] / 1e6
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        # H2 reaches H1 only through the relay: what it handed the relay, against what it sent H1
        sent = (s2.stop() or {}).get("bytes_sent", {})
        relay_wire = sum(n for per in sent.values() for t, n in per.items() if t == "$relay")
        carried = sum(sent.get(me["id"], {}).values())
        direct = statistics.median(r["mbit_s"] for r in rows if r["path"] == "direct")
        relayed = statistics.median(r["mbit_s"] for r in rows if r["path"] == "relayed")
        return {"rate_mbit": rate_mbit, "mib": mib, "reachable": {"P1": seed["reachable"], "P2":
                served_direct["reachable"], "H1": me["reachable"], "H2": served_relayed["reachable"]},
                "direct_mbit_s": round(direct, 1), "relayed_mbit_s": round(relayed, 1),
                "relayed_over_direct": round(relayed / direct, 3), "relayed_bytes": carried,
                "relay_wire_bytes": relay_wire, "framing_overhead": round(relay_wire / carried - 1, 5)}
    finally:
        for w in workers:
            w.stop()
        lab.down()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=100.0, help="tbf rate on each home's links (0: unshaped)")
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    why = lab_unavailable()
    if why:
        print(json.dumps({"skipped": why}))
        sys.exit(1)
    summary = run(a.rate_mbit or None, a.mib, a.repeats)
    summary["relay_target_met"] = summary["relayed_over_direct"] >= RELAY_TARGET
    summary["framing_target_met"] = summary["framing_overhead"] <= FRAMING_TARGET
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
