"""Checks of one owner's averages by members drawn after the round (collectives/checking.py)."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import in_parallel, lying, swarm, wait_until

from starling.collectives import ReduceTimeouts, ShardedReducer
from starling.collectives.bodies import BodyError, CheckAsk, Checked
from starling.collectives.checking import MISAVERAGED, SUFFIX
from starling.collectives.compact import view_digest
from starling.collectives.defences import Defences
from starling.node import Refusal, refusal_of
from starling.node.trust import Evidence

FAST = ReduceTimeouts(round_timeout_s=5.0, reply_grace_s=1.0)


def _rounds(nodes, reducers, rounds, numel, seed=0, start=0):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=generator)
    for t in range(start, start + rounds):
        live = [r for r in range(len(nodes)) if not any(nodes[r].peer_id in n.trust.banned for n in nodes)]
        members = tuple(sorted(nodes[r].peer_id for r in live))
        vectors = {r: base + 0.3 * torch.randn(numel, generator=generator) for r in live}
        weights = {r: float(1 + r % 3) for r in live}
        in_parallel([lambda r=r: reducers[r].start(t, members, vectors[r], weight=weights[r]).wait() for r in live])


def _settled(reducers):
    return wait_until(lambda: all(not r.checks._running for r in reducers))


@pytest.mark.parametrize("aggregator,compressor", [("mean", "none"), ("centered_clip", "none"),
                                                  ("centered_clip", "int4"), ("mean", "randomk:0.25")])
def test_honest_owners_pass_every_check(make_node, aggregator, compressor):
    """Weighted parts, several chunks per shard, every chunk checked on average: each check
    averages the owner's signed parts again and gets its signed answer bit for bit, lossy
    parts (the owner's own as it signed it) and seeded codecs included."""
    nodes = swarm(make_node, 4)
    defences = Defences(aggregator, check_rate=1.0)
    reducers = [ShardedReducer(n, "test.checked", 512, compressor, timeouts=FAST, chunk_numel=64, defences=defences)
                for n in nodes]
    _rounds(nodes, reducers, 6, 512)
    assert _settled(reducers)
    counts = [r.checks.counts for r in reducers]
    assert sum(c["checks"] for c in counts) >= 10, counts
    assert sum(c["checks_passed"] for c in counts) == sum(c["checks"] for c in counts), counts
    assert not any(c["checks_failed"] or c["checks_unanswered"] for c in counts), counts
    assert not any(n.trust.banned for n in nodes)


def test_a_lying_owner_fails_a_check_and_is_banned_by_everyone_on_its_own_signatures(make_node):
    nodes = swarm(make_node, 5)
    defences = Defences("centered_clip", check_rate=1.0)
    reducers = [ShardedReducer(n, "test.liar", 256, timeouts=FAST, chunk_numel=32, defences=defences) for n in nodes]
    liar = 2
    lying(reducers[liar], -1.0)  # within what the parts allow: only a check can tell
    liar_id = nodes[liar].peer_id
    honest = [n for k, n in enumerate(nodes) if k != liar]
    for t in range(6):
        _rounds(nodes, reducers, 1, 256, seed=t, start=t)
        _settled(reducers)
        if any(liar_id in n.trust.banned for n in honest):
            break
    assert wait_until(lambda: all(liar_id in n.trust.banned for n in honest))
    bans = [n.trust.banned[liar_id] for n in honest]
    assert all(b.kind == MISAVERAGED for b in bans)
    assert any(b.verifiable and len(b.witnesses) == 1 for b in bans)  # one check proves it
    assert not any(h.peer_id in n.trust.banned for h in honest for n in honest)


def test_evidence_of_a_wrong_average_is_refused_once_altered(make_node):
    nodes = swarm(make_node, 4)
    defences = Defences("mean", check_rate=1.0)
    reducers = [ShardedReducer(n, "test.evidence", 128, timeouts=FAST, chunk_numel=32, defences=defences)
                for n in nodes]
    lying(reducers[0], -1.0)
    liar_id = nodes[0].peer_id
    for t in range(6):
        _rounds(nodes, reducers, 1, 128, seed=t, start=t)
        _settled(reducers)
        if any(liar_id in n.trust.banned for n in nodes[1:]):
            break
    assert wait_until(lambda: liar_id in nodes[1].trust.banned)
    proof = nodes[1].trust._proofs[liar_id][0]
    evidence = Evidence.from_wire(proof["ev"])
    trust = nodes[3].trust
    assert trust.verifiable(evidence)

    def altered(change):
        detail = {k: (list(v) if isinstance(v, list) else v) for k, v in evidence.detail.items()}
        detail["parts"] = [list(p) for p in evidence.detail["parts"]]
        change(detail)
        return Evidence(evidence.kind, evidence.accused, evidence.key, evidence.round, detail)

    def flip_part(d):  # a part's bytes no longer what its author signed, nor what the owner listed
        row = d["parts"][0]
        row[6] = [bytes([row[6][0][0] ^ 1]) + row[6][0][1:]] + row[6][1:]

    def drop_part(d):
        d["parts"] = d["parts"][1:]

    def other_round(d):
        d["shard"] += 1
    for change in (flip_part, drop_part, other_round, lambda d: d.pop("average"),
                   lambda d: d.update(members=d["members"][1:])):
        assert not trust.verifiable(altered(change))


def test_nobody_can_know_beforehand_which_chunks_are_checked(make_node):
    """The same round run twice, every seed the swarm knows set alike, draws other chunks: the
    draw is each checker's own randomness, taken after its parts are sent."""
    nodes = swarm(make_node, 3)
    defences = Defences("mean", check_rate=1.0)
    reducers = [ShardedReducer(n, "test.draw", 2048, timeouts=FAST, chunk_numel=16, defences=defences)
                for n in nodes]
    drawn = []
    for attempt in range(2):
        random.seed(0)
        torch.manual_seed(0)
        asked = []
        check = reducers[0].checks._check

        async def spy(t, members, res, asked=asked, check=check):
            asked.append((res.owner, res.shard, res.chunk))
            await check(t, members, res)
        reducers[0].checks._check = spy
        members = tuple(sorted(n.peer_id for n in nodes))
        vectors = [torch.ones(2048) * (k + 1) for k in range(3)]
        in_parallel([lambda r=r: reducers[r].reduce(7 + attempt, members, vectors[r]) for r in range(3)])
        reducers[0].checks._check = check
        drawn.append(sorted(asked))
    assert drawn[0] and drawn[1] and drawn[0] != drawn[1]


def test_a_check_is_refused_past_its_budget_and_for_strangers_to_the_round(make_node):
    nodes = swarm(make_node, 3)
    defences = Defences("mean", check_rate=0.1)
    reducers = [ShardedReducer(n, "test.budget", 64, timeouts=FAST, chunk_numel=8, defences=defences)
                for n in nodes]
    members = tuple(sorted(n.peer_id for n in nodes))
    in_parallel([lambda r=r: reducers[r].reduce(0, members, torch.ones(64)) for r in range(3)])
    owner = nodes[0]
    shards = reducers[0].placement.shards(members, 0)
    i = next(k for k, (_, owners) in enumerate(shards) if owners == (owner.peer_id,))
    # the members' own checks after the round (drawn at random) count against the same budget,
    # and both may have checked this owner: once they are done, start from a budget none has used
    assert _settled(reducers)
    reducers[0].checks._asked.clear()
    asker = nodes[1]
    answers = [asker.request(owner.peer_id, "test.budget" + SUFFIX, CheckAsk(0, view_digest(members), i, c).to_wire())
               for c in range(len(shards[i][0]))]
    assert Checked.from_wire(answers[0].body).parts  # one check is within any budget
    assert any(refusal_of(a.body) is Refusal.BUSY for a in answers)
    missing = asker.request(owner.peer_id, "test.budget" + SUFFIX, CheckAsk(5, view_digest(members), i, 0).to_wire())
    assert refusal_of(missing.body) is Refusal.NOT_FOUND
    with pytest.raises(BodyError):
        CheckAsk.from_wire({"check": -1, "view": b"x", "shard": 0, "chunk": 0})
    with pytest.raises(BodyError):
        Checked.from_wire({"ok": True, "parts": [["a", 1.0, b"s" * 64, None, {}, 99]], "sig": b"s" * 64})


def test_an_owner_that_does_not_answer_checks_is_counted_not_accused(make_node):
    nodes = swarm(make_node, 3)
    defences = Defences("mean", check_rate=1.0)
    reducers = [ShardedReducer(n, "test.silent", 256, timeouts=ReduceTimeouts(round_timeout_s=5.0, reply_grace_s=0.5),
                               chunk_numel=16, defences=defences) for n in nodes]
    reducers[0].checks.timeout_s = 0.5
    reducers[1].checks.timeout_s = 0.5
    reducers[2].checks.timeout_s = 0.5
    silent = nodes[2]
    silent.on("test.silent" + SUFFIX, lambda msg: {"ok": False, "error": "no"})
    members = tuple(sorted(n.peer_id for n in nodes))
    for t in range(3):
        in_parallel([lambda r=r: reducers[r].reduce(t, members, torch.randn(256)) for r in range(3)])
    assert _settled(reducers)
    assert sum(r.checks.counts["checks_unanswered"] for r in reducers[:2]) > 0
    assert not any(silent.peer_id in n.trust.banned for n in nodes)


def test_checks_refuse_secure_aggregation_and_bad_rates():
    with pytest.raises(ValueError, match="check_rate"):
        Defences(check_rate=1.5)
    assert Defences(check_rate=0.5).on and Defences(check_rate=0.5).fixed_answers


def test_a_check_after_the_authors_reuse_their_vectors_still_sees_what_they_signed(make_node):
    """A lent part (`reduce`) is a slice of its author's vector, and an inproc frame of 64 KiB
    or more is that memory as it is: the owner keeps its own copy when the group closes, so a
    check made after every author has written its vector again still finds the signed bytes."""
    nodes = swarm(make_node, 3)
    defences = Defences("centered_clip", check_rate=1.0)
    numel, chunk = 3 * 20_000, 20_000  # 80 KB parts: ZeroMQ sends them without a copy
    reducers = [ShardedReducer(n, "test.reuse", numel, timeouts=FAST, chunk_numel=chunk, defences=defences)
                for n in nodes]
    drawn = {r: [] for r in range(3)}
    for r, reducer in enumerate(reducers):  # hold the draws: check once the vectors are written again
        reducer.checks.after_round = lambda t, members, chosen, r=r: drawn[r].append((t, members, list(chosen)))
    members = tuple(sorted(n.peer_id for n in nodes))
    vectors = [torch.randn(numel) for _ in nodes]
    in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(3)])
    for v in vectors:
        v.copy_(torch.randn(numel) * 100)  # the next step's gradient, in the same memory
    checked = 0
    for r, reducer in enumerate(reducers):
        for t, ms, chosen in drawn[r]:
            for res in chosen:
                if res.packet is not None and res.owner != nodes[r].peer_id:
                    nodes[r].run(reducer.checks._check(t, ms, res))
                    checked += 1
    counts = [r.checks.counts for r in reducers]
    assert checked == 6 and sum(c["checks_passed"] for c in counts) == checked, counts
    assert not any(n.trust.banned for n in nodes)


