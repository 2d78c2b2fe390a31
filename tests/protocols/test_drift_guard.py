"""The drift guard of the protocols whose replicas are meant to be bit-identical (allreduce,
sketch-dp): a peer built with other initial weights and an optimizer state of its own, whose id
sorts first, finds out at the first check, takes the parameters and optimizer state the other
two hold, and from then on they agree bit for bit; with the check off they never agree. The
repair's rules, on guards of plain tensors: a member that claims the majority's digest and
serves another state is skipped for the next holder, and an even split repairs nobody."""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
from conftest import in_parallel, swarm, wait_until
from torch import nn

from starling.collectives import ReduceTimeouts
from starling.collectives.agreement import digest_bytes
from starling.node.rpc import Refusal, refusal_of
from starling.protocols import get_protocol
from starling.protocols.guard import DIGEST_SIZE, REFEREES, DriftGuard, donor_digest, referees, sources
from starling.protocols.optim import optimizer_from_wire, optimizer_to_wire

PEERS = 3
SKETCH_DP = {"optimizer": "sgd", "momentum": 0.9, "lr": 0.01, "round_timeout_s": 10.0}
OPTIONS = {"allreduce": ("allreduce", {"optimizer": "adamw", "lr": 0.01}),
           "sketch-dp": ("sketch-dp", {**SKETCH_DP, "sketch": "gsketch:16"}),
           # FetchSGD's error accumulator is public state too: taken with the parameters
           "sketch-dp-heavy": ("sketch-dp", {**SKETCH_DP, "sketch": "countsketch:1x16,heavy=4"})}


def model_of(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # a starting point of its own: the mistake the guard catches
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))


def in_member_order(nodes: list) -> list:
    """The nodes as a round's members are ordered (by peer id): rank 0 sorts first."""
    return sorted(nodes, key=lambda node: node.peer_id)


def loss_of(proto, rank: int, g: torch.Generator) -> torch.Tensor:
    return proto.model(torch.randn(16, 3, generator=g) * (rank + 1)).pow(2).mean()


