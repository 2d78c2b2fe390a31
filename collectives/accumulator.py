"""An owner's accumulator: the parts of one chunk of one shard of one round, summed in
member order, with non-finite parts left out, and averaged by the contributors' weights.

Weights (the tokens each part was computed on): the average is sum_i s_i part_i
with shares s_i = w_i / sum_j w_j, which sum to one. Equal weights (every part without one
counts 1) take the plain path, sum / count, so that their average is bit for bit the plain
one.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from starling.collectives.aggregators import AggregatorConfig, aggregate


@dataclass(frozen=True)
class Verdict:
    """What a robust aggregator made of the members' parts: those it left out, and why, and
    those it clipped hard."""

    screened: dict[str, str] = field(default_factory=dict)
    clipped: frozenset[str] = frozenset()


@dataclass
class ShardGroup:
    """An owner's accumulator for one chunk of one shard of one round. Lives on the network thread.

    Parts are never written: a first part is kept as it is (often a view of the wire buffer it
    came in, or of the owner's own vector), and the second makes the sum out of place. Parts
    go into the sum in `members` order, whatever order they arrive in: float addition is not
    associative, and summing in arrival order made two runs of the same swarm round
    differently (and, through a quantized average, drift apart). A part that arrives ahead of
    its turn waits until the parts before it have come or the group closes. Every part stays
    referenced until the group closes (its handler awaits the reply anyway), so finiteness is
    checked once, on the sum, instead of once per part: a NaN or Inf in any part makes the
    sum's sum non-finite, and only then are the parts checked one by one and the bad ones left
    out. A peer's own part is checked like everyone else's.
    """

    members: tuple[str, ...]
    expected: set[str]
    contributors: list[str] = field(default_factory=list)  # in the order their parts arrived
    received: dict[str, torch.Tensor] = field(default_factory=dict)  # each contributor's part
    owned: set[str] = field(default_factory=set)  # contributors whose part nobody else holds
    folded: int = 0  # members[:folded] are in the sum, or were skipped at close for want of a part
    first: str | None = None  # whose part is the sum while only one is in it
    total: torch.Tensor | None = None  # the sum of two or more parts, in a buffer of its own
    bad: set[str] = field(default_factory=set)  # contributors whose part was not finite
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reply: tuple[dict[str, Any], tuple[torch.Tensor, ...]] | None = None  # every contributor's answer, as it goes out
    timer: asyncio.Future[None] | None = None  # closes the group when its time is up
    weights: dict[str, float] = field(default_factory=dict)  # each contributor's weight (1 if it named none)
    states: dict[str, bytes] = field(default_factory=dict)  # the state digest each contributor's part named
    signed: dict[str, Any] = field(default_factory=dict)  # each remote part as its author signed it (evidence)
    closing: bool = False  # being averaged: it takes no more parts
    # `reply` is set (a robust average, computed off the loop, comes after `done`)
    replied: asyncio.Event = field(default_factory=asyncio.Event)
    # False: parts are kept, never summed here (masked integer parts: their owner sums them in
    # their ring once the group closes, `collectives/unmasking.py`)
    summing: bool = True

    def add(self, sender: str, part: torch.Tensor, owned: bool = False, weight: float = 1.0) -> None:
        """`owned`: nobody else holds `part` (it may become a lone part's sum as it is)."""
        self.contributors.append(sender)
        self.received[sender] = part
        self.weights[sender] = weight
        if owned:
            self.owned.add(sender)
        if self.summing:
            self._fold(closing=False)

    def _fold(self, closing: bool) -> None:
        """Add the parts whose turn has come; `closing`: skip the members that sent none."""
        while self.folded < len(self.members):
            sender = self.members[self.folded]
            part = self.received.get(sender)
            if part is None and not closing:
                return
            self.folded += 1
            if part is None:
                continue
            if self.first is None:
                self.first = sender
            elif self.total is None:
                self.total = torch.add(self.received[self.first], part)
            else:
                self.total.add_(part)

    def sum(self) -> torch.Tensor:
        """The sum of the finite parts, in `members` order and a buffer of its own; drops the
        others from `contributors` into `bad`. Empty when no part was finite."""
        self._fold(closing=True)
        total = self.total
        if total is None:
            if self.first is None:  # every contributor is a member, so this cannot be
                raise RuntimeError("a group closed with contributors but no part to sum")
            part = self.received[self.first]
            total = part if self.first in self.owned else part.clone()
        if bool(torch.isfinite(total.sum())):
            return total
        self.bad = {s for s, p in self.received.items() if not all_finite(p)}
        if not self.bad:  # finite parts whose sum overflowed: that is the sum
            return total
        good = [self.received[s] for s in self.members if s in self.received and s not in self.bad]
        self.contributors = [s for s in self.contributors if s not in self.bad]
        if not good:
            return total.new_empty(0)
        total = good[0].clone()
        for part in good[1:]:
            total.add_(part)
        return total

    def average(self, aggregator: AggregatorConfig | None = None, center: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float] | None, Verdict]:
        """The finite parts' average and, when their weights differ, each contributor's share
        of it (None: equal weights, the plain average). Empty when no part was finite.

        A robust `aggregator` (collectives/aggregators/) combines the finite parts instead, in
        member order, from `center` (the chunk's last average) where it needs one; the parts
        it screens out leave `contributors`, and the verdict names them."""
        total = self.sum()
        if not self.contributors:
            return total, None, Verdict()
        if aggregator is not None and aggregator.robust:
            order = [s for s in self.members if s in self.contributors]
            result = aggregate([self.received[s] for s in order], [self.weights.get(s, 1.0) for s in order],
                               aggregator, center if center is not None and center.shape == total.shape else None)
            screened = {order[k]: why for k, why in result.screened.items()}
            self.contributors = [s for s in self.contributors if s not in screened]
            return result.average, None, Verdict(screened, frozenset(order[k] for k in result.clipped))
        weights = [self.weights.get(s, 1.0) for s in self.contributors]
        whole = sum(weights)
        if len(set(weights)) == 1 or whole <= 0.0:
            return total.div_(len(self.contributors)), None, Verdict()
        shares = {s: self.weights.get(s, 1.0) / whole for s in self.contributors}
        average = torch.zeros_like(total)
        for sender in self.members:  # in members order, as the sum is: every run rounds alike
            if sender in shares:
                average.add_(self.received[sender], alpha=shares[sender])
        return average, shares, Verdict()

    def complete(self) -> bool:
        return self.expected <= set(self.contributors)


def all_finite(part: torch.Tensor) -> bool:
    """A NaN or Inf anywhere makes the sum non-finite, and a sum costs one pass with no
    temporary (an elementwise isfinite allocates a mask and is ~50x slower on 50 MB); only
    a sum that overflowed from finite values needs the elementwise check."""
    return bool(torch.isfinite(part.sum())) or bool(torch.isfinite(part).all())
