"""A relay and its clients against a hostile member, over real CURVE sockets on loopback:
forwards only to clients attached to the relay, a flood toward dead destinations, a client
that never reads, and replays after a flood of fresh nonces from another source."""
from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import replace

import pytest
from conftest import ECHO_CONFIG, TEST_LIVENESS, statuses, wait_until

from starling.node.identity import Identity
from starling.node.node import Node, NodeConfig
from starling.node.relay import (
    COUNTER_BITS,
    FORWARDS,
    NOT_A_CLIENT,
    QUEUE_FULL,
    RELAY,
    RELAYED,
    TOO_LARGE,
    VIA,
    RelayConfig,
    Sealer,
    sealed_ns,
)
from starling.node.relay_delivery import ACKS
from starling.node.wire import WireError, encode

NO_RELAY = replace(ECHO_CONFIG, offer_relay=False)


@pytest.fixture
def nodes(echo_nodes):
    return echo_nodes


def _all_live(*everyone: Node) -> None:
    for node in everyone:
        assert wait_until(lambda node=node: len(node.live_peers()) == len(everyone) - 1)


def _attached(client: Node, relay: Node) -> None:
    """Wait until `client` names `relay` in `$via`: the relay can forward to it."""
    assert wait_until(lambda: relay.peer_id in client.status()["meta"].get(VIA, ""))


def _rejected(node: Node, reason: str) -> int:
    return node.stats.snapshot()["rejected"].get(reason, 0)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_relay_forwards_only_to_clients_attached_to_it(nodes):
    s = nodes()
    m = nodes(join=[s.address], config=NO_RELAY)  # a member anyone can dial
    c = nodes(listen=None, join=[s.address])
    _all_live(s, m, c)
    got: list[object] = []
    m.on("note", lambda msg: got.append(msg.body))
    nonce, sealed = c._relay.sealer.seal(m.peer_id, m.identity.curve_public,
                                         c._outbox.frames("note", "through the relay"), c.record.incarnation)
    c.run(c._asend_raw(s.peer_id, RELAY, [m.peer_id, nonce], [sealed]))
    assert wait_until(lambda: _rejected(s, "no_route") >= 1 or got)
    assert got == []
    assert s.status()["relaying"]["refused"][NOT_A_CLIENT] == 1
    assert RELAYED not in s.stats.snapshot()["bytes_sent"].get(m.peer_id, {})


def test_a_flood_toward_dead_destinations_leaves_honest_clients_their_relay(nodes):
    queue = 32  # messages a client may have queued at the relay, small so that the flood fills one
    s = nodes(config=NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0,
                                relay=RelayConfig(max_queued_messages=queue)))
    # a member whose record names a port nobody listens on: the relay can never dial it
    x = nodes(join=[s.address], config=NO_RELAY, advertise=f"tcp://127.0.0.1:{_closed_port()}")
    a = nodes(join=[s.address], config=NO_RELAY)  # the flooder
    c1, c2, gone = (nodes(listen=None, join=[s.address]) for _ in range(3))
    assert wait_until(lambda: len(s.live_peers()) == 5)  # x is alive to it: x's pings come in
    for c, other in ((c1, c2), (c2, c1)):  # (others cannot ping x: they see it only in digests)
        assert wait_until(lambda c=c, other=other: {s.peer_id, other.peer_id} <= set(c.live_peers()))
    for c in (c1, c2, gone):
        _attached(c, s)
    gone.close()  # a client that is gone, though the relay still holds its route
    junk = os.urandom(1024)
    stop = asyncio.Event()

    async def flood() -> int:
        sent = 0
        while not stop.is_set():
            for dest in (x.peer_id, gone.peer_id, c2.peer_id):
                await a._asend_raw(s.peer_id, RELAY, [dest, os.urandom(12)], [junk], wait=False)
                sent += 1
            await asyncio.sleep(0.003)
        return sent

    flooding = a.submit(flood())
    try:
        assert wait_until(lambda: s.status()["relaying"]["refused"][NOT_A_CLIENT] >= 100)
        answered = 0
        for i in range(40):
            try:
                answered += c1.request(c2.peer_id, "echo", i, timeout_s=2.0).body["got"] == i
            except Exception:
                pass
    finally:
        a.run(_set(stop))
    assert flooding.result(5) > 300
    assert answered >= 38, f"{answered}/40 honest requests answered under the flood"
    relaying = s.status()["relaying"]
    assert relaying["refused"][NOT_A_CLIENT] >= 100  # refused at once, never waited on
    assert relaying["forwarding"] == 0
    # the gone client's queue filled to the flooder's share of its bound, and no further (the
    # rest of it is other senders': the members' probes of the gone client go through the relay too)
    assert relaying["refused"][QUEUE_FULL] > 0
    assert 0 < s.run(_held_by(s, gone.peer_id, a.peer_id)) <= queue // 2
    assert s._relay.queued(gone.peer_id)[1] <= queue


