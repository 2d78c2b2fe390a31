"""SWIM's rules one by one: the arithmetic of `node.swim` on a fake clock, then indirect probes,
refutation and claims between real nodes on loopback sockets."""
from __future__ import annotations

import math
import random
import time

import msgpack
import pytest
from conftest import TEST_LIVENESS, statuses, wait_until

from starling.node.identity import Identity
from starling.node.node import NodeConfig
from starling.node.swim import (
    NEWS,
    NEWS_SHARE,
    ROUTINE,
    URGENT,
    Awareness,
    Broadcasts,
    IdSet,
    Liveness,
    ProbeOrder,
    Suspicion,
)
from starling.node.transport import TransportConfig
from starling.node.updates import DEAD, SUSPECT, Claim, parse_updates, sign_claim
from starling.node.wire import RejectReason, WireError


def test_suspicion_timeout_grows_with_log_n_and_shrinks_with_independent_confirmations():
    lv = Liveness(suspicion_base_s=3.0, suspicion_per_decade_s=0.5, suspicion_max_mult=4.0)
    assert lv.suspicion_bounds(1) == (3.0, 12.0)
    low, high = lv.suspicion_bounds(1000)
    assert math.isclose(low, 4.5) and math.isclose(high, 18.0)
    s = Suspicion((1, 0), "a", start=100.0, min_s=low, max_s=high, expected=3)
    assert math.isclose(s.expires_at(), 118.0)  # alone: the long timeout
    assert s.confirm("b") and not s.confirm("b")  # the same member twice counts once
    one = s.timeout_s
    assert low < one < high
    assert s.confirm("c") and s.timeout_s < one
    assert s.confirm("d") and math.isclose(s.timeout_s, low)  # `expected` confirmations: the shortest
    assert not s.confirm("e") and math.isclose(s.timeout_s, low)
    s.pardon(2.0)  # this node stalled: the suspect gets that long again to refute
    assert math.isclose(s.expires_at(), 100.0 + 2.0 + low)
    assert Suspicion((1, 0), "a", 0.0, low, high, expected=0).timeout_s == low  # nobody else could confirm


def test_awareness_stretches_periods_up_to_its_ceiling_and_recovers():
    a = Awareness(max_score=8)
    assert a.scale(1.0) == 1.0
    a.apply(3)
    assert a.scale(0.5) == 2.0
    a.apply(100)
    assert a.score == 7 and a.scale(1.0) == 8.0
    for _ in range(10):
        a.apply(-1)
    assert a.score == 0 and a.scale(1.0) == 1.0


def test_probe_order_visits_every_member_once_per_pass_and_fits_in_joiners():
    rng = random.Random(1)
    members = IdSet()
    for i in range(10):
        members.add(f"p{i}")
    order = ProbeOrder(rng)
    first = [order.next(members) for _ in range(10)]
    assert sorted(first) == sorted(members)  # one pass: each exactly once
    second = [order.next(members) for _ in range(3)]
    members.add("late")
    order.add("late")  # joins mid-pass: probed before the pass ends
    members.remove(second[0])
    rest = [order.next(members) for _ in range(8)]
    assert "late" in rest and second[0] not in rest
    assert sorted(second + rest) == sorted(set(members) | {second[0]})
    assert ProbeOrder(rng).next(IdSet()) is None


def test_idset_samples_without_repeats_and_removes_in_place():
    ids = IdSet()
    for i in range(100):
        ids.add(str(i))
    assert not ids.add("5") and ids.remove("5") and not ids.remove("5") and "5" not in ids
    sample = ids.sample(random.Random(0), 10, but=("7",))
    assert len(set(sample)) == 10 and "7" not in sample and "5" not in sample
    assert sorted(IdSet().sample(random.Random(0), 3)) == []


