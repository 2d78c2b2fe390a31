"""The unit assignment rule on a fake swarm: each peer keeps its own ledger and advances it with
the members it sees; what every peer trains is recorded, so coverage and repeats are counted
exactly."""
from __future__ import annotations

import collections

import pytest

from starling.data.assignment import Unit, UnitLedger, epoch_order


class FakeSwarm:
    """Peers with their own ledgers; `round(views)` advances each live peer's ledger with the
    members it sees and records the units it trains (`finishing`: those that finish the round)."""

    def __init__(self, units: int, peers: list[str], seed: int = 7, per_member: int = 1) -> None:
        self.units, self.seed, self.per_member = units, seed, per_member
        self.ledgers = {p: UnitLedger(units, seed, per_member) for p in peers}
        self.trained: collections.Counter[tuple[int, int]] = collections.Counter()
        self.r = 0

    def round(self, views: dict[str, list[str]] | None = None, finishing: set[str] | None = None,
              left: tuple[str, ...] = (), adopt: dict[str, str] | None = None) -> None:
        """`adopt`: peer -> peer whose state it takes after advancing, before it trains."""
        live = sorted(self.ledgers)
        for peer in live:
            members = (views or {}).get(peer, live)
            self.ledgers[peer].advance(self.r, members, finished=left)
        for peer, source in (adopt or {}).items():
            self.ledgers[peer].load_state_dict(self.ledgers[source].state_dict())
        for peer in live:
            if finishing is None or peer in finishing:
                for unit in self.ledgers[peer].units_of(peer):
                    self.trained[(unit.epoch, unit.index)] += 1
        self.r += 1

    def kill(self, peer: str) -> None:
        del self.ledgers[peer]

    def join(self, peer: str, from_peer: str) -> None:
        ledger = UnitLedger(self.units, self.seed, self.per_member)
        ledger.load_state_dict(self.ledgers[from_peer].state_dict())  # the state a joiner fetches
        self.ledgers[peer] = ledger

    def epoch_counts(self, epoch: int) -> collections.Counter[int]:
        return collections.Counter({i: n for (e, i), n in self.trained.items() if e == epoch})

    def digests(self) -> set[str]:
        return {ledger.digest() for ledger in self.ledgers.values()}


def test_a_steady_swarm_trains_each_unit_of_an_epoch_once_in_the_epochs_order():
    swarm = FakeSwarm(20, ["a", "b", "c", "d"])
    for _ in range(5):
        swarm.round()
    assert swarm.epoch_counts(0) == collections.Counter(range(20))
    order = epoch_order(20, 7, 0).tolist()
    assert swarm.ledgers["a"].units_of("a") == [Unit(0, 16, order[16])]  # members by id: a takes first
    swarm.round()
    assert swarm.ledgers["a"].epoch == 1 and len(swarm.digests()) == 1
    assert epoch_order(20, 7, 1).tolist() != order  # each epoch its own order


def test_a_dead_peers_unfinished_unit_goes_to_the_next_member_and_nothing_is_lost_or_repeated():
    swarm = FakeSwarm(30, ["a", "b", "c"])
    swarm.round()
    swarm.round(finishing={"a", "b"})  # c dies during this round: its unit is never trained by it
    lost = swarm.ledgers["a"].units_of("c")
    swarm.kill("c")
    swarm.round()
    assert swarm.ledgers["a"].units_of("a") == lost  # the pool comes first
    while swarm.ledgers["a"].epoch == 0:
        swarm.round()
    assert swarm.epoch_counts(0) == collections.Counter(range(30))
    assert swarm.ledgers["a"].returned == 1 and len(swarm.digests()) == 1


