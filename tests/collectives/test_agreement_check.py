"""The agreement check: every member holds the same bits, or one differs."""
from __future__ import annotations

import torch
from conftest import in_parallel, swarm

from starling.collectives.agreement import AgreementCheck
from starling.collectives.reduce import ReduceTimeouts


def test_the_check_agrees_on_equal_bits_and_not_on_one_flipped_bit(make_node):
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    checks = [AgreementCheck(n, "test.agree", ReduceTimeouts(round_timeout_s=10.0), lambda: True) for n in nodes]
    same = [torch.arange(10.0)] * 3
    assert in_parallel([lambda c=c, s=s: c.agree(1, members, [s]) for c, s in zip(checks, same)]) == [True] * 3
    flipped = torch.arange(10.0)
    flipped.view(torch.int32)[3] ^= 1  # one bit of one value
    tensors = [torch.arange(10.0), torch.arange(10.0), flipped]
    assert in_parallel([lambda c=c, s=s: c.agree(2, members, [s]) for c, s in zip(checks, tensors)]) == [False] * 3


def test_a_large_swarm_holding_one_state_agrees_in_the_owners_float32_arithmetic():
    """The owner sums every member's values in float32, in member order, and divides: for
    equal states the mean must come back bit for bit (whole bytes squared overflowed float32's
    exact integers past 258 members, and every check of a larger swarm found a difference)."""
    from starling.collectives.accumulator import ShardGroup
    from starling.collectives.agreement import MAX_MEMBERS, agreement_values

    assert MAX_MEMBERS >= 4096
    for digest in (b"\xff" * 8, b"\xfb\xfd\xef\x7f\x01\x99\xff\xc3"):
        mine = agreement_values(digest)
        members = [f"m{i:05d}" for i in range(4096)]
        group = ShardGroup(tuple(members), set(members))
        for m in members:
            group.add(m, mine.clone(), owned=True)
        mean, _, _ = group.average()
        assert torch.equal(mean, mine), digest.hex()