def test_broadcasts_send_each_update_a_bounded_number_of_times_least_sent_and_urgent_first():
    lv = Liveness(retransmit_mult=3)
    assert lv.retransmit_limit(5) == 3 and lv.retransmit_limit(128) == 9 and lv.retransmit_limit(4096) == 12
    q = Broadcasts()
    q.add(("a", "x"), ["a", ["x", 1, 1, {}, b"s" * 64]])
    q.add(("d", "y"), ["d", "y", 1, 0, "z", b"s" * 64], URGENT)
    assert q.eager == 1
    first = q.take(10_000, limit=2)
    assert [u[0] for u in first] == ["d", "a"]  # urgent first
    assert [u[0] for u in q.take(10_000, limit=2)] == ["d", "a"]
    assert q.take(10_000, limit=2) == [] and len(q) == 0 and q.eager == 0  # each sent `limit` times
    # a newer update about the same thing replaces the older, and starts its count again
    q.add(("a", "x"), ["a", ["x", 1, 1, {}, b"s" * 64]])
    q.take(10_000, limit=3)
    q.add(("a", "x"), ["a", ["x", 1, 2, {}, b"s" * 64]])
    assert len(q) == 1 and q.take(10_000, limit=3)[0][1][2] == 2
    # the byte budget bounds one message; what does not fit waits
    for i in range(20):
        q.add(("a", str(i)), ["a", [str(i), 1, 1, {}, b"s" * 64]])
    taken = q.take(300, limit=3)
    assert 1 <= len(taken) < 20
    assert q.take(300, limit=3, eager_only=True) == []
    # bounded: past max_items the most-sent half goes
    small = Broadcasts(max_items=8)
    for i in range(20):
        small.add(("a", str(i)), ["a", [str(i), 1, 1, {}, b"s" * 64]])
    assert len(small) <= 8


def test_news_is_passed_on_for_its_time_then_dropped_sent_or_not():
    """A mass join queues thousands of records at every member; what waits past
    `Liveness.news_for_s` is dropped unsent (anti-entropy brings it to whoever missed it), so
    the records stop riding on messages soon after the swarm forms. Only news ages: claims and
    beats do not."""
    lv = Liveness(probe_interval_s=2.0, retransmit_mult=3)
    assert lv.news_for_s(128) == 9 * 2.0 and lv.news_for_s(4096) == 12 * 2.0
    q = Broadcasts()
    q.add(("r", "old"), ["r", {"id": "old"}], NEWS, now=100.0)
    q.add(("d", "y"), ["d", "y", 1, 0, "z", b"s" * 64], URGENT, now=100.0)
    q.add(("a", "x"), ["a", ["x", 1, 1, {}, b"s" * 64]], ROUTINE, now=100.0)
    q.add(("r", "new"), ["r", {"id": "new"}], NEWS, now=110.0)
    assert [u[1]["id"] for u in q.take(10_000, limit=5) if u[0] == "r"] == ["new", "old"]  # sent once each
    q.expire_news(before=105.0)
    assert q.count(NEWS) == 1 and q.expired == 1 and q.eager == 2
    assert {u[0] for u in q.take(10_000, limit=5)} == {"r", "d", "a"}
    # news replaced by a newer update about the same peer is dated anew
    q.add(("r", "new"), ["r", {"id": "new", "v": 2}], NEWS, now=120.0)
    q.expire_news(before=115.0)
    assert q.count(NEWS) == 1 and q.expired == 1
    q.expire_news(before=121.0)
    assert q.count(NEWS) == 0 and q.expired == 2 and len(q) == 2  # the claim and the beat stay
    # news sent its limit's times is gone already, and its date no longer counts
    q.add(("r", "quick"), ["r", {"id": "quick"}], NEWS, now=130.0)
    q.take(10_000, limit=1)
    q.expire_news(before=200.0)
    assert q.expired == 2
    # the dates kept stay bounded however much news replaces news
    small = Broadcasts(max_items=8)
    for i in range(1000):
        small.add(("r", "same"), ["r", {"id": "same", "v": i}], NEWS, now=float(i))
    assert len(small._news_ages) <= 4 * 8 + 64 + 1 and small.count(NEWS) == 1
    small.expire_news(before=998.5)
    assert small.count(NEWS) == 1 and small.expired == 0


def test_news_keeps_its_share_of_every_message_whatever_the_claims_waiting():
    """A storm of claims does not stall a join, nor a mass join a claim: with news waiting,
    claims take at most (NEWS_SHARE - 1) / NEWS_SHARE of a message, and news the rest."""
    q = Broadcasts()
    for i in range(200):  # far more claims than one message holds
        q.add(("s", str(i)), ["s", str(i), 1, 0, "z", b"s" * 64], URGENT)
    q.add(("r", "joiner"), ["r", {"id": "joiner", "pad": b"r" * 100}], NEWS)
    q.add(("a", "x"), ["a", ["x", 1, 1, {}, b"s" * 64]])  # a routine beat: only in room left over
    taken = q.take(1200, limit=3)
    kinds = [u[0] for u in taken]
    assert "r" in kinds and kinds.count("s") >= 1
    claims_bytes = sum(len(__import__("msgpack").packb(u, use_bin_type=True)) for u in taken if u[0] == "s")
    assert claims_bytes <= 1200 * (NEWS_SHARE - 1) // NEWS_SHARE
    # once the news is sent its `limit` times, claims take whole messages again
    q.take(1200, limit=3), q.take(1200, limit=3)
    assert q.count(NEWS) == 0
    assert sum(1 for u in q.take(1200, limit=3) if u[0] == "s") > kinds.count("s")
    # and news alone goes out on the gossip fan-out, ahead of routine beats
    fresh = Broadcasts()
    fresh.add(("a", "x"), ["a", ["x", 1, 1, {}, b"s" * 64]])
    fresh.add(("r", "j"), ["r", {"id": "j"}], NEWS)
    assert fresh.eager == 1 and [u[0] for u in fresh.take(1200, limit=3, eager_only=True)] == ["r"]
    with pytest.raises(ValueError):
        fresh.add(("a", "y"), ["a"], 7)


