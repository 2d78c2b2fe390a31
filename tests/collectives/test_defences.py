"""A sharded all-reduce among members it cannot trust: signed parts and averages, robust
aggregators, weight caps, replays, replicated owners, and the bans they lead to."""
from __future__ import annotations

import time

import pytest
import torch
from conftest import in_parallel, lying, swarm, wait_until

from starling.collectives import ReduceTimeouts, ShardedReducer
from starling.collectives.compact import view_digest
from starling.collectives.contributions import NOT_FINITE, OVERWEIGHT, REPLAYED, Contributions
from starling.collectives.defences import Defences, OutlierWatch, ReplayWatch
from starling.collectives.suspicion import SUSPECT, SuspicionConfig, SuspicionLedger, chunk_scores
from starling.compressors import from_spec
from starling.node import Refusal, refusal_of
from starling.node.trust import Evidence, statement

ROBUST = Defences("centered_clip", max_weight=4.0)
FAST = ReduceTimeouts(round_timeout_s=5.0, reply_grace_s=1.0)
SHORT = ReduceTimeouts(round_timeout_s=0.3, reply_grace_s=0.5)  # rounds that close while the test goes on


def _signed_body(node, topic, t, members, values, weight=None, tamper=False, state=None):
    packet = from_spec("none").encode(values)
    sig = Contributions(node, topic).sign_part(t, 0, 0, view_digest(members), weight, packet, None, state)
    if tamper:
        sig = bytes([sig[0] ^ 1]) + sig[1:]
    body = {"step": t, "shard": 0, "chunk": 0, "members": list(members), "packet": packet.header, "sig": sig}
    if weight is not None:
        body["weight"] = weight
    if state is not None:
        body["state"] = state
    return body, [bytes(b.numpy()) for b in packet.buffers]


def _owner_and_other(nodes, members):
    owner = next(n for n in nodes if n.peer_id == members[0])
    return owner, next(n for n in nodes if n is not owner)


def _three_robust(make_node, topic, timeouts=FAST):
    """Three nodes with a robust reducer on `topic` each: (nodes, members, the first shard's owner,
    another)."""
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    for n in nodes:
        ShardedReducer(n, topic, 12, timeouts=timeouts, defences=ROBUST)
    return (nodes, members, *_owner_and_other(nodes, members))


def test_a_tampered_signature_is_refused_counted_and_held_against_nobody(make_node):
    nodes = swarm(make_node, 2)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.sig", 8, timeouts=FAST, defences=ROBUST) for n in nodes]
    owner, other = _owner_and_other(nodes, members)
    body, frames = _signed_body(other, "test.sig", 0, members, torch.ones(4), tamper=True)
    reply = other.request(owner.peer_id, "test.sig", body, frames).body
    assert refusal_of(reply) is Refusal.BAD_SIGNATURE
    assert owner.stats.rejected["test.sig.bad_signature"] == 1
    assert owner.trust.counts[other.peer_id]["bad_signature"] == 1 and not owner.trust.banned
    unsigned = {k: v for k, v in body.items() if k != "sig"}  # no signature at all: the same
    assert refusal_of(other.request(owner.peer_id, "test.sig", unsigned, frames).body) is Refusal.BAD_SIGNATURE
    # nothing changed: round 0 runs with both peers' real parts
    vectors = [torch.full((8,), 1.0), torch.full((8,), 3.0)]
    results = in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(2)])
    assert all(r.synced and not r.lost for r in results) and torch.equal(vectors[0], vectors[1])


def test_an_overclaimed_weight_is_refused_and_its_signature_bans_the_author(make_node):
    nodes, members, owner, liar = _three_robust(make_node, "test.weight")
    body, frames = _signed_body(liar, "test.weight", 0, members, torch.ones(4), weight=1000.0)
    reply = liar.request(owner.peer_id, "test.weight", body, frames).body
    assert refusal_of(reply) is Refusal.OVERWEIGHT
    assert owner.trust.counts[liar.peer_id]["overweight"] == 1
    honest = [n for n in nodes if n is not liar]
    # verifiable evidence: the owner bans at once, and every other member that checks it too
    assert all(wait_until(lambda n=n: liar.peer_id in n.trust.banned) for n in honest)
    assert all(n.trust.banned[liar.peer_id].verifiable and n.trust.banned[liar.peer_id].kind == OVERWEIGHT
               for n in honest)
    assert all(liar.peer_id not in n.live_peers() for n in honest)  # it owns no shard and leads no round


