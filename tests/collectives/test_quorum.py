"""The quorum close: a bad ask is refused and counted, a leader's answer that is no closing
set (or one it did not sign) is read as none, and a leader that leaves out a member it
acknowledged is banned on the evidence the member holds."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest
from conftest import swarm, wait_until

from starling.collectives import ReduceTimeouts
from starling.collectives.bodies import Ack, Closing
from starling.collectives.quorum import (
    _KEEP_CLOSED_ROUNDS,
    _MAX_CLOSED,
    ECHO_FANOUT,
    OMITTED,
    QuorumClose,
    ack_statement,
    check_omission,
    close_statement,
)
from starling.node import Refusal, refusal_of
from starling.node.trust import Evidence

TIMEOUTS = ReduceTimeouts(round_timeout_s=10.0)


def by_leader(nodes, t: int = 0):
    """(members, the leader of round t, the others) for a salt of 0."""
    members = tuple(sorted(n.peer_id for n in nodes))
    leader = next(n for n in nodes if n.peer_id == members[t % len(members)])
    return members, leader, [n for n in nodes if n is not leader]


def accused_anywhere(nodes) -> bool:
    return any(n.trust.banned or any(f"accused.{OMITTED}" in c for c in n.trust.counts.values()) for n in nodes)


def test_a_bad_ask_is_refused_and_a_malformed_closing_set_is_read_as_none(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    leader_node, asker_node = (a, b) if members[0] == a.peer_id else (b, a)
    quorum = QuorumClose(leader_node, "test.q", 1, 0.0, ReduceTimeouts(round_timeout_s=5.0))
    for body in ({"round": 0, "members": list(members), "weight": float("nan")},
                 {"round": 0, "members": list(members), "weight": -2},
                 {"round": -1, "members": list(members), "weight": 1.0},
                 {"members": list(members)}):
        reply = asker_node.request(leader_node.peer_id, "test.q", body).body
        assert refusal_of(reply) is Refusal.MALFORMED
    assert leader_node.stats.rejected["test.q.malformed"] == 4
    # a wait that is no wait, and one for a round nobody asked for
    assert refusal_of(asker_node.request(leader_node.peer_id, "test.q", {"round": 0, "wait": 1}).body) \
        is Refusal.MALFORMED
    assert refusal_of(asker_node.request(leader_node.peer_id, "test.q", {"round": 5, "wait": True}).body) \
        is Refusal.NOT_FOUND
    assert leader_node.stats.rejected["test.q.not_found"] == 1
    assert not quorum._open and not quorum._closed

    # a leader whose answer is not a closing set: the asker counts it and is in no set
    for bad in ({"ok": True, "round": 0, "closed": [["x", -1.0]]}, {"ok": True, "round": 3, "closed": [["x", 1]]},
                {"ok": True, "round": 0, "closed": [["y", 1], ["x", 1]]}, {"ok": True, "round": 0}, ["nope"]):
        leader_node.on("test.fake", lambda msg, bad=bad: bad)
        asker = QuorumClose(asker_node, "test.fake", 1, 0.0, ReduceTimeouts(round_timeout_s=5.0))
        assert asker.ask(0, members, 1.0).result(timeout=30) is None
        with pytest.raises(ValueError):
            Closing.from_wire(bad, 0)
    assert asker_node.stats.rejected["test.fake.malformed_close"] == 5
    with pytest.raises(ValueError, match="weight"):
        quorum.ask(0, members, float("nan"))


def test_every_member_gets_the_set_the_leader_signed(make_node):
    nodes = swarm(make_node, 3)
    members, leader, _ = by_leader(nodes)
    quorums = [QuorumClose(n, "test.q", 3, 0.0, TIMEOUTS) for n in nodes]
    futures = [q.ask(0, members, 1.0 + i) for i, q in enumerate(quorums)]
    closings = [f.result(timeout=30) for f in futures]
    assert closings[0] is not None and closings[0].members == members
    assert all(c == closings[0] for c in closings)
    signed = close_statement("test.q", 0, closings[0].contributions)
    assert all(n.trust.verify(leader.peer_id, signed, closings[0].signature) for n in nodes)
    assert not accused_anywhere(nodes)


def test_a_set_or_an_ack_the_leader_did_not_sign_is_refused_and_counted(make_node):
    a, b = swarm(make_node, 2)
    members, leader, (asker,) = by_leader([a, b])
    me = asker.peer_id
    good = close_statement("test.fake", 0, [(me, 1.0)])
    flipped = bytearray(leader.trust.sign(good))
    flipped[5] ^= 1
    bad_answers = [
        Closing(0, ((me, 2.0),), leader.trust.sign(good)).to_wire(),  # a weight changed after signing
        Closing(0, ((me, 1.0),), bytes(flipped)).to_wire(),  # a signature changed
        Closing(0, ((me, 1.0),), asker.trust.sign(good)).to_wire(),  # signed, but not by the leader
        Ack(0, leader.trust.sign(ack_statement("test.fake", 0, me, 2.0))).to_wire(),  # an ack of another weight
    ]
    for i, bad in enumerate(bad_answers):
        leader.on("test.fake", lambda msg, bad=bad: bad)
        quorum = QuorumClose(asker, "test.fake", 1, 0.0, TIMEOUTS)
        assert quorum.ask(0, members, 1.0).result(timeout=30) is None
        assert asker.stats.rejected["test.fake.bad_signature"] == i + 1
    # the same answers, signed as they say: taken
    leader.on("test.fake", lambda msg: Closing(0, ((me, 1.0),), leader.trust.sign(good)).to_wire())
    assert QuorumClose(asker, "test.fake", 1, 0.0, TIMEOUTS).ask(0, members, 1.0).result(timeout=30).members == (me,)
    assert asker.stats.rejected["test.fake.bad_signature"] == len(bad_answers)


def test_a_leader_that_leaves_out_a_member_it_acknowledged_is_banned_on_every_peer(make_node, monkeypatch):
    nodes = swarm(make_node, 3)
    members, leader, (victim, other) = by_leader(nodes)
    quorums = {n.peer_id: QuorumClose(n, "test.q", 3, 0.0, TIMEOUTS) for n in nodes}
    lead = quorums[leader.peer_id]
    close = lead._close

    def close_without_victim(t, gathering):  # a leader that drops a member it counted in
        gathering.weights.pop(victim.peer_id, None)
        close(t, gathering)

    monkeypatch.setattr(lead, "_close", close_without_victim)
    asked = quorums[victim.peer_id].ask(0, members, 1.0)
    # the victim's ask is in (and acknowledged) before the others' asks close the round
    assert wait_until(lambda: 0 in lead._open and victim.peer_id in lead._open[0].weights)
    rest = [quorums[n.peer_id].ask(0, members, 1.0) for n in (other, leader)]
    closing = asked.result(timeout=30)
    assert closing is not None and victim.peer_id not in closing.members
    assert all(f.result(timeout=30) == closing for f in rest)
    for node in (victim, other):
        assert wait_until(lambda node=node: leader.peer_id in node.trust.banned)
        ban = node.trust.banned[leader.peer_id]
        assert (ban.kind, ban.round, ban.verifiable, ban.witnesses) == (OMITTED, 0, True, (victim.peer_id,))
    assert leader.peer_id not in victim.live_peers() and leader.peer_id not in other.live_peers()


def test_an_honest_leader_that_closed_at_the_quorum_before_a_late_ask_is_not_accused(make_node):
    nodes = swarm(make_node, 3)
    members, leader, (early, late) = by_leader(nodes)
    quorums = {n.peer_id: QuorumClose(n, "test.q", 2, 0.0, TIMEOUTS) for n in nodes}
    first = [quorums[n.peer_id].ask(0, members, 1.0) for n in (leader, early)]
    closing = first[0].result(timeout=30)
    assert closing.members == tuple(sorted((leader.peer_id, early.peer_id)))
    assert first[1].result(timeout=30) == closing
    assert quorums[late.peer_id].ask(0, members, 1.0).result(timeout=30) == closing  # the set, without it
    assert late.stats.rejected.get("test.q.bad_signature", 0) == 0
    assert not accused_anywhere(nodes)


def test_asks_racing_the_close_never_make_evidence_against_an_honest_leader(make_node):
    nodes = swarm(make_node, 4)
    members = tuple(sorted(n.peer_id for n in nodes))
    # quorum 1, a grace window of a millisecond, and asks that start up to a millisecond apart:
    # some land in the window (acked, then in the set), some after the close (the set alone)
    quorums = [QuorumClose(n, "test.q", 1, 0.001, TIMEOUTS) for n in nodes]
    sizes = []
    for t in range(40):
        futures = []
        for q in random.sample(quorums, 4):
            futures.append(q.ask(t, members, 1.0))
            time.sleep(random.uniform(0.0, 0.001))  # spreads the asks; the test waits on the futures
        closings = [f.result(timeout=30) for f in futures]
        assert all(c is not None and c == closings[0] for c in closings)
        sizes.append(len(closings[0].members))
    assert any(size < len(members) for size in sizes) and any(size > 1 for size in sizes), sizes  # they raced
    assert not accused_anywhere(nodes)
    assert not accused_anywhere(nodes)


def test_a_leader_acks_no_round_older_than_the_ones_it_remembers(make_node):
    a, b = swarm(make_node, 2)
    members, leader, (asker,) = by_leader([a, b])
    quorum = QuorumClose(leader, "test.q", 1, 0.0, TIMEOUTS)
    QuorumClose(asker, "test.q", 1, 0.0, TIMEOUTS)
    led = [t for t in range(2 * (_KEEP_CLOSED_ROUNDS + 2)) if quorum.leader(t, members) == leader.peer_id]
    for t in led:
        assert quorum.ask(t, members, 1.0).result(timeout=30).members == (leader.peer_id,)
    reply = asker.request(leader.peer_id, "test.q", {"round": led[0], "members": list(members), "weight": 1.0}).body
    assert refusal_of(reply) is Refusal.TOO_OLD
    reply = asker.request(leader.peer_id, "test.q", {"round": led[-1], "members": list(members), "weight": 1.0}).body
    assert Closing.from_wire(reply, led[-1]).members == (leader.peer_id,)  # remembered: its set, no ack


def test_the_omission_check_takes_only_evidence_that_proves_it(make_node):
    a, b, c = swarm(make_node, 3)
    leader, asker = a, b.peer_id
    QuorumClose(c, "test.q", 1, 0.0, TIMEOUTS)
    closed = [[c.peer_id, 1.0]]

    def evidence(t=3, signer=leader, topic="test.q", who=asker, weight=2.0, in_set=closed, **change):
        detail = {"topic": topic, "asker": who, "weight": weight,
                  "ack": signer.trust.sign(ack_statement(topic, t, who, weight)), "closed": in_set,
                  "close_sig": signer.trust.sign(close_statement(topic, t, in_set))}
        fields = {"kind": OMITTED, "accused": leader.peer_id, "key": leader.identity.verify_key, "round": t,
                  "detail": detail}
        return Evidence(**{**fields, **change})

    good = evidence()
    assert check_omission(good)
    assert check_omission(Evidence.from_wire(good.to_wire()))

    def with_detail(**change):
        return dataclasses.replace(good, detail={**good.detail, **change})

    other_round = evidence(t=4).detail
    forged = [
        evidence(signer=b),  # signed by someone else
        evidence(key=b.identity.verify_key),  # the key is not the accused's
        evidence(signer=b, key=b.identity.verify_key),  # the key is the signer's, the name is not
        evidence(in_set=[[asker, 2.0], [c.peer_id, 1.0]]),  # the asker is in the set
        evidence(who=leader.peer_id, in_set=[[c.peer_id, 1.0]]),  # the leader's ack of itself
        with_detail(ack=other_round["ack"]),  # an ack of another round
        with_detail(close_sig=other_round["close_sig"]),  # a set of another round
        with_detail(weight=3.0),  # an ack of another weight
        with_detail(topic="test.other"),  # another topic's round
        with_detail(closed=[[c.peer_id, 2.0]]),  # a set changed after signing
        with_detail(ack=good.detail["ack"][:-1] + bytes([good.detail["ack"][-1] ^ 1])),
    ]
    garbage_details = [{}, {"topic": 1}, {**good.detail, "weight": 2}, {**good.detail, "weight": "2"},
                       {**good.detail, "ack": "sig"}, {**good.detail, "close_sig": None},
                       {**good.detail, "closed": "x"}, {**good.detail, "closed": [[1, 2]]},
                       {**good.detail, "closed": [["z", 1.0], ["a", 1.0]]}, {**good.detail, "closed": []},
                       {**good.detail, "closed": [["x", 1.0]] * (_MAX_CLOSED + 1)},
                       {**good.detail, "topic": "\ud800"}, {**good.detail, "asker": None}]
    garbage = [dataclasses.replace(good, detail=d) for d in garbage_details]
    garbage += [dataclasses.replace(good, round=r) for r in (2**70, -1, "3", None)]
    garbage += [dataclasses.replace(good, key=k) for k in (b"", None, "key")]
    garbage += [dataclasses.replace(good, detail=["not", "a", "map"])]
    for bad in forged + garbage:
        assert check_omission(bad) is False, bad
        assert c.submit(_verifiable(c, bad)).result(timeout=10) is False
    assert c.submit(_verifiable(c, good)).result(timeout=10) is True


async def _verifiable(node, evidence: Evidence) -> bool:
    return node.trust.verifiable(evidence)


def test_a_leader_that_gives_two_members_two_sets_of_one_round_is_banned(make_node):
    """Members show a few others the set they got: a member holding another set that the
    same leader signed for the same round holds proof, which every peer checks alone."""
    nodes = swarm(make_node, 5)
    members, leader, others = by_leader(nodes)
    quorums = {n.peer_id: QuorumClose(n, "test.eq", 5, 0.0, TIMEOUTS) for n in nodes}
    lead = quorums[leader.peer_id]
    answer = lead._on_request
    fooled = {others[0].peer_id, others[1].peer_id}

    async def equivocating(msg):
        reply = await answer(msg)
        if msg.sender in fooled and isinstance(reply, dict) and "closed" in reply:
            t = reply["round"]
            other = tuple((p, 2.0 * w) for p, w in Closing.from_wire(reply, t).contributions)
            return Closing(t, other, leader.trust.sign(close_statement("test.eq", t, other))).to_wire()
        return reply
    leader.on("test.eq", equivocating)
    futures = [quorums[n.peer_id].ask(0, members, 1.0) for n in nodes]
    closings = [f.result(timeout=30) for f in futures]
    assert len({c.contributions for c in closings if c is not None}) == 2  # it did give two sets
    honest = [n for n in nodes if n is not leader]
    assert all(wait_until(lambda n=n: leader.peer_id in n.trust.banned) for n in honest)
    ban = honest[0].trust.banned[leader.peer_id]
    assert ban.kind == "quorum.equivocated" and ban.verifiable


def test_members_that_show_each_other_one_leader_s_set_accuse_nobody(make_node):
    nodes = swarm(make_node, 5)
    members, _, _ = by_leader(nodes)
    quorums = [QuorumClose(n, "test.same", 5, 0.0, TIMEOUTS) for n in nodes]
    for t in range(3):
        assert all(f.result(timeout=30) is not None for f in [q.ask(t, members, 1.0) for q in quorums])
    # every member but each round's leader shows its set to ECHO_FANOUT others
    assert wait_until(lambda: sum(q.echoes for q in quorums) == 3 * (len(nodes) - 1) * ECHO_FANOUT)
    assert not any(n.trust.banned for n in nodes)
    assert not any("accused.quorum.equivocated" in c for n in nodes for c in n.trust.counts.values())


def test_the_equivocation_check_takes_only_two_different_sets_the_accused_signed(make_node):
    from starling.collectives.quorum import EQUIVOCATED, check_equivocation
    (a,) = swarm(make_node, 1)
    key = a.trust.key_of(a.peer_id)
    one, two = (("p", 1.0), ("q", 1.0)), (("p", 1.0),)

    def evidence(x, y, signer=a, topic="test.q", t=3):
        sign = lambda c: signer.trust.sign(close_statement("test.q", t, c))  # noqa: E731
        return Evidence(EQUIVOCATED, a.peer_id, key, t, {"topic": topic, "a": [list(p) for p in x], "a_sig": sign(x),
                                                        "b": [list(p) for p in y], "b_sig": sign(y)})
    assert check_equivocation(evidence(one, two))
    assert not check_equivocation(evidence(one, one))  # the same set twice proves nothing
    assert not check_equivocation(evidence(one, two, topic="test.other"))  # signed for another topic
    bad = evidence(one, two)
    bad.detail["b"] = [["p", 2.0]]  # a set other than the one signed
    assert not check_equivocation(bad)
    assert not check_equivocation(Evidence(EQUIVOCATED, a.peer_id, key, 3, {"topic": "test.q", "a": 5}))


def test_a_leader_that_took_a_state_at_round_k_refuses_every_round_before_it(make_node):
    """A restarted leader remembers no set it closed: once its protocol takes the swarm's state
    at round k, an ask for an earlier round is too old, never acknowledged or closed again."""
    a, b = swarm(make_node, 2)
    members, leader, (asker,) = by_leader([a, b], t=4)
    QuorumClose(leader, "test.resume", 2, 0.0, TIMEOUTS).resume_at(6)
    for t in (2, 4):  # rounds this leader (of the even rounds) may have closed before it restarted
        body = {"round": t, "members": list(members), "weight": 1.0}
        assert refusal_of(asker.request(leader.peer_id, "test.resume", body).body) is Refusal.TOO_OLD
    body = {"round": 6, "members": list(members), "weight": 1.0}
    assert refusal_of(asker.request(leader.peer_id, "test.resume", body).body) is None  # acknowledged
