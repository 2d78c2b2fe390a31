"""Which units of an epoch each member of a swarm trains at a round, with no coordinator.

A data set is cut into units (one unit: one batch of rows). An epoch is a permutation of the
units fixed by the swarm's seed and the epoch's number. Every peer keeps a `UnitLedger` and
advances it once per round with the round's members; the ledger is a pure function of its state
and those members, so peers that agree on the members of each round hold the same ledger and
hand out the same units:

1. settle the last round: a member of this round finished the units it held (it is here, so it
   stepped), unless the last round went on without it; the units of a peer that is no longer a
   member, or whose work did not count, go back to the pool;
2. hand out: each member takes `units_per_member` units, first from the pool (lowest epoch
   position first), then fresh units from the epoch's cursor; when the epoch is used up and the
   pool is empty, the next epoch begins. Members take their turn in the order they first became
   members (the first ones, and those that join in the same round, in the order of their ids),
   so that a joiner takes the next units after everyone else's: a peer that does not see the
   joiner yet hands every other member the same units as a peer that does.

So a dead peer's unfinished units go to whoever comes next, a joiner takes the next units in
line (never a finished one), and a swarm of any size covers the epoch: the cursor moves by the
number of members, whatever it is.

A graceful leaver says it finished: `advance(..., finished=...)` counts its units done though
it is no longer a member.

What the rule needs the swarm to agree on: the members of each round (and who finished the last
one). When views disagree (one peer still counts a member that died, or holds dead a member that
trains on), each peer trains what its own ledger hands it while the others' ledgers hand it
something else: in that round a unit can be trained twice and another counted finished that
nobody trained, at most the units in flight in that round each. The ledgers can then differ
until one takes another's state (`load_state_dict`, between advancing and training: a joiner
does with the swarm's state, and a peer whose `digest()` differs from the others' can).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from starling.common import derive_seed


@dataclass(frozen=True, order=True)
class Unit:
    """One unit of the data set, as handed out in `epoch` at `position` of that epoch's order.
    `index` is the unit in the data set (rows `index * rows_per_unit` onwards)."""

    epoch: int
    position: int
    index: int

    def to_wire(self) -> list[int]:
        return [self.epoch, self.position, self.index]

    @classmethod
    def from_wire(cls, raw: Any) -> Unit:
        if not (isinstance(raw, (list, tuple)) and len(raw) == 3 and all(isinstance(v, int) for v in raw)):
            raise ValueError(f"a unit is [epoch, position, index], got {raw!r}")
        return cls(*raw)


def epoch_order(units: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's permutation of `units` unit indices, the same on every peer."""
    generator = torch.Generator().manual_seed(derive_seed("data-epoch", seed, epoch))
    return torch.randperm(units, generator=generator)