def test_claims_are_signed_by_their_claimant():
    claimant, other = Identity.generate(), Identity.generate()
    claim = sign_claim(claimant, SUSPECT, "victim", 3, 1)
    assert [u.to_wire() for u in parse_updates([claim])] == [claim]
    assert Claim.from_wire(claim).is_signed(claimant.verify_key)
    forged = sign_claim(other, DEAD, "victim", 3, 1)
    forged[4] = claimant.peer_id  # another member's claim passed off as the claimant's
    assert not Claim.from_wire(forged).is_signed(claimant.verify_key)


def test_typed_updates_round_trip_and_name_what_they_are_about():
    peer = Identity.generate()
    claim = Claim.sign(peer, SUSPECT, "victim", 3, 1)
    wire = [["a", ["p", 1, 2, {"step": 3}, bytes(64)]], ["r", ["p", b"k" * 32, b"c" * 32, [], 1, bytes(64), False]],
            claim.to_wire(), ["d", "victim", 3, 1, "c", bytes(64)], ["l", "p", 4, bytes(64)]]
    updates = parse_updates(wire)
    assert [type(u).__name__ for u in updates] == ["Beat", "Record", "Claim", "Claim", "Leave"]
    assert [u.to_wire() for u in updates] == wire  # compact on the wire, as before
    assert [u.key for u in updates] == [("a", "p"), ("r", "p"), ("s", "victim", peer.peer_id), ("d", "victim"),
                                        ("l", "p")]
    assert updates[2] == claim and claim.is_signed(peer.verify_key)
    with pytest.raises(ValueError):
        Claim.sign(peer, "l", "victim", 3, 1)


@pytest.mark.parametrize("raw", [[["a", "beat", 1]], [["r", {}]], [["s", "p", 1, 2**31 - 1, "c", bytes(64)]],
                                 [["s", "p", True, 1, "c", bytes(64)]], [["l", "p", 1, bytes(63)]],
                                 [["l", "p", 1, bytes(64), "extra"]], [[5, "p"]], [["d", "p", 1, 1, "", bytes(64)]]])
def test_typed_updates_refuse_malformed_fields(raw):
    with pytest.raises(WireError, match="update"):
        parse_updates(raw)


@pytest.mark.parametrize("raw", [None, "x", [["q"]], [[]], [["a"]], [["a", "beat"]], [["s", "p", 1, 1, "c", b"x"]],
                                 [["d", "", 1, 1, "c", bytes(64)]], [["l", "p", -1, bytes(64)]], [["r"]] * 65])
def test_malformed_updates_raise_typed_errors(raw):
    with pytest.raises(WireError) as err:
        parse_updates(raw)
    assert err.value.reason is RejectReason.BAD_FIELD


# ---------------------------------------------------------------- on sockets
PROBES_ONLY = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0,
                         transport=TransportConfig(monitor_connections=False))


def _three(make_node):
    """Three nodes that detect failures by probes alone, each seeing the other two alive."""
    a = make_node("inproc", config=PROBES_ONLY)
    b = make_node("inproc", join=[a.address], config=PROBES_ONLY)
    c = make_node("inproc", join=[a.address], config=PROBES_ONLY)
    for n in (a, b, c):
        assert wait_until(lambda n=n: sorted(statuses(n).values()) == ["alive", "alive"])
    return a, b, c


def test_a_peer_one_member_cannot_reach_is_reached_through_others_and_never_suspected(make_node):
    a, b, c = _three(make_node)
    suspected: list = []
    a.on_peer_change(lambda ch: suspected.append(ch) if ch.peer_id == b.peer_id else None)
    direct = a._swarm._ask

    async def lossy(peer_id, topic, body, timeout_s):  # A's own probes of B are lost on the way
        if peer_id == b.peer_id and topic == "$probe":
            return None
        return await direct(peer_id, topic, body, timeout_s)

    a._swarm._ask = lossy
    sent_via = lambda: a.stats.snapshot()["bytes_sent"].get(c.peer_id, {}).get("$probe-via", 0)  # noqa: E731
    assert wait_until(lambda: sent_via() > 0, timeout_s=10)  # A asked C to probe B for it
    time.sleep(TEST_LIVENESS.suspicion_base_s)
    assert suspected == [] and statuses(a)[b.peer_id] == "alive"


