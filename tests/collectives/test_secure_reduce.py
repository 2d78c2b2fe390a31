"""Secure aggregation inside the sharded all-reduce, over real sockets: the average equals the
plain one within the encoding's rounding, an owner sees only masked bytes, dropouts are
unmasked by the survivors' shares, and tampered shares or seeds are refused and counted."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from conftest import in_parallel, load_benchmark, swarm, wait_until

from starling.collectives import ReduceTimeouts, ShardedReducer
from starling.collectives.bodies import Deal
from starling.collectives.compact import view_digest
from starling.collectives.outcome import ShardResult
from starling.collectives.secure import SecureAggregation, check_secure_config
from starling.protocols.allreduce import AllReduceConfig


def reducers(nodes, numel, secure=SecureAggregation(), **kw):
    return [ShardedReducer(n, "test.secure", numel, "none", secure=secure, **kw) for n in nodes]


def test_the_masked_average_is_the_plain_one_and_replicas_agree(make_node):
    world, numel = 5, 300
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, numel, chunk_numel=64)
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    mean = torch.stack(vectors).mean(0)
    results = in_parallel([lambda r=r: rs[r].reduce(3, members, vectors[r]) for r in range(world)])
    assert all(res.synced and res.peers == world and not res.lost for res in results)
    scale = SecureAggregation().codec(world).scale  # fitted to 5 members: 2^23
    assert scale == 2.0**23
    torch.testing.assert_close(vectors[0], mean, rtol=0, atol=0.5 / scale + 1e-6)
    assert all(torch.equal(v, vectors[0]) for v in vectors[1:])


def test_weighted_parts_average_by_weight(make_node):
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, 40, secure=SecureAggregation(unit=4.0))
    vectors = [torch.full((40,), float(r + 1)) for r in range(3)]
    weights = [1.0, 2.0, 4.0]
    expected = sum(w * v for w, v in zip(weights, vectors)) / sum(weights)
    pending = [rs[r].start(1, members, vectors[r], weight=weights[r]) for r in range(3)]
    results = [p.wait() for p in pending]
    assert all(r.synced for r in results)
    torch.testing.assert_close(vectors[0], expected, rtol=0, atol=1e-4)
    by_id = {nodes[r].peer_id: weights[r] / sum(weights) for r in range(3)}
    assert dict(results[0].shares) == pytest.approx(by_id)


def test_an_owner_sees_only_uniform_bytes(make_node, monkeypatch):
    """What an owner holds of another member's part, for a part of all zeros, passes a
    chi-square test of uniform bytes: it is mask, not data."""
    import starling.collectives.accumulator as accumulator

    seen = []
    real_add = accumulator.ShardGroup.add

    def spy(self, sender, part, owned=False, weight=1.0):
        seen.append((sender, part.clone()))
        return real_add(self, sender, part, owned, weight)

    monkeypatch.setattr(accumulator.ShardGroup, "add", spy)
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    numel = 4096
    rs = reducers(nodes, numel)
    vectors = [torch.zeros(numel) for _ in range(3)]
    in_parallel([lambda r=r: rs[r].reduce(1, members, vectors[r]) for r in range(3)])
    assert all(torch.equal(v, torch.zeros(numel)) for v in vectors)
    assert len(seen) == 3 * 3  # every member's part of every shard, the owners' own included
    for _, part in seen:
        data = part.contiguous().view(torch.uint8).numpy()
        counts = np.bincount(data, minlength=256)
        expected = data.size / 256
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 350, chi2  # 255 degrees of freedom: p < 1e-5 beyond ~350; zeros would give ~4M


@pytest.mark.slow
def test_dropped_members_are_unmasked_away_by_survivors_with_t_shares(make_node):
    """Two of six members mask and deal their shares, then die before their parts go: each
    survivor keeps exactly t = 3 live neighbours, whose pair seeds with the dead remove their
    masks, and every chunk a survivor owns carries the survivors' mean."""
    world, numel = 6, 120
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    timeouts = ReduceTimeouts(round_timeout_s=2.0, reply_grace_s=2.0)
    rs = reducers(nodes, numel, timeouts=timeouts)
    assert rs[0]._secure.config.shape(world) == (5, 3)
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    dead = [nodes.index(next(n for n in nodes if n.peer_id == m)) for m in members[-2:]]
    for r in dead:
        masked = rs[r]._secure.mask(1, members, view_digest(members), vectors[r], None)
        nodes[r].run(rs[r]._secure.deal(masked))
        nodes[r].close()
    live = [r for r in range(world) if r not in dead]
    results = in_parallel([lambda r=r: rs[r].reduce(1, members, vectors[r]) for r in live])
    mean = torch.stack([vectors[r] for r in live]).mean(0)
    assert set(members[-2:]) <= set(results[0].lost)  # the dead members own shards: skipped alike (0)
    for chunks, owners in rs[live[0]].placement.shards(members, 1):
        if owners[0] in members[-2:]:
            continue
        for lo, hi in chunks:
            for r in live:
                torch.testing.assert_close(vectors[r][lo:hi], mean[lo:hi], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_a_survivor_gone_before_the_unmasking_is_dropped_too_and_the_round_completes(make_node):
    """One member dies before its part goes (dropped); another sends its part, then answers no
    reveal request (gone before the unmasking): only it could give its pair seed with the
    dropped one, so the owners drop it too, before anyone is asked for seed shares, and every
    chunk the others own carries the mean of the four left."""
    world, numel = 6, 120
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, numel, timeouts=ReduceTimeouts(round_timeout_s=2.0, reply_grace_s=2.0))
    t = 1
    unmasker = rs[0]._secure.unmasker(members, t)
    ranks = [r for r in range(world) if nodes[r].peer_id != unmasker]
    dead, gone = ranks[0], ranks[1]
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    masked = rs[dead]._secure.mask(t, members, view_digest(members), vectors[dead], None)
    nodes[dead].run(rs[dead]._secure.deal(masked))
    nodes[dead].close()

    async def silent(owner, ask):
        await asyncio.sleep(30)
    rs[gone]._secure._on_reveal = silent
    live = [r for r in range(world) if r != dead]
    in_parallel([lambda r=r: rs[r].reduce(t, members, vectors[r]) for r in live])
    left = [r for r in live if r != gone]
    mean = torch.stack([vectors[r] for r in left]).mean(0)
    assert sum(rs[r]._secure.dropped for r in left) == 0
    for chunks, owners in rs[left[0]].placement.shards(members, t):
        if owners[0] in (nodes[dead].peer_id, nodes[gone].peer_id):
            continue
        for lo, hi in chunks:
            for r in left:
                torch.testing.assert_close(vectors[r][lo:hi], mean[lo:hi], rtol=0, atol=1e-4)


