"""The drift guard of the protocols whose replicas are meant to be bit-identical (allreduce,
sketch-dp): peers built with different initial weights, one of them with an optimizer state of
its own, find out at the first check, every one but the first member takes the first member's
parameters and optimizer state, and from then on they agree bit for bit; with the check off
they never agree."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import in_parallel, swarm, wait_until
from torch import nn

from starling.node.rpc import Refusal, refusal_of
from starling.protocols import get_protocol
from starling.protocols.optim import optimizer_from_wire, optimizer_to_wire

PEERS = 3
SKETCH_DP = {"optimizer": "sgd", "momentum": 0.9, "lr": 0.01, "round_timeout_s": 10.0}
OPTIONS = {"allreduce": ("allreduce", {"optimizer": "adamw", "lr": 0.01}),
           "sketch-dp": ("sketch-dp", {**SKETCH_DP, "sketch": "gsketch:16"}),
           # FetchSGD's error accumulator is public state too: taken with the parameters
           "sketch-dp-heavy": ("sketch-dp", {**SKETCH_DP, "sketch": "countsketch:1x16,heavy=4"})}


def model_of(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # every peer its own starting point: the mistake the guard catches
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))


def loss_of(proto, rank: int, g: torch.Generator) -> torch.Tensor:
    return proto.model(torch.randn(16, 3, generator=g) * (rank + 1)).pow(2).mean()


def trained(make_node, variant: str, check_every: int | None, steps: int = 6) -> list:
    nodes = swarm(make_node, PEERS)
    protocol, options = OPTIONS[variant]
    options = {**options, **({} if check_every is None else {"check_every": check_every})}
    protos = [get_protocol(protocol).create(n, model_of(r), options) for r, n in enumerate(nodes)]
    last = protos[-1]  # an optimizer state of its own, from a step it took alone
    last._backprop(lambda: loss_of(last, 9, torch.Generator().manual_seed(9)))
    last.optimizer.step()
    if getattr(last, "error", None) is not None:
        last.error.add_(0.5)  # and a FetchSGD error of its own

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
def test_the_default_guard_repairs_peers_that_started_apart_and_they_stay_identical(make_node, caplog, variant):
    protos = trained(make_node, variant, None)  # the default: step 0 is checked
    assert agree(protos)
    assert sorted(p.guard.repairs for p in protos) == [0, 1, 1]  # every member but the first, once
    assert "my parameters differ from the swarm's" in caplog.text
    states = [optimizer_to_wire(p.optimizer) for p in protos]
    for header, tensors in states[1:]:
        assert header == states[0][0] and all(torch.equal(a, b) for a, b in zip(tensors, states[0][1]))
    if variant == "sketch-dp-heavy":
        assert all(torch.equal(p.error, protos[0].error) for p in protos[1:])


@pytest.mark.parametrize("variant", ["allreduce", "sketch-dp"])
def test_without_the_guard_they_stay_apart(make_node, variant):
    protos = trained(make_node, variant, 0)
    assert not agree(protos) and all(p.guard is None for p in protos)


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


def test_the_first_member_serves_only_the_round_of_a_mismatch(make_node):
    nodes = swarm(make_node, 2)
    protos = [get_protocol("allreduce").create(n, model_of(0), {}) for n in nodes]
    guard = protos[0].guard

    def ask(body: dict) -> Refusal | None:
        return refusal_of(nodes[1].request(nodes[0].peer_id, guard.topic, body, timeout_s=5).body)

    assert ask({"round": 0}) is Refusal.BUSY  # no verdict yet: asked again
    in_parallel([lambda p=p: p.step(lambda p=p: p.model(torch.ones(2, 3)).sum()) for p in protos])
    assert ask({"round": 0}) is Refusal.NOT_FOUND  # step 0 was checked and agreed: nothing to serve
    assert ask({"round": -1}) is Refusal.TOO_OLD
    assert ask({"nope": 0}) is Refusal.MALFORMED
    for proto in protos:
        proto.close()


def test_a_check_that_agrees_costs_one_tiny_round_and_no_transfer(make_node):
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
        assert wait_until(lambda node=node: node.stats.total_sent("allreduce.agree") > 0)
        per_check = node.stats.total_sent("allreduce.agree") / checks
        # 16 values in P - 1 parts and P - 1 averages; nearly all of it is their headers, which
        # name the round's members (1.3 kB measured), against 24 kB of gradient every step
        assert 0 < per_check < 2000, per_check
        assert node.stats.total_sent("allreduce.sync") == 0 and proto.guard.repairs == 0
        proto.close()