def test_a_suspected_peer_refutes_with_a_higher_liveness_incarnation(make_node):
    a, b, c = _three(make_node)
    changes: list = []
    c.on_peer_change(lambda ch: changes.append(ch.new.value) if ch.peer_id == b.peer_id else None)

    async def suspect():  # A claims B suspect (signed by A), as after a probe nobody answered
        a._swarm._suspect(b.peer_id)
    a.run(suspect())
    assert wait_until(lambda: a._swarm.broadcasts.eager == 0 and statuses(a)[b.peer_id] == "alive", timeout_s=10)
    assert wait_until(lambda: statuses(c)[b.peer_id] == "alive", timeout_s=10)
    assert b._swarm._live >= 1  # it signed a beat of a higher liveness incarnation
    assert "dead" not in changes


def test_a_claim_forged_in_another_members_name_is_refused_and_counted(make_node):
    a = make_node("inproc", config=PROBES_ONLY)
    b = make_node("inproc", join=[a.address], config=PROBES_ONLY)
    mallory = make_node("inproc", join=[a.address], config=PROBES_ONLY)
    assert wait_until(lambda: len(a.live_peers()) == 2 and len(mallory.live_peers()) == 2)
    before = a.stats.snapshot()["rejected"].get("bad_signature", 0)
    forged = sign_claim(mallory.identity, DEAD, b.peer_id, b.record.incarnation, 0)
    forged[4] = b.peer_id  # passed off as B's own claim
    mallory.run(mallory._asend_raw(a.peer_id, "$gossip", {"u": [forged]}))
    assert wait_until(lambda: a.stats.snapshot()["rejected"].get("bad_signature", 0) == before + 1)
    assert statuses(a)[b.peer_id] == "alive"


def test_a_sample_of_a_small_set_comes_in_random_order():
    """Gossip sends to the first few of a sample that suit it: had a set no larger than the
    sample come back in table order, a small swarm's gossip would always reach the same members."""
    ids = IdSet()
    for i in range(6):
        ids.add(f"p{i}")
    rng = random.Random(0)
    firsts = {tuple(ids.sample(rng, 5, but=("p5",))[:3]) for _ in range(50)}
    assert len(firsts) > 10
    assert all(set(ids.sample(rng, 5, but=("p5",))) == {"p0", "p1", "p2", "p3", "p4"} for _ in range(10))


def test_an_idset_keeps_each_ids_key_beside_it_and_the_ids_in_order_as_they_come_and_go():
    """The probe ring computes on the keys as an array (`IdSet.keys`) and table pages walk the
    ids in order (`IdSet.in_order`): both must follow every add and remove, swaps included."""
    rng = random.Random(3)
    ids = IdSet(lambda p: int(p[1:]) * 7 + 1, ordered=True)
    held: set[str] = set()
    for _ in range(600):
        peer = f"p{rng.randrange(200)}"
        if rng.random() < 0.6:
            assert ids.add(peer) == (peer not in held)
            held.add(peer)
        else:
            assert ids.remove(peer) == (peer in held)
            held.discard(peer)
        assert ids.in_order() == sorted(held)
        assert list(ids.keys()) == [int(p[1:]) * 7 + 1 for p in ids.ids]
        assert all(ids.index(p) == at for at, p in enumerate(ids.ids)) and ids.index("nobody") is None
    with pytest.raises(ValueError):
        IdSet().in_order()


def test_broadcasts_count_the_bytes_taken_by_priority_each_send_counted():
    q = Broadcasts()
    news, urgent = ["a", ["x", 1, 1, {}, b"s" * 64]], ["d", "y", 1, 0, "z", b"s" * 64]
    q.add(("a", "x"), news, NEWS)
    q.add(("d", "y"), urgent, URGENT)
    q.add(("b", "x"), news)  # routine
    assert q.take(10_000, limit=2, eager_only=True) and q.take(10_000, limit=2)
    size = {kind: len(msgpack.packb(u, use_bin_type=True)) for kind, u in (("news", news), ("urgent", urgent))}
    assert q.taken == [2 * size["urgent"], 2 * size["news"], size["news"]]
