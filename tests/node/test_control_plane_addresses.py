"""No address from the wire stops a node: records are parsed when they arrive, and an endpoint
ZeroMQ refuses is that peer's problem, never the node's (real CURVE sockets on loopback)."""
from __future__ import annotations

import socket
import threading

import pytest
from conftest import TEST_LIVENESS, wait_until
from zmq.utils import z85

from starling.node.address import AddressError, parse_address, parse_record_endpoint
from starling.node.client import ClientError, query
from starling.node.hello import Hello
from starling.node.identity import Identity
from starling.node.membership import PeerRecord
from starling.node.node import Node, NodeConfig
from starling.node.swarm import ANNOUNCE, HELLO
from starling.node.wire import WireError

CONFIG = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0, reach_timeout_s=0.5)
LONG_IPC = "ipc:///tmp/" + "a" * 200
BAD = ["x", "tcp://host", "tcp://1.2.3.4:0", "tcp://0.0.0.0:7000", LONG_IPC, "tcp://10.0.0.1:7000#" + "A" * 43,
       "tcp://[::1]:070", "tcp://localhost:7000", "tcp://example.com:7000"]


@pytest.fixture
def node():
    made = Node(config=CONFIG).start("tcp://127.0.0.1:0")
    yield made
    made.close()


@pytest.mark.parametrize("address", BAD)
def test_a_record_endpoint_must_parse_and_be_canonical(address):
    with pytest.raises(AddressError):
        parse_record_endpoint(address)
    with pytest.raises(WireError, match="peer record"):
        PeerRecord.from_wire(PeerRecord.create(Identity.generate(), [address], 1).to_wire())
    assert parse_record_endpoint("tcp://127.0.0.1:7000") == "tcp://127.0.0.1:7000"


@pytest.mark.parametrize("address", ["x", LONG_IPC])
def test_a_strangers_hello_with_a_signed_record_it_cannot_dial_leaves_the_node_up(node, address):
    stranger = Identity.generate()
    record = PeerRecord.create(stranger, [address], 1)
    with pytest.raises(ClientError, match="record"):  # refused with a clear error, counted
        query(node.address, HELLO, Hello.ours(record.to_wire()).to_wire(), identity=stranger, timeout_s=5)
    assert node.fault is None and not node.closed
    assert node.stats.snapshot()["rejected"].get("bad_field", 0) >= 1
    assert query(node.address, identity=Identity.generate())["id"] == node.peer_id  # still answers


def test_a_strangers_reach_naming_a_long_ipc_path_leaves_the_node_up(node):
    from starling.node.bootstrap import REACH

    with pytest.raises(ClientError, match="ipc path"):
        query(node.address, REACH, [[LONG_IPC]], timeout_s=5)
    assert node.fault is None and not node.closed


def test_a_members_announce_of_a_record_it_cannot_dial_is_refused_and_the_node_goes_on():
    a = Node(config=CONFIG).start("tcp://127.0.0.1:0")
    b = Node(config=CONFIG).start("tcp://127.0.0.1:0", join=[a.address])
    try:
        assert wait_until(lambda: b.peer_id in a.live_peers())
        forged = PeerRecord.create(Identity.generate(), ["x"], 1)

        async def announce() -> None:
            await b._asend_raw(a.peer_id, ANNOUNCE, [forged.to_wire()])

        b._call(announce())
        assert wait_until(lambda: a.stats.snapshot()["rejected"].get("bad_field", 0) >= 1)
        assert forged.peer_id not in [p.id for p in a.peers]
        assert a.fault is None and query(a.address, timeout_s=5)["id"] == a.peer_id
    finally:
        b.close()
        a.close()


def test_an_endpoint_zeromq_refuses_fails_that_peers_sends_and_never_the_node(node):
    transport = node._transport

    async def dial() -> None:
        # past the parser: ZeroMQ itself refuses it
        transport.connect("nowhere", [LONG_IPC], z85.encode(Identity.generate().curve_public))

    node._call(dial())
    assert transport.connect_failures == 1 and not transport.is_open("nowhere")
    assert node.status()["sockets"]["connect_failures"] == 1
    assert node.fault is None and not node.closed


