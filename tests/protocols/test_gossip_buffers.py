"""gossip's buffers: floating ones (BatchNorm statistics) mixed with the parameters' weights at
every exchange, integer ones set to the larger of both sides; gossip never makes peers agree,
so what it promises is that their eval outputs come closer than with local buffers (FedBN)."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm
from torch import nn

from starling.protocols import get_protocol

PEERS = 4
PROBE = torch.randn(64, 3, generator=torch.Generator().manual_seed(99))


def bn_swarm(make_node, n: int, options: dict) -> list:
    """n gossip peers on one BatchNorm model and starting point; peer r has counted 10 r batches."""
    protos = []
    for rank, node in enumerate(swarm(make_node, n)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        model[1].num_batches_tracked.fill_(10 * rank)
        protos.append(get_protocol("gossip").create(node, model, {"lr": 0.01, **options}))
    return protos


def loss_of(proto, rank: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(16, 3, generator=g) * 4 ** rank + 3 * rank  # each peer's data at its own scale
    return proto.model(x).pow(2).mean()


def spread(protos: list) -> float:
    """How far the peers' eval outputs are from their mean, on average."""
    with torch.no_grad():
        outs = torch.stack([p.eval_model().eval()(PROBE) for p in protos])
        for p in protos:
            p.model.train()
    return float((outs - outs.mean(0)).norm(dim=(1, 2)).mean())


def train(protos: list, steps: int) -> None:
    def run(rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            protos[rank].step(lambda: loss_of(protos[rank], rank, g))
    in_parallel([lambda r=r: run(r) for r in range(len(protos))])


def test_one_exchange_mixes_the_statistics_like_the_parameters_and_takes_the_larger_count(make_node):
    a, b = bn_swarm(make_node, 2, {"lr": 0.0})
    with torch.no_grad():
        b.model[1].running_mean.fill_(4.0)
        b.model[1].running_var.fill_(9.0)
    a.model[1].momentum = 0.0  # a's forward leaves its statistics as they were: zeros and ones
    report = a.step(lambda: loss_of(a, 0, torch.Generator().manual_seed(0)))
    assert report.synced
    for p in (a, b):
        bn = p.model[1]
        torch.testing.assert_close(bn.running_mean, torch.full((8,), 2.0))  # the pair's mean, as mixing=0.5
        torch.testing.assert_close(bn.running_var, torch.full((8,), 5.0))
        assert int(bn.num_batches_tracked) == 10  # b's; a's was 0 + 1 batch


@pytest.mark.parametrize("compressor", ["none", "topk:0.5"], ids=["exact", "choco"])
def test_gossip_brings_the_peers_eval_outputs_closer_than_local_statistics(make_node, compressor):
    spreads = {}
    for local in (True, False):
        protos = bn_swarm(make_node, PEERS, {"compressor": compressor, "local_buffers": local})
        train(protos, 24)
        spreads[local] = spread(protos)
        counts = [int(p.model[1].num_batches_tracked) for p in protos]
        for p in protos:
            p.close()
        if local:
            assert counts == [24, 34, 44, 54]
        else:  # the largest count only spreads: every peer's is at least its own, some took a larger one
            assert all(c >= 24 + 10 * r for r, c in enumerate(counts)) and counts != [24, 34, 44, 54], counts
    assert spreads[False] < 0.2 * spreads[True], spreads  # measured: 0.01-0.04 of it
