"""DiLoCo's drift guard: peers built with different initial weights find out at the first sync
of fragment 0 that their outer parameters differ, and every one but the first member takes
the first member's; with the check off they never agree."""
from __future__ import annotations

import torch
from conftest import in_parallel, swarm
from torch import nn

from starling.protocols import get_protocol

PEERS = 3


def _outer_after_training(make_node, check_every: int) -> list[list[torch.Tensor]]:
    nodes = swarm(make_node, PEERS)
    protos = []
    for rank, node in enumerate(nodes):
        torch.manual_seed(rank)  # every peer its own starting point: the mistake the guard catches
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
    for proto in protos:
        proto.close()
    return outers


def _same(outers: list[list[torch.Tensor]]) -> bool:
    return all(all(torch.equal(a, b) for a, b in zip(outers[0], other)) for other in outers[1:])


def test_peers_that_started_apart_end_with_the_same_outer_parameters(make_node, caplog):
    assert _same(_outer_after_training(make_node, check_every=1))
    assert "outer parameters differ from the swarm's" in caplog.text


def test_without_the_check_they_stay_apart(make_node):
    assert not _same(_outer_after_training(make_node, check_every=0))