def test_a_member_whose_part_reached_one_owner_only_is_left_out_alike_by_every_owner(make_node):
    """A member whose part reached the round's unmasker and no other owner (it died in the
    middle of sending): the unmasker hears whose parts every group holds and sums only those,
    so no holder is asked to call the member alive for one owner and dropped for another, and
    every chunk the others own carries the mean of the members every group holds."""
    world, numel = 5, 200
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, numel, timeouts=ReduceTimeouts(round_timeout_s=4.0, reply_grace_s=6.0), chunk_numel=32)
    t = 1
    unmasker = rs[0]._secure.unmasker(members, t)
    half = next(r for r in range(world) if nodes[r].peer_id != unmasker)
    real_send = rs[half]._send_part

    async def to_the_unmasker_only(t, members, view, slot, owner, weight=None, recipe=None, deal=None, state=None):
        if owner != unmasker:  # the part is lost; the share of its seed riding on it still arrives
            if deal is not None:
                nodes[half].send(owner, "test.secure.secagg", Deal(t, view, *deal).to_wire())
            return ShardResult(slot.shard, slot.chunk, owner, None, reason="cut off")
        return await real_send(t, members, view, slot, owner, weight, recipe, deal, state)
    rs[half]._send_part = to_the_unmasker_only
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    others = [r for r in range(world) if r != half]
    mean = torch.stack([vectors[r] for r in others]).mean(0)
    in_parallel([lambda r=r: rs[r].reduce(t, members, vectors[r]) for r in range(world)])
    assert sum(rs[r]._secure.dropped for r in range(world)) == 0  # no group dropped
    for chunks, owners in rs[0].placement.shards(members, t):
        if owners[0] == nodes[half].peer_id:
            continue  # its own shard holds its own part: not every group's
        for lo, hi in chunks:
            for r in others:
                torch.testing.assert_close(vectors[r][lo:hi], mean[lo:hi], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_t_minus_one_survivors_drop_the_round_and_nothing_is_unmasked(make_node):
    """Threshold 1.0 over 3 neighbours (t = 3): one member gone leaves every survivor t - 1
    live neighbours, short of shares of its seed, so every group is dropped and the members
    keep their values."""
    world, numel = 4, 60
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    timeouts = ReduceTimeouts(round_timeout_s=1.5, reply_grace_s=2.0)
    rs = reducers(nodes, numel, secure=SecureAggregation(threshold=1.0), timeouts=timeouts)
    gone = nodes.index(next(n for n in nodes if n.peer_id == members[-1]))
    nodes[gone].close()
    live = [r for r in range(world) if r != gone]
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    before = [vectors[r].clone() for r in live]
    told = []  # the unmasker could not gather either: it tells the other owners not to wait for it
    for r in live:
        real = rs[r]._secure._on_gave_up
        rs[r]._secure._on_gave_up = lambda sender, body, r=r, real=real: (told.append(r), real(sender, body))
    in_parallel([lambda r=r: rs[r].reduce(1, members, vectors[r]) for r in live])
    assert all(torch.equal(vectors[r], b) for r, b in zip(live, before))
    assert sum(rs[r]._secure.dropped for r in live) >= 1
    unmasker = rs[live[0]]._secure.unmasker(members, 1)
    owners = {r for r in live if nodes[r].peer_id in rs[r]._secure._owners(members, 1)}
    assert sorted(told) == sorted(r for r in owners if nodes[r].peer_id != unmasker), (told, owners)
    assert any(n.stats.rejected.get("test.secure.secagg_dropped", 0) for n in (nodes[r] for r in live))


def test_secure_aggregation_refuses_what_must_see_the_parts():
    with pytest.raises(ValueError, match="robust aggregator"):
        AllReduceConfig(secure_aggregation="on", aggregator="median")
    with pytest.raises(ValueError, match="compressor 'none'"):
        AllReduceConfig(secure_aggregation="on", compressor="int8")
    with pytest.raises(ValueError, match="unknown setting"):
        AllReduceConfig(secure_aggregation="on:bits=8")
    assert check_secure_config(AllReduceConfig(secure_aggregation="on:scale=1024")).scale == 1024


def _tamper(stage, how):
    """Make `stage` (a holder) alter what it reveals: `how(reply)` edits the answer."""
    real = stage._on_reveal

    async def altered(owner, body):
        reply = await real(owner, body)
        if isinstance(reply, dict) and reply.get("ok"):
            how(reply)
        return reply

    stage._on_reveal = altered


def test_a_tampered_share_is_refused_counted_and_the_others_unmask(make_node):
    world, numel = 5, 80
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, numel)  # k = 4, t = 2: one bad share leaves three good ones
    liar = nodes.index(next(n for n in nodes if n.peer_id == members[0]))

    def flip(reply):
        for share in reply["shares"]:
            share[2] = bytes([share[2][0] ^ 1]) + share[2][1:]

    _tamper(rs[liar]._secure, flip)
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    mean = torch.stack(vectors).mean(0)
    results = in_parallel([lambda r=r: rs[r].reduce(1, members, vectors[r]) for r in range(world)])
    assert all(res.synced and not res.lost for res in results)
    torch.testing.assert_close(vectors[1], mean, rtol=0, atol=1e-4)
    bad = sum(n.stats.rejected.get("test.secure.secagg_bad_share", 0) for n in nodes)
    assert bad >= world - 1  # every other owner refused the liar's shares


