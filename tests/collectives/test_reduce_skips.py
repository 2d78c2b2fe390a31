"""Nobody waits out the round timeout for a member that will send nothing in a round: one that
says so (`ShardedReducer.skip`), or one whose answers show it took part under another view.
Found by the chaos soak (benchmarks/chaos.py): at every join the whole Streaming DiLoCo swarm
waited for the joiner until the round timeout."""
from __future__ import annotations

import time

import torch
from conftest import in_parallel, linear, swarm, wait_until
from torch import nn

from starling.collectives import ShardedReducer
from starling.collectives.reduce import ReduceTimeouts
from starling.protocols import get_protocol

TIMEOUT_S = 20.0  # a round that waited for the member that skipped it would take this long


def test_no_group_waits_for_a_member_that_skips_the_round(make_node):
    nodes = swarm(make_node, 3)
    a, b, c = (ShardedReducer(n, "t", 12, timeouts=ReduceTimeouts(round_timeout_s=TIMEOUT_S)) for n in nodes)
    members = tuple(sorted(n.peer_id for n in nodes))
    c.skip(0)
    va, vb = torch.arange(12.0), 3 * torch.arange(12.0)
    start = time.monotonic()
    ra, rb = in_parallel([lambda: a.reduce(0, members, va), lambda: b.reduce(0, members, vb)])
    assert time.monotonic() - start < TIMEOUT_S / 4
    # c's own shard too: its group took a's and b's parts without waiting for c's
    assert torch.equal(va, 2 * torch.arange(12.0)) and torch.equal(vb, 2 * torch.arange(12.0))
    for r in (ra, rb):  # skipping is not being lost
        assert r.skipped == (nodes[2].peer_id,) and r.lost == () and r.peers == 2 and r.synced
    vectors = [torch.full((12,), float(i)) for i in range(3)]  # round 1: c takes part again
    results = in_parallel([lambda r=r, v=v: r.reduce(1, members, v) for r, v in zip((a, b, c), vectors)])
    assert all(torch.equal(v, torch.ones(12)) for v in vectors)
    assert all(r.skipped == () and r.lost == () and r.peers == 3 for r in results)


def test_a_member_whose_view_the_others_do_not_share_does_not_wait_for_them(make_node):
    """a and b began round 0 before they knew of c; c counts all three in. c gets no part from
    them, but their answers to its parts say they took part elsewhere: it stops waiting."""
    nodes = swarm(make_node, 3)
    a, b, c = (ShardedReducer(n, "t", 12, timeouts=ReduceTimeouts(round_timeout_s=TIMEOUT_S)) for n in nodes)
    pair = tuple(sorted((nodes[0].peer_id, nodes[1].peer_id)))
    everyone = tuple(sorted(n.peer_id for n in nodes))
    va, vb, vc = torch.zeros(12), 2 * torch.ones(12), 7 * torch.ones(12)
    in_parallel([lambda: a.reduce(0, pair, va), lambda: b.reduce(0, pair, vb)])
    start = time.monotonic()
    rc = c.reduce(0, everyone, vc)
    assert time.monotonic() - start < TIMEOUT_S / 4
    assert torch.equal(va, torch.ones(12)) and torch.equal(vb, torch.ones(12))
    assert not rc.synced and set(rc.lost) == set(pair)  # c's round went without them, and says so


def train(proto, rank: int, until: int) -> None:
    while proto.step_count < until:
        step = proto.step_count

        def loss(model=proto.model, step=step) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g) * (rank + 1)
            return nn.functional.mse_loss(model(x), y)

        proto.step(loss)


def outer(proto) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in proto.eval_model().parameters()])


