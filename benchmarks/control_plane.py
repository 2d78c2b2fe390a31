"""Control-plane hardening: what a stranger or a member can make a node do, measured against
real Nodes on tcp loopback with CurveZMQ on (as by default).

    python benchmarks/control_plane.py [--quick] [--rows NAME,NAME]

Attackers speak through DEALERs of their own, built here from the wire's frames: a stranger
with a fresh key, or a member speaking past its node (a node authenticates the key, not the
code). Prints one JSON row per target: its `figure`, `unit`, `target` and whether it is `met`,
with the details that explain the figure. A row whose measurement meets an API the code does
not have prints `figure: null` and `not_measurable: why` instead of stopping the run.

Rows:
- malformed_addresses: record addresses and records of every kind (`x`, an ipc path over
  107 bytes, inproc from the wire, ports 0 and 70000, 512-character hosts, and others),
  sent as a stranger (`$hello`, `$reach`) and as a member (`$announce`, a `$hello`
  re-announce). Figure: node stops (faulted, closed, or no answer to `$status`); target 0.
- dial_back: strangers ask a node (`$reach`) to dial back listeners on 127.0.0.2 and a unix
  socket while they ask from 127.0.0.1. Figure: connections the node opened to anything but
  the requester's IP; target 0. A listener on the requester's IP and the same port counts
  what is allowed, and a dial-back asked there is the control.
- amplification: every request a stranger can send (hellos with and without the table,
  `$status`, `$reach`, `$echo`, unknown topics, malformed bodies) to a seed whose table holds
  300 records a member announced, each with as many and as long addresses as a record may
  carry; then what a stranger can pay for with its own bytes (`$status` padded as the node
  asks, a hello padded with 64 KB). Figure: the largest reply bytes over request bytes;
  target at most 10. Beside it, whether `starling.node.client.query` reads that seed's status.
- member_pull_rate: a member pulls the same seed (4 `$sync` requests in flight, a `$want` of
  256 ids every 20 ms) for 5 s (2 s with --quick). Figure: bytes per second the seed sends
  that member after the first second (a budget's burst is spent by then), refusals
  included; target 1 MB/s.
- member_status_rate: the same member, 2 s later, keeps 4 `$status` requests in flight (a
  member's status carries the table, in pages out of the same budget). Figure and target as
  above.
- join_table and join_table_max_records: a real joiner (a node's defaults) joins through a
  seed whose table holds 1024 records (signed records of fresh identities announced by a
  member; no node behind them), with one ordinary address each, then as big as allowed (256
  of those with --quick). Figure: joined; target yes.
- sybil_lockout: one attacker holds 10,000 identities (1,000 with --quick, against a table
  of 256), each saying hello itself from 127.0.0.2 on a CURVE connection of its own, more
  than the table holds (processes of its own make and hold the connections, and say hello
  again when turned away busy). Then an honest node joins from 127.0.0.1. Figure: seconds
  until the joiner and the seed hold each other; target 10, with the seed's table at most
  its cap.
- relay_delivery_under_flood: two clients talk through a relay (its own process) while a
  member floods `$relay` toward a destination whose connection is gone (the member keeps it
  alive with the destination's own signed beats: it holds both keys). Figure: the share of
  the honest client's messages delivered; target at least 95%.
- relay_memory_never_reader: the same member sends 128 KiB `$relay` messages to a client that
  never reads (its receive queue holds one message). Figure: the relay process's RSS growth;
  target at most 64 MB.
- relay_replays_after_sessions: a destination's replay guard (the `Sealer` a node opens
  relayed messages with) takes messages from one source, then 100,000 fresh sessions from
  another (5,000 with --quick), then the first source's messages again. Figure: replays
  accepted; target 0.
- relay_replays_after_forgetting: a destination's replay guard opens messages from source A,
  sealed a minute before now; forgets A, as its table does `forget_after_s` after A left; opens
  one message each from 100,000 throwaway sources (5,000 with --quick), forgetting each in
  turn, so that A's mark is pushed out of any memory bounded by count; then A's messages
  again, under A's old incarnation (what an attacker who re-announces A's stale record gets).
  Figure: replays accepted; target 0. A source that seals now must still be opened.
- relay_delivery_under_capture: a member M whose id sorts before the real relay's (keys drawn
  until one does) offers to relay and drops every `$relay` it is handed; two fresh clients
  keep both relays, and M has the first place in each one's order of relays (which a node
  draws at random: here M is lucky). Figure: the share of one client's notes (20 a second, 10 s; 2 s with
  --quick) the other gets; target at least 95%.
- relay_delivery_under_steering: the same, while M also signs a suspect claim about the real
  relay every 0.1 s and sends it to both clients and the relay (which refutes each). Figure
  and target as above.
- forged_beats: a member gossips beats for a victim (a member and a client) that
  carry a huge counter and `$via` naming the attacker, signed by the attacker, unsigned,
  tampered from the victim's genuine beat, or in the old unsigned shape. Figure: forged
  entries the node accepted; target 0. A genuine beat relayed by the same member is the
  control that shows the channel works.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from procmem import rss_mb  # a sibling script module (benchmarks/ is not a package)

# Targets of the hardening
NODE_STOPS_TARGET = 0
DIAL_BACK_TARGET = 0
AMPLIFICATION_TARGET = 10.0
MEMBER_PULL_TARGET_BPS = 1_000_000
RELAY_DELIVERY_TARGET = 0.95
RELAY_MEMORY_TARGET_MB = 64.0
REPLAYS_TARGET = 0
FORGED_BEATS_TARGET = 0

# Liveness for the measured nodes: fast enough for a short run. A seed whose table holds
# records with no node behind them keeps them alive as their owners' signed beats would (an
# attacker holds those keys), so its timeouts outlast the run.
FAST = {"probe_interval_s": 0.2, "suspicion_base_s": 3.0}
STICKY = {"probe_interval_s": 0.5, "suspicion_base_s": 600.0}
VIA_KEY = "$via"
HUGE_BEAT = 2**62
ANNOUNCE_BYTES = 800_000  # per `$announce` when a member fills a table: under a header's 1 MiB
RELAY_PAYLOAD_BYTES = 128 << 10
RELAY_NEVER_READER_RATE = 400  # messages a second: ~51 MB/s, well within what a relay reads
RELAY_FLOOD_PAYLOAD_BYTES = 1024


class NotMeasurable(Exception):
    """The code under measurement lacks what this row needs."""


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row, default=str), flush=True)


def row(name: str, figure: Any, unit: str, target: str, met: bool | None, **details: Any) -> dict[str, Any]:
    return {"bench": "control_plane", "row": name, "figure": figure, "unit": unit, "target": target, "met": met,
            **details}


def measured(specs: list[tuple[str, str, str]], fn: Callable[[], list[dict[str, Any]] | dict[str, Any]]
             ) -> list[dict[str, Any]]:
    """Run the measurement of the rows `specs` ((name, unit, target) each). An API it needs
    that is missing (or anything else that stops it) gives its rows as not measurable, with
    why, instead of ending the run."""
    t0 = time.monotonic()
    try:
        out = fn()
        rows = out if isinstance(out, list) else [out]
    except Exception as exc:  # the code changes under the benchmark: say what, go on
        where = traceback.extract_tb(exc.__traceback__)[-1]
        why = f"{type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:{where.lineno})"
        rows = [row(name, None, unit, target, None, not_measurable=why) for name, unit, target in specs]
    for r in rows:
        r.setdefault("seconds", round(time.monotonic() - t0, 1))
    return rows


# ---------------------------------------------------------------------------- helpers


def node_config(liveness: dict[str, float] = FAST, **overrides: Any) -> Any:
    from starling.node import Liveness, NodeConfig

    fields = {"liveness": Liveness(**liveness), "reach_timeout_s": 0.5, "request_timeout_s": 5.0, **overrides}
    return NodeConfig(**fields)


def start_node(liveness: dict[str, float] = FAST, listen: str | None = "tcp://127.0.0.1:0",
               join: list[str] | None = None, **overrides: Any) -> Any:
    from starling.node import Node

    node = Node(config=node_config(liveness, **overrides))
    try:
        node.start(listen, join or [])
    except BaseException:
        node.close()
        raise
    return node


@contextlib.contextmanager
def closing_nodes() -> Iterator[list[Any]]:
    made: list[Any] = []
    try:
        yield made
    finally:
        for node in reversed(made):
            with contextlib.suppress(Exception):
                node.close()


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return cond()


def member_of(seed: Any, liveness: dict[str, float] = FAST) -> Any:
    """A real node joined to `seed`, known to it."""
    member = start_node(liveness, join=[seed.address])
    if not wait_until(lambda: member.peer_id in seed.live_peers()):
        member.close()
        raise RuntimeError("the member never showed up in the seed's table")
    return member


def stopped(node: Any) -> bool:
    return getattr(node, "fault", None) is not None or node.closed


def answers(node: Any, timeout_s: float = 5.0) -> bool:
    from starling.node.client import query

    try:
        query(node.address, timeout_s=timeout_s)
        return True
    except Exception:
        return False


def frames_of(topic: str, sender: str, body: Any, payload: tuple[bytes, ...] = ()) -> list[bytes]:
    from starling.node.wire import encode

    return [bytes(f) for f in encode(topic, sender, 0, body, payload)]


def request_frames(topic: str, sender: str, body: Any, rid: int = 1) -> list[bytes]:
    """A request as `starling.node.client.query` sends it."""
    from starling.node.rpc import REQUEST_TOPIC, request_body

    return frames_of(REQUEST_TOPIC, sender, request_body(topic, rid, body))


def nbytes(frames: list[bytes]) -> int:
    return sum(len(f) for f in frames)


def result_of(frames: list[bytes] | None) -> Any:
    """The body of a successful reply (None for anything else)."""
    from starling.node.rpc import parse_reply
    from starling.node.wire import Limits, decode

    try:
        _, ok, result = parse_reply(decode(frames or [], Limits(max_header_bytes=1 << 30)))
    except Exception:
        return None
    return result if ok else None


def answer_of(frames: list[bytes] | None) -> str:
    """What a reply says, in brief: `ok`, or the error's code and message."""
    from starling.node.rpc import parse_reply
    from starling.node.wire import Limits, decode

    if frames is None:
        return "no reply"
    try:
        _, ok, result = parse_reply(decode(frames, Limits(max_header_bytes=1 << 30)))
    except Exception as exc:
        return f"undecodable: {exc}"[:120]
    return "ok" if ok else f"{result.code.value}: {result.message}"[:120]