@pytest.mark.slow
def test_a_wrong_mask_seed_is_refused_counted_and_changes_nothing(make_node):
    """A survivor that reveals a wrong pair seed for a dropped neighbour: the seed breaks the
    hash it signed with its part, the owner counts it and drops the group (an unmasking with
    it would be garbage), and the members keep their local values."""
    world, numel = 4, 40
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    timeouts = ReduceTimeouts(round_timeout_s=1.5, reply_grace_s=2.0)
    rs = reducers(nodes, numel, timeouts=timeouts)
    gone = nodes.index(next(n for n in nodes if n.peer_id == members[-1]))
    masked = rs[gone]._secure.mask(1, members, view_digest(members), torch.zeros(numel), None)
    nodes[gone].run(rs[gone]._secure.deal(masked))
    nodes[gone].close()
    live = [r for r in range(world) if r != gone]

    def wrong(reply):
        for pair in reply["pairs"]:
            pair[1] = bytes(32)

    for r in live:
        _tamper(rs[r]._secure, wrong)
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    before = [vectors[r].clone() for r in live]
    in_parallel([lambda r=r: rs[r].reduce(1, members, vectors[r]) for r in live])
    assert all(torch.equal(vectors[r], b) for r, b in zip(live, before))
    assert sum(n.stats.rejected.get("test.secure.secagg_bad_seed", 0) for n in (nodes[r] for r in live)) >= 1


