"""An owner's average taken second hand: a member that an owner's answer never reached takes
the owner's signed average from a member it reached, so that both write the same chunk; a
relayed average its owner did not sign is refused, counted, and changes nothing; asks that are
malformed, from strangers or over budget are refused and counted."""
from __future__ import annotations

import asyncio

import torch
from conftest import in_parallel, swarm

from starling.collectives import ReduceTimeouts, ShardedReducer
from starling.collectives.bodies import HeardAsk, heard_rows
from starling.collectives.compact import view_digest
from starling.collectives.secondhand import ASKS_PER_ROUND, SUFFIX
from starling.compressors import Packet
from starling.node import Refusal, refusal_of

NUMEL = 40
TIMEOUTS = ReduceTimeouts(round_timeout_s=1.0, reply_grace_s=1.0)


class StopsBeforeAnswering(ShardedReducer):
    """An owner whose answers to some members never leave: it stopped after answering the
    others (as a process does when SIGSTOP or SIGKILL comes between two sends)."""

    deaf_to: frozenset[str] = frozenset()

    async def _on_part(self, msg):  # type: ignore[override]
        reply = await super()._on_part(msg)
        if msg.sender in self.deaf_to:
            await asyncio.sleep(60)  # the member's wait ends long before
        return reply


def _round(make_node, deaf: str):
    """Four members; the owner of shard 0 answers every member but `deaf` ("one": the last of
    the others; "all": none of them). Returns the members, their reducers and vectors, the
    index of the member it did not answer, and the owner's index."""
    nodes = swarm(make_node, 4)
    members = tuple(sorted(n.peer_id for n in nodes))
    nodes.sort(key=lambda n: n.peer_id)
    owner = 0  # shard 0's owner is the first member of the sorted list
    others = frozenset(members) - {members[owner]}
    reducers = []
    for r, node in enumerate(nodes):
        cls = StopsBeforeAnswering if r == owner else ShardedReducer
        reducer = cls(node, "test.heard", NUMEL, timeouts=TIMEOUTS, unaveraged=0.0)
        reducers.append(reducer)
    reducers[owner].deaf_to = frozenset({members[-1]}) if deaf == "one" else others
    assert reducers[owner].placement.shards(members, 1)[0][1] == (members[owner],)
    vectors = [torch.full((NUMEL,), float(r + 1)) for r in range(4)]
    return nodes, members, reducers, vectors, len(members) - 1, owner


def test_a_member_the_owners_answer_missed_takes_it_from_a_member_it_reached(make_node):
    nodes, members, reducers, vectors, deaf, owner = _round(make_node, "one")
    mean = torch.stack(vectors).mean(0)
    results = in_parallel([lambda r=r: reducers[r].reduce(1, members, vectors[r]) for r in range(4)])
    assert all(torch.equal(v, mean) for v in vectors), [v[:3] for v in vectors]  # one outcome, the exact mean
    assert results[deaf].synced and not results[deaf].lost
    assert all(not n.stats.rejected for n in nodes)


def test_an_owner_that_answered_nobody_leaves_the_chunk_unaveraged_on_every_member(make_node):
    nodes, members, reducers, vectors, _, owner = _round(make_node, "all")
    mean = torch.stack(vectors).mean(0)
    bounds = reducers[0].placement.bounds(members, 1)[0]
    results = in_parallel([lambda r=r: reducers[r].reduce(1, members, vectors[r]) for r in range(4)])
    for r, (v, res) in enumerate(zip(vectors, results)):
        if r == owner:  # its own group's average came back to it
            continue
        assert torch.equal(v[bounds[0]:bounds[1]], torch.zeros(bounds[1] - bounds[0]))
        assert torch.equal(v[bounds[1]:], mean[bounds[1]:])
        assert members[owner] in res.lost
    assert all(not n.stats.rejected for n in nodes)