def trained(make_node, variant: str, check_every: int | None, steps: int = 6) -> list:
    """Rank 0, the first member, drifted: its own initial weights, optimizer state and FetchSGD
    error; ranks 1 and 2 start alike."""
    nodes = in_member_order(swarm(make_node, PEERS))
    protocol, options = OPTIONS[variant]
    options = {**options, **({} if check_every is None else {"check_every": check_every})}
    protos = [get_protocol(protocol).create(n, model_of(min(r, 1)), options) for r, n in enumerate(nodes)]
    drifted = protos[0]  # an optimizer state of its own, from a step it took alone
    drifted._backprop(lambda: loss_of(drifted, 9, torch.Generator().manual_seed(9)))
    drifted.optimizer.step()
    if getattr(drifted, "error", None) is not None:
        drifted.error.add_(0.5)  # and a FetchSGD error of its own

    def run(rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            protos[rank].step(lambda: loss_of(protos[rank], rank, g))

    in_parallel([lambda r=r: run(r) for r in range(PEERS)])
    for proto in protos:
        proto.close()
    return protos


def agree(protos: list) -> bool:
    first = protos[0].flat.read_params()
    return all(torch.equal(first, p.flat.read_params()) for p in protos[1:])


@pytest.mark.parametrize("variant", list(OPTIONS))
def test_a_drifted_first_member_takes_the_majoritys_state_and_they_stay_identical(make_node, caplog, variant):
    protos = trained(make_node, variant, None)  # the default: step 0 is checked
    assert agree(protos)
    assert [p.guard.repairs for p in protos] == [1, 0, 0]  # the first member, once; the others keep theirs
    assert "my parameters differ from the majority's" in caplog.text
    holders = {p.node.peer_id for p in protos[1:]}
    assert any(f"took {h}'s state" in caplog.text for h in holders)  # a holder of the majority's
    states = [optimizer_to_wire(p.optimizer) for p in protos]
    for header, tensors in states[1:]:
        assert header == states[0][0] and all(torch.equal(a, b) for a, b in zip(tensors, states[0][1]))
    if variant == "sketch-dp-heavy":
        assert all(torch.equal(p.error, protos[0].error) for p in protos[1:])


@pytest.mark.parametrize("variant", ["allreduce", "sketch-dp"])
def test_without_the_guard_they_stay_apart(make_node, variant):
    protos = trained(make_node, variant, 0)
    assert not agree(protos) and all(p.guard is None for p in protos)


@pytest.mark.parametrize("variant", ["allreduce", "sketch-dp"])
def test_a_drift_between_checks_is_repaired_at_the_end_of_the_next_round(make_node, caplog, variant):
    """The members began round 1 with different parameters (as after a round whose views
    differed): the owners see their parts name different states, and every member checks
    right after round 1, though the next scheduled check is round 100."""
    nodes = in_member_order(swarm(make_node, PEERS))
    protocol, options = OPTIONS[variant]
    protos = [get_protocol(protocol).create(n, model_of(1), options) for n in nodes]
    gens = [torch.Generator().manual_seed(r) for r in range(PEERS)]

    def steps(n: int) -> None:
        in_parallel([lambda r=r: [protos[r].step(lambda: loss_of(protos[r], r, gens[r])) for _ in range(n)]
                     for r in range(PEERS)])

    steps(1)  # round 0, checked: they agree
    assert agree(protos) and [p.guard.repairs for p in protos] == [0, 0, 0]
    with torch.no_grad():
        protos[2].flat.params[0].add_(0.25)  # rank 2 drifts after the check
    steps(1)  # round 1: not due (check_every 100), but its averages say the states differed
    assert agree(protos)
    assert [p.guard.repairs for p in protos] == [0, 0, 1]
    assert "my parameters differ from the majority's (2 of 3 members) at round 1" in caplog.text
    steps(2)  # and no check after rounds that began alike
    assert agree(protos) and [p.guard.repairs for p in protos] == [0, 0, 1]
    for proto in protos:
        proto.close()


def test_members_whose_round_context_differs_are_told_so_and_keep_their_parameters(make_node):
    """The runtime's `round_context` (its data ledger's digest) is hashed into what a round's
    parts name: a member whose ledger differs makes every member's report say `diverged`
    (the runtime then re-takes its ledger), and the guard's check finds the parameters alike."""
    nodes = in_member_order(swarm(make_node, PEERS))
    protocol, options = OPTIONS["allreduce"]
    protos = [get_protocol(protocol).create(n, model_of(1), options) for n in nodes]
    for r, proto in enumerate(protos):
        proto.round_context = (lambda r=r: b"ledger B" if r == 2 else b"ledger A")
    gens = [torch.Generator().manual_seed(r) for r in range(PEERS)]
    reports = in_parallel([lambda r=r: protos[r].step(lambda: loss_of(protos[r], r, gens[r]))
                           for r in range(PEERS)])
    assert [rep.diverged for rep in reports] == [True] * PEERS
    assert agree(protos) and [p.guard.repairs for p in protos] == [0, 0, 0]
    protos[2].round_context = lambda: b"ledger A"
    reports = in_parallel([lambda r=r: protos[r].step(lambda: loss_of(protos[r], r, gens[r]))
                           for r in range(PEERS)])
    assert not any(rep.diverged for rep in reports)
    for proto in protos:
        proto.close()


def test_optimizer_state_that_does_not_fit_is_refused_and_changes_nothing():
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    header, tensors = optimizer_to_wire(opt)
    other = torch.optim.AdamW(nn.Linear(3, 2).parameters())
    optimizer_from_wire(other, header, tensors)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_to_wire(other)[1], tensors))
    small = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="shape"):
        optimizer_from_wire(small, header, tensors)
    assert small.state_dict()["state"] == {}