class UnitLedger:
    """The swarm's data position as one peer computes it (see the module's rule)."""

    def __init__(self, units: int, seed: int, units_per_member: int = 1, newcomers_wait: bool = False) -> None:
        """`newcomers_wait`: a member joining a running swarm gets no units in its first round
        (its work there is often late, and peers may disagree on whether it counted); it then
        takes part without counting (a weightless step). Off for protocols that cannot step so."""
        if units < 1:
            raise ValueError(f"a ledger needs at least one unit, got {units}")
        if units_per_member < 1:
            raise ValueError(f"units_per_member must be >= 1, got {units_per_member}")
        self.units, self.seed, self.units_per_member = units, seed, units_per_member
        self.newcomers_wait = newcomers_wait
        self.epoch = 0
        self.cursor = 0  # the next fresh position of this epoch's order
        self.round = -1  # the last round advanced to
        self.pool: list[Unit] = []  # handed out to a peer that left before finishing them
        self.in_flight: dict[str, list[Unit]] = {}
        self.order: list[str] = []  # the members, in the order they take their units
        self.done = 0  # units finished, over all epochs
        self.returned = 0  # units handed back to the pool, over all epochs
        self._order: tuple[int, torch.Tensor] | None = None

    # ------------------------------------------------------------------ the rule
    def advance(self, round: int, members: Iterable[str], finished: Iterable[str] = (),
                unfinished: Iterable[str] = ()) -> dict[str, list[Unit]]:
        """Settle the last round and hand out this one's units; returns who holds what.
        `finished`: peers that are no longer members but finished their units (a graceful leave).
        `unfinished`: members whose work of the last round did not count (the round went on
        without them: a joiner still fetching state, a peer that died unnoticed): their units go
        back to the pool though they are still members."""
        if round <= self.round:
            raise ValueError(f"round {round} is not after the ledger's round {self.round}")
        here = sorted(set(members))
        done = (set(here) | set(finished)) - set(unfinished)
        for peer in sorted(self.in_flight):
            held = self.in_flight[peer]
            if peer in done:
                self.done += len(held)
            else:
                self.pool.extend(held)
                self.returned += len(held)
        self.pool.sort()
        present, known = set(here), set(self.order)
        waiting = {p for p in here if p not in known} if self.newcomers_wait and known else set()
        self.order = [p for p in self.order if p in present] + [p for p in here if p not in known]
        self.in_flight = {peer: [] if peer in waiting else [self._next() for _ in range(self.units_per_member)]
                          for peer in self.order}
        self.round = round
        return dict(self.in_flight)

    def admit(self, peer: str) -> list[Unit]:
        """Hand `peer`, a member this ledger's round left out (its author did not see it yet),
        its units of the round now, after everyone else's; returns them. Ledgers that did not
        admit it hand the same units out in their next round, so each costs one repeat at most."""
        if peer not in self.in_flight:
            self.order.append(peer)
            self.in_flight[peer] = [self._next() for _ in range(self.units_per_member)]
        return list(self.in_flight[peer])

    def peek(self) -> Unit:
        """The unit this ledger hands out next, without handing it out."""
        if self.pool:
            return self.pool[0]
        epoch, position = (self.epoch + 1, 0) if self.cursor == self.units else (self.epoch, self.cursor)
        return Unit(epoch, position, int(self._order_of(epoch)[position]))

    def units_of(self, peer: str) -> list[Unit]:
        """The units `peer` trains in the current round ([] if it is not a member)."""
        return list(self.in_flight.get(peer, ()))

    def _next(self) -> Unit:
        if self.pool:
            return self.pool.pop(0)
        if self.cursor == self.units:
            self.epoch, self.cursor = self.epoch + 1, 0
        position = self.cursor
        self.cursor += 1
        return Unit(self.epoch, position, int(self._order_of(self.epoch)[position]))

    def _order_of(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.units, self.seed, epoch))
        return self._order[1]

    # ------------------------------------------------------------------ reporting and state
    def position(self) -> dict[str, Any]:
        """Where the swarm stands in its data, for `node status` and run summaries."""
        return {"epoch": self.epoch, "units": self.units, "fresh_left": self.units - self.cursor,
                "in_flight": sum(len(v) for v in self.in_flight.values()), "pool": len(self.pool),
                "done": self.done, "returned": self.returned, "round": self.round, "digest": self.digest()}

    def state_dict(self) -> dict[str, Any]:
        """Plain data (ints, strings, lists): for checkpoints and the state a joiner fetches."""
        return {"units": self.units, "seed": self.seed, "units_per_member": self.units_per_member,
                "epoch": self.epoch, "cursor": self.cursor, "round": self.round,
                "pool": [u.to_wire() for u in self.pool],
                "in_flight": {peer: [u.to_wire() for u in held] for peer, held in sorted(self.in_flight.items())},
                "order": list(self.order), "done": self.done, "returned": self.returned}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved or fetched position; ValueError (and no change) if it is of another data
        set or malformed."""
        try:
            mine = (self.units, self.seed, self.units_per_member)
            theirs = (state["units"], state["seed"], state["units_per_member"])
            if theirs != mine:
                raise ValueError(f"a ledger of (units, seed, units_per_member) {theirs}, not {mine}")
            epoch, cursor, round_ = int(state["epoch"]), int(state["cursor"]), int(state["round"])
            if epoch < 0 or not 0 <= cursor <= self.units:
                raise ValueError(f"epoch {epoch} and cursor {cursor} are out of range")
            pool = sorted(Unit.from_wire(u) for u in state["pool"])
            in_flight = {str(peer): [Unit.from_wire(u) for u in held] for peer, held in state["in_flight"].items()}
            done, returned = int(state["done"]), int(state["returned"])
            order = state.get("order", sorted(in_flight))  # a position saved before members had an order
            distinct = isinstance(order, list) and len(set(order)) == len(order)
            if not distinct or not all(isinstance(p, str) for p in order):
                raise ValueError(f"a ledger's order is a list of distinct peer ids, got {order!r}")
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed ledger state: {exc!r}") from None
        if any(not 0 <= u.index < self.units for u in (*pool, *(u for v in in_flight.values() for u in v))):
            raise ValueError("a ledger state names a unit out of range")
        self.epoch, self.cursor, self.round = epoch, cursor, round_
        self.pool, self.in_flight, self.done, self.returned = pool, in_flight, done, returned
        self.order = list(order)

    def digest(self) -> str:
        """A short hash of what decides the units handed out next: equal on peers that agree."""
        stream = {"epoch": self.epoch, "cursor": self.cursor, "pool": [u.to_wire() for u in self.pool],
                  "order": self.order,
                  "in_flight": {p: [u.to_wire() for u in v] for p, v in sorted(self.in_flight.items())}}
        return hashlib.sha256(json.dumps(stream, sort_keys=True).encode()).hexdigest()[:16]