def dealt_round_7(make_node):
    """Three members that masked zeros in round 7 and dealt their seeds' shares."""
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, 10)
    view = view_digest(members)
    for r in range(3):
        masked = rs[r]._secure.mask(7, members, view, torch.zeros(10), None)
        nodes[r].run(rs[r]._secure.deal(masked))
    return nodes, members, rs, view


def test_a_holder_never_reveals_both_halves_of_a_members_secrets(make_node):
    """An owner that asks one holder for a member's seed share and then for its pair seed (to
    strip both its masks) is refused the second time, and the refusal is counted."""
    nodes, members, rs, view = dealt_round_7(make_node)
    owner, holder = nodes[0], nodes[1]
    victim = members[2] if members[2] != owner.peer_id and members[2] != holder.peer_id else \
        next(m for m in members if m not in (owner.peer_id, holder.peer_id))
    topic = rs[0]._secure.reveal_topic
    rs[1]._known_views.add(members)
    first = owner.request(holder.peer_id, topic, {"reveal": 7, "view": view, "seeds": [victim], "pairs": []}).body
    assert first["ok"] and len(first["shares"]) == 1
    second = owner.request(holder.peer_id, topic, {"reveal": 7, "view": view, "seeds": [], "pairs": [victim]}).body
    assert second["ok"] is False and second["code"] == "conflict"
    assert holder.stats.rejected.get("test.secure.conflict", 0) == 1


def test_an_owner_asking_for_its_own_secrets_binds_no_holder(make_node):
    """An unmasker gathers its own seed's shares among the survivors', then dies: the holder
    that gave it one still gives another owner its pair seed with the dead unmasker (an owner
    learns nothing from its own secrets, so asking for them binds nobody), and the owners
    without its part unmask their sums without it."""
    nodes, members, rs, view = dealt_round_7(make_node)
    unmasker, holder, other = nodes[0], nodes[1], nodes[2]
    topic = rs[0]._secure.reveal_topic
    rs[1]._known_views.add(members)
    own = unmasker.request(holder.peer_id, topic,
                           {"reveal": 7, "view": view, "seeds": [unmasker.peer_id], "pairs": []}).body
    assert own["ok"] and len(own["shares"]) == 1
    pair = other.request(holder.peer_id, topic, {"reveal": 7, "view": view, "seeds": [], "pairs": [unmasker.peer_id]}).body
    assert pair["ok"] and len(pair["pairs"]) == 1  # the dead unmasker's pair seed: not refused as "alive"
    # and the binding still holds for what another owner learns: both halves never go to one
    seed = other.request(holder.peer_id, topic, {"reveal": 7, "view": view, "seeds": [unmasker.peer_id],
                                                 "pairs": []}).body
    assert seed["ok"] is False and seed["code"] == "conflict"