def test_a_replayed_part_is_refused_and_makes_its_owner_a_witness_but_repeats_do_not(make_node):
    """A part of some rounds back, with others in between, is refused, and its owner is one
    witness against the author (two signed parts of one content are not proof: an honest part
    repeats). Zeros repeat honestly, and so does last round's part (a chunk that nobody
    averaged keeps its parameters, and a deterministic loss its gradient)."""
    _, members, owner, cheat = _three_robust(make_node, "test.replay", SHORT)
    for t in (0, 1):  # zeros twice: a layer with no gradient, honestly
        body, frames = _signed_body(cheat, "test.replay", t, members, torch.zeros(4))
        assert refusal_of(cheat.request(owner.peer_id, "test.replay", body, frames).body) is None
    values = torch.tensor([1.0, -2.0, 3.0, 0.5])
    for t, part, state in ((2, values, 2), (3, values, 3), (4, values * 2, 4)):  # round 3 repeats round 2
        body, frames = _signed_body(cheat, "test.replay", t, members, part, state=bytes([state]) * 8)
        assert refusal_of(cheat.request(owner.peer_id, "test.replay", body, frames).body) is None
    body, frames = _signed_body(cheat, "test.replay", 5, members, values, state=b"\x05" * 8)  # rounds 2-3's again
    assert refusal_of(cheat.request(owner.peer_id, "test.replay", body, frames).body) is Refusal.REPLAYED
    counts = owner.trust.counts[cheat.peer_id]
    assert counts["repeated"] == 2 and counts["replayed"] == 1 and counts[f"accused.{REPLAYED}"] == 1  # zeros, round 3
    assert cheat.peer_id not in owner.trust.banned  # one witness


def test_a_part_repeated_from_the_same_state_is_taken_and_accuses_nobody(make_node):
    """A part begun from the state its author signed for the earlier round is honest when it
    repeats: nothing it trains on moved."""
    _, members, owner, author = _three_robust(make_node, "test.repeat", SHORT)
    values = torch.tensor([1.0, -2.0, 3.0, 0.5])
    for t in (0, 1, 2):
        body, frames = _signed_body(author, "test.repeat", t, members, values, state=b"\x01" * 8)
        assert refusal_of(author.request(owner.peer_id, "test.repeat", body, frames).body) is None
    counts = owner.trust.counts[author.peer_id]
    assert counts["repeated"] == 2 and counts["replayed"] == 0 and not owner.trust.banned