@pytest.mark.parametrize("topic", ["sync", "digest"])
def test_a_member_serves_its_state_and_digest_only_for_the_round_of_a_mismatch(make_node, topic):
    nodes = swarm(make_node, 2)
    protos = [get_protocol("allreduce").create(n, model_of(0), {}) for n in nodes]
    asked = getattr(protos[0].guard, {"sync": "topic", "digest": "digest_topic"}[topic])

    def ask(body: dict) -> Refusal | None:
        return refusal_of(nodes[1].request(nodes[0].peer_id, asked, body, timeout_s=5).body)

    assert ask({"round": 0}) is Refusal.BUSY  # no verdict yet: asked again
    in_parallel([lambda p=p: p.step(lambda p=p: p.model(torch.ones(2, 3)).sum()) for p in protos])
    assert ask({"round": 0}) is Refusal.NOT_FOUND  # step 0 was checked and agreed: nothing to serve
    assert ask({"round": -1}) is Refusal.TOO_OLD
    assert ask({"nope": 0}) is Refusal.MALFORMED
    for proto in protos:
        proto.close()


class Replica:
    """A guard over one plain tensor, every round checked; `serves` is the value it hands out
    when asked for its state (a liar's), its own by default."""

    def __init__(self, node, value: float, serves: float | None = None) -> None:
        self.node, self.value, self.serves = node, torch.full((4,), value), serves
        self.guard = DriftGuard(node, "test.", 1, ReduceTimeouts(round_timeout_s=10.0), lambda: True,
                                lambda: [self.value], self.snapshot, self.adopt, lambda header, tensors: tensors[:1])

    def snapshot(self) -> tuple[dict, list[torch.Tensor]]:
        return {}, [self.value.clone() if self.serves is None else torch.full((4,), self.serves)]

    def adopt(self, header: dict, tensors: list[torch.Tensor]) -> None:
        self.value = tensors[0].clone()


def checked(make_node, values: list[float], serves: list[float | None] | Callable[[tuple[str, ...]], list],
            ) -> tuple[list[Replica], list[bool | None]]:
    """One check of round 0 by a guard on each of len(values) nodes, rank r holding values[r]
    (ranks in member order); `serves` may be drawn from the member list."""
    nodes = in_member_order(swarm(make_node, len(values)))
    members = tuple(n.peer_id for n in nodes)
    replicas = [Replica(n, v, s) for n, v, s in zip(nodes, values, serves(members) if callable(serves) else serves)]
    return replicas, in_parallel([lambda r=r: r.guard.run(0, members) for r in replicas])


def test_a_member_that_claims_the_majoritys_digest_and_serves_another_state_is_skipped(make_node, caplog):
    # ranks 0, 2 and 3 hold the majority's 1.0 and say so; rank 1 drifted to 2.0, and the
    # holder it asks first serves 9.0
    values = [1.0, 2.0, 1.0, 1.0]
    order: list[str] = []

    def serves(members: tuple[str, ...]) -> list[float | None]:
        held = {m: digest_bytes([torch.full((4,), v)], DIGEST_SIZE) for m, v in zip(members, values)}
        order.extend(sources(members[1], referees(0, members), held, held[members[0]]))
        return [9.0 if m == order[0] else None for m in members]

    caplog.set_level(logging.WARNING)
    replicas, verdicts = checked(make_node, values, serves)
    assert verdicts == [False] * 4
    assert [r.value[0].item() for r in replicas] == [1.0] * 4  # rank 1 took the majority's, not 9.0
    assert [r.guard.repairs for r in replicas] == [0, 1, 0, 0]
    assert f"{order[0]} claimed the chosen parameters for round 0 but served others" in caplog.text
    assert f"took {order[1]}'s state for round 0" in caplog.text  # the next holder


@pytest.mark.parametrize("values", [[1.0, 2.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0]])
def test_without_a_majority_every_member_takes_one_drawn_donors_state(make_node, caplog, values):
    """An even split, every member apart, a pair that differs: no majority, and still one
    state after one check, the one `donor_digest` draws (every member draws the same)."""
    caplog.set_level(logging.WARNING)
    replicas, verdicts = checked(make_node, values, [None] * len(values))
    assert verdicts == [False] * len(values)
    (final,) = {r.value[0].item() for r in replicas}
    members = tuple(r.node.peer_id for r in replicas)
    digests = {r.node.peer_id: digest_bytes([torch.full((4,), v)], DIGEST_SIZE) for r, v in zip(replicas, values)}
    chosen, how = donor_digest(0, members, digests)
    assert "donor's, drawn among" in how
    assert digest_bytes([replicas[0].value], DIGEST_SIZE) == chosen
    assert sum(r.guard.repairs for r in replicas) == sum(v != final for v in values)


