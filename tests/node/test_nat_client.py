"""Client peers (nobody can dial them) and relays between them, over real CURVE sockets on
loopback. The same paths across real NAT routers are in tests/node/test_netns_nat.py."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import ECHO_CONFIG, statuses, wait_until

from starling.node import rpc
from starling.node.client import query
from starling.node.identity import Identity
from starling.node.node import Node
from starling.node.relay import (
    NONCE_BYTES,
    PROBE,
    READ,
    RELAY,
    RELAYED,
    SEALED_ACK,
    TAG_BYTES,
    VIA,
    ProbeToken,
    Relay,
    RelayConfig,
    Sealed,
    Sealer,
    pack_frames,
    unpack_frames,
)
from starling.node.transport import SendError
from starling.node.wire import Message, RejectReason, WireError, encode


@pytest.fixture
def nodes(echo_nodes):
    return echo_nodes


def _public_and_clients(make, clients: int = 2) -> tuple[list[Node], list[Node]]:
    s = make()
    r = make(join=[s.address])
    cs = [make(listen=None, join=[s.address]) for _ in range(clients)]
    everyone = [s, r, *cs]
    for node in everyone:
        assert wait_until(lambda node=node: len(node.live_peers()) == len(everyone) - 1)
    for c in cs:  # each client names both relays once it holds connections to them
        assert wait_until(lambda c=c: all(p in c.status()["meta"].get(VIA, "") for p in (s.peer_id, r.peer_id)))
    return [s, r], cs


def test_a_client_has_no_address_and_says_so(nodes):
    s = nodes()
    c = nodes(listen=None, join=[s.address])
    status = c.status()
    assert (status["reachable"], status["relay"], status["listening"], status["address"]) == (False, False, False, "")
    assert (s.status()["reachable"], s.status()["relay"]) == (True, True)
    seen = {p["id"]: p for p in s.status()["peers"]}[c.peer_id]
    assert (seen["reachable"], seen["addresses"]) == (False, [])


def test_the_unreachable_peers_are_the_clients_each_node_holds_and_itself_if_it_is_one(nodes):
    """`unreachable_peers`, what a reducer's placement leaves out of shard ownership all at
    once, says what `is_reachable` says of every peer, on a public node and on a client."""
    s = nodes()
    c = nodes(listen=None, join=[s.address])
    assert wait_until(lambda: s.live_peers() == [c.peer_id] and c.live_peers() == [s.peer_id])
    assert s.unreachable_peers() == (c.peer_id,) and c.unreachable_peers() == (c.peer_id,)
    for node in (s, c):
        assert {p for p in (s.peer_id, c.peer_id, "stranger") if not node.is_reachable(p)} == \
            set(node.unreachable_peers())


def test_a_node_that_listens_nowhere_must_join():
    with pytest.raises(ValueError, match="must join"):
        Node(config=ECHO_CONFIG).start(None, [])


def test_requests_both_ways_between_a_client_and_a_public_peer(nodes):
    s = nodes()
    c = nodes(listen=None, join=[s.address])
    assert wait_until(lambda: s.live_peers() == [c.peer_id] and c.live_peers() == [s.peer_id])
    assert c.request(s.peer_id, "echo", 1).body == {"from": s.peer_id, "got": 1}
    # the public peer answers down the connection the client opened: no relay in between
    assert wait_until(lambda: s._transport.can_send(c.peer_id))
    assert s.request(c.peer_id, "echo", 2).body == {"from": c.peer_id, "got": 2}
    assert "$relay" not in s.stats.snapshot()["bytes_sent"].get(c.peer_id, {})


def test_two_clients_talk_through_a_relay_that_reads_nothing(nodes):
    (s, r), (c1, c2) = _public_and_clients(nodes)
    big = bytes(range(256)) * 4096  # 1 MiB of payload
    reply = c1.request(c2.peer_id, "echo", {"n": 3}, payload=[big])
    assert reply.body == {"from": c2.peer_id, "got": {"n": 3}}
    relays = [n for n in (s, r) if n.stats.snapshot()["bytes_received"].get(c1.peer_id, {}).get("$relay")]
    assert relays, "the request went through neither public peer"
    # what a relay forwards is sealed: the payload's bytes appear nowhere in it
    grabbed: list[bytes] = []
    for relay in (s, r):
        original = relay._relay._forward

        async def spy(dest, relayed, original=original):
            grabbed.append(bytes(relayed.sealed))
            await original(dest, relayed)

        relay._relay._forward = spy
    c1.request(c2.peer_id, "echo", "secret text", payload=[big], timeout_s=5)
    # the request, its answer, and each one's acknowledgement (a nonce, sealed); on a loaded box
    # an acknowledgement late past its timeout sends a message again, through the other relay
    def acks() -> list[bytes]:
        return [g for g in grabbed if len(g) == len(SEALED_ACK) + NONCE_BYTES + TAG_BYTES + 8]

    assert wait_until(lambda: len(acks()) >= 2)  # the answer's goes out once it is read
    assert len(grabbed) - len(acks()) >= 2
    assert all(b"secret text" not in g and big[:4096] not in g for g in list(grabbed))


def test_a_relay_that_flips_a_byte_is_caught_and_nothing_is_delivered(nodes):
    (s, r), (c1, c2) = _public_and_clients(nodes)
    delivered: list[object] = []
    c2.on("note", lambda msg: delivered.append(msg.body))
    for relay in (s, r):
        original = relay._relay._forward

        async def flip(dest, relayed, original=original):
            altered = bytearray(relayed.sealed)
            altered[len(altered) // 2] ^= 0x01
            await original(dest, dataclasses.replace(relayed, sealed=memoryview(bytes(altered))))

        relay._relay._forward = flip
    c1.send(c2.peer_id, "note", "hello").result(5)
    assert wait_until(lambda: c2.stats.snapshot()["rejected"].get("relay_tampered", 0) >= 1)
    assert delivered == []


def test_a_replayed_relayed_message_is_refused():
    a, b = Identity.generate(), Identity.generate()
    sa = Sealer(a.curve_secret, a.peer_id, RelayConfig())
    sb = Sealer(b.curve_secret, b.peer_id, RelayConfig())
    frames = encode("note", a.peer_id, 1, {"x": 1})
    nonce, sealed = sa.seal(b.peer_id, b.curve_public, frames)
    opened = sb.open(a.peer_id, a.curve_public, nonce, sealed, 16)
    assert [bytes(f) for f in opened] == [bytes(f) for f in frames]
    with pytest.raises(WireError, match="replayed"):
        sb.open(a.peer_id, a.curve_public, nonce, sealed, 16)
    # sealed for b by a: a third party's key does not open it, nor does a claim that c sent it
    c = Identity.generate()
    nonce, sealed = sa.seal(b.peer_id, b.curve_public, frames)
    with pytest.raises(WireError, match="relay_tampered"):
        sb.open(c.peer_id, c.curve_public, nonce, sealed, 16)


def test_frame_packing_refuses_lengths_that_do_not_add_up():
    frames = [b"head", b"", b"x" * 1000]
    assert [bytes(f) for f in unpack_frames(pack_frames(frames), 8)] == frames
    packed = bytearray(pack_frames(frames))
    for bad in (packed[:3], packed[:-1], packed + b"!", b"\xff\xff\xff\xff" + packed[4:]):
        with pytest.raises(WireError):
            unpack_frames(bytes(bad), 8)


def test_relay_bodies_read_back_what_they_wrote_and_name_what_is_malformed():
    nonce, token = bytes(range(12)), b"\x01" * 8

    def message(topic, body, payload=()):
        return Message(topic, "sender", 0, 0.0, body, tuple(payload), 0)

    for topic, who in ((RELAY, "dest"), (RELAYED, "src")):
        body, payload = Sealed("peer", nonce, memoryview(b"ciphertext")).to_wire()
        sealed = Sealed.from_wire(message(topic, body, payload))
        assert (sealed.peer, sealed.nonce, bytes(sealed.sealed)) == ("peer", nonce, b"ciphertext")
        for bad_body, bad_payload in ((["peer"], payload), (["peer", "nonce"], payload), ([7, nonce], payload),
                                      ("junk", payload), (body, []), (body, [b"not a view"])):
            with pytest.raises(WireError, match=rf"\{topic} body must be \[{who}, nonce\]") as exc:
                Sealed.from_wire(message(topic, bad_body, bad_payload))
            assert exc.value.reason is RejectReason.BAD_FIELD
        with pytest.raises(WireError, match="nonce must be 12 bytes"):
            Sealed.from_wire(message(topic, ["peer", nonce[:5]], payload))
    for topic in (PROBE, READ):
        assert ProbeToken.from_wire(message(topic, ProbeToken(token).to_wire())).token == token
        for bad_body, bad_payload in (([token[:3]], ()), ([token, token], ()), (token, ()), ([token], [memoryview(b"x")])):
            with pytest.raises(WireError, match="token of 8 bytes") as exc:
                ProbeToken.from_wire(message(topic, bad_body, bad_payload))
            assert exc.value.reason is RejectReason.BAD_FIELD


def test_killing_the_relay_in_use_moves_clients_to_the_other(nodes):
    (s, r), (c1, c2) = _public_and_clients(nodes)
    first = c2.status()["meta"][VIA].split(",")[0]
    relay, other = (s, r) if first == s.peer_id else (r, s)
    assert c1.request(c2.peer_id, "echo", 1).body["got"] == 1
    carried = other.stats.snapshot()["bytes_received"].get(c1.peer_id, {}).get("$relay", 0)
    relay.close()  # no leave: a crash, as far as the others can tell
    assert wait_until(lambda: relay.peer_id not in c2.status()["meta"][VIA], timeout_s=10)
    # once the sender suspects the relay (what it handed the relay before that is lost), it tries
    # the others first
    assert wait_until(lambda: statuses(c1).get(relay.peer_id) != "alive", timeout_s=10)
    assert c1.request(c2.peer_id, "echo", 2, timeout_s=5).body["got"] == 2
    assert other.stats.snapshot()["bytes_received"][c1.peer_id].get("$relay", 0) > carried


def test_a_client_keeps_a_few_relays_and_replaces_one_that_dies(nodes):
    publics = [nodes()]
    publics += [nodes(join=[publics[0].address]) for _ in range(5)]
    c = nodes(listen=None, join=[publics[0].address])
    assert wait_until(lambda: len(c.live_peers()) == 6)
    kept = c.run(_home_relays(c))  # its `$via` count (3) and a spare, of the 6
    assert len(kept) == 4 and len(set(kept)) == 4
    assert wait_until(lambda: len(c.status()["meta"].get(VIA, "").split(",")) == 3)
    assert set(c.status()["meta"][VIA].split(",")) <= set(kept)
    gone = next(p for p in publics if p.peer_id == kept[0])
    gone.close()  # no leave: a crash
    assert wait_until(lambda: gone.peer_id not in c.live_peers(), timeout_s=30)
    now = c.run(_home_relays(c))
    assert len(now) == 4 and gone.peer_id not in now and set(kept[1:]) <= set(now)


async def _home_relays(node: Node) -> list[str]:
    return list(node._swarm.relays.choose())


def test_the_seed_dials_a_joiner_back_and_authenticates_its_key(nodes):
    s = nodes()
    b = nodes()
    endpoint = b.address.split("#")[0]
    assert query(s.address, "$reach", [[endpoint]], identity=b.identity)["reachable"] is True
    # someone else's key: the dial-back's CURVE handshake with b fails, so not reachable
    assert query(s.address, "$reach", [[endpoint]], identity=Identity.generate(), timeout_s=5)["reachable"] is False


def test_a_joiner_the_seed_cannot_dial_becomes_a_client(nodes):
    s = nodes()
    # advertises an address nobody can reach (TEST-NET-1): the dial-back times out
    c = nodes(listen="tcp://127.0.0.1:0", join=[s.address], advertise="tcp://192.0.2.1:9")
    assert c.status()["reachable"] is False
    assert wait_until(lambda: s.live_peers() == [c.peer_id])
    assert wait_until(lambda: s._transport.can_send(c.peer_id))
    assert s.request(c.peer_id, "echo", 5).body["got"] == 5


def test_relay_messages_from_a_non_relay_or_to_strangers_are_refused(nodes):
    (s, r), (c1, c2) = _public_and_clients(nodes)
    # a client is no relay: asking it to relay is refused and counted
    c1_sealed = c1._relay.sealer.seal(s.peer_id, s.identity.curve_public, encode("note", c1.peer_id, 1, None))
    c2.run(c1._asend_raw(c2.peer_id, "$relay", [s.peer_id, c1_sealed[0]], [c1_sealed[1]]))
    assert wait_until(lambda: c2.stats.snapshot()["rejected"].get("no_route", 0) == 1)
    # a relay asked to forward to someone outside the swarm refuses too
    s.run(c1._asend_raw(s.peer_id, "$relay", ["nobody", c1_sealed[0]], [c1_sealed[1]]))
    assert wait_until(lambda: s.stats.snapshot()["rejected"].get("no_route", 0) == 1)
    # a malformed envelope (no sealed frame, a body that is no [dest, nonce]) is refused and counted
    bad = s.stats.snapshot()["rejected"].get("bad_field", 0)
    s.run(c1._asend_raw(s.peer_id, "$relay", [c2.peer_id, c1_sealed[0]]))
    s.run(c1._asend_raw(s.peer_id, "$relay", "junk", [c1_sealed[1]]))
    assert wait_until(lambda: s.stats.snapshot()["rejected"].get("bad_field", 0) == bad + 2)
    # a relayed message claiming a source the destination does not know is refused
    s.run(s._asend_raw(c2.peer_id, RELAYED, ["nobody", c1_sealed[0]], [c1_sealed[1]]))
    assert wait_until(lambda: c2.stats.snapshot()["rejected"].get("unknown_peer", 0) >= 1)


def test_a_relay_caps_its_forwards_in_flight(nodes):
    s = nodes()
    relay: Relay = s._relay
    relay.forwarding = relay.config.max_forwarding
    c1 = nodes(listen=None, join=[s.address])
    c2 = nodes(listen=None, join=[s.address])
    assert wait_until(lambda: len(c1.live_peers()) == 2 and len(c2.live_peers()) == 2)
    with pytest.raises(rpc.RequestTimeout):
        c1.request(c2.peer_id, "echo", 1, timeout_s=0.5)
    assert s.stats.snapshot()["rejected"].get("busy", 0) >= 1
    relay.forwarding = 0
    assert c1.request(c2.peer_id, "echo", 2).body["got"] == 2


def test_the_replay_window_takes_late_messages_once_and_refuses_the_too_old():
    a, b = Identity.generate(), Identity.generate()
    sa = Sealer(a.curve_secret, a.peer_id, RelayConfig(replay_window=8), clock=lambda: 0)  # all in one ms
    sb = Sealer(b.curve_secret, b.peer_id, RelayConfig(replay_window=8))
    sealed = [sa.seal(b.peer_id, b.curve_public, encode("t", a.peer_id, i, None)) for i in range(20)]  # counters 1..20

    def opens(i: int) -> bool:
        try:
            sb.open(a.peer_id, a.curve_public, *sealed[i], 16)
            return True
        except WireError:
            return False

    assert [opens(i) for i in (2, 0, 1, 5, 3, 19, 12)] == [True] * 7  # out of order, within the window
    assert [opens(i) for i in (2, 19, 12)] == [False] * 3  # delivered before
    assert [opens(i) for i in (10, 11)] == [False, False]  # 9 and 8 behind the highest: past the window
    assert opens(13)  # 6 behind, never seen


def test_clients_started_with_key_files_open_what_they_relay_to_each_other(nodes, tmp_path):
    paths = []
    for name in ("relay", "a", "b"):
        Identity.generate().save(tmp_path / name)
        paths.append(tmp_path / name)
    r = nodes(key=paths[0])
    a, b = (nodes(listen=None, join=[r.address], key=p) for p in paths[1:])
    assert (a.peer_id, b.peer_id) == (Identity.load(paths[1]).peer_id, Identity.load(paths[2]).peer_id)
    for c in (a, b):
        assert wait_until(lambda c=c: len(c.live_peers()) == 2)
        assert wait_until(lambda c=c: r.peer_id in c.status()["meta"].get(VIA, ""))
    assert a.request(b.peer_id, "echo", {"n": 1}).body == {"from": b.peer_id, "got": {"n": 1}}
    assert b.request(a.peer_id, "echo", {"n": 2}).body == {"from": a.peer_id, "got": {"n": 2}}
    assert "relay_tampered" not in a.stats.snapshot()["rejected"] | b.stats.snapshot()["rejected"]


def test_a_client_names_a_relay_only_once_the_relay_has_reached_it(nodes):
    """A relay forwards to a client only down a connection the client spoke on; naming it
    before then sent other clients' messages to a relay that refused them (`no_route`)."""
    s = nodes()
    c = nodes(listen=None, join=[s.address])
    transport = c._transport
    assert wait_until(lambda: s.peer_id in c.status()["meta"].get(VIA, ""))
    assert transport.heard(s.peer_id) and s._transport.can_send(c.peer_id)

    async def reconnect() -> tuple[bool, str]:  # a fresh connection: the relay knows nothing of it yet
        transport._close(s.peer_id, 0)
        transport._dealer(s.peer_id)
        return transport.is_open(s.peer_id), c._relay.via()

    assert c._call(reconnect()) == (True, "")  # open, and not named until the relay has used it
    assert wait_until(lambda: s.peer_id in c._relay.via())  # its probe was answered down the new one


def test_a_send_after_the_sockets_close_fails_cleanly_instead_of_relaying_forever(nodes):
    s = nodes()
    r = nodes(join=[s.address])
    assert wait_until(lambda: s.live_peers() == [r.peer_id])
    s._net.run(s._transport.close())
    # no route is left to anyone, and every peer is a relay: a send that fell back to relaying
    # would ask `r` to relay to `r`, through relays, without end (a RecursionError)
    with pytest.raises(SendError, match="closed"):
        s._net.run(s._outbox.send(r.peer_id, "echo", 1))


def test_a_relay_this_node_cannot_reach_itself_is_not_asked_to_relay(nodes):
    s = nodes()
    r = nodes(join=[s.address])
    assert wait_until(lambda: s.live_peers() == [r.peer_id])
    async def forget() -> None:  # as if its address were forgotten
        s._transport._routes.pop(r.peer_id)

    s._net.run(forget())
    with pytest.raises(SendError, match="no relay is alive"):
        s._net.run(s._outbox.send(r.peer_id, "echo", 1))