def test_evidence_checks_refuse_what_does_not_prove_the_fault(make_node):
    """A forged or altered accusation bans nobody: the signature, the bytes and the claim must hold."""
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    contributions = Contributions(a, "test.ev", max_weight=4.0)
    nan = torch.tensor([1.0, float("nan")])
    packet = from_spec("none").encode(nan)
    view = view_digest(members)
    sig = Contributions(b, "test.ev").sign_part(5, 0, 0, view, None, packet)
    from starling.collectives.contributions import content_digest
    content = content_digest(packet.header, packet.buffers)
    good = contributions.part_evidence(NOT_FINITE, b.peer_id, 5, 0, 0, view, None, packet, sig, content)
    assert a.trust.verifiable(good)
    forged = [
        Evidence(NOT_FINITE, b.peer_id, good.key, 6, good.detail),  # another round than signed
        Evidence(NOT_FINITE, b.peer_id, good.key, 5, {**good.detail, "sig": bytes(64)}),
        Evidence(NOT_FINITE, b.peer_id, good.key, 5, {**good.detail, "buffers": [bytes(8)]}),  # other bytes
        Evidence(NOT_FINITE, b.peer_id, good.key, 5, {**good.detail, "topic": 7}),
        Evidence(NOT_FINITE, b.peer_id, good.key, 5, {"garbage": [1, 2]}),
        Evidence(OVERWEIGHT, b.peer_id, good.key, 5, good.detail),  # weight 1: not over the cap
        Evidence(REPLAYED, b.peer_id, good.key, 5, {**good.detail, "earlier": {"round": 5}}),
    ]
    # a signed sparse part with a NaN, whose header names a huge vector: refused before anything
    # is allocated (the same part at its real size is evidence)
    sparse = from_spec("topk:0.5").encode(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    values = torch.tensor([float("nan"), 4.0]).view(torch.uint8)
    for size, proves in ((4, True), (1 << 25, False)):
        header = {**sparse.header, "shape": [size]}
        packet = type(sparse)(header, (sparse.buffers[0], values))
        signed = Contributions(b, "test.ev").sign_part(5, 0, 0, view, None, packet)
        evidence = contributions.part_evidence(NOT_FINITE, b.peer_id, 5, 0, 0, view, None, packet, signed,
                                               content_digest(packet.header, packet.buffers))
        assert a.trust.verifiable(evidence) is proves, size
    for evidence in forged:
        assert not a.trust.verifiable(evidence), evidence.detail.keys()


def test_a_lying_owner_is_outvoted_by_three_owners_and_banned_on_two_witnesses(make_node):
    """Members take the majority's signed average; an owner outvoted with the same contributors
    in 3 of its rounds in a row is accused by every member that saw it, and banned on their word."""
    nodes = swarm(make_node, 4)
    members = tuple(sorted(n.peer_id for n in nodes))
    defences = Defences("mean", owner_replication=3)
    reducers = [ShardedReducer(n, "test.liar3", 16, timeouts=FAST, defences=defences) for n in nodes]
    liar = 1
    lying(reducers[liar], -10.0)
    honest = [r for r in range(4) if r != liar]
    liar_id = nodes[liar].peer_id
    for t in range(3):
        vectors = [torch.full((16,), float(k + 1)) for k in range(4)]
        results = in_parallel([lambda r=r: reducers[r].reduce(t, members, vectors[r]) for r in range(4)])
        assert all(torch.equal(vectors[r], torch.full((16,), 2.5)) for r in honest)  # the majority's average
        assert all(results[r].synced for r in honest)
        if t < 2:  # one vote, or two, is no accusation: the third makes it
            assert not any(liar_id in nodes[r].trust.banned for r in honest)
    assert all(wait_until(lambda r=r: liar_id in nodes[r].trust.banned) for r in honest)
    assert all(not nodes[r].trust.banned[liar_id].verifiable for r in honest)  # on the members' word
    assert all(len(nodes[r].trust.banned[liar_id].witnesses) >= 2 for r in honest)


def test_owners_are_placed_afresh_each_round_and_every_peer_places_them_alike(make_node):
    nodes = swarm(make_node, 5)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.place", 20, timeouts=FAST, defences=Defences(owner_replication=3))
                for n in nodes]
    placements = [[tuple(owners for _, owners in r.placement.shards(members, t)) for t in range(6)] for r in reducers]
    assert all(p == placements[0] for p in placements[1:])
    assert len(set(placements[0])) > 1  # not the same owners round after round
    for shards in placements[0]:
        assert all(len(set(owners)) == 3 for owners in shards)
        assert sorted(o for owners in shards for o in owners) == sorted(members * 3)  # each owns three


def test_two_owners_that_disagree_drop_the_shard_and_both_are_reported(make_node):
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    defences = Defences("mean", owner_replication=2)
    reducers = [ShardedReducer(n, "test.liar2", 12, timeouts=FAST, defences=defences) for n in nodes]
    liar = 0
    lying(reducers[liar], 3.0)
    vectors = [torch.full((12,), float(k + 1)) for k in range(3)]
    before = [v.clone() for v in vectors]
    in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(3)])
    liar_id = nodes[liar].peer_id
    for i, (chunks, owners) in enumerate(reducers[1].placement.shards(members, 0)):
        (lo, hi), = chunks
        for r in (1, 2):
            if liar_id in owners:  # the two owners differ: every honest member keeps its own values
                assert torch.equal(vectors[r][lo:hi], before[r][lo:hi]), i
                other = next(o for o in owners if o != liar_id)
                if other != nodes[r].peer_id:
                    assert nodes[r].trust.counts[other]["disputed"] >= 1  # both owners are reported
                assert nodes[r].trust.counts[liar_id]["disputed"] >= 1
            else:
                assert torch.equal(vectors[r][lo:hi], torch.full((hi - lo,), 2.0)), i
    assert not any(n.trust.banned for n in nodes)  # two owners cannot tell who lied: nobody is banned


