"""An owner's accumulator: parts kept as they came, summed in member order, non-finite ones left out."""
from __future__ import annotations

import itertools

import torch

from starling.collectives.accumulator import ShardGroup as _ShardGroup


def test_an_owner_sums_parts_without_copying_or_writing_them():
    """A first part is kept as it is (a view of a wire buffer or of the caller's vector); the
    second makes the sum in a buffer of its own; no part is ever written."""
    mine, theirs, third = torch.arange(4.0), torch.ones(4), torch.full((4,), 2.0)
    before = mine.clone(), theirs.clone()
    group = _ShardGroup(("a", "b", "c"), {"a", "b", "c"})
    group.add("a", mine)
    assert group.total is None and group.received["a"] is mine  # kept, not copied
    group.add("b", theirs)
    group.add("c", third)
    total = group.sum()
    assert total.data_ptr() not in (mine.data_ptr(), theirs.data_ptr(), third.data_ptr())
    assert torch.equal(total, before[0] + before[1] + third)
    total.div_(3)  # what the owner does to its sum: the parts stay as they were
    assert torch.equal(mine, before[0]) and torch.equal(theirs, before[1])

    lone = _ShardGroup(("a", "b"), {"a", "b"})
    lone.add("a", mine)
    alone = lone.sum()  # closed without the others: a copy, never the caller's memory
    assert alone.data_ptr() != mine.data_ptr() and torch.equal(alone, mine)

    copied = mine.clone()
    owned = _ShardGroup(("a", "b"), {"a", "b"})
    owned.add("a", copied, owned=True)  # a private copy becomes a lone sum as it is
    assert owned.sum() is copied

def test_an_owner_sums_in_member_order_whatever_order_the_parts_come_in():
    """Float addition is not associative: (1e8 + 1) - 1e8 is 0 in float32, (1e8 - 1e8) + 1 is
    1. Every arrival order gives the member-order sum, bit for bit, so two runs of a swarm
    average alike; a part that came ahead of its turn waits for the ones before it."""
    parts = {"a": torch.tensor([1e8, 0.5]), "b": torch.tensor([1.0, 0.25]), "c": torch.tensor([-1e8, 0.125])}
    expected = (parts["a"] + parts["b"]) + parts["c"]
    assert expected[0] == 0.0  # the member-order sum of the first values; arrival order c, b, a would give 1
    for order in itertools.permutations("abc"):
        group = _ShardGroup(("a", "b", "c"), {"a", "b", "c"})
        for sender in order:
            group.add(sender, parts[sender])
        assert group.contributors == list(order)
        assert torch.equal(group.sum(), expected), order

    early = _ShardGroup(("a", "b", "c"), {"a", "b", "c"})
    early.add("c", parts["c"])
    early.add("b", parts["b"])
    assert early.first is None and early.total is None  # nothing is summed before a's part
    early.add("a", parts["a"])
    assert torch.equal(early.total, expected)

    missing = _ShardGroup(("a", "b", "c"), {"a", "b", "c"})  # closed without b: a + c, in order
    missing.add("c", parts["c"])
    missing.add("a", parts["a"])
    assert missing.total is None and torch.equal(missing.sum(), parts["a"] + parts["c"])

def test_an_owner_leaves_out_parts_that_are_not_finite_and_only_those():
    group = _ShardGroup(("a", "b", "c"), {"a", "b", "c"})
    group.add("a", torch.ones(4))
    group.add("b", torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    group.add("c", torch.full((4,), 3.0))
    assert torch.equal(group.sum(), torch.full((4,), 4.0))
    assert group.bad == {"b"} and group.contributors == ["a", "c"]

    poisoned = _ShardGroup(("a", "b"), {"a", "b"})
    poisoned.add("a", torch.tensor([float("inf")]), owned=True)  # one's own part is checked too
    poisoned.add("b", torch.tensor([float("-inf")]))
    assert poisoned.sum().numel() == 0 and poisoned.bad == {"a", "b"} and poisoned.contributors == []

    huge = _ShardGroup(("a", "b"), {"a", "b"})  # finite parts whose sum overflows: that is the sum
    huge.add("a", torch.tensor([3e38, 1.0]))
    huge.add("b", torch.tensor([3e38, 1.0]))
    assert huge.sum()[0] == float("inf") and not huge.bad and huge.contributors == ["a", "b"]