async def _held_by(relay: Node, client: str, source: str) -> int:
    lane = relay._relay._lanes.get(client)
    held = None if lane is None else lane.by_source.get(source)
    return 0 if held is None else held.messages


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_one_source_cannot_take_every_forward_slot(nodes):
    s = nodes()
    c1, c2 = (nodes(listen=None, join=[s.address]) for _ in range(2))
    _all_live(s, c1, c2)
    _attached(c2, s)
    relay = s._relay
    half = relay.config.max_forwarding // 2

    async def hold(n: int) -> None:  # a member with forwards in flight (as when forwards could wait)
        relay._in_flight["hog"] = relay._in_flight.get("hog", 0) + n
        relay.forwarding += n

    s.run(hold(half))
    try:
        assert relay._no_slot("hog") is not None  # alone, it may hold max_forwarding / 2
        assert c1.request(c2.peer_id, "echo", 1).body["got"] == 1  # another source still gets a slot
        assert relay.refused[FORWARDS] == 0
    finally:
        s.run(hold(-half))


def test_a_client_that_never_reads_holds_no_more_than_its_bound_at_the_relay(nodes):
    bound = 1 << 20
    s = nodes(config=NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0,
                                relay=RelayConfig(max_queued_bytes=bound)))
    c, d = (nodes(listen=None, join=[s.address]) for _ in range(2))
    _all_live(s, c, d)
    _attached(d, s)
    got: list[int] = []
    d.on("note", lambda msg: got.append(msg.body))
    transport = d._transport

    async def stop_reading() -> None:
        transport._tasks.pop(s.peer_id).cancel()

    async def read_again() -> None:
        transport._tasks[s.peer_id] = asyncio.ensure_future(transport._read(transport._dealers[s.peer_id], s.peer_id))

    c.send(d.peer_id, "note", "big", payload=[os.urandom(bound)]).result(5)  # more than the bound, sealed
    assert wait_until(lambda: s.status()["relaying"]["refused"][TOO_LARGE] == 1)
    d.run(stop_reading())
    chunk = os.urandom(64 << 10)
    for i in range(100):  # 6.4 MiB for a client that reads none of it
        c.send(d.peer_id, "note", i, payload=[chunk]).result(5)
    # the relay has read all 100: it forwarded some (none proven read) and refused the rest
    assert wait_until(lambda: s.status()["relaying"]["refused"][QUEUE_FULL] + s._relay.queued(d.peer_id)[1] == 100)
    assert s.status()["relaying"]["refused"][QUEUE_FULL] >= 80
    held, messages = s._relay.queued(d.peer_id)
    assert 0 < held <= bound
    handed = s.stats.snapshot()["bytes_sent"][d.peer_id][RELAYED]
    assert handed <= bound + messages * 256  # the forwarded messages' headers
    assert _rejected(s, "busy") >= 80
    # reading again, the client answers the relay's probe, and what it is sent arrives again
    d.run(read_again())
    assert wait_until(lambda: len(got) == messages)
    assert wait_until(lambda: c.send(d.peer_id, "note", -1, payload=[chunk]).result(5) or -1 in got, interval_s=0.1)
    assert wait_until(lambda: s._relay.queued(d.peer_id)[0] < bound // 2)


def test_a_replay_is_refused_after_a_flood_of_fresh_nonces_from_another_source(nodes):
    s = nodes()  # the relay, hostile: it keeps what it forwards, and is a member who can seal as itself
    c, d = (nodes(listen=None, join=[s.address]) for _ in range(2))
    _all_live(s, c, d)
    _attached(d, s)
    notes: list[object] = []
    d.on("note", lambda msg: notes.append(msg.body))
    captured: list[tuple[str, list, bytes]] = []
    original = s._relay._forward

    async def keep(dest, relayed):
        body, payload = relayed.to_wire()
        captured.append((dest, body, bytes(payload[0])))
        await original(dest, relayed)

    s._relay._forward = keep
    c.send(d.peer_id, "note", "pay once").result(5)
    assert wait_until(lambda: notes == ["pay once"])
    dest, body, sealed = captured[0]
    # 5000 messages sealed by s for d, each under a nonce of its own later "run": more than
    # the window, and more than any bound on sources a shared table could hold
    sealer = Sealer(s.identity.curve_secret, s.peer_id, RelayConfig())
    frames = encode("junk", s.peer_id, 0, None)
    base = s.record.incarnation
    for start in range(0, 5000, 500):
        async def burst(start: int = start) -> None:
            for i in range(start, start + 500):
                nonce, junk = sealer.seal(d.peer_id, d.identity.curve_public, frames, base + i)
                await s._asend_raw(d.peer_id, RELAYED, [s.peer_id, nonce], [junk])

        s.run(burst())
        assert wait_until(lambda start=start: _rejected(d, "unknown_topic") == start + 500)
    s.run(s._asend_raw(dest, RELAYED, body, [sealed]))  # the captured message, again
    assert wait_until(lambda: _rejected(d, "replayed") == 1)
    assert notes == ["pay once"]


def test_a_message_from_an_earlier_run_of_its_source_is_refused_whatever_was_forgotten():
    a, b = Identity.generate(), Identity.generate()
    frames = encode("note", a.peer_id, 1, {"x": 1})
    first_run = time.time_ns() - 10**9  # incarnations are the wall-clock ns a run started
    old = Sealer(a.curve_secret, a.peer_id, RelayConfig()).seal(b.peer_id, b.curve_public, frames, first_run)
    second_run = time.time_ns() + 1
    receiver = Sealer(b.curve_secret, b.peer_id, RelayConfig())
    receiver.open(a.peer_id, a.curve_public, *old, 16, first_run)
    # the table forgot a (its window goes): its highest nonce is kept, so the message is still refused
    receiver.guard.forget(lambda peer: False)
    assert len(receiver.guard) == 0
    with pytest.raises(WireError, match="delivered before"):
        receiver.open(a.peer_id, a.curve_public, *old, 16, first_run)
    # a restarted: its record's incarnation alone refuses what the first run sealed, even to a
    # receiver that remembers nothing of a
    for fresh in (receiver, Sealer(b.curve_secret, b.peer_id, RelayConfig())):
        with pytest.raises(WireError, match="earlier run"):
            fresh.open(a.peer_id, a.curve_public, *old, 16, second_run)
    before = time.time_ns()
    new = Sealer(a.curve_secret, a.peer_id, RelayConfig()).seal(b.peer_id, b.curve_public, frames, second_run)
    assert int.from_bytes(new[0], "big") >> COUNTER_BITS == second_run
    assert before - 10**6 <= sealed_ns(second_run, int.from_bytes(new[0], "big")) <= time.time_ns()  # when, to the ms
    assert [bytes(f) for f in receiver.open(a.peer_id, a.curve_public, *new, 16, second_run)] == \
        [bytes(f) for f in frames]


def test_a_replay_after_its_source_was_forgotten_and_its_mark_flushed_is_refused():
    """A departed source is forgotten `forget_after_s` after it left; a flood of throwaway
    sources then pushes its mark out of the guard's memory. What it sealed lies below the floor
    its mark left, so a replay is refused however many sources came; a source that seals now,
    even one never heard before, is still taken."""
    a, b = Identity.generate(), Identity.generate()
    frames = encode("note", a.peer_id, 1, {"pay": 1})
    minute = 60 * 10**9
    incarnation = time.time_ns() - 2 * minute
    # sealed a minute ago, the last a's run sent before it left; the table forgot a only now
    past = Sealer(a.curve_secret, a.peer_id, RelayConfig(), clock=lambda: time.time_ns() - minute)
    captured = past.seal(b.peer_id, b.curve_public, frames, incarnation)
    receiver = Sealer(b.curve_secret, b.peer_id, RelayConfig(max_keys=64))
    receiver.open(a.peer_id, a.curve_public, *captured, 16, incarnation)
    receiver.guard.forget(lambda peer: False)
    guard = receiver.guard
    for i in range(1000):  # throwaway sources, each heard once and then forgotten
        guard.accept(f"throwaway-{i}", (time.time_ns() << COUNTER_BITS) + 1)
        guard.forget(lambda peer: False)
    with pytest.raises(WireError, match="still remembers"):
        receiver.open(a.peer_id, a.curve_public, *captured, 16, incarnation)
    c = Identity.generate()
    fresh = Sealer(c.curve_secret, c.peer_id, RelayConfig()).seal(b.peer_id, b.curve_public, frames, incarnation)
    assert len(receiver.open(c.peer_id, c.curve_public, *fresh, 16, incarnation)) == len(frames)


def test_each_direction_of_a_pair_seals_under_its_own_key():
    """Both peers of a pair start their nonces from their incarnations; were the key shared,
    two runs started in the same nanosecond would seal under one key and nonce."""
    a, b = Identity.generate(), Identity.generate()
    sa = Sealer(a.curve_secret, a.peer_id, RelayConfig(), clock=lambda: 5)  # both in one nanosecond
    sb = Sealer(b.curve_secret, b.peer_id, RelayConfig(), clock=lambda: 5)
    frames = encode("note", a.peer_id, 1, None)
    nonce_ab, sealed_ab = sa.seal(b.peer_id, b.curve_public, frames, 7)
    nonce_ba, sealed_ba = sb.seal(a.peer_id, a.curve_public, frames, 7)
    assert nonce_ab == nonce_ba
    assert sealed_ab[:-16] != sealed_ba[:-16]  # the ciphertexts, tags aside: different keystreams


FAST_ACKS = replace(ECHO_CONFIG, relay=RelayConfig(ack_timeout_s=0.5))


def _capturing_relay(nodes, seed: Node) -> Node:
    """A member that offers to relay and drops every `$relay` it is handed."""
    m = nodes(join=[seed.address], config=FAST_ACKS)
    m._dispatch.on_internal_message(RELAY, lambda msg: None)
    return m


def _acknowledges(sender: Node, dest: Node) -> None:
    """Wait until `sender` has `dest`'s beat saying it acknowledges what it is relayed. A client's
    beats reach another client only through members, each of which passes a beat on a bounded
    number of times: one spent before `sender` knew `dest` comes again only with `dest`'s next
    meta, so `dest` moves its meta on while we wait, as a training peer's progress does."""
    said = [0.0, 0]

    def known() -> bool:
        if time.monotonic() - said[0] >= 1.0:
            said[0], said[1] = time.monotonic(), said[1] + 1
            dest.set_meta(progress=said[1])
        return bool((sender._table.get(dest.peer_id).meta or {}).get(ACKS))
    assert wait_until(known, timeout_s=30)


def test_a_relay_that_drops_everything_is_fallen_back_from_and_avoided(nodes):
    s = nodes(config=FAST_ACKS)
    m = _capturing_relay(nodes, s)
    c1, c2 = (nodes(listen=None, join=[s.address], config=FAST_ACKS) for _ in range(2))
    _all_live(s, m, c1, c2)
    for c in (c1, c2):
        _attached(c, s)
        _attached(c, m)
        c._relay.deliveries._ranks[m.peer_id] = -1.0  # the capturing relay is each client's first choice
    _acknowledges(c1, c2)
    _acknowledges(c2, c1)
    assert c1._relay.relays_for(c2.peer_id)[0] == m.peer_id
    answered = sum(c1.request(c2.peer_id, "echo", i, timeout_s=5.0).body["got"] == i for i in range(20))
    assert answered == 20
    delivery = c1.status()["relaying"]["delivery"]
    assert delivery["fell_back"] >= 1 and delivery["drops"].get(m.peer_id, 0) > 0.5
    # once it dropped, it is tried last: the other requests went through the honest relay at once
    assert c1._relay.relays_for(c2.peer_id)[-1] == m.peer_id
    assert delivery["fell_back"] <= 2 and delivery["acked"] >= 18
    assert _rejected(c2, "replayed") <= 2  # a copy the slow first relay delivered late, at most


def test_suspect_claims_about_a_clients_relay_do_not_steer_its_traffic(nodes):
    from starling.node.swarm import GOSSIP
    from starling.node.updates import SUSPECT, Claim

    r = nodes(config=FAST_ACKS)
    m = _capturing_relay(nodes, r)  # the claimant, a relay that drops what it is handed
    c1, c2 = (nodes(listen=None, join=[r.address], config=FAST_ACKS) for _ in range(2))
    _all_live(r, m, c1, c2)
    for c in (c1, c2):
        _attached(c, r)
        c._relay.deliveries._ranks[m.peer_id] = 1.0  # the honest relay first, until the claims
        c._relay.deliveries._ranks[r.peer_id] = 0.0
    _acknowledges(c1, c2)
    _acknowledges(c2, c1)
    stop = asyncio.Event()

    async def accuse() -> int:
        sent = 0
        while not stop.is_set():
            at = m._table.live_at(r.peer_id)
            if at is not None:
                claim = Claim.sign(m._local.identity, SUSPECT, r.peer_id, *at).to_wire()
                for target in (c1, c2, r):
                    await m._asend_raw(target.peer_id, GOSSIP, {"u": [claim]}, wait=False)
                    sent += 1
            await asyncio.sleep(0.1)
        return sent

    accusing = m.submit(accuse())
    try:
        assert wait_until(lambda: c1.status()["claims"]["refuted"] >= 1)
        answered = sum(c1.request(c2.peer_id, "echo", i, timeout_s=5.0).body["got"] == i for i in range(20))
        # refuted three times, the claimant is no longer believed about the relay
        assert wait_until(lambda: c1.status()["claims"]["discounted"] > 0, timeout_s=30)
    finally:
        m.run(_set(stop))
    assert accusing.result(5) > 0
    assert answered == 20
    assert c1.status()["relaying"]["delivery"]["fell_back"] == 0  # never steered onto the claimant
    assert m.peer_id in c1.status()["claims"]["most_refuted"]
    assert wait_until(lambda: statuses(c1).get(r.peer_id) == "alive")