def test_robust_owners_give_every_peer_the_same_bits_and_screen_a_scaled_part(make_node):
    nodes = swarm(make_node, 5)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.robust", 4096, timeouts=FAST, chunk_numel=512,
                               defences=Defences("centered_clip")) for n in nodes]
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=generator)
    vectors = [base + 0.1 * torch.randn(4096, generator=generator) for _ in nodes]
    vectors[2] = vectors[2] * 100.0  # one member's part, far from the others
    honest_mean = torch.stack([v for k, v in enumerate(vectors) if k != 2]).mean(0)
    in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(5)])
    assert all(torch.equal(vectors[0], v) for v in vectors[1:])  # bit-identical on every peer
    assert float((vectors[0] - honest_mean).norm() / honest_mean.norm()) < 0.05
    scaled = nodes[2].peer_id
    assert sum(n.trust.counts[scaled]["screened"] for n in nodes) >= 4  # every other owner left it out


def test_outlier_watch_accuses_only_after_rounds_in_a_row():
    watch = OutlierWatch(3)
    assert not watch.saw("p", 1, True) and not watch.saw("p", 2, True)
    assert not watch.saw("p", 2, True)  # another chunk of round 2 counts once
    assert watch.saw("p", 3, True)
    assert not watch.saw("q", 1, True) and not watch.saw("q", 2, False) and not watch.saw("q", 3, True)


def test_replay_watch_remembers_a_bounded_number_of_digests():
    watch = ReplayWatch(keep=2)
    assert watch.seen("p", 1, b"a", "r1") is None
    assert watch.seen("p", 1, b"a", "r1") is None  # the same round again: a retry, not a replay
    assert watch.seen("p", 2, b"a", "r2") == (1, "r1")
    watch.seen("p", 3, b"b", "r3")
    watch.seen("p", 4, b"c", "r4")
    assert watch.seen("p", 5, b"a", "r5") is None  # forgotten: at most `keep` per member


def test_defences_refuse_bad_settings():
    import pytest
    with pytest.raises(ValueError, match="owner_replication"):
        Defences(owner_replication=4)
    with pytest.raises(ValueError):
        Defences("geometric_median")
    assert not Defences().on and Defences("median").on and Defences(owner_replication=2).on


def test_a_banned_peers_messages_are_dropped_and_counted(make_node):
    a, b = swarm(make_node, 2)
    a.on("echo", lambda msg: {"got": msg.body})
    assert b.request(a.peer_id, "echo", 1).body == {"got": 1}

    async def ban():
        a.trust.register_check("test.always", lambda evidence: True)
        a.trust.accuse(Evidence("test.always", b.peer_id, b.identity.verify_key, 0, {}))
    a.run(ban())
    assert b.peer_id in a.trust.banned and b.peer_id not in a.live_peers()
    try:
        b.request(a.peer_id, "echo", 2, timeout_s=0.5)
        answered = True
    except Exception:
        answered = False
    assert not answered and a.stats.rejected["banned"] >= 1


def test_a_ban_on_a_witnesss_word_needs_two_witnesses(make_node):
    nodes = swarm(make_node, 4)
    accused, first, second, judge = nodes

    def accuse(witness):
        async def go():
            witness.trust.accuse(Evidence("test.word", accused.peer_id, accused.identity.verify_key, 3, {}))
        witness.run(go())

    accuse(first)
    assert wait_until(lambda: first.peer_id in judge.trust.status()["accused"].get(accused.peer_id, []))
    assert accused.peer_id not in judge.trust.banned  # one liar cannot ban an honest peer
    accuse(second)
    assert wait_until(lambda: accused.peer_id in judge.trust.banned)
    assert sorted(judge.trust.banned[accused.peer_id].witnesses) == sorted([first.peer_id, second.peer_id])


