"""The swarm's data position: which units of a task's data each member trains, round after round,
held alike by every member of a round.

A task whose data comes in units (`Task.data_units()`: a token file cut into units, a streamed
corpus) trains them as a `UnitLedger` (`starling.data.assignment`) hands them out: each round
the ledger advances with the members of the round, settles the last one (a member absent from
its whole update did not finish its units) and hands each member its next units. Every member
advances its own copy, so the copies must agree: a peer whose view of the members changed, that
caught up, joined, resumed, or whose round lost someone takes the round's ledger from the
round's most senior member (`reference`), which every peer that sees the same members asks.
The digest of the round's ledger is part of what the members must hold alike at its start
(the round context), so a round whose members hold different ledgers is seen as diverged.

`SwarmLedger` is that position for one peer: the Trainer asks it for the units of each round,
tells it each step's report, and puts its state in checkpoints and in the state joiners fetch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from starling.data.assignment import Unit, UnitLedger
from starling.node import TransferError

if TYPE_CHECKING:
    from starling.node import Node
    from starling.protocols import StepReport

__all__ = ["DATA_STATE", "LEDGER_BLOB", "LEDGER_FETCH_S", "LEDGER_MAX_BYTES", "LEDGER_ROUNDS", "SwarmLedger"]

log = logging.getLogger(__name__)

# The data positions (UnitLedger states) of a unit task's last LEDGER_ROUNDS rounds, as JSON
# {round: state}: a peer whose view of the members changed, or that caught up, takes one from
# the round's most senior member, so that the swarm's ledgers agree again.
LEDGER_BLOB = "starling.train.ledger"
LEDGER_ROUNDS = 8
LEDGER_FETCH_S = 1.5  # how long a peer waits for the reference's ledger before advancing its own
LEDGER_MAX_BYTES = 64 << 20  # a ledger blob said to be larger is refused (8 rounds of a very large swarm fit)
DATA_STATE = "data"  # the state_dict key of the swarm's data position (a UnitLedger), next to the protocol's


class SwarmLedger:
    """One peer's copy of the swarm's data position (see the module's docstring)."""

    def __init__(self, node: Node, units: int, seed: int) -> None:
        self.node = node
        self.ledger = UnitLedger(units, seed)
        self.adopted = 0  # times this peer took the reference's ledger
        self._rounds: dict[int, str] = {}  # round -> the ledger's state after advancing to it, as JSON
        self._blob = b"{}"  # those, as served (one reference swap: the network thread reads it)
        self._members: tuple[str, ...] | None = None  # the members the ledger last advanced with
        # round -> members absent from its whole update, for each round that lost someone
        self._went_without: dict[int, tuple[str, ...]] = {}
        self._weightless_round: int | None = None  # a round the reference's ledger gave this peer no unit in
        self._readopt = False  # this peer's ledger may differ from the reference's: take it again next round
        self._recheck = False  # the ledger came with a fetched state: take this round's from the reference
        # the ledger came from a checkpoint or a donor: until a reference's has been taken, this
        # peer is never its own reference, even where that ledger names it the most senior member
        self._fresh = False
        self._weightless_steps = False

    def start(self, weightless_steps: bool) -> None:
        """The protocol is built: `weightless_steps`, whether it can take part in a round without
        counting (a joiner then waits a round so). Serves this peer's recent rounds' ledgers."""
        self._weightless_steps = weightless_steps
        self.ledger.newcomers_wait = weightless_steps
        self.node.serve_blob(LEDGER_BLOB, lambda: self._blob)

    # ------------------------------------------------------------------ saved and fetched positions
    def parse(self, data: Any) -> UnitLedger | None:
        """A ledger holding a saved or fetched data position (None if none came); ValueError for
        one of another data set or a malformed one. Changes nothing."""
        if data is None:
            return None
        ledger = UnitLedger(self.ledger.units, self.ledger.seed, self.ledger.units_per_member,
                            self.ledger.newcomers_wait)
        ledger.load_state_dict(data)
        return ledger

    def take(self, ledger: UnitLedger) -> None:
        """Continue from `ledger` (a donor's or a checkpoint's, from `parse`): the swarm may have
        gone on since, so this round's is taken from the reference before this peer's counts."""
        self.ledger = ledger
        self._recheck = self._fresh = True

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    # ------------------------------------------------------------------ rounds
    def rounds(self, step_count: Callable[[], int]) -> Iterator[tuple[Unit, bool]]:
        """Each round (this peer's step count), advance the ledger with the members this peer
        sees and yield the units it hands this peer, as (unit, counts); a round that gives it
        none yields, where the protocol allows, the next unit in line not to count (to keep in
        step). Ends when a round passes without a step (a caller that only reads batches)."""
        me = self.node.peer_id
        while True:
            round_ = step_count()
            if round_ > self.ledger.round or self._recheck:
                self.advance(round_, tuple(sorted({me, *self.node.live_peers()})))
                self.node.set_status_info(data=self.ledger.position())
            for unit in self.ledger.units_of(me):
                yield unit, True
            if self._weightless_round == round_ and not self.ledger.units_of(me):
                yield self.ledger.peek(), False
            if step_count() == round_:
                return

    def stepped(self, report: StepReport) -> bool:
        """What a step's report says of the round: who was absent from its whole update, and
        whether its members began it apart (then the next round's ledger is taken again).
        Returns whether the update held this peer's work."""
        if report.absent_peers or report.lost_peers:
            self._went_without[report.step] = tuple(report.absent_peers)
        if report.diverged:  # the members began the round apart (ledgers, or parameters): re-take it
            self._readopt = True
        return self.node.peer_id not in report.absent_peers

    def digest(self) -> bytes:
        """The digest of the ledger of the round this peer is in (its serialized form, kept
        anyway for the others to fetch); empty before the first round."""
        state = self._rounds.get(self.ledger.round)
        return hashlib.sha256(state.encode()).digest() if state is not None else b""

    def advance(self, round_: int, members: tuple[str, ...]) -> None:
        """The ledger at `round_`: advanced here with `members`, settling the last round (a member
        absent from its whole update did not finish its units); or, when this peer skipped
        rounds (it caught up), the members changed or the last round lost someone (views may
        differ for a round), taken from the round's most senior member, which every peer that
        sees the same members asks."""
        recheck, self._recheck = round_ == self.ledger.round, False  # a joiner's first round
        jumped = recheck or round_ > self.ledger.round + 1
        changed = self._members is not None and members != self._members
        changed = changed or self.ledger.round in self._went_without or self._readopt  # or lost someone
        self._readopt = False
        self._members = members
        # the reference: the round's most senior member (the first in the ledger's order that is
        # still here), never a joiner, whose ledger has not caught up yet
        me = self.node.peer_id
        present = set(members) - ({me} if self._fresh and len(members) > 1 else set())
        reference = next((p for p in self.ledger.order if p in present), min(present))
        adopted = None
        if (jumped or changed) and reference != me:
            adopted = self._reference(reference, round_)
        if adopted is not None or len(members) == 1:
            self._fresh = False
        if adopted is not None:
            self.ledger = adopted
            self.adopted += 1
            # a peer that caught up or just joined may have been late in this round, which the
            # others then settle without it: it takes the next round's ledger too
            self._readopt = jumped
        elif not recheck:
            without = [p for p in self._went_without.get(self.ledger.round, ()) if p in members]
            if len(without) > max(2, len(members) // 4):
                # Most of the round looks absent: its members disagreed on who was in it (a shard
                # layout of another view sends parts to other owners), and their work did count
                # where it went. Only a few absences are taken for work that counted nowhere.
                without = []
            self.ledger.advance(round_, members, unfinished=without)
        if not self.ledger.in_flight.get(self.node.peer_id):  # it did not see this peer yet, or it is new
            log.info("%s: the ledger of round %d (%s) gives this peer no unit", self.node.peer_id, round_,
                     "from " + reference if adopted is not None else "its own")
            self._readopt = True
            if self._weightless_steps:
                self._weightless_round = round_
            else:  # a protocol that cannot step without counting: train the next unit in line
                self.ledger.admit(self.node.peer_id)
        self._went_without = {r: v for r, v in self._went_without.items() if r >= round_ - 1}
        self._rounds[round_] = json.dumps(self.ledger.state_dict())  # each round's serialized once
        for old in [r for r in self._rounds if r <= round_ - LEDGER_ROUNDS]:
            del self._rounds[old]
        rounds = ", ".join(f'"{r}": {state}' for r, state in self._rounds.items())
        self._blob = ("{" + rounds + "}").encode()

    def _reference(self, reference: str, round_: int) -> UnitLedger | None:
        """`reference`'s ledger at `round_` (None if it has none for that round within
        LEDGER_FETCH_S, or sends one that does not load: this peer then advances its own)."""
        deadline = time.monotonic() + LEDGER_FETCH_S
        while True:
            try:
                left = max(0.0, deadline - time.monotonic())
                _, blob = self.node.fetch_blob(LEDGER_BLOB, [reference], deadline_s=left, max_bytes=LEDGER_MAX_BYTES)
                state = json.loads(blob).get(str(round_)) if blob.startswith(b"{") else None
                if state is not None:
                    ledger = self.parse(state)
                    if ledger is not None and ledger.round == round_:
                        return ledger
            except (TransferError, ValueError, AttributeError, RecursionError) as exc:
                log.info("%s: no ledger of round %d from %s: %s", self.node.peer_id, round_, reference, exc)
                return None
            if time.monotonic() >= deadline:  # the reference has not reached the round
                log.info("%s: %s had no ledger of round %d within %.1f s", self.node.peer_id, reference, round_,
                         LEDGER_FETCH_S)
                return None
            time.sleep(0.02)
