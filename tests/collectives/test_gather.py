"""An author's signed parts of a round, gathered from every owner that kept them
(`ShardedReducer.gather`, for checks of a whole pseudo-gradient)."""
from __future__ import annotations

import torch
from conftest import in_parallel, swarm

from starling.collectives import ReduceTimeouts, ShardedReducer
from starling.collectives.bodies import KeptAsk, kept_rows
from starling.collectives.compact import view_digest
from starling.collectives.gathering import GATHERS_PER_ROUND
from starling.collectives.gathering import SUFFIX as GATHER_SUFFIX
from starling.node import Refusal, refusal_of

FAST = ReduceTimeouts(round_timeout_s=5.0, reply_grace_s=1.0)


def _round(nodes, reducers, t, numel):
    members = tuple(sorted(n.peer_id for n in nodes))
    vectors = [torch.arange(numel, dtype=torch.float32) * (k + 1) for k in range(len(nodes))]
    for r, n in zip(reducers, nodes):
        r.keep(t, frozenset(m for m in members if m != n.peer_id))
    in_parallel([lambda r=r: reducers[r].start(t, members, vectors[r].clone(), recipe=(r, 7)).wait()
                 for r in range(len(nodes))])
    for r in reducers:
        r.take_kept(t)
    return members, vectors


def test_a_gathered_author_is_its_whole_vector_checked_against_its_signatures(make_node):
    nodes = swarm(make_node, 4)
    reducers = [ShardedReducer(n, "test.gather", 96, timeouts=FAST, chunk_numel=8) for n in nodes]
    members, vectors = _round(nodes, reducers, 3, 96)
    author = 2
    parts = reducers[0].gathering.gather(3, members, nodes[author].peer_id)
    # every owner but the author's own shard (never sent) and mine (kept here): all the others
    got = torch.zeros(96)
    covered = torch.zeros(96, dtype=torch.bool)
    for p in parts:
        got[p.lo:p.hi] = p.values
        covered[p.lo:p.hi] = True
        assert p.detail["recipe"] == [author, 7]
    own = [b for i, (chunks, owners) in enumerate(reducers[0].placement.shards(members, 3))
           if nodes[author].peer_id in owners for b in chunks]
    for lo, hi in own:
        covered[lo:hi] = ~covered[lo:hi]  # the author's own shard never crossed the wire
    assert bool(covered.all())
    assert torch.equal(got[covered & (got != 0)], vectors[author][covered & (got != 0)])


def test_a_gather_is_refused_past_its_budget_and_tampered_parts_are_dropped(make_node):
    nodes = swarm(make_node, 3)
    reducers = [ShardedReducer(n, "test.gather2", 48, timeouts=FAST, chunk_numel=8) for n in nodes]
    members, _ = _round(nodes, reducers, 0, 48)
    asker, owner, author = nodes[0], nodes[1], nodes[2]
    ask = KeptAsk(0, view_digest(members), author.peer_id).to_wire()
    answers = [asker.request(owner.peer_id, "test.gather2" + GATHER_SUFFIX, ask) for _ in range(GATHERS_PER_ROUND + 1)]
    assert kept_rows(answers[0].body)
    assert refusal_of(answers[-1].body) is Refusal.BUSY

    serve = reducers[1].gathering._serve

    async def tampered(msg):
        reply = await serve(msg)
        payload = [bytes(b.numpy()) if hasattr(b, "numpy") else bytes(b) for b in reply.payload]
        payload[0] = bytes([payload[0][0] ^ 1]) + payload[0][1:]
        return type(reply)(reply.body, tuple(payload))
    owner.on("test.gather2" + GATHER_SUFFIX, tampered)
    reducers[1].gathering._asked.clear()
    parts = reducers[0].gathering.gather(0, members, author.peer_id)
    owned_by_owner = {(i, c) for i, (chunks, owners) in enumerate(reducers[0].placement.shards(members, 0))
                      if owner.peer_id in owners for c in range(len(chunks))}
    got = {(p.shard, p.chunk) for p in parts}
    assert len(owned_by_owner - got) == 1  # the tampered chunk is left out, the rest came
    assert asker.trust.counts[owner.peer_id]["bad_signature"] >= 1