def test_a_peer_that_joins_after_a_ban_bans_as_the_swarm_does(make_node):
    """A joiner gets the signed accusations behind each ban: verifiable evidence, and a
    witness-level ban's two witnesses' own accusations (passed on, still signed by them)."""
    nodes = swarm(make_node, 4)
    cheat, liar, first, second = nodes

    def accuse(witness, accused, kind):
        async def go():
            witness.trust.register_check("test.proof", lambda evidence: True)
            witness.trust.accuse(Evidence(kind, accused.peer_id, accused.identity.verify_key, 3, {}))
        witness.run(go())

    accuse(first, cheat, "test.proof")  # verifiable here (the check is registered on the accuser only)
    accuse(first, liar, "test.word")
    accuse(second, liar, "test.word")
    assert wait_until(lambda: all(liar.peer_id in n.trust.banned for n in (first, second)))
    assert cheat.peer_id in first.trust.banned
    joiner = make_node("inproc", join=[first.address])

    async def register():
        joiner.trust.register_check("test.proof", lambda evidence: True)
    joiner.run(register())
    assert wait_until(lambda: liar.peer_id in joiner.trust.banned and cheat.peer_id in joiner.trust.banned)
    assert sorted(joiner.trust.banned[liar.peer_id].witnesses) == sorted([first.peer_id, second.peer_id])
    assert liar.peer_id not in joiner.live_peers()


def test_replicated_owners_agree_on_honest_parts_under_a_lossy_codec(make_node):
    """Three owners per shard hand out the same bits round after round when every member is
    honest: an owner sums its own part as the others decode it, and keeps no error feedback of
    its own on the averages. Nobody is disputed, every chunk is averaged."""
    nodes = swarm(make_node, 4)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.lossy3", 64, "int4", timeouts=FAST, chunk_numel=8,
                               defences=Defences("centered_clip", owner_replication=3)) for n in nodes]
    generator = torch.Generator().manual_seed(1)
    for t in range(4):
        vectors = [torch.randn(64, generator=generator) for _ in nodes]
        results = in_parallel([lambda r=r: reducers[r].reduce(t, members, vectors[r]) for r in range(4)])
        assert all(r.synced and not r.lost for r in results), t
        assert all(torch.equal(vectors[0], v) for v in vectors[1:]), t
    counts = [kind for n in nodes for per in n.trust.counts.values() for kind in per]
    assert not {"disputed", "bad_signature", "screened", "not_finite"} & set(counts), counts


def test_a_member_that_missed_a_ban_takes_it_when_the_others_share_their_bans(make_node):
    """Ban sets are part of what a round's members hold alike (`Trust.ban_digest`): a member
    whose ban the others never heard of (restored from its own checkpoint, or an accusation
    lost on the way) shares the signed accusations behind it, and they ban as it does."""
    a, b, c, cheat = swarm(make_node, 4)
    evidence = Evidence("test.proof", cheat.peer_id, cheat.identity.verify_key, 3, {})
    body = {"ev": evidence.to_wire(), "sig": a.trust.sign(statement("accuse", evidence.digest())),
            "witness": a.peer_id}
    state = {"bans": [{"peer": cheat.peer_id, "kind": "test.proof", "round": 3, "witnesses": [a.peer_id],
                       "verifiable": True, "proofs": [body]}]}
    for node in (b, c):
        async def register(node=node):
            node.trust.register_check("test.proof", lambda evidence: True)
        node.run(register())

    async def restore():
        return a.trust.load_state_dict(state)
    assert a.run(restore()) == 1
    assert a.trust.ban_digest and not b.trust.ban_digest and cheat.peer_id not in c.trust.banned
    a.share_bans()
    assert wait_until(lambda: all(cheat.peer_id in n.trust.banned for n in (b, c)))
    assert b.trust.ban_digest == c.trust.ban_digest == a.trust.ban_digest

    async def again():
        return a.trust.share_bans(a.live_peers_here(), time.monotonic())
    assert a.run(again()) == 0  # at most once every SHARE_EVERY_S


def test_the_suspicion_ledger_accuses_a_member_flagged_two_rounds_in_three_and_nobody_else():
    ledger = SuspicionLedger(SuspicionConfig())
    honest = {m: (1.0, 1.0) for m in "abcd"}
    accused_at = {}
    for t in range(30):
        poisons = t % 3 != 2
        ledger.add(t, 1.0, {**honest, "x": (-1.0 if poisons else 1.0, 1.0), "w": (-0.3 if poisons else 1.0, 1.0),
                            "y": (-1.0 if t == 7 else 1.0, 1.0), "z": (-0.2 if t in (5, 9) else 1.0, 1.0),
                            "v": (-0.05, 1.0)})
        for member in ledger.close(t):
            accused_at[member] = t
    # x, against the median: 2 then 4; w, away from it: 1, 2, 1.5 (its honest round), 2.5, 3.5, 3, 4
    assert accused_at == {"x": 1, "w": 6}
    assert ledger.peak["y"] == 2.0 and ledger.peak["z"] == 1.0 and ledger.flags["z"] == 2
    assert ledger.flags["v"] == 0  # slightly away from the median, every round: not flagged


