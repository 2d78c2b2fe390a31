"""Protocol refusals carry a machine-readable code next to their text, and are counted."""
from __future__ import annotations

import torch
from conftest import in_parallel, swarm
from torch import nn

from starling.collectives import ShardedReducer
from starling.node import Refusal, refusal_of
from starling.protocols import get_protocol
from starling.protocols.diloco import SYNC_TOPIC
from starling.protocols.gossip import PULL_TOPIC


def part(t: int, members: tuple[str, ...], shard: int = 0) -> dict:
    return {"step": t, "shard": shard, "chunk": 0, "members": list(members), "packet": {}}


def test_a_reducer_refuses_malformed_misrouted_and_late_parts_with_their_codes(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    ra, rb = ShardedReducer(a, "test.codes", 4), ShardedReducer(b, "test.codes", 4)
    owner, other = (a, b) if members[0] == a.peer_id else (b, a)

    reply = other.request(owner.peer_id, "test.codes", {"step": "x"}).body
    assert refusal_of(reply) is Refusal.MALFORMED and reply["reason"].startswith("malformed: ")
    reply = other.request(owner.peer_id, "test.codes", part(1, members, shard=1)).body
    assert refusal_of(reply) is Refusal.NOT_OWNER
    assert owner.stats.rejected["test.codes.malformed"] == 1 and owner.stats.rejected["test.codes.not_owner"] == 1

    in_parallel([lambda: ra.reduce(2, members, torch.ones(4)), lambda: rb.reduce(2, members, torch.ones(4))])
    reply = other.request(owner.peer_id, "test.codes", part(1, members)).body
    assert refusal_of(reply) is Refusal.LATE and reply["step"] == 2  # the owner's round rides along


def test_a_closed_reducer_refuses_as_closed(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    owner, other = (a, b) if members[0] == a.peer_id else (b, a)
    ShardedReducer(owner, "test.closed", 4, is_open=lambda: False)
    reply = other.request(owner.peer_id, "test.closed", part(1, members)).body
    assert reply["ok"] is False and refusal_of(reply) is Refusal.CLOSED


def test_gossip_and_diloco_refusals_carry_codes(make_node):
    a, b = swarm(make_node, 2)
    torch.manual_seed(0)
    get_protocol("gossip").create(a, nn.Linear(3, 2), {})
    reply = b.request(a.peer_id, PULL_TOPIC, {"step": 1, "xid": 1}, [torch.zeros(3)]).body
    assert refusal_of(reply) is Refusal.MALFORMED
    reply = b.request(a.peer_id, PULL_TOPIC, {"step": 1, "xid": 2}, [torch.full((8,), float("nan"))]).body
    assert refusal_of(reply) is Refusal.NOT_FINITE

    get_protocol("diloco").create(b, nn.Linear(3, 2), {})
    reply = a.request(b.peer_id, SYNC_TOPIC, {"fragments": [99]}).body
    assert refusal_of(reply) is Refusal.MALFORMED
