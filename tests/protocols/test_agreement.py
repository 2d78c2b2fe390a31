"""DiLoCo's drift guard: a peer built with other initial weights, whose id sorts first, finds
out at the first sync of fragment 0 that its outer parameters differ and takes those the other
two hold; with the check off they never agree."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm
from torch import nn

from starling.protocols import get_protocol

PEERS = 3


def _outer_after_training(make_node, check_every: int, repairs: list[int] | None = None) -> list[list[torch.Tensor]]:
    nodes = sorted(swarm(make_node, PEERS), key=lambda node: node.peer_id)  # rank 0 sorts first
    protos = []
    for rank, node in enumerate(nodes):
        torch.manual_seed(min(rank, 1))  # rank 0 a starting point of its own: the mistake the guard catches
        model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        protos.append(get_protocol("diloco").create(node, model, {"lr": 0.01, "sync_every": 2,
                                                                  "check_every": check_every}))

    def run(rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            x = torch.randn(16, 3, generator=g)
            protos[rank].step(lambda x=x: protos[rank].model(x).pow(2).mean())

    in_parallel([lambda r=r: run(r) for r in range(PEERS)])
    outers = [[o.clone() for o in p.outer] for p in protos]
    if repairs is not None:
        repairs.extend(p.guard.repairs for p in protos)
    for proto in protos:
        proto.close()
    return outers


def _same(outers: list[list[torch.Tensor]]) -> bool:
    return all(all(torch.equal(a, b) for a, b in zip(outers[0], other)) for other in outers[1:])


def test_a_first_member_that_started_apart_takes_the_majoritys_outer_parameters(make_node, caplog):
    repairs: list[int] = []
    assert _same(_outer_after_training(make_node, check_every=1, repairs=repairs))
    assert "outer parameters differ from the majority's" in caplog.text
    assert repairs == [1, 0, 0]  # the first member, once; the others keep theirs: then they agree


def test_an_outer_state_that_does_not_fit_is_refused_and_changes_nothing(make_node):
    proto = get_protocol("streaming-diloco").create(make_node("inproc"), nn.Linear(3, 4), {"fragments": 2,
                                                                                         "sync_every": 4})
    before = [o.clone() for o in proto.outer]
    sizes = [f.view.numel for f in proto.fragments]
    good = [torch.ones(n) for n in sizes * 2]
    bad = {"other versions": ({"versions": [5, 5]}, good),
           "one tensor short": ({"versions": proto.versions}, good[:-1]),
           "a NaN": ({"versions": proto.versions}, [torch.full((n,), float("nan")) for n in sizes * 2]),
           "float64": ({"versions": proto.versions}, [t.double() for t in good])}
    for header, tensors in bad.values():
        with pytest.raises(ValueError):
            proto._take_replica_state(header, tensors)
    assert all(torch.equal(a, b) for a, b in zip(before, proto.outer))
    proto._take_replica_state({"versions": proto.versions}, good)
    assert all(torch.equal(o, torch.ones(n)) for o, n in zip(proto.outer, sizes))
    proto.close()


def test_without_the_check_they_stay_apart(make_node):
    assert not _same(_outer_after_training(make_node, check_every=0))


