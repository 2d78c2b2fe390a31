"""A small vector over many peers: shards of at least `min_shard_numel` values, owned by as
many members as there are shards (drawn each round), so a round costs n x (shards) requests
instead of n^2."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm

from starling.collectives import ShardedReducer
from starling.node import Refusal, refusal_of


class CountingReducer(ShardedReducer):
    """Counts the parts that reach it as an owner."""

    def __init__(self, *args, **kwargs) -> None:
        self.parts_in = 0
        super().__init__(*args, **kwargs)

    async def _on_part(self, msg):
        self.parts_in += 1
        return await super()._on_part(msg)


def test_only_as_many_members_as_shards_own_them_and_every_peer_gets_the_same_average(make_node):
    nodes = swarm(make_node, 4)
    reducers = [CountingReducer(n, "t.min", 12, min_shard_numel=6) for n in nodes]  # 2 shards of 6
    members = tuple(sorted(n.peer_id for n in nodes))
    vectors = [torch.arange(12.0) * (i + 1) for i in range(4)]
    results = in_parallel([lambda r=r, v=v: r.reduce(0, members, v) for r, v in zip(reducers, vectors)])
    for v, r in zip(vectors, results):
        assert torch.equal(v, torch.arange(12.0) * 2.5)
        assert r.peers == 4 and r.lost == () and r.synced
    parts_in = {n.peer_id: r.parts_in for n, r in zip(nodes, reducers)}
    # every part went to one of the round's two owners, one from each of the three others
    owners = reducers[0].placement.owner_set(members, 0)
    assert len(owners) == 2 and all(r.placement.owner_set(members, 0) == owners for r in reducers)
    assert [parts_in[m] for m in members] == [3 if m in owners else 0 for m in members]


def test_a_part_for_a_shard_past_the_owners_is_refused_and_counted(make_node):
    a, b, c = swarm(make_node, 3)
    for n in (a, b, c):
        ShardedReducer(n, "t.min", 12, min_shard_numel=6)
    members = tuple(sorted(n.peer_id for n in (a, b, c)))
    third = next(n for n in (a, b, c) if n.peer_id == members[2])  # owns nothing: 2 shards
    sender = next(n for n in (a, b, c) if n is not third)
    body = {"step": 0, "shard": 2, "chunk": 0, "members": list(members), "packet": {}}
    reply = sender.request(third.peer_id, "t.min", body).body
    assert refusal_of(reply) is Refusal.NOT_OWNER
    assert third.stats.rejected["t.min.not_owner"] == 1


def test_min_shard_numel_must_be_positive(make_node):
    with pytest.raises(ValueError, match="min_shard_numel"):
        ShardedReducer(make_node("inproc"), "t.min", 12, min_shard_numel=0)


def test_max_owners_caps_the_shards_and_as_many_members_own_them(make_node):
    nodes = swarm(make_node, 5)
    reducers = [CountingReducer(n, "t.cap", 20, max_owners=2) for n in nodes]
    members = tuple(sorted(n.peer_id for n in nodes))
    vectors = [torch.arange(20.0) * (i + 1) for i in range(5)]
    results = in_parallel([lambda r=r, v=v: r.reduce(0, members, v) for r, v in zip(reducers, vectors)])
    assert all(torch.equal(v, torch.arange(20.0) * 3) for v in vectors)
    assert all(r.peers == 5 and r.lost == () for r in results)
    parts_in = {n.peer_id: r.parts_in for n, r in zip(nodes, reducers)}
    owners = reducers[0].placement.owner_set(members, 0)
    assert len(owners) == 2 and all(r.placement.owner_set(members, 0) == owners for r in reducers)
    assert [parts_in[m] for m in members] == [4 if m in owners else 0 for m in members]
    with pytest.raises(ValueError, match="max_owners"):
        ShardedReducer(nodes[0], "t.bad", 12, max_owners=-1)


def test_a_round_whose_owners_fit_the_socket_cap_holds_every_part(make_node):
    # every node may hold 2 sockets to others (3 while they are busy), and a part holds one
    # until its owner's group closes: with an owner per member (5 others) the parts that found
    # no socket were lost, or waited on groups that waited on them; with 2 owners every part
    # has a socket
    from conftest import TEST_LIVENESS, wait_until

    from starling.node import NodeConfig
    from starling.node.transport import TransportConfig

    config = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0,
                        transport=TransportConfig(max_open_dealers=2))
    first = make_node("inproc", config=config)
    nodes = [first] + [make_node("inproc", join=[first.address], config=config) for _ in range(5)]
    for node in nodes:
        assert wait_until(lambda node=node: len(node.live_peers()) == 5)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "t.sockets", 64, max_owners=2) for n in nodes]
    for t in range(3):
        vectors = [torch.full((64,), float(i + t)) for i in range(6)]
        results = in_parallel([lambda r=r, v=v: r.reduce(t, members, v) for r, v in zip(reducers, vectors)])
        assert all(r.peers == 6 and r.lost == () for r in results), [r.lost for r in results]
        assert all(torch.equal(v, torch.full((64,), 2.5 + t)) for v in vectors)