class Raw:
    """A DEALER of our own to a node, as `identity`: the node authenticates the CURVE key, so
    a member's key makes this socket speak as that member."""

    _context: Any = None

    def __init__(self, address: str, identity: Any, *, rcvhwm: int | None = None) -> None:
        import zmq
        from zmq.utils import z85

        from starling.node.address import parse_address

        if Raw._context is None:
            Raw._context = zmq.Context()
        target = parse_address(address)
        self.identity = identity
        self.sock = Raw._context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if target.curve_key is not None:
            self.sock.curve_serverkey = z85.encode(target.curve_key)
            self.sock.curve_publickey = identity.curve_public_z85
            self.sock.curve_secretkey = identity.curve_secret_z85
        self.sock.connect(target.endpoint)
        self._rids = itertools.count(1)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def request(self, topic: str, body: Any) -> list[bytes]:
        return request_frames(topic, self.identity.peer_id, body, next(self._rids))

    def recv(self, timeout_s: float) -> list[bytes] | None:
        if self.sock.poll(int(timeout_s * 1000)):
            return self.sock.recv_multipart()
        return None

    def barrier(self, timeout_s: float = 5.0) -> bool:
        """Everything sent before is processed once an `$echo` sent after it is answered
        (one connection's messages are read in order)."""
        nonce = os.urandom(16)
        self.send(self.request("$echo", nonce))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.recv(max(0.0, deadline - time.monotonic()))
            if reply is not None and nonce in reply[0]:
                return True
        return False

    def close(self) -> None:
        self.sock.close(0)


def record_wire(identity: Any, addresses: list[Any], incarnation: int | None = None) -> list[Any]:
    from starling.node.membership import PeerRecord

    return PeerRecord.create(identity, addresses, time.time_ns() if incarnation is None else incarnation).to_wire()


def largest_address(i: int) -> str:
    """The longest record address the parser takes (each distinct), with nothing behind it: an
    IPv6 literal with a zone of an interface name's full length (records name IPs, not host
    names), else an ipc path of 107 bytes."""
    from starling.node.address import parse_record_endpoint

    tag = f"{i:x}"
    candidates = [f"tcp://[fe80:ffff:ffff:ffff:ffff:ffff:ffff:{i % 0xFFFF:x}%{('z' + tag).ljust(15, 'z')}]:65535",
                  "ipc:///tmp/" + ("s" + tag).ljust(96, "s")]
    for address in candidates:
        try:
            if parse_record_endpoint(address) == address:
                return address
        except ValueError:
            continue
    raise NotMeasurable("no long record address parses")