@pytest.mark.slow
def test_a_member_sigkilled_mid_round_leaves_the_survivors_sum():
    """Real processes on tcp: one of four is SIGKILLed once it has masked and dealt (its parts
    on the wire); every chunk a survivor owns comes back as the mean of the parts summed (the
    survivors', and the killed member's where its part got there first), and the rounds after
    it run over the three."""
    row = load_benchmark("secagg").dropout(peers=4, kill=1, rounds=5, kill_round=2, timeout_s=120)
    assert row["killed"] == 1 and row["survivors_finished"] and row["wrong_chunks"] == 0, row
    # its parts reached the owners or not: either way each chunk is the mean of those summed
    assert row["at_kill"]["chunks_with_survivors_sum"] >= 3 and set(row["at_kill"]["left_out"]) <= {0, 1}, row
    assert 3 in row["after"]["members"] and row["dropped_groups"] == 0, row


def test_distributed_noise_shares_sum_to_the_full_noise_in_the_mean(make_node):
    """Each of 8 members adds a discrete Gaussian share of std sigma / sqrt(8) to its integers:
    the mean carries std sigma / 8 (the sum's sigma over 8), every member the same mean."""
    world, numel, sigma = 8, 4096, 0.5
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, numel)
    vectors = [torch.zeros(numel) for _ in range(world)]
    pending = [rs[r].start(1, members, vectors[r], noise_std=sigma / world**0.5) for r in range(world)]
    assert all(p.wait().synced for p in pending)
    assert all(torch.equal(v, vectors[0]) for v in vectors[1:])
    assert vectors[0].std().item() == pytest.approx(sigma / world, rel=0.05)
    assert abs(vectors[0].mean().item()) < 4 * sigma / world / numel**0.5
    with pytest.raises(ValueError, match="needs secure aggregation"):
        ShardedReducer(nodes[0], "test.plain", 4, "none").start(1, members, torch.zeros(4), noise_std=1.0)


def test_bad_secure_aggregation_messages_are_refused_counted_and_change_nothing(make_node):
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    rs = reducers(nodes, 10)
    a, b = nodes[0], nodes[1]
    topic = rs[0]._secure.reveal_topic
    view = view_digest(members)
    rs[1]._known_views.add(members)
    assert a.request(b.peer_id, topic, {"reveal": "x"}).body["code"] == "malformed"
    assert a.request(b.peer_id, topic, [1, 2]).body["code"] == "malformed"
    unknown = a.request(b.peer_id, topic, {"reveal": 1, "view": bytes(16), "seeds": [], "pairs": []}).body
    assert unknown["code"] == "unknown_view"
    nothing = a.request(b.peer_id, topic, {"reveal": 1, "view": view, "seeds": [], "pairs": []}).body
    assert nothing["code"] == "unknown_step"  # b masked nothing in round 1: no round state is made for it
    assert not rs[1]._secure._rounds
    a.send(b.peer_id, topic, {"deal": 1, "view": view, "x": 2, "box": b"\0" * 146})  # not sealed by a
    unmasker = rs[1]._secure.unmasker(members, 1)
    liar = next(n for n in nodes if n.peer_id not in (unmasker, b.peer_id))
    liar.send(b.peer_id, topic, {"unmasked": 1, "view": view, "alive": b"\x07", "seeds": [], "pairs": [],
                                 "lists": []})
    honest = next(n for n in nodes if n.peer_id == unmasker)  # the round's unmasker, for a round b never had
    if honest is not b:
        honest.send(b.peer_id, topic, {"unmasked": 1, "view": view, "alive": b"\x07", "seeds": [], "pairs": [],
                                       "lists": []})
    assert wait_until(lambda: b.stats.rejected.get("test.secure.secagg_bad_share", 0) == 1
                      and b.stats.rejected.get("test.secure.secagg_not_unmasker", 0) == 1
                      and b.stats.rejected.get("test.secure.secagg_stale", 0) == (honest is not b))
    assert b.stats.rejected.get("test.secure.malformed", 0) == 2
    assert not rs[1]._secure._held and not rs[1]._secure._rounds