def test_a_streaming_diloco_peer_that_catches_up_past_a_round_does_not_stall_it(make_node):
    """H=4, F=2, tau=1: fragment 1's round 1 is sent after step 7 and merged after 8. The joiner
    starts from a state of step 2; its round 0 of fragment 1 is refused as late, so it catches
    up to the others' step 7, where round 1 (which counts it as a member) is in flight: it
    fetches that round's result at the merge instead of sending to it, and must say so."""
    options = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "round_timeout_s": TIMEOUT_S}
    a, b = swarm(make_node, 2)
    pa, pb = (get_protocol("streaming-diloco").create(n, linear(), options) for n in (a, b))
    in_parallel([lambda: train(pa, 0, 2), lambda: train(pb, 1, 2)])
    stale = pa.state_dict()
    in_parallel([lambda: train(pa, 0, 6), lambda: train(pb, 1, 6)])
    c = make_node("inproc", join=[a.address])
    for node in (a, b, c):
        assert wait_until(lambda node=node: len(node.live_peers()) == 2)
    pc = get_protocol("streaming-diloco").create(c, linear(), options)
    pc.load_state_dict(stale)
    in_parallel([lambda: train(pa, 0, 7), lambda: train(pb, 1, 7)])  # round 1 of fragment 1 begins, c a member
    assert c.peer_id in pa.in_flight[1].members
    start = time.monotonic()
    in_parallel([lambda: train(pa, 0, 16), lambda: train(pb, 1, 16), lambda: train(pc, 2, 16)])
    assert time.monotonic() - start < TIMEOUT_S / 2  # nobody waited for the round timeout
    assert pa.versions == pb.versions == pc.versions == [4, 4]
    assert torch.equal(outer(pa), outer(pc)) and torch.equal(outer(pb), outer(pc))


def test_a_peer_that_catches_up_past_a_drift_check_does_not_stall_it(make_node):
    """The same catch-up, past fragment 0's round 2 (sent after step 9, merged after 10), whose
    merge also runs the drift guard's check (check_every=1): the check waits for the joiner's
    digest unless it says it takes no part in it either."""
    options = {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "round_timeout_s": TIMEOUT_S, "check_every": 1}
    a, b = swarm(make_node, 2)
    pa, pb = (get_protocol("streaming-diloco").create(n, linear(), options) for n in (a, b))
    in_parallel([lambda: train(pa, 0, 2), lambda: train(pb, 1, 2)])
    stale = pa.state_dict()
    in_parallel([lambda: train(pa, 0, 8), lambda: train(pb, 1, 8)])
    c = make_node("inproc", join=[a.address])
    for node in (a, b, c):
        assert wait_until(lambda node=node: len(node.live_peers()) == 2)
    pc = get_protocol("streaming-diloco").create(c, linear(), options)
    pc.load_state_dict(stale)
    in_parallel([lambda: train(pa, 0, 9), lambda: train(pb, 1, 9)])
    assert c.peer_id in pa.in_flight[0].members
    start = time.monotonic()
    in_parallel([lambda: train(pa, 0, 16), lambda: train(pb, 1, 16), lambda: train(pc, 2, 16)])
    assert time.monotonic() - start < TIMEOUT_S / 2
    assert pa.versions == pb.versions == pc.versions == [4, 4]
    assert torch.equal(outer(pa), outer(pc)) and torch.equal(outer(pb), outer(pc))


def test_the_only_owner_of_a_round_the_others_left_learns_it_is_behind(make_node):
    """With one owner a round (`max_owners=1`), the member that owns round 0 but is still in it
    sends no part to anyone, so no late refusal tells it the round is over. Once every other
    member has sent it parts of a later round, its own group closes at once and its round
    reports that round as the one to catch up to, without waiting out the timeout."""
    nodes = swarm(make_node, 3)
    reducers = {n.peer_id: ShardedReducer(n, "t", 12, timeouts=ReduceTimeouts(round_timeout_s=TIMEOUT_S),
                                          max_owners=1) for n in nodes}
    members = tuple(sorted(reducers))
    (owner,) = next(iter(reducers.values())).placement.owner_set(members, 0)
    assert reducers[owner].placement.owner_set(members, 3) == {owner}  # one term: the same owner
    others = [reducers[m] for m in members if m != owner]
    ahead = [o.start(3, members, torch.full((12,), 2.0)) for o in others]  # they went on to round 3
    assert wait_until(lambda: all(reducers[owner]._peer_round.get(m, -1) == 3 for m in members if m != owner))
    start = time.monotonic()
    behind = reducers[owner].reduce(0, members, torch.zeros(12))
    assert time.monotonic() - start < TIMEOUT_S / 4
    assert behind.ahead == 3 and owner in behind.absent
    vector = torch.full((12,), 5.0)  # it catches up: round 3 closes with all three
    caught_up = reducers[owner].reduce(3, members, vector)
    assert caught_up.peers == 3 and caught_up.lost == () and torch.equal(vector, torch.full((12,), 3.0))
    assert all(p.wait().peers == 3 for p in ahead)