def _listener(host: str) -> tuple[socket.socket, list]:
    """A plain TCP listener that counts the connections it accepts (a third party's port)."""
    server = socket.socket()
    server.bind((host, 0))
    server.listen(64)
    server.settimeout(0.05)
    accepted: list = []

    def accept() -> None:
        while server.fileno() >= 0:
            try:
                conn, _ = server.accept()
                accepted.append(conn)
            except (TimeoutError, OSError):
                continue

    threading.Thread(target=accept, daemon=True).start()
    return server, accepted


def test_the_dial_back_dials_only_the_ip_the_request_came_from(node):
    """A stranger on 127.0.0.1 names a third party on 127.0.0.2 (and a unix socket): the node
    opens no connection to either, answers at once, and counts it."""
    from starling.node.bootstrap import REACH

    server, accepted = _listener("127.0.0.2")
    try:
        third_party = f"tcp://127.0.0.2:{server.getsockname()[1]}"
        before = node.stats.snapshot()["rejected"].get("reach_elsewhere", 0)
        for _ in range(4):
            answer = query(node.address, REACH, [[third_party, "ipc:///tmp/starling-third-party.sock"]], timeout_s=5)
            assert answer["reachable"] is False and "came from" in answer["reason"]
        assert node.stats.snapshot()["rejected"]["reach_elsewhere"] == before + 4
        assert accepted == []  # a dial-back connects before its answer is sent
    finally:
        server.close()


def test_a_joiner_that_listens_off_its_default_source_ip_is_dialled_back():
    """A joiner advertising 127.0.0.3 asks from 127.0.0.3 (its request's source is the IP it
    advertises), so the seed's dial-back finds it, and it joins as a reachable member."""
    from starling.node.bootstrap import Bootstrap

    seed = Node(config=CONFIG).start("tcp://127.0.0.1:0")
    joiner = Node(config=CONFIG)
    try:
        joiner.start("tcp://127.0.0.3:0", [seed.address])
        endpoint = joiner.address.split("#")[0]
        # loopback joiners skip the dial-back; ask it as a joiner off loopback would
        assert joiner.run(Bootstrap.reachable_via(joiner._bootstrap, [parse_address(seed.address)], [endpoint])) is True
        assert wait_until(lambda: joiner.peer_id in seed.live_peers())
    finally:
        joiner.close()
        seed.close()


def test_a_name_is_dialled_back_at_the_askers_ip_not_resolved_again(node):
    """`localhost` resolves to the asker's 127.0.0.1: the dial-back goes to that IP, written as
    such (ZeroMQ resolving the name itself could reach another host)."""
    from starling.node.bootstrap import REACH

    b = Node(config=CONFIG).start("tcp://127.0.0.1:0")
    try:
        port = b.address.split("#")[0].rsplit(":", 1)[1]
        answer = query(node.address, REACH, [[f"tcp://localhost:{port}"]], identity=b.identity, timeout_s=5)
        assert answer == {"reachable": True, "endpoint": f"tcp://127.0.0.1:{port}"}
    finally:
        b.close()


@pytest.mark.parametrize("zone", ["z" * 16, "z" * 490, "a:b"])
def test_an_ipv6_zone_must_be_an_interface_name(zone):
    with pytest.raises(AddressError, match="zone"):
        parse_record_endpoint(f"tcp://[fe80::1%{zone}]:7000")
    assert parse_record_endpoint("tcp://[fe80::1%eth0]:7000") == "tcp://[fe80::1%eth0]:7000"


def test_a_member_cannot_make_a_tcp_node_dial_a_local_unix_socket():
    a = Node(config=CONFIG).start("tcp://127.0.0.1:0")
    b = Node(config=CONFIG).start("tcp://127.0.0.1:0", join=[a.address])
    try:
        record = PeerRecord.create(Identity.generate(), ["ipc:///tmp/starling-someone-elses.sock"], 1)
        b.run(b._asend_raw(a.peer_id, ANNOUNCE, [record.to_wire()]))
        assert wait_until(lambda: a.stats.snapshot()["rejected"].get("bad_field", 0) >= 1)
        assert record.peer_id not in a.live_peers()
    finally:
        b.close()
        a.close()


def test_an_advertised_name_is_signed_as_the_address_it_resolves_to():
    node = Node(config=CONFIG).start("tcp://127.0.0.1:0", advertise="tcp://localhost:7123")
    try:
        assert node.record.addresses in (("tcp://127.0.0.1:7123",), ("tcp://[::1]:7123",))
    finally:
        node.close()