def test_members_on_their_own_data_drifting_a_little_away_from_the_median_are_not_accused():
    """Two members at the edge of a non-IID swarm near its optimum: their cosines with the median
    fall below zero round after round, while the two in the middle keep near 0.65 (numbers from
    a fault-harness run, where the old watch banned the edge members)."""
    ledger = SuspicionLedger(SuspicionConfig())
    for t in range(80):
        edge = 0.4 - 0.011 * t  # 0.4 down to -0.47: a little away from the median, ever more
        ledger.add(t, 1.0, {"a": (edge, 1.0), "b": (edge - 0.03, 1.0), "c": (0.65, 1.0), "d": (0.65, 1.0)})
        assert ledger.close(t) == []
    assert ledger.flags["a"] == ledger.flags["b"] == 0
    # the same cosines in a round whose members agree (the median cosine 0.9) are flagged
    ledger.add(80, 1.0, {"a": (-0.3, 1.0), "c": (0.9, 1.0), "d": (0.9, 1.0), "e": (0.95, 1.0)})
    ledger.close(80)
    assert ledger.flags["a"] == 1


def test_a_part_against_the_median_is_flagged_in_any_round():
    ledger = SuspicionLedger(SuspicionConfig())
    accused = []
    for t in range(3):  # half the members against the other half: no coherent round
        ledger.add(t, 1.0, {"x": (-0.99, 1.0), "y": (-0.99, 1.0), "h1": (0.9, 1.0), "h2": (0.9, 1.0)})
        accused += ledger.close(t)
    assert sorted(accused) == ["x", "y"] and ledger.flags["h1"] == 0


def test_suspicion_settings_out_of_order_are_refused():
    for bad in ({"strong": 0.0, "below": -0.1}, {"coherent": 1.5}, {"below": 2.0}):
        with pytest.raises(ValueError, match="suspicion needs"):
            SuspicionConfig(**bad)


def test_chunk_scores_are_against_the_coordinate_median():
    parts = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 6.0]),
             torch.tensor([-100.0, -100.0, -100.0, -100.0])]
    ref_norm2, rows = chunk_scores(parts, slice(0, 4, 2))  # coordinates 0 and 2
    assert ref_norm2 == 1.0 + 9.0  # the median of each sampled coordinate: 1 and 3
    assert rows[0] == (10.0, 10.0) and rows[2] == (-400.0, 20000.0)


def test_colluders_poisoning_two_rounds_in_three_across_rotating_owners_are_accused_and_banned(make_node):
    """Two members send the same vector against the honest direction in 2 of every 3 rounds,
    under three owners per chunk placed afresh each round: no owner sees them flagged 3 rounds
    in a row, but every member's test of the signed scores accuses both, and they are banned."""
    world, numel = 7, 2048
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.suspect", numel, timeouts=FAST, chunk_numel=256,
                               defences=Defences("centered_clip", owner_replication=3)) for n in nodes]
    by_id = {n.peer_id: r for r, n in enumerate(nodes)}
    colluders = {by_id[members[0]], by_id[members[1]]}
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=generator)
    for t in range(8):
        live = [r for r in range(world) if not any(nodes[r].peer_id in n.trust.banned for n in nodes)]
        if colluders.isdisjoint(live):
            break
        round_members = tuple(sorted(nodes[r].peer_id for r in live))
        vectors = {r: base + 0.5 * torch.randn(numel, generator=generator) for r in live}
        for r in colluders & set(live):
            if t % 3 != 2:
                vectors[r] = -base * (float(vectors[r].norm()) / float(base.norm()))
        in_parallel([lambda r=r: reducers[r].reduce(t, round_members, vectors[r]) for r in live])
    honest = [n for r, n in enumerate(nodes) if r not in colluders]
    assert wait_until(lambda: all(nodes[c].peer_id in n.trust.banned for c in colluders for n in honest))
    assert all(n.trust.banned[nodes[c].peer_id].kind == SUSPECT for c in colluders for n in honest)
    assert not any(h.peer_id in n.trust.banned for h in honest for n in honest)