def test_a_relayed_average_its_owner_did_not_sign_is_refused_counted_and_changes_nothing(make_node):
    nodes, members, reducers, vectors, deaf, owner = _round(make_node, "one")
    mean = torch.stack(vectors).mean(0)
    bounds = reducers[0].placement.bounds(members, 1)[0]
    for r in range(4):
        if r in (owner, deaf):
            continue
        keep = reducers[r].secondhand.keep

        def forged(t, view, i, c, who, average, packet, keep=keep):  # the relayer alters what it keeps
            bad = tuple(b.clone() for b in packet.buffers)
            bad[0][0] ^= 0x40
            keep(t, view, i, c, who, average, Packet(packet.header, bad))
        reducers[r].secondhand.keep = forged
    results = in_parallel([lambda r=r: reducers[r].reduce(1, members, vectors[r]) for r in range(4)])
    lo, hi = bounds
    assert torch.equal(vectors[deaf][lo:hi], torch.zeros(hi - lo))  # unaveraged, as with no relay
    assert torch.equal(vectors[deaf][hi:], mean[hi:])
    assert members[owner] in results[deaf].lost
    assert nodes[deaf].stats.rejected["test.heard.bad_heard_average"] == 2  # one from each relayer


def test_asks_that_are_malformed_from_strangers_or_over_budget_are_refused_and_counted(make_node):
    nodes = swarm(make_node, 3)
    a, b, c = nodes
    reducers = [ShardedReducer(n, "test.heard", NUMEL, timeouts=TIMEOUTS) for n in nodes]
    pair = tuple(sorted((a.peer_id, b.peer_id)))
    view = view_digest(pair)
    reducers[0]._known_views.add(pair)
    topic = "test.heard" + SUFFIX

    def ask(node, body):
        return node.request(a.peer_id, topic, body, timeout_s=5).body

    assert refusal_of(ask(b, {"heard": 1, "view": view, "wants": "all"})) is Refusal.MALFORMED
    assert refusal_of(ask(b, {"heard": 1, "view": view, "wants": [[0, 0, b.peer_id]] * 1000})) is Refusal.MALFORMED
    assert refusal_of(ask(c, HeardAsk(1, view, ((0, 0, b.peer_id),)).to_wire())) is Refusal.MALFORMED  # not a member
    for _ in range(ASKS_PER_ROUND):
        assert heard_rows(ask(b, HeardAsk(1, view, ((0, 0, a.peer_id),)).to_wire())) == []  # nothing heard
    assert refusal_of(ask(b, HeardAsk(1, view, ((0, 0, a.peer_id),)).to_wire())) is Refusal.BUSY
    assert a.stats.rejected["test.heard.malformed"] == 3 and a.stats.rejected["test.heard.busy"] == 1
    assert reducers[0].secondhand.kept_bytes == 0


def test_what_a_member_keeps_is_bounded_in_bytes_and_in_time(make_node):
    """The averages a member keeps for others never pass `max_bytes` (the oldest go first), and
    none is kept past `keep_s`."""
    import time

    from starling.collectives.bodies import Average
    from starling.compressors import from_spec

    (node,) = swarm(make_node, 1)
    reducer = ShardedReducer(node, "test.kept", NUMEL, timeouts=TIMEOUTS)
    heard = reducer.secondhand
    assert heard.max_bytes == 8 * NUMEL  # two float32 vectors
    packet = from_spec("none").encode(torch.ones(NUMEL // 4))  # a quarter of a vector: 40 bytes
    view = view_digest((node.peer_id,))
    for c in range(10):
        heard.keep(1, view, 0, c, "owner", Average(packet.header, ()), packet)
        assert heard.kept_bytes <= heard.max_bytes
    assert heard.kept_bytes == heard.max_bytes and len(heard._kept) == 8
    assert (1, view, 0, 0, "owner") not in heard._kept and (1, view, 0, 9, "owner") in heard._kept
    brief = ShardedReducer(node, "test.brief", NUMEL, timeouts=TIMEOUTS).secondhand
    brief.keep_s = 0.05
    brief.keep(1, view, 0, 0, "owner", Average(packet.header, ()), packet)
    time.sleep(0.1)
    brief.keep(2, view, 0, 0, "owner", Average(packet.header, ()), packet)
    assert list(brief._kept) == [(2, view, 0, 0, "owner")] and brief.kept_bytes == 40  # the first expired