def fake_records(n: int, big: bool) -> tuple[list[Any], list[list[Any]]]:
    """`n` fresh identities and their signed records: no node behind them. `big`: as many
    and as long addresses as a record may carry; else one ordinary address (a closed port)."""
    from starling.node.identity import Identity
    from starling.node.membership import MAX_ADDRESSES

    identities = [Identity.generate() for _ in range(n)]
    if big:
        records = [record_wire(ident, [largest_address(i * MAX_ADDRESSES + j) for j in range(MAX_ADDRESSES)])
                   for i, ident in enumerate(identities)]
    else:
        port = closed_port()
        records = [record_wire(ident, [f"tcp://127.0.0.1:{port}"]) for ident in identities]
    return identities, records


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def announce(member_sock: Raw, records: list[list[Any]]) -> None:
    """A member announces records, in messages under a header's size limit."""
    from starling.node.swarm import ANNOUNCE, MAX_ANNOUNCE

    size = max(len(json.dumps(r, default=lambda b: "x" * len(b))) for r in records) if records else 1
    chunk = max(1, min(MAX_ANNOUNCE, ANNOUNCE_BYTES // size))
    for i in range(0, len(records), chunk):
        member_sock.send(frames_of(ANNOUNCE, member_sock.identity.peer_id, records[i:i + chunk]))
    if not member_sock.barrier(timeout_s=60.0):
        raise RuntimeError("the seed did not get through the announced records")


@contextlib.contextmanager
def seeded(n: int, big: bool) -> Iterator[tuple[Any, Any, Raw, list[Any]]]:
    """A seed whose table holds `n` records announced by a member: (seed, member, the
    member's own DEALER, the records' identities)."""
    with closing_nodes() as made:
        seed = start_node(STICKY)
        made.append(seed)
        member = member_of(seed, STICKY)
        made.append(member)
        sock = Raw(seed.address, member.identity)
        try:
            identities, records = fake_records(n, big)
            announce(sock, records)
            if not wait_until(lambda: len(seed.live_peers()) >= n + 1, timeout_s=30.0):
                raise RuntimeError(f"the seed learned {len(seed.live_peers()) - 1} of {n} announced records")
            yield seed, member, sock, identities
        finally:
            sock.close()


def bytes_sent_to(node: Any, peer: str) -> dict[str, int]:
    return dict(node.stats.snapshot()["bytes_sent"].get(peer, {}))


# ---------------------------------------------------------------------------- 1. addresses


def bad_addresses() -> dict[str, Any]:
    """Record addresses nobody can or should dial; the last two parse (a node may take them
    and must still go on)."""
    labels = ".".join(["a" * 63] * 8)  # 511 characters in legal labels
    return {
        "x": "x",
        "ipc_path_over_107_bytes": "ipc:///tmp/" + "a" * 120,
        "inproc_from_the_wire": "inproc://starling-control-plane",
        "tcp_port_0": "tcp://127.0.0.1:0",
        "tcp_port_70000": "tcp://127.0.0.1:70000",
        "host_of_512_chars": "tcp://" + "a" * 512 + ":7000",
        "host_of_511_chars_in_labels": f"tcp://{labels}:7000",
        "wildcard_host": "tcp://0.0.0.0:7000",
        "non_canonical_port": "tcp://127.0.0.1:07000",
        "unknown_scheme": "udp://127.0.0.1:7000",
        "empty": "",
        "not_a_string": 7,
        "ipv6_zone_of_max_length": largest_address(0),
        "hostname_of_253_chars": "tcp://" + ".".join(["c" * 63] * 3 + ["d" * 61]) + ":65535",
    }


def malformed_records(identity: Any) -> dict[str, list[Any]]:
    """Records signed by `identity` (so they pass the key check), each wrong in one way."""
    from starling.node.membership import MAX_ADDRESSES

    out = {name: record_wire(identity, [address]) for name, address in bad_addresses().items()}
    out["too_many_addresses"] = record_wire(identity, [f"tcp://127.0.0.1:{7000 + i}"
                                                       for i in range(MAX_ADDRESSES + 1)])
    bad_signature = record_wire(identity, ["tcp://127.0.0.1:7000"])
    bad_signature[5] = bytes(len(bad_signature[5]))
    out["bad_signature"] = bad_signature
    out["not_a_record"] = ["x"]
    return out


def _outcome(call: Callable[[], Any]) -> str:
    from starling.node.client import ClientError

    try:
        call()
        return "accepted"
    except ClientError as exc:
        return "no_answer" if "no answer" in str(exc) else "refused"
    except Exception:  # the client itself would not send it
        return "not_sent"


# The cases a quick run sends: the ones the hardening named, and the two that parse.
QUICK_CASES = ("x", "ipc_path_over_107_bytes", "inproc_from_the_wire", "tcp_port_0", "tcp_port_70000",
               "host_of_512_chars", "host_of_511_chars_in_labels", "ipv6_zone_of_max_length", "hostname_of_253_chars")


def malformed_addresses(quick: bool) -> dict[str, Any]:
    from starling.node.bootstrap import REACH
    from starling.node.client import query
    from starling.node.hello import Hello
    from starling.node.identity import Identity
    from starling.node.swarm import ANNOUNCE, HELLO

    def stranger_hello(target: Any, member: Any, sock: Raw, name: str) -> str:
        stranger = Identity.generate()
        body = Hello.ours(malformed_records(stranger)[name]).to_wire()
        return _outcome(lambda: query(target.address, HELLO, body, identity=stranger, timeout_s=5))

    def stranger_reach(target: Any, member: Any, sock: Raw, name: str) -> str:
        from starling.node.membership import MAX_ADDRESSES

        addresses = bad_addresses()
        body = [[f"tcp://127.0.0.1:{7000 + i}" for i in range(MAX_ADDRESSES + 1)]] \
            if name == "too_many_addresses" else [[addresses[name]]]
        return _outcome(lambda: query(target.address, REACH, body, timeout_s=5))

    def member_announce(target: Any, member: Any, sock: Raw, name: str) -> str:
        forged = malformed_records(Identity.generate())[name]
        before = len(target.live_peers())
        sock.send(frames_of(ANNOUNCE, member.peer_id, [forged]))
        if not sock.barrier():
            return "no_answer"
        return "accepted" if len(target.live_peers()) > before else "refused"

    def member_hello(target: Any, member: Any, sock: Raw, name: str) -> str:
        body = Hello.ours(malformed_records(member.identity)[name], None, False).to_wire()
        return _outcome(lambda: query(target.address, HELLO, body, identity=member.identity, timeout_s=5))

    channels: dict[str, Callable[[Any, Any, Raw, str], str]] = {
        "stranger_hello": stranger_hello, "stranger_reach": stranger_reach,
        "member_announce": member_announce, "member_hello_reannounce": member_hello}
    reach_cases = [*bad_addresses(), "too_many_addresses"]
    cases = list(malformed_records(Identity.generate()))
    if quick:
        reach_cases, cases = list(QUICK_CASES), list(QUICK_CASES)
    stops: list[str] = []
    outcomes: dict[str, dict[str, str]] = {}
    for channel, send in channels.items():
        outcomes[channel] = {}
        with closing_nodes() as made:
            def fresh() -> tuple[Any, Any, Raw]:
                target = start_node(FAST)
                made.append(target)
                member = member_of(target)
                made.append(member)
                return target, member, Raw(target.address, member.identity)

            target, member, sock = fresh()
            try:
                for name in reach_cases if channel == "stranger_reach" else cases:
                    outcomes[channel][name] = send(target, member, sock, name)
                    if stopped(target) or (outcomes[channel][name] == "no_answer" and not answers(target)):
                        stops.append(f"{channel}/{name}")
                        sock.close()
                        target, member, sock = fresh()
                time.sleep(0.3)  # a dial the last record started, and the pings that follow
                if stopped(target) or not answers(target):
                    stops.append(f"{channel}/after_all")
            finally:
                sock.close()
    counts = {channel: {kind: sum(1 for o in seen.values() if o == kind)
                        for kind in ("refused", "accepted", "no_answer", "not_sent")}
              for channel, seen in outcomes.items()}
    return row("malformed_addresses", len(stops), "node stops", f"== {NODE_STOPS_TARGET}",
               len(stops) <= NODE_STOPS_TARGET, stopped_by=stops, cases=len(cases), reach_cases=len(reach_cases),
               outcomes_by_channel=counts,
               accepted=sorted(f"{c}/{n}" for c, seen in outcomes.items() for n, o in seen.items()
                               if o == "accepted"))


# ---------------------------------------------------------------------------- 2. dial-back


class AcceptCounter:
    """TCP listeners that accept and hold every connection, counting them per listener."""

    def __init__(self, listeners: dict[str, socket.socket]) -> None:
        self.listeners = listeners
        self.counts = dict.fromkeys(listeners, 0)
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select

        by_fd = {s.fileno(): name for name, s in self.listeners.items()}
        while not self._stop.is_set():
            ready, _, _ = select.select(list(self.listeners.values()), [], [], 0.05)
            for s in ready:
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                self._held.append(conn)
                self.counts[by_fd[s.fileno()]] += 1

    def total(self, prefix: str) -> int:
        return sum(n for name, n in self.counts.items() if name.startswith(prefix))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for s in [*self._held, *self.listeners.values()]:
            s.close()


def _listener_pair() -> tuple[int, socket.socket, socket.socket]:
    """Listeners on 127.0.0.2 and 127.0.0.1 on one port number."""
    for _ in range(20):
        third = socket.socket()
        third.bind(("127.0.0.2", 0))
        port = third.getsockname()[1]
        mine = socket.socket()
        try:
            mine.bind(("127.0.0.1", port))
        except OSError:
            third.close()
            mine.close()
            continue
        for s in (third, mine):
            s.listen(64)
        return port, third, mine
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


def dial_back(quick: bool) -> dict[str, Any]:
    """Strangers on 127.0.0.1 ask for dial-backs to listeners on 127.0.0.2 (and to a unix
    socket: no IP at all); listeners on 127.0.0.1 at the same ports count the allowed ones."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from starling.node.bootstrap import REACH
    from starling.node.client import query
    from starling.node.membership import MAX_ADDRESSES

    requests, per_request = (2, 2) if quick else (4, MAX_ADDRESSES - 1)
    listeners: dict[str, socket.socket] = {}
    ports = []
    for _ in range(per_request):
        port, third, mine = _listener_pair()
        ports.append(port)
        listeners[f"third:{port}"], listeners[f"requester:{port}"] = third, mine
    folder = tempfile.mkdtemp(prefix="sl-")
    unix_path = os.path.join(folder, "l.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen(64)
    listeners["third:ipc"] = unix
    counter = AcceptCounter(listeners)
    answers_seen: list[str] = []
    try:
        with closing_nodes() as made:
            target = start_node(FAST)
            made.append(target)
            reach_timeout = target.config.reach_timeout_s

            def ask(addresses: list[str]) -> str:
                try:
                    return json.dumps(query(target.address, REACH, [addresses],
                                            timeout_s=reach_timeout * len(addresses) + 10), default=str)
                except Exception as exc:
                    return f"{type(exc).__name__}: {exc}"[:200]

            third_party = [f"tcp://127.0.0.2:{p}" for p in ports] + [f"ipc://{unix_path}"]
            with ThreadPoolExecutor(requests) as pool:
                answers_seen = list(pool.map(ask, [third_party] * requests))
            time.sleep(0.3)
            to_third, to_requester = counter.total("third:"), counter.total("requester:")
            control = ask([f"tcp://127.0.0.1:{ports[0]}"])  # the requester's own IP: allowed
            time.sleep(0.3)
            control_connections = counter.total("requester:") - to_requester
            up = not stopped(target)
            rejected = target.stats.snapshot()["rejected"]
    finally:
        counter.close()
        with contextlib.suppress(OSError):
            os.unlink(unix_path)
            os.rmdir(folder)
    return row("dial_back", to_third, "connections to third parties", f"== {DIAL_BACK_TARGET}",
               to_third <= DIAL_BACK_TARGET, requests=requests, addresses_per_request=per_request + 1,
               requester_ip="127.0.0.1", third_parties=["127.0.0.2 (tcp)", "a unix socket (ipc)"],
               by_listener={k: v for k, v in counter.counts.items() if k.startswith("third:") and v},
               connections_to_requester_ip_meanwhile=to_requester,
               control_dial_to_requester_ip_connections=control_connections, control_answer=control,
               answers=sorted(set(answers_seen)), node_rejected=rejected, node_up=up)


# ---------------------------------------------------------------------------- 3. amplification


def _stranger_requests(reach_port: int) -> dict[str, Callable[[Any], list[bytes]]]:
    """Every request a stranger can send, as frames from the stranger `ident`."""
    from starling.node.bootstrap import ECHO, REACH
    from starling.node.hello import Hello
    from starling.node.swarm import GOSSIP, HELLO, PROBE, SYNC

    def client_record(ident: Any) -> list[Any]:
        return record_wire(ident, [])

    return {
        "hello_with_table": lambda i: request_frames(HELLO, i.peer_id, Hello.ours(client_record(i)).to_wire()),
        "hello_without_table": lambda i: request_frames(HELLO, i.peer_id,
                                                        Hello.ours(client_record(i), None, False).to_wire()),
        "status": lambda i: request_frames("$status", i.peer_id, None),
        "reach": lambda i: request_frames(REACH, i.peer_id, [[f"tcp://127.0.0.1:{reach_port}"]]),
        "echo": lambda i: request_frames(ECHO, i.peer_id, os.urandom(16)),
        "members_only_sync": lambda i: request_frames(SYNC, i.peer_id, None),
        "unknown_internal_topic": lambda i: request_frames("$nope", i.peer_id, None),
        "unknown_topic": lambda i: request_frames("nope", i.peer_id, None),
        "hello_malformed_body": lambda i: request_frames(HELLO, i.peer_id, "x"),
        "reach_malformed_body": lambda i: request_frames(REACH, i.peer_id, 5),
        "echo_oversized_nonce": lambda i: request_frames(ECHO, i.peer_id, b"x" * 65),
        "status_with_a_body": lambda i: request_frames("$status", i.peer_id, {"x": "y" * 64}),
        "one_way_gossip": lambda i: frames_of(GOSSIP, i.peer_id, {"u": []}),
        "probe_without_a_record": lambda i: request_frames(PROBE, i.peer_id, {"u": []}),
        "probe_with_its_record": lambda i: request_frames(PROBE, i.peer_id, {"u": [["r", client_record(i)]]}),
        "garbage_frame": lambda i: [b"\xc1garbage"],
    }


def amplification(seed: Any, quick: bool) -> dict[str, Any]:
    """Each stranger request on a connection and key of its own, all sent at once; replies
    collected until the slowest (a dial-back) has had its time. Then the exchanges a stranger
    can pay for with its own bytes: `$status` sent again padded as the node asks, and a hello
    padded with 64 KB of config (a bigger hello earns a bigger page of the table)."""
    from starling.node.client import query
    from starling.node.hello import Hello
    from starling.node.identity import Identity
    from starling.node.swarm import HELLO

    wait_s = seed.config.reach_timeout_s + (0.7 if quick else 3.0)
    sent: dict[str, tuple[Raw, int]] = {}
    for name, build in _stranger_requests(closed_port()).items():
        ident = Identity.generate()
        sock = Raw(seed.address, ident)
        frames = build(ident)
        sock.send(frames)
        sent[name] = (sock, nbytes(frames))
    replies = dict.fromkeys(sent, 0)
    said = dict.fromkeys(sent, "no reply")
    deadline = time.monotonic() + wait_s
    waiting = set(sent)
    while waiting and time.monotonic() < deadline:
        for name in list(waiting):
            reply = sent[name][0].recv(0.01)
            if reply is not None:
                replies[name] += nbytes(reply)
                said[name] = answer_of(reply)
                waiting.discard(name)
    for sock, _ in sent.values():
        sock.close()
    table = {name: {"request_bytes": req, "reply_bytes": replies[name], "ratio": round(replies[name] / req, 2),
                    "answer": said[name]} for name, (_, req) in sent.items()}

    def exchange(ident: Any, frames: list[bytes]) -> tuple[int, list[bytes] | None]:
        sock = Raw(seed.address, ident)
        try:
            sock.send(frames)
            return nbytes(frames), sock.recv(10.0)
        finally:
            sock.close()

    stranger = Identity.generate()
    first = exchange(stranger, request_frames("$status", stranger.peer_id, None))[1]
    asked = result_of(first)
    if isinstance(asked, dict) and set(asked) == {"pad_to"} and isinstance(asked["pad_to"], int):
        req, reply = exchange(stranger, request_frames("$status", stranger.peer_id, {"pad": bytes(asked["pad_to"])}))
        table["status_padded_as_asked"] = {"request_bytes": req, "reply_bytes": nbytes(reply or []),
                                           "ratio": round(nbytes(reply or []) / req, 2), "answer": answer_of(reply)}
    stranger = Identity.generate()
    body = Hello.ours(record_wire(stranger, []), {"pad": "x" * 64_000}).to_wire()
    req, reply = exchange(stranger, request_frames(HELLO, stranger.peer_id, body))
    page = result_of(reply)
    table["hello_with_table_padded_64k"] = {
        "request_bytes": req, "reply_bytes": nbytes(reply or []), "ratio": round(nbytes(reply or []) / req, 2),
        "answer": answer_of(reply), "records": len(page.get("peers", [])) if isinstance(page, dict) else None}
    worst = max(table, key=lambda n: table[n]["ratio"])
    try:
        status = query(seed.address, identity=Identity.generate(), timeout_s=10)
        status_query = f"answered: {len(status.get('peers', []))} peers"
    except Exception as exc:
        status_query = f"{type(exc).__name__}: {exc}"[:200]
    figure = table[worst]["ratio"]
    return row("amplification", figure, "reply bytes / request bytes (worst request)", f"<= {AMPLIFICATION_TARGET}",
               figure <= AMPLIFICATION_TARGET, worst=worst, table_records=len(seed.live_peers()) - 1,
               requests=table, status_via_query=status_query)


def member_pull_rate(seed: Any, member: Any, sock: Raw, identities: list[Any], quick: bool,
                     name: str = "member_pull_rate") -> dict[str, Any]:
    """The member keeps 4 `$sync` requests in flight and sends a `$want` of 256 ids every
    20 ms (for `member_status_rate`: 4 `$status` requests, nothing else); the seed's byte
    counters say what it sent that member. The figure is the rate after the first second
    (what a budget's burst lets through is spent by then); the whole window's rate is printed
    beside it."""
    from starling.node.table_sync import MAX_WANT, SYNC, WANT

    statuses = name == "member_status_rate"
    topic = "$status" if statuses else SYNC

    warm_s, seconds = 1.0, (1.0 if quick else 4.0)
    ids = [ident.peer_id for ident in identities[:MAX_WANT]]
    want = frames_of(WANT, member.peer_id, ids)
    start = bytes_sent_to(seed, member.peer_id)
    marks: list[tuple[float, dict[str, int]]] = []
    in_flight = syncs = wants = 0
    answers: dict[str, int] = {}
    reply_bytes: dict[str, int] = {}
    t0 = time.monotonic()
    next_want = t0
    while (now := time.monotonic()) - t0 < warm_s + seconds:
        if not marks and now - t0 >= warm_s:
            marks.append((now, bytes_sent_to(seed, member.peer_id)))
        while in_flight < 4:
            sock.send(sock.request(topic, None))
            in_flight += 1
        if now >= next_want and not statuses:
            sock.send(want)
            wants += 1
            next_want = now + 0.02
        reply = sock.recv(0.005)
        if reply is not None:
            in_flight -= 1
            syncs += 1
            said = answer_of(reply).split(":")[0]
            answers[said] = answers.get(said, 0) + 1
            reply_bytes[said] = reply_bytes.get(said, 0) + nbytes(reply)
    end = time.monotonic()
    after = bytes_sent_to(seed, member.peer_id)
    (mark_t, mark), = marks

    def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {t: b.get(t, 0) - a.get(t, 0) for t in b if b.get(t, 0) != a.get(t, 0)}

    sustained = sum(delta(mark, after).values()) / (end - mark_t)
    whole = sum(delta(start, after).values()) / (end - t0)
    with contextlib.suppress(Exception):  # let the last answers drain before the next row
        sock.barrier(timeout_s=10)
    return row(name, round(sustained), "bytes/s to one member (after the first second)",
               f"<= {MEMBER_PULL_TARGET_BPS}", sustained <= MEMBER_PULL_TARGET_BPS,
               whole_window_bytes_per_s=round(whole), window_s=round(end - t0, 2), topic=topic,
               requests_answered=syncs, answers=answers, reply_bytes_by_answer=reply_bytes, wants_sent=wants,
               bytes_by_topic=delta(start, after), table_records=len(identities))


def amplification_rows(quick: bool) -> list[dict[str, Any]]:
    with seeded(300, big=True) as (seed, member, sock, identities):
        rows = measured(specs("amplification"), lambda: amplification(seed, quick))
        rows += measured(specs("member_pull_rate"), lambda: member_pull_rate(seed, member, sock, identities, quick))
        time.sleep(2.0)  # the member's budget refills (1 MB/s) before it pulls again
        rows += measured(specs("member_status_rate"),
                         lambda: member_pull_rate(seed, member, sock, identities, quick, name="member_status_rate"))
    return rows


def join_big_table(quick: bool, big: bool) -> dict[str, Any]:
    """A real joiner, with a node's defaults, through a seed whose table holds 1024 records.
    Max-size records join at the pace of the seed's pull budget (about 4 MB of table), so the
    quick run fills the table with 256 of those."""
    from starling.node import Node

    name = "join_table_max_records" if big else "join_table"
    records = 256 if quick and big else 1024
    with seeded(records, big=big) as (seed, _member, _sock, _identities):
        t0 = time.monotonic()
        error = None
        with closing_nodes() as made:
            try:
                joiner = Node()
                made.append(joiner)
                joiner.start("tcp://127.0.0.1:0", [seed.address])
                joined = wait_until(lambda: seed.peer_id in joiner.live_peers(), timeout_s=5.0)
                learned = len(joiner.live_peers())
            except Exception as exc:
                joined, learned, error = False, 0, f"{type(exc).__name__}: {exc}"[:300]
            seconds = time.monotonic() - t0
        return row(name, joined, "joined", "== true", joined, join_s=round(seconds, 2), peers_learned=learned,
                   table_records=records, record_addresses="as many and long as allowed" if big else "one ordinary",
                   error=error, seed_up=not stopped(seed))


def sybil_greeters(cfg: dict[str, Any], conn: Any) -> None:
    """`cfg["n"]` fresh keys, each saying hello itself on a CURVE connection of its own from
    `cfg["source"]` (a loopback alias), all as fast as the seed answers; the connections stay
    open. Sends back how many were taken, turned away, or not answered."""
    import zmq

    from starling.node.hello import Hello
    from starling.node.identity import Identity

    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, cfg["n"] + 64)
    socks, answers = [], {"ok": 0, "table_full": 0, "other": 0, "unanswered": 0, "busy_retried": 0}
    hellos: dict[Any, list[bytes]] = {}
    poller = zmq.Poller()
    t0 = time.monotonic()
    for _ in range(cfg["n"]):
        key = Identity.generate()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = cfg["server_key"]
        sock.curve_publickey, sock.curve_secretkey = key.curve_public_z85, key.curve_secret_z85
        sock.connect(f"tcp://{cfg['source']}:0;{cfg['endpoint'].removeprefix('tcp://')}")
        hellos[sock] = request_frames("$hello", key.peer_id, Hello.ours(record_wire(key, []), None, False).to_wire())
        sock.send_multipart(hellos[sock])
        socks.append(sock)
        poller.register(sock, zmq.POLLIN)
    pending = set(socks)
    retry: list[tuple[float, Any]] = []  # (when, socket): a key turned away busy asks again
    deadline = time.monotonic() + cfg["answer_within_s"]
    while pending and time.monotonic() < deadline:
        now = time.monotonic()
        while retry and retry[0][0] <= now:
            _, sock = retry.pop(0)
            sock.send_multipart(hellos[sock])
        for sock, _ in poller.poll(50):
            if sock not in pending:
                continue
            said = answer_of(sock.recv_multipart())
            answer = said.split(":")[0]
            if answer == "busy" and "table_full" not in said:
                answers["busy_retried"] += 1
                retry.append((time.monotonic() + 0.25, sock))
                continue
            answers["ok" if answer == "ok" else "table_full" if answer == "busy" else "other"] += 1
            pending.discard(sock)
    answers["unanswered"] = len(pending)
    conn.send({**answers, "seconds": round(time.monotonic() - t0, 1)})
    conn.recv()  # hold the connections open until told
    ctx.destroy(0)


def sybil_lockout(quick: bool) -> dict[str, Any]:
    """One attacker holds 10,000 identities (1,000 with --quick, against a table a 32nd the
    size), each saying hello itself from 127.0.0.2 on a connection of its own, more than the
    table holds (two processes make and hold the connections: one process has too few
    descriptors for all). Then an honest node joins from 127.0.0.1. Figure: seconds from the
    joiner's start until it holds the seed and the seed holds it; target 10."""
    from zmq.utils import z85

    from starling.node import Node
    from starling.node.address import parse_address
    from starling.node.membership import TableLimits

    limits = TableLimits(max_peers=256, max_sponsored_per_member=128) if quick else TableLimits()
    identities, processes = (1_000, 1) if quick else (10_000, 2)
    with closing_nodes() as made:
        seed = start_node(STICKY, table=limits)
        made.append(seed)
        target = parse_address(seed.address)
        cfg = {"n": identities // processes, "source": "127.0.0.2", "endpoint": target.endpoint,
               "server_key": z85.encode(target.curve_key), "answer_within_s": 120.0}
        spawn = mp.get_context("spawn")
        attackers = []
        for _ in range(processes):
            conn, child = spawn.Pipe()
            proc = spawn.Process(target=sybil_greeters, args=(cfg, child), daemon=True)
            proc.start()
            attackers.append((proc, conn))
        try:
            greeters: dict[str, Any] = {}
            for _, conn in attackers:
                if not conn.poll(300):
                    raise RuntimeError("the greeters did not finish")
                for k, v in conn.recv().items():
                    greeters[k] = max(greeters.get(k, 0), v) if k == "seconds" else greeters.get(k, 0) + v
            full = len(seed._table.all())
            t0 = time.monotonic()
            error = None
            try:
                joiner = Node(config=node_config(STICKY))
                made.append(joiner)
                joiner.start("tcp://127.0.0.1:0", [seed.address])
                joined = wait_until(lambda: seed.peer_id in joiner.live_peers()
                                    and joiner.peer_id in seed.live_peers(), timeout_s=30.0)
            except Exception as exc:
                joined, error = False, f"{type(exc).__name__}: {exc}"[:300]
            seconds = round(time.monotonic() - t0, 2)
            held = len(seed._table.all())
            rejected = seed.stats.snapshot()["rejected"]
            up = not stopped(seed)
        finally:
            for proc, conn in attackers:
                with contextlib.suppress(Exception):
                    conn.send("stop")
                proc.join(15)
                if proc.is_alive():
                    proc.kill()
    met = joined and seconds <= 10.0 and held <= limits.max_peers
    return row("sybil_lockout", seconds if joined else None, "s until an honest joiner is in", "<= 10", met,
               joined=joined, identities=identities, greeters=greeters, table_before_joiner=full, table_after=held,
               table_cap=limits.max_peers, rejected={k: rejected.get(k, 0) for k in ("table_full", "busy")},
               error=error, seed_up=up)


# ---------------------------------------------------------------------------- 4. relays


def relay_process(conn: Any, liveness: dict[str, float]) -> None:
    """A relay (a reachable node, default config but for its liveness timing), run in its
    own process so that its RSS is its own. Answers `status` on `conn` until `stop`."""
    from starling.node import Liveness, Node, NodeConfig

    node = Node(config=NodeConfig(liveness=Liveness(**liveness))).start("tcp://127.0.0.1:0")
    conn.send({"address": node.address, "id": node.peer_id, "relay": bool(node.record and node.record.relay)})
    while conn.recv() == "status":
        status = node.status()
        relay = getattr(node, "_relay", None)
        conn.send({"rejected": status["stats"]["rejected"], "relaying": status.get("relaying"),
                   "forwarding": getattr(relay, "forwarding", None), "fault": node.fault, "closed": node.closed,
                   "sockets": status.get("sockets"), "peers": {p["id"]: p["status"] for p in status["peers"]}})
    node.close()


def relay_attacker(cfg: dict[str, Any], conn: Any) -> None:
    """A member M and a client X (both keys held by the attacker), raw sockets only.

    X joins the relay as a client (a hello, then a ping, so the relay can send down its
    connection). `dead`: X then closes its socket. `never_reads`: X keeps it and never reads
    again (its queue holds one message). M joins too, then sends `$relay` toward X, as fast as
    it can or at `rate` a second, and pings every 0.25 s with its own beat and X's (it signs
    both), so the relay holds X alive throughout."""
    import zmq

    ctx = zmq.Context()

    def dealer(keys: tuple[bytes, bytes], small: bool = False) -> Any:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        if small:
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
        sock.curve_serverkey = cfg["server_key"]
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.connect(cfg["endpoint"])
        return sock

    def hello(sock: Any, frames: list[bytes]) -> None:
        sock.send_multipart(frames)
        if not sock.poll(10_000):
            raise RuntimeError("the relay did not answer a hello")
        sock.recv_multipart()

    x = dealer(cfg["x_keys"], small=cfg["scenario"] == "never_reads")
    hello(x, cfg["x_hello"])
    x.send_multipart(cfg["x_ping"])
    m = dealer(cfg["m_keys"])
    hello(m, cfg["m_hello"])
    pings = iter(cfg["m_pings"])
    m.send_multipart(next(pings))
    time.sleep(0.3)
    if cfg["scenario"] == "dead":
        x.close(0)
    conn.send("ready")
    conn.recv()  # go
    counts = {"relay_sent": 0, "queue_full": 0, "pings": 1, "read": 0}
    start = time.monotonic()
    next_ping = start
    interval = 1.0 / cfg["rate"] if cfg["rate"] else 0.0
    next_send = start
    while time.monotonic() - start < cfg["seconds"] and not conn.poll(0):
        now = time.monotonic()
        if now >= next_ping:  # waits its turn behind the flood: X must stay alive
            with contextlib.suppress(StopIteration, zmq.Again):
                m.send_multipart(next(pings))
                counts["pings"] += 1
            next_ping = now + 0.25
        if interval and now < next_send:
            time.sleep(min(next_send - now, 0.01))
            continue
        for _ in range(1 if interval else 64):
            try:
                m.send_multipart(cfg["relay"], flags=zmq.NOBLOCK, copy=False)
                counts["relay_sent"] += 1
            except zmq.Again:
                counts["queue_full"] += 1
                time.sleep(0.001)
                break
        next_send += interval
        while m.poll(0):
            m.recv_multipart()
            counts["read"] += 1
    counts["seconds"] = round(time.monotonic() - start, 2)
    conn.send(counts)
    ctx.destroy(0)


def capturing_member(conn: Any, liveness: dict[str, float], join: str, sort_before: str) -> None:
    """A member M that captures relayed traffic, in its own process: a real node whose id sorts
    before the real relay's (keys are drawn until one does), that offers to relay and drops
    every `$relay` it is handed. On "claims" it also signs, every 0.1 s, a suspect claim about
    the real relay's current liveness and sends it to the clients and the relay (its own
    claims, validly signed: what any member may say). Answers "status" until "stop"."""
    from starling.node import Liveness, Node, NodeConfig
    from starling.node.identity import Identity
    from starling.node.relay import RELAY
    from starling.node.updates import SUSPECT, Claim

    generated = 1
    identity = Identity.generate()
    while identity.peer_id >= sort_before:
        identity, generated = Identity.generate(), generated + 1
    node = Node(identity, NodeConfig(liveness=Liveness(**liveness))).start("tcp://127.0.0.1:0", [join])
    dropped = [0]

    def drop(msg: Any) -> None:
        dropped[0] += 1

    node._dispatch.on_internal_message(RELAY, drop)
    claims = {"sent": 0, "targets": []}

    async def accuse(stop: Any) -> None:
        import asyncio

        while not stop.is_set():
            at = node._table.live_at(sort_before)
            if at is not None:
                claim = Claim.sign(identity, SUSPECT, sort_before, *at).to_wire()
                for target in [*claims["targets"], sort_before]:
                    with contextlib.suppress(Exception):
                        await node._asend_raw(target, "$gossip", {"u": [claim]}, wait=False)
                        claims["sent"] += 1
            await asyncio.sleep(0.1)

    stopping = threading.Event()
    conn.send({"id": node.peer_id, "keys_generated": generated})
    while True:
        command = conn.recv()
        if isinstance(command, tuple) and command[0] == "claims":
            claims["targets"] = list(command[1])
            node.submit(accuse(stopping))
            conn.send("claiming")
        elif command == "status":
            conn.send({"dropped": dropped[0], "claims_sent": claims["sent"], "fault": node.fault,
                       "closed": node.closed})
        else:
            break
    stopping.set()
    node.close()


class RelayLab:
    """The relay's process, and the frames an attacker replays against it."""

    def __init__(self) -> None:
        spawn = mp.get_context("spawn")
        self._spawn = spawn
        self.conn, child = spawn.Pipe()
        self.process = spawn.Process(target=relay_process, args=(child, FAST), daemon=True)
        self.process.start()
        self.info: dict[str, Any] | None = None

    def ready(self) -> dict[str, Any]:
        if self.info is None:
            if not self.conn.poll(120):
                raise RuntimeError("the relay process did not start")
            self.info = self.conn.recv()
        return self.info

    def status(self) -> dict[str, Any]:
        self.conn.send("status")
        if not self.conn.poll(30):
            raise RuntimeError("the relay process did not answer")
        return self.conn.recv()

    def rss_mb(self) -> float:
        assert self.process.pid is not None
        return rss_mb(self.process.pid)

    def attacker_config(self, scenario: str, seconds: float, payload_bytes: int, rate: float | None) -> dict[str, Any]:
        from zmq.utils import z85

        from starling.node.address import parse_address
        from starling.node.hello import Hello
        from starling.node.identity import Identity
        from starling.node.membership import sign_beat
        from starling.node.relay import RELAY

        info = self.ready()
        target = parse_address(info["address"])
        m, x = Identity.generate(), Identity.generate()
        m_record, x_record = record_wire(m, []), record_wire(x, [])
        m_inc, x_inc = m_record[4], x_record[4]
        # beats of a rising liveness incarnation: each refutes whatever claim the target made of
        # these raw sockets, which answer no probe
        pings = [frames_of("$gossip", m.peer_id, {"u": [["a", sign_beat(m, m_inc, k << 32, {})],
                                                        ["a", sign_beat(x, x_inc, k << 32, {})]]})
                 for k in range(2, int(seconds * 4) + 40)]
        return {
            "scenario": scenario, "seconds": seconds, "rate": rate, "endpoint": target.endpoint, "x_id": x.peer_id,
            "server_key": z85.encode(target.curve_key),
            "m_keys": (m.curve_public_z85, m.curve_secret_z85), "x_keys": (x.curve_public_z85, x.curve_secret_z85),
            "m_hello": request_frames("$hello", m.peer_id, Hello.ours(m_record, None, False).to_wire()),
            "x_hello": request_frames("$hello", x.peer_id, Hello.ours(x_record, None, False).to_wire()),
            "x_ping": frames_of("$gossip", x.peer_id, {"u": [["a", sign_beat(x, x_inc, 1 << 32, {})]]}),
            "m_pings": pings,
            "relay": frames_of(RELAY, m.peer_id, [x.peer_id, os.urandom(12)], (os.urandom(payload_bytes),)),
        }

    def attack(self, cfg: dict[str, Any]) -> tuple[Any, Any]:
        """Start an attacker; returns (process, its end of the pipe) once it is ready."""
        conn, child = self._spawn.Pipe()
        proc = self._spawn.Process(target=relay_attacker, args=(cfg, child), daemon=True)
        proc.start()
        if not conn.poll(60):
            proc.kill()
            raise RuntimeError("the attacker did not get into the swarm")
        conn.recv()
        return proc, conn

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send("stop")
        self.process.join(15)
        if self.process.is_alive():
            self.process.kill()


def _send_notes(sender: Any, dest: str, got: set[str], tag: str, rate: float, seconds: float) -> dict[str, Any]:
    """One-way notes at `rate` a second; how many arrived (waiting a while for stragglers)."""
    n = max(1, int(rate * seconds))
    failed = 0
    futures = []
    t0 = time.monotonic()
    for i in range(n):
        time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        futures.append(sender.send(dest, "note", f"{tag}-{i}"))
    for fut in futures:
        try:
            fut.result(15)
        except Exception:
            failed += 1
    wait_until(lambda: sum(1 for k in got if k.startswith(tag + "-")) >= n, timeout_s=3.0)
    delivered = sum(1 for k in got if k.startswith(tag + "-"))
    return {"sent": n, "send_failed": failed, "delivered": delivered, "share": round(delivered / n, 4)}


def relay_rows(lab: RelayLab, quick: bool) -> list[dict[str, Any]]:
    info = lab.ready()
    if not info.get("relay"):
        raise NotMeasurable("the relay's node does not offer to relay")
    rows: list[dict[str, Any]] = []
    with closing_nodes() as made:
        c1 = start_node(FAST, listen=None, join=[info["address"]])
        made.append(c1)
        c2 = start_node(FAST, listen=None, join=[info["address"]])
        made.append(c2)
        relay_id = info["id"]

        def ready() -> bool:
            return (c2.peer_id in c1.live_peers() and c1.peer_id in c2.live_peers()
                    and all(relay_id in c.status()["meta"].get(VIA_KEY, "") for c in (c1, c2)))

        if not wait_until(ready, timeout_s=20):
            raise RuntimeError("the clients never saw each other through the relay")
        got: set[str] = set()
        c2.on("note", lambda msg: got.add(msg.body))
        rate = 100.0
        rows += measured(specs("relay_delivery_under_flood"), lambda: _delivery_under_flood(lab, c1, c2, got, rate,
                                                                                          quick))
        rows += measured(specs("relay_memory_never_reader"), lambda: _memory_never_reader(lab, quick))
    rows += measured(specs("relay_delivery_under_capture", "relay_delivery_under_steering"),
                     lambda: _delivery_under_capture(lab, quick))
    return rows


def _client_pair(relay: str, address: str, also: str) -> tuple[Any, Any, set[str]]:
    """Two fresh clients of the relay at `address` that see each other and name both `relay`
    and `also` (the attacker) among their relays; the notes the second got."""
    c1 = start_node(FAST, listen=None, join=[address])
    c2 = start_node(FAST, listen=None, join=[address])

    def ready() -> bool:
        return (c2.peer_id in c1.live_peers() and c1.peer_id in c2.live_peers()
                and all({relay, also} <= set(c.status()["meta"].get(VIA_KEY, "").split(",")) for c in (c1, c2))
                # and each has the other's beat saying so
                and all(set(c._table.get(o.peer_id).meta.get(VIA_KEY, "").split(",")) >= {relay, also}
                        for c, o in ((c1, c2), (c2, c1))))

    if not wait_until(ready, timeout_s=30):
        for c in (c1, c2):
            c.close()
        raise RuntimeError("the clients never named both relays")
    got: set[str] = set()
    c2.on("note", lambda msg: got.add(msg.body))
    return c1, c2, got


def _delivery_under_capture(lab: RelayLab, quick: bool) -> list[dict[str, Any]]:
    """A member whose id sorts before the relay's offers to relay and drops everything; then it
    also keeps accusing the real relay. Honest notes between two fresh clients in each case."""
    info = lab.ready()
    seconds, rate = (2.0, 20.0) if quick else (10.0, 20.0)
    spawn = mp.get_context("spawn")
    conn, child = spawn.Pipe()
    proc = spawn.Process(target=capturing_member, args=(child, FAST, info["address"], info["id"]), daemon=True)
    proc.start()
    rows = []
    try:
        if not conn.poll(120):
            raise RuntimeError("the capturing member did not start")
        m = conn.recv()
        for name in ("relay_delivery_under_capture", "relay_delivery_under_steering"):
            with closing_nodes() as made:
                c1, c2, got = _client_pair(info["id"], info["address"], m["id"])
                made += [c1, c2]
                for c in (c1, c2):  # the attacker drew first place in both senders' orders (it
                    # cannot choose that: each node ranks relays at random; here it is lucky)
                    deliveries = getattr(c._relay, "deliveries", None)
                    if deliveries is not None:
                        deliveries.order([info["id"], m["id"]])
                        deliveries._ranks[m["id"]] = -1.0
                if name == "relay_delivery_under_steering":
                    conn.send(("claims", [c1.peer_id, c2.peer_id]))
                    conn.recv()
                    wait_until(lambda c1=c1: lab.status()["peers"].get(c1.peer_id) is not None, timeout_s=2)
                    time.sleep(1.0)  # the claims are going round
                order = c1._relay.relays_for(c2.peer_id)
                during = _send_notes(c1, c2.peer_id, got, name, rate, seconds)
                conn.send("status")
                attacker = conn.recv()
                status = c1.status()
                share = during["share"]
                rows.append(row(name, share, "share delivered", f">= {RELAY_DELIVERY_TARGET}",
                                share >= RELAY_DELIVERY_TARGET, honest=during,
                                attacker_first_in_senders_order=bool(order) and order[0] == m["id"],
                                attacker_keys_generated=m["keys_generated"], attacker=attacker,
                                sender_delivery=status["relaying"].get("delivery"),
                                sender_claims=status.get("claims"),
                                relay_as_the_sender_holds_it={p["id"]: p["status"] for p in status["peers"]}.get(
                                    info["id"])))
    finally:
        with contextlib.suppress(Exception):
            conn.send("stop")
        proc.join(15)
        if proc.is_alive():
            proc.kill()
    return rows


def _delivery_under_flood(lab: RelayLab, c1: Any, c2: Any, got: set[str], rate: float, quick: bool
                          ) -> dict[str, Any]:
    seconds = 1.5 if quick else 8.0
    baseline = _send_notes(c1, c2.peer_id, got, "baseline", rate, 0.5 if quick else 2.0)
    before = lab.status()
    cfg = lab.attacker_config("dead", seconds + 5.0, RELAY_FLOOD_PAYLOAD_BYTES, None)
    proc, conn = lab.attack(cfg)
    try:
        conn.send("go")
        time.sleep(0.3)  # the flood is on
        during = _send_notes(c1, c2.peer_id, got, "flood", rate, seconds)
        destination = lab.status()["peers"].get(cfg["x_id"], "unknown")
        conn.send("stop")
        flood = conn.recv() if conn.poll(30) else {}
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    after = lab.status()
    rejected = {k: v - before["rejected"].get(k, 0) for k, v in after["rejected"].items()
                if v != before["rejected"].get(k, 0)}
    share = during["share"]
    return row("relay_delivery_under_flood", share, "share delivered", f">= {RELAY_DELIVERY_TARGET}",
               share >= RELAY_DELIVERY_TARGET, honest=during, honest_without_flood=baseline,
               flood={**flood, "payload_bytes": RELAY_FLOOD_PAYLOAD_BYTES},
               relay_rejected_during=rejected, destination_status_at_relay_at_end=destination,
               relay_accounting=after.get("relaying"), relay_up=not (after["fault"] or after["closed"]))


def _memory_never_reader(lab: RelayLab, quick: bool) -> dict[str, Any]:
    seconds = 2.0 if quick else 6.0
    proc, conn = lab.attack(lab.attacker_config("never_reads", seconds, RELAY_PAYLOAD_BYTES,
                                                RELAY_NEVER_READER_RATE))
    samples: list[float] = []
    stopped_early = False
    try:
        before = statistics.median(_sample(lab, 0.5))
        conn.send("go")
        end = time.monotonic() + seconds + 1.0  # and a second for what is still in flight
        while time.monotonic() < end:
            samples.append(lab.rss_mb())
            if samples[-1] - before > 4 * RELAY_MEMORY_TARGET_MB and not stopped_early:
                conn.send("stop")  # far past the target already: spare the machine
                stopped_early = True
            time.sleep(0.1)
        flood = conn.recv() if conn.poll(30) else {}
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    status = lab.status()
    growth = max(samples) - before
    return row("relay_memory_never_reader", round(growth, 1), "MB relay RSS growth", f"<= {RELAY_MEMORY_TARGET_MB}",
               growth <= RELAY_MEMORY_TARGET_MB, rss_before_mb=round(before, 1), rss_peak_mb=round(max(samples), 1),
               rss_last_mb=round(samples[-1], 1), stopped_early=stopped_early,
               flood={**flood, "payload_bytes": RELAY_PAYLOAD_BYTES, "rate_per_s": RELAY_NEVER_READER_RATE},
               relay_accounting=status.get("relaying"), relay_rejected=status["rejected"],
               relay_up=not (status["fault"] or status["closed"]))


def _sample(lab: RelayLab, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(lab.rss_mb())
        time.sleep(0.05)
    return out


def replays_after_sessions(quick: bool) -> dict[str, Any]:
    """The guard a destination opens relayed messages with: source A's messages, then
    `sessions` fresh sessions from source E (each a restart of E: a new session prefix, or
    a new incarnation where nonces carry one), then A's messages again."""
    import inspect

    from starling.node.identity import Identity
    from starling.node.relay import RelayConfig, Sealer
    from starling.node.wire import WireError, encode

    sessions = 5_000 if quick else 100_000  # both past 4096: more sessions than a guard bounded by count would keep
    a, e, d = Identity.generate(), Identity.generate(), Identity.generate()
    config = RelayConfig()
    guard = Sealer(d.curve_secret, d.peer_id, config)
    by_incarnation = "incarnation" in inspect.signature(Sealer.seal).parameters
    a_incarnation, e_incarnation = time.time_ns(), time.time_ns()

    def seal(sealer: Sealer, frames: list[Any], incarnation: int) -> tuple[bytes, bytes, int]:
        if by_incarnation:
            return (*sealer.seal(d.peer_id, d.curve_public, frames, incarnation), incarnation)
        return (*sealer.seal(d.peer_id, d.curve_public, frames), incarnation)

    def opens(sender: Identity, nonce: bytes, sealed: bytes, incarnation: int) -> bool:
        try:
            if by_incarnation:
                guard.open(sender.peer_id, sender.curve_public, nonce, sealed, 16, incarnation)
            else:
                guard.open(sender.peer_id, sender.curve_public, nonce, sealed, 16)
            return True
        except WireError:
            return False

    source = Sealer(a.curve_secret, a.peer_id, config)
    early = [seal(source, encode("note", a.peer_id, i, {"x": i}), a_incarnation) for i in range(5)]
    first = sum(opens(a, *m) for m in early)
    replayed_at_once = sum(opens(a, *m) for m in early)
    other = Sealer(e.curve_secret, e.peer_id, config)
    if not by_incarnation and not hasattr(other, "_session"):
        raise NotMeasurable("Sealer's nonces carry neither a session prefix nor an incarnation")
    small = encode("note", e.peer_id, 1, None)
    fresh_opened = 0
    for k in range(sessions):
        if not by_incarnation:
            other._session = os.urandom(len(other._session))  # what a restarted sender does
        fresh_opened += opens(e, *seal(other, small, e_incarnation + k + 1))
    replayed = sum(opens(a, *m) for m in early)
    return row("relay_replays_after_sessions", replayed, "replays accepted", f"== {REPLAYS_TARGET}",
               replayed <= REPLAYS_TARGET, replayed_messages=len(early), fresh_sessions=sessions,
               session_is="incarnation" if by_incarnation else "nonce prefix",
               fresh_sessions_opened=fresh_opened, first_delivery_opened=first,
               replays_accepted_before_the_sessions=replayed_at_once,
               level="relay.Sealer (what a node opens relayed messages with), no sockets")


# ---------------------------------------------------------------------------- 5. forged beats


def forged_beats(quick: bool) -> dict[str, Any]:
    from starling.node.membership import beat_statement, sign_beat
    from starling.node.swarm import GOSSIP

    with closing_nodes() as made:
        seed = start_node(FAST)
        made.append(seed)
        attacker = member_of(seed)
        made.append(attacker)
        victim = member_of(seed)
        made.append(victim)
        client = start_node(FAST, listen=None, join=[seed.address])
        made.append(client)
        if not wait_until(lambda: client.peer_id in seed.live_peers()):
            raise RuntimeError("the client victim never joined")
        sock = Raw(seed.address, attacker.identity)
        marks: dict[str, tuple[str, int, str]] = {}  # attempt -> (victim id, counter, $via)
        try:
            k = 0
            for who, ident, node in (("member", victim.identity, victim), ("client", client.identity, client)):
                incarnation = node.record.incarnation

                def entries(k: int) -> dict[str, list[Any]]:
                    beat, via = HUGE_BEAT + k, f"{attacker.peer_id},forged{k}"
                    meta = {VIA_KEY: via}
                    genuine = sign_beat(ident, incarnation, beat, {})
                    return {
                        "signed_by_attacker": [ident.peer_id, incarnation, beat, meta,
                                               attacker.identity.sign(beat_statement(ident.peer_id, incarnation,
                                                                                     beat, meta))],
                        "random_signature": [ident.peer_id, incarnation, beat, meta, os.urandom(64)],
                        "genuine_beat_counter_raised": [*sign_beat(ident, incarnation, 5, meta)[:2], beat, meta,
                                                        sign_beat(ident, incarnation, 5, meta)[4]],
                        "genuine_beat_meta_swapped": [*genuine[:3], meta, genuine[4]],
                        "unsigned_old_shape": [ident.peer_id, incarnation, beat, meta],
                    }

                for name in entries(0):
                    k += 1
                    entry = entries(k)[name]
                    marks[f"{who}/{name}"] = (ident.peer_id, HUGE_BEAT + k, entry[3][VIA_KEY])
                    own = sign_beat(attacker.identity, attacker.record.incarnation, 10**9 + k, {})
                    sock.send(frames_of(GOSSIP, attacker.peer_id, {"u": [["a", own], ["a", entry]]}))
            if not sock.barrier():
                raise RuntimeError("the seed did not answer after the gossip")
            time.sleep(0.2)
            accepted = [name for name, (peer, beat, via) in marks.items() if _took(seed, peer, beat, via)]
            # the control: the victim's genuine beat, relayed by the same member, is taken
            control_via = "control"
            genuine = sign_beat(victim.identity, victim.record.incarnation, 10**9, {VIA_KEY: control_via})
            sock.send(frames_of(GOSSIP, attacker.peer_id, {"u": [["a", genuine]]}))
            sock.barrier()
            control = _took(seed, victim.peer_id, 10**9, control_via)
            up = not stopped(seed)
            rejected = seed.stats.snapshot()["rejected"]
        finally:
            sock.close()
    return row("forged_beats", len(accepted), "forged entries accepted", f"== {FORGED_BEATS_TARGET}",
               len(accepted) <= FORGED_BEATS_TARGET if control else None, accepted=accepted, attempts=len(marks),
               control_genuine_relayed_beat_accepted=control, seed_rejected=rejected, seed_up=up)


def _took(seed: Any, peer: str, beat: int, via: str) -> bool:
    """Whether the seed now holds `beat` (or `via` in the meta) for `peer`."""
    table = getattr(seed, "_table", None)
    info = table.get(peer) if table is not None else None
    if info is not None and getattr(info, "beat", -1) == beat:
        return True
    for p in seed.status()["peers"]:
        if p["id"] == peer and p.get("meta", {}).get(VIA_KEY) == via:
            return True
    return False


def replays_after_forgetting(quick: bool) -> dict[str, Any]:
    """A forgotten source's messages, replayed after a flood of sources pushed out its mark
    (`node.relay_sealing`'s "Replays")."""
    from starling.node.identity import Identity
    from starling.node.relay import RelayConfig, Sealer
    from starling.node.wire import WireError, encode

    sources = 5_000 if quick else 100_000
    a, d, t = Identity.generate(), Identity.generate(), Identity.generate()
    config = RelayConfig()
    guard = Sealer(d.curve_secret, d.peer_id, config)
    minute = 60 * 10**9
    a_incarnation = time.time_ns() - 2 * minute
    try:  # sealed a minute ago: the last A's run sent before it left
        past = Sealer(a.curve_secret, a.peer_id, config, clock=lambda: time.time_ns() - minute)
    except TypeError:
        past = Sealer(a.curve_secret, a.peer_id, config)  # a Sealer that takes no clock: nonces carry no time
    captured = [past.seal(d.peer_id, d.curve_public, encode("pay", a.peer_id, i, {"x": i}), a_incarnation)
                for i in range(5)]

    def opens(sender: str, curve: bytes, nonce: bytes, sealed: bytes, incarnation: int) -> bool:
        try:
            guard.open(sender, curve, nonce, sealed, 16, incarnation)
            return True
        except WireError:
            return False

    first = sum(opens(a.peer_id, a.curve_public, *m, a_incarnation) for m in captured)
    guard.guard.forget(lambda peer: False)  # the table forgot A
    note = encode("note", t.peer_id, 1, None)
    opened = 0
    for k in range(sources):  # each one message under an id of its own (one key pair), then forgotten
        name = f"throwaway{k:07d}"
        sealed = Sealer(t.curve_secret, name, config).seal(d.peer_id, d.curve_public, note, a_incarnation)
        opened += opens(name, t.curve_public, *sealed, a_incarnation)
        if k % 64 == 63:
            guard.guard.forget(lambda peer: False)
    guard.guard.forget(lambda peer: False)
    replayed = sum(opens(a.peer_id, a.curve_public, *m, a_incarnation) for m in captured)
    c = Identity.generate()
    fresh = Sealer(c.curve_secret, c.peer_id, config).seal(d.peer_id, d.curve_public, note, a_incarnation)
    return row("relay_replays_after_forgetting", replayed, "replays accepted", f"== {REPLAYS_TARGET}",
               replayed <= REPLAYS_TARGET, replayed_messages=len(captured), first_delivery_opened=first,
               throwaway_sources=sources, throwaway_opened=opened,
               fresh_source_opened=opens(c.peer_id, c.curve_public, *fresh, a_incarnation))


# ---------------------------------------------------------------------------- main

# name -> (unit, target); in the order the rows print
ROWS: dict[str, tuple[str, str]] = {
    "malformed_addresses": ("node stops", f"== {NODE_STOPS_TARGET}"),
    "dial_back": ("connections to third parties", f"== {DIAL_BACK_TARGET}"),
    "forged_beats": ("forged entries accepted", f"== {FORGED_BEATS_TARGET}"),
    "relay_replays_after_sessions": ("replays accepted", f"== {REPLAYS_TARGET}"),
    "relay_replays_after_forgetting": ("replays accepted", f"== {REPLAYS_TARGET}"),
    "amplification": ("reply bytes / request bytes (worst request)", f"<= {AMPLIFICATION_TARGET}"),
    "member_pull_rate": ("bytes/s to one member (after the first second)", f"<= {MEMBER_PULL_TARGET_BPS}"),
    "member_status_rate": ("bytes/s to one member (after the first second)", f"<= {MEMBER_PULL_TARGET_BPS}"),
    "join_table": ("joined", "== true"),
    "join_table_max_records": ("joined", "== true"),
    "sybil_lockout": ("s until an honest joiner is in", "<= 10"),
    "relay_delivery_under_flood": ("share delivered", f">= {RELAY_DELIVERY_TARGET}"),
    "relay_memory_never_reader": ("MB relay RSS growth", f"<= {RELAY_MEMORY_TARGET_MB}"),
    "relay_delivery_under_capture": ("share delivered", f">= {RELAY_DELIVERY_TARGET}"),
    "relay_delivery_under_steering": ("share delivered", f">= {RELAY_DELIVERY_TARGET}"),
}


def specs(*names: str) -> list[tuple[str, str, str]]:
    return [(name, *ROWS[name]) for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: shorter, smaller")
    parser.add_argument("--rows", default="", help=f"comma-separated subset of: {', '.join(ROWS)}")
    args = parser.parse_args()
    wanted = set(args.rows.split(",")) if args.rows else set(ROWS)
    unknown = wanted - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    quick = args.quick
    t0 = time.monotonic()
    import starling.node  # noqa: F401  (torch and all: once, before any row's clock starts)

    imported_s = time.monotonic() - t0
    relays = {"relay_delivery_under_flood", "relay_memory_never_reader", "relay_delivery_under_capture",
              "relay_delivery_under_steering"}
    # the relay's process imports while the rows before it run
    lab = RelayLab() if wanted & relays else None
    groups: list[tuple[list[str], Callable[[], Any]]] = [
        (["malformed_addresses"], lambda: malformed_addresses(quick)),
        (["dial_back"], lambda: dial_back(quick)),
        (["forged_beats"], lambda: forged_beats(quick)),
        (["relay_replays_after_sessions"], lambda: replays_after_sessions(quick)),
        (["relay_replays_after_forgetting"], lambda: replays_after_forgetting(quick)),
        (["amplification", "member_pull_rate", "member_status_rate"], lambda: amplification_rows(quick)),
        (["join_table"], lambda: join_big_table(quick, big=False)),
        (["join_table_max_records"], lambda: join_big_table(quick, big=True)),
        (["sybil_lockout"], lambda: sybil_lockout(quick)),
        (sorted(relays), lambda: relay_rows(lab, quick)),
    ]
    try:
        for names, fn in groups:
            if wanted & set(names):
                for r in measured(specs(*names), fn):
                    if r["row"] in wanted:
                        emit(r)
    finally:
        if lab is not None:
            lab.close()
    emit({"bench": "control_plane", "row": "run", "quick": quick, "import_s": round(imported_s, 1),
          "seconds": round(time.monotonic() - t0, 1)})


if __name__ == "__main__":
    main()
