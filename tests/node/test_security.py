"""CurveZMQ allowlists, spoofing, forged records, plaintext guards, malformed traffic."""
from __future__ import annotations

import msgpack
import pytest
import zmq
from conftest import raw_dealer, statuses, wait_until

from starling.node.address import encode_key
from starling.node.identity import Identity
from starling.node.membership import PeerRecord
from starling.node.node import JoinError, Node, NodeConfig
from starling.node.security import SecurityError
from starling.node.transport import TransportConfig
from starling.node.wire import Limits, encode


def test_allowlist_admits_listed_keys_only(make_node, tmp_path):
    a_id, b_id, c_id = Identity.generate(), Identity.generate(), Identity.generate()
    allow = tmp_path / "authorized_keys"
    allow.write_text(f"; swarm members\n{encode_key(b_id.curve_public)}\n")
    a = make_node("tcp", key=a_id, authorized_keys=allow)
    seen: list = []
    a.on("x", lambda m: seen.append(m), public=True)
    b = make_node("tcp", key=b_id, join=[a.address])
    assert wait_until(lambda: b.peer_id in a.live_peers())
    short = NodeConfig(join_timeout_s=1.0, join_deadline_s=1.0)  # refused by ZAP: no answer comes, ever
    with pytest.raises(JoinError):
        Node(c_id, short).start("tcp://127.0.0.1:0", [a.address])
    # not even a public request from the outsider is accepted
    sock = raw_dealer(a.address, c_id)
    try:
        sock.send_multipart(encode("$req", c_id.peer_id, 0, ["x", 1, None]))
    except zmq.Again:
        pass  # refused before the connection existed: nothing could be sent at all
    assert not sock.poll(500)
    sock.close()
    assert seen == []
    assert a.status()["zap_denied"] >= 1
    assert set(statuses(a)) == {b.peer_id}