def test_a_joiner_takes_fresh_units_never_finished_ones_and_a_growing_swarm_covers_the_epoch():
    swarm = FakeSwarm(64, ["a", "b"], per_member=2)
    swarm.round()
    for n, name in enumerate("cdefgh"):  # grows past its first size, one peer a round
        swarm.join(name, from_peer="a")
        swarm.round()
        finished = {i for (e, i), k in swarm.trained.items() if e == 0}
        assert not set(u.index for u in swarm.ledgers[name].units_of(name)) & (finished - {
            u.index for u in swarm.ledgers[name].units_of(name)}), n
    while swarm.ledgers["a"].epoch == 0:
        swarm.round()
    counts = swarm.epoch_counts(0)
    assert sorted(counts) == list(range(64)) and set(counts.values()) == {1}
    assert len(swarm.digests()) == 1


def test_a_shrinking_swarm_covers_the_epoch_and_one_member_alone_goes_on():
    swarm = FakeSwarm(25, list("abcdef"))
    left: tuple[str, ...] = ()
    for name in "bcdef":
        swarm.round(left=left)
        swarm.kill(name)  # each leaves gracefully after finishing its round, and says so
        left = (name,)
    while swarm.ledgers["a"].epoch == 0:
        swarm.round(left=left)
    assert swarm.epoch_counts(0) == collections.Counter(range(25))


def test_one_round_of_disagreeing_views_costs_at_most_a_round_in_flight_and_taking_a_state_heals_it():
    swarm = FakeSwarm(40, ["a", "b", "c", "d"])
    swarm.round()
    swarm.round(finishing={"a", "b", "d"})  # c dies in this round
    swarm.kill("c")
    swarm.round(views={"a": ["a", "b", "c", "d"]})  # only `a` still counts c
    swarm.round()
    assert len(swarm.digests()) == 2  # a took c's unit for finished; the others returned it
    swarm.round(adopt={"a": "b"})  # a takes b's state before it trains, as a peer whose digest differs can
    assert len(swarm.digests()) == 1
    while swarm.ledgers["a"].epoch == 0:
        swarm.round()
    counts = swarm.epoch_counts(0)
    skipped = 40 - len(counts)
    repeated = sum(n - 1 for n in counts.values())
    assert skipped <= 4 and repeated <= 4  # each at most the units in flight in the round views differed


def test_a_false_death_repeats_at_most_the_units_the_member_held_and_the_ledgers_then_differ():
    swarm = FakeSwarm(40, ["a", "b", "c"])
    swarm.round()
    held = swarm.ledgers["c"].units_of("c")
    # b holds c dead for one round while c goes on training
    swarm.round(views={"b": ["a", "b"]})
    swarm.round()
    counts = swarm.trained
    assert sum(n - 1 for n in counts.values()) <= len(held) + swarm.per_member
    assert len(swarm.digests()) > 1  # documented: only a state fetch brings them together


def test_a_kill_all_restart_from_saved_ledgers_repeats_and_skips_nothing():
    swarm = FakeSwarm(30, ["a", "b", "c"])
    for _ in range(4):
        swarm.round()
    saved = {p: ledger.state_dict() for p, ledger in swarm.ledgers.items()}
    for p in list(swarm.ledgers):  # everyone dies after finishing round 3; restart from checkpoints
        ledger = UnitLedger(30, 7)
        ledger.load_state_dict(saved[p])
        swarm.ledgers[p] = ledger
    while swarm.ledgers["a"].epoch == 0:
        swarm.round()
    assert swarm.epoch_counts(0) == collections.Counter(range(30))


def test_a_ledger_refuses_another_data_sets_state_or_a_malformed_one_and_keeps_its_own():
    ledger = UnitLedger(10, 1)
    ledger.advance(0, ["a"])
    before = ledger.state_dict()
    for bad in [UnitLedger(11, 1).state_dict(), UnitLedger(10, 2).state_dict(), {"units": 10},
                {**before, "pool": [[0, 0, 99]]}, {**before, "cursor": 11}, {**before, "in_flight": [1, 2]},
                {**before, "pool": "x"}]:
        with pytest.raises(ValueError):
            ledger.load_state_dict(bad)
        assert ledger.state_dict() == before
    with pytest.raises(ValueError, match="not after"):
        ledger.advance(0, ["a"])
    with pytest.raises(ValueError):
        UnitLedger(0, 1)