def test_the_donor_is_drawn_from_the_round_and_members_not_from_the_sort_order():
    members = tuple(f"peer{i:02d}" for i in range(8))
    apart = {m: bytes([i]) * DIGEST_SIZE for i, m in enumerate(members)}
    donors = {donor_digest(t, members, apart)[0] for t in range(40)}
    assert len(donors) > 3  # not always the first member's
    assert donor_digest(5, members, apart) == donor_digest(5, members, dict(reversed(apart.items())))
    majority = {**apart, **{m: b"x" * DIGEST_SIZE for m in members[3:]}}
    assert donor_digest(5, members, majority)[0] == b"x" * DIGEST_SIZE
    assert donor_digest(5, members, {}) == (None, "")


def test_a_large_swarm_asks_the_same_few_referees_drawn_from_the_round():
    members = tuple(f"peer{i:04d}" for i in range(1000))
    asked = referees(3, members)
    assert len(asked) == REFEREES and set(asked) <= set(members)
    assert referees(4, members) != asked  # and afresh each round
    assert set(referees(3, members[:REFEREES])) == set(members[:REFEREES])  # a small swarm asks everyone
    # one member in a hundred apart: the referees' majority is the swarm's, however it is drawn
    held = {m: (b"y" if i % 100 == 7 else b"x") * DIGEST_SIZE for i, m in enumerate(members)}
    for t in range(20):
        chosen, how = donor_digest(t, members, held)
        assert chosen == b"x" * DIGEST_SIZE and f"of {REFEREES} referees of 1000 members" in how
    # the members that take a state spread over its holders
    firsts = {sources(m, asked, held, b"x" * DIGEST_SIZE)[0] for m in members[:200]}
    assert len(firsts) > REFEREES // 2


def test_a_check_that_agrees_costs_no_round_of_its_own_and_no_transfer(make_node):
    world, dim, checks = 4, 4000, 3
    nodes = swarm(make_node, world)
    torch.manual_seed(0)
    first = nn.Linear(dim, 1, bias=False)
    models = [first] + [copy.deepcopy(first) for _ in range(world - 1)]  # one starting point
    protos = [get_protocol("allreduce").create(n, m, {"check_every": 1}) for n, m in zip(nodes, models)]
    x = torch.randn(2, dim)
    in_parallel([lambda r=r: [protos[r].step(lambda: models[r](x).sum()) for _ in range(checks)]
                 for r in range(world)])
    for node, proto in zip(nodes, protos):
        # each due round's parts named a digest of every parameter, every owner saw one, and
        # every average counted every member: the round was the check
        assert proto.guard.passed_in_round == checks
        assert node.stats.total_sent("allreduce.agree") == 0
        assert node.stats.total_sent("allreduce.sync") == 0 and proto.guard.repairs == 0
        proto.close()


def test_the_agreement_round_alone_costs_one_tiny_round_and_no_transfer(make_node):
    """What a check costs where a round cannot settle it (a round that was not whole, DiLoCo's)."""
    world, dim, checks = 4, 4000, 3
    nodes = swarm(make_node, world)
    torch.manual_seed(0)
    first = nn.Linear(dim, 1, bias=False)
    models = [first] + [copy.deepcopy(first) for _ in range(world - 1)]
    protos = [get_protocol("allreduce").create(n, m, {"check_every": 1}) for n, m in zip(nodes, models)]
    in_parallel([lambda r=r: [protos[r].guard.run(t, tuple(sorted(n.peer_id for n in nodes)))
                              for t in range(checks)] for r in range(world)])
    for node, proto in zip(nodes, protos):
        assert wait_until(lambda node=node: node.stats.total_sent("allreduce.agree") > 0)
        per_check = node.stats.total_sent("allreduce.agree") / checks
        # 16 values to one owner and its average back; nearly all of it is the headers, which
        # name the round's members, against 24 kB of gradient every step
        assert 0 < per_check < 2000, per_check
        assert node.stats.total_sent("allreduce.sync") == 0 and proto.guard.repairs == 0
        proto.close()
