"""Protocol refusals carry a machine-readable code next to their text, and are counted."""
from __future__ import annotations

import torch
from conftest import swarm
from torch import nn

from starling.node import Refusal, refusal_of
from starling.protocols import get_protocol
from starling.protocols.diloco import SYNC_TOPIC
from starling.protocols.gossip import PULL_TOPIC


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