def test_the_position_reports_what_node_status_shows():
    ledger = UnitLedger(10, 1, units_per_member=2)
    ledger.advance(0, ["a", "b"])
    ledger.advance(1, ["a"])
    position = ledger.position()
    assert position == {**position, "epoch": 0, "units": 10, "done": 2, "returned": 2, "in_flight": 2,
                        "pool": 0, "fresh_left": 6, "round": 1}


def test_a_member_the_round_went_on_without_gets_its_units_back_into_the_pool_not_counted_done():
    # j is a member in every view (its join is known) but trains nothing yet: it is fetching state
    ledgers = {p: UnitLedger(12, 3) for p in ("a", "b", "j")}
    for peer in ("a", "b"):
        ledgers[peer].advance(0, ["a", "b", "j"])
    held = ledgers["a"].units_of("j")
    for peer in ("a", "b"):
        ledgers[peer].advance(1, ["a", "b", "j"], unfinished=["j"])  # round 0 went on without j
    assert ledgers["a"].units_of("a") == held  # the pool comes first: a trains j's unit
    assert ledgers["a"].done == 2 and ledgers["a"].returned == 1
    assert ledgers["a"].digest() == ledgers["b"].digest()


def test_a_joiner_seen_by_some_peers_only_changes_nobody_elses_units_that_round():
    swarm = FakeSwarm(40, ["b", "c", "d"])
    swarm.round()
    swarm.join("a", from_peer="b")  # an id before everyone's: by id order it would take b's unit
    swarm.round(views={"b": ["a", "b", "c", "d"], "a": ["a", "b", "c", "d"]}, finishing={"b", "c", "d"})
    for peer in ("b", "c", "d"):  # b sees the joiner, c and d do not yet: all hand them the same units
        assert swarm.ledgers["b"].units_of(peer) == swarm.ledgers["c"].units_of(peer)
    assert sum(n - 1 for n in swarm.trained.values()) == 0
    assert swarm.ledgers["b"].order == ["b", "c", "d", "a"]  # the joiner takes its turn last


def test_a_member_left_out_of_a_round_is_admitted_after_everyone_else():
    ledger = UnitLedger(10, 1)
    ledger.advance(0, ["a", "b"])
    taken = {u.position for held in ledger.in_flight.values() for u in held}
    mine = ledger.admit("c")
    assert [u.position for u in mine] == [max(taken) + 1] and ledger.order == ["a", "b", "c"]
    assert ledger.admit("c") == mine  # once


def test_peek_names_the_next_unit_without_handing_it_out():
    ledger = UnitLedger(3, 1)
    ledger.advance(0, ["a", "b"])
    nxt = ledger.peek()
    assert ledger.peek() == nxt and ledger.cursor == 2
    ledger.advance(1, ["a", "b"])
    assert ledger.units_of("a") == [nxt] and nxt.position == 2  # the last of epoch 0
    assert ledger.units_of("b")[0].epoch == 1 and (ledger.peek().epoch, ledger.peek().position) == (1, 1)


def test_a_newcomer_waits_its_first_round_when_the_swarm_can_step_without_counting():
    ledger = UnitLedger(20, 2, newcomers_wait=True)
    ledger.advance(0, ["a", "b"])  # the first members start at once
    assert ledger.units_of("a") and ledger.units_of("b")
    ledger.advance(1, ["a", "b", "c"])
    assert ledger.units_of("c") == [] and ledger.order == ["a", "b", "c"]
    ledger.advance(2, ["a", "b", "c"])
    assert len(ledger.units_of("c")) == 1 and ledger.done == 4 and ledger.returned == 0