def test_spoofed_sender_is_rejected(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    seen: list = []
    a.on("x", lambda m: seen.append(m))
    # a member-less outsider claims to be B over its own (authenticated) connection
    sock = raw_dealer(a.address)
    sock.send_multipart(encode("x", b.peer_id, 0, "i am b"))
    assert wait_until(lambda: a.stats.snapshot()["rejected"].get("spoofed_sender") == 1)
    sock.close()
    assert seen == []


def test_message_from_non_member_is_rejected(make_node):
    a = make_node("tcp")
    seen: list = []
    a.on("x", lambda m: seen.append(m))
    sock = raw_dealer(a.address)
    sock.send_multipart(encode("x", "stranger", 0, None))
    assert wait_until(lambda: a.stats.snapshot()["rejected"].get("unknown_peer") == 1)
    sock.close()
    assert seen == []


def test_relayed_record_with_bad_signature_is_rejected(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    victim = Identity.generate()
    record = PeerRecord.create(victim, ["tcp://127.0.0.1:9"], 1)
    forged = record.to_wire()
    forged[3] = ["tcp://10.6.6.6:9"]  # the relay rewrites the victim's address
    b.run(b._asend_raw(a.peer_id, "$announce", [forged]))
    assert wait_until(lambda: a.stats.snapshot()["rejected"].get("bad_signature") == 1)
    assert victim.peer_id not in statuses(a)


def test_plaintext_is_refused_on_public_addresses(make_node):
    with pytest.raises(SecurityError, match="non-loopback"):
        Node().start("tcp://0.0.0.0:0", security="plaintext")
    node = make_node("tcp", listen="tcp://0.0.0.0:0", security="plaintext", insecure=True)
    assert node.mode.value == "plaintext"
    loop = make_node("tcp", security="plaintext")  # loopback: fine without --insecure
    assert "#" not in loop.address


def test_curve_join_address_must_carry_a_key(make_node):
    a = make_node("tcp")
    with pytest.raises(SecurityError, match="KEY"):
        Node().start("tcp://127.0.0.1:0", [a.address.split("#")[0]])


@pytest.mark.parametrize("frames", [
    [b"garbage"],
    [msgpack.packb({"v": 99, "t": "x", "s": "a", "n": 0, "ts": 0.0, "b": None, "f": []})],
    [msgpack.packb({"v": 1, "t": "x", "s": "a", "n": 0, "ts": 0.0, "b": None, "f": [["t", "float32", [4]]]}), b"\x00" * 3],
    [msgpack.packb({"v": 1, "t": "x", "s": "a", "n": 0, "ts": 0.0, "b": None, "f": [["t", "complex64", [1]]]}), b"\x00" * 8],
])
def test_malformed_frames_are_counted_and_change_nothing(make_node, frames):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    assert wait_until(lambda: len(a.live_peers()) == 1)
    before = statuses(a)
    sock = raw_dealer(a.address)
    sock.send_multipart(frames)
    assert wait_until(lambda: sum(a.stats.snapshot()["rejected"].values()) == 1)
    sock.close()
    assert statuses(a) == before
    a.on("ping2", lambda m: "pong")
    assert b.request(a.peer_id, "ping2", None).body == "pong"  # still serving


def test_oversize_frame_is_dropped_before_delivery(make_node):
    small = NodeConfig(transport=TransportConfig(max_message_bytes=64 << 10), limits=Limits(max_message_bytes=64 << 10))
    a = make_node("tcp", config=small)
    seen: list = []
    a.on("big", lambda m: seen.append(m), public=True)
    sock = raw_dealer(a.address)
    sock.send_multipart(encode("$req", "x", 0, ["big", 1, None], [b"\x00" * (1 << 20)]))
    assert not sock.poll(500)  # ZeroMQ drops the connection: no reply, no delivery
    sock.close()
    assert seen == []
    b = make_node("tcp", join=[a.address])  # the node is unharmed
    assert wait_until(lambda: b.peer_id in a.live_peers())


def _allowlist(tmp_path, *identities: Identity):
    path = tmp_path / f"allow-{len(list(tmp_path.iterdir()))}"
    path.write_text("".join(f"{encode_key(i.curve_public)}\n" for i in identities))
    return path


def test_a_relayed_record_for_a_key_off_the_allowlist_is_never_added_or_dialed(make_node, tmp_path):
    """An allowed member announces a record for a key not on the list: the node must neither
    add it as alive nor open a socket to it."""
    a_id, b_id, c_id = Identity.generate(), Identity.generate(), Identity.generate()
    a = make_node("tcp", key=a_id, authorized_keys=_allowlist(tmp_path, b_id))
    b = make_node("tcp", key=b_id, join=[a.address])  # open: it lets c in
    assert wait_until(lambda: b.peer_id in a.live_peers())
    c = make_node("tcp", key=c_id, join=[b.address])  # b announces c to a, and relays c's beats
    assert wait_until(lambda: c.peer_id in b.live_peers())
    assert wait_until(lambda: a.stats.snapshot()["rejected"].get("not_allowed", 0) >= 1)
    # a keeps hearing c's beats from b for a while; it neither adds c nor keeps asking for it
    refused = a.stats.snapshot()["rejected"]["not_allowed"]
    heard = a.stats.snapshot()["messages_received"]
    assert wait_until(lambda: a.stats.snapshot()["messages_received"] >= heard + 20)
    assert a.stats.snapshot()["rejected"]["not_allowed"] <= refused + 1  # a WANT already on its way
    assert set(statuses(a)) == {b.peer_id}
    assert not a._transport.has(c.peer_id)


def test_a_joiner_with_an_allowlist_takes_only_listed_records_from_the_join_table(make_node, tmp_path):
    a_id, b_id, d_id = Identity.generate(), Identity.generate(), Identity.generate()
    a = make_node("tcp", key=a_id)
    b = make_node("tcp", key=b_id, join=[a.address])
    c = make_node("tcp", join=[a.address])
    assert wait_until(lambda: len(a.live_peers()) == 2)
    d = make_node("tcp", key=d_id, join=[a.address], authorized_keys=_allowlist(tmp_path, a_id, b_id))
    assert d.stats.snapshot()["rejected"]["not_allowed"] == 1  # c, in a's answer
    assert set(statuses(d)) == {a.peer_id, b.peer_id} and not d._transport.has(c.peer_id)
    # a peer to join through must be on the list too
    with pytest.raises(JoinError, match="allowlist"):
        make_node("tcp", join=[c.address], authorized_keys=_allowlist(tmp_path, a_id))