def test_an_average_larger_than_its_parts_allow_is_left_out_by_every_member(make_node):
    """A robust average lies within what its parts' signed sizes allow: one ten times the
    truth is taken by nobody (every member sees the same signed answer) and its owner is
    accused by all of them, before any check."""
    from starling.collectives.reduce import UNBOUNDED
    nodes = swarm(make_node, 5)
    defences = Defences("centered_clip", check_rate=0.01)
    reducers = [ShardedReducer(n, "test.bound", 320, timeouts=FAST, chunk_numel=32, defences=defences)
                for n in nodes]
    liar = 1
    lying(reducers[liar], -10.0)
    liar_id = nodes[liar].peer_id
    members = tuple(sorted(n.peer_id for n in nodes))
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(320, generator=generator)
    vectors = [base + 0.3 * torch.randn(320, generator=generator) for _ in nodes]
    sent = [v.clone() for v in vectors]
    in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(5)])
    lied = [b for i, (chunks, owners) in enumerate(reducers[0].placement.shards(members, 0))
            if liar_id in owners for b in chunks]
    honest = [r for r in range(5) if r != liar]
    for r in honest:
        for lo, hi in lied:  # not averaged: each keeps its own values (this reducer's rule)
            assert torch.equal(vectors[r][lo:hi], sent[r][lo:hi])
        others = [(lo, hi) for lo, hi in reducers[0].placement.bounds(members, 0) if (lo, hi) not in lied]
        assert all(torch.equal(vectors[r][lo:hi], vectors[honest[0]][lo:hi]) for lo, hi in others)
    assert all(wait_until(lambda r=r: liar_id in nodes[r].trust.banned) for r in honest)
    assert all(nodes[r].trust.banned[liar_id].kind == UNBOUNDED for r in honest)
    assert not any(nodes[h].peer_id in nodes[r].trust.banned for h in honest for r in honest)
