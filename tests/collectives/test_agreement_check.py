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
