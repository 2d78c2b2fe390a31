"""BatchNorm statistics under DiLoCo: averaged at every sync of fragment 0, so that every
peer's eval_model() gives the same output, even when the peers' data differ in scale; kept
local with local_buffers (FedBN)."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm
from torch import nn

from starling.protocols import get_protocol

PEERS = 3


def _train(make_node, protocol: str, options: dict) -> list[torch.Tensor]:
    nodes = swarm(make_node, PEERS)
    protos = []
    for node in nodes:
        torch.manual_seed(0)  # one starting point
        model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        protos.append(get_protocol(protocol).create(node, model, {"lr": 0.01, "compressor": "none", **options}))

    def run(rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            x = torch.randn(16, 3, generator=g) * (rank + 1) + rank  # each peer's own scale and shift
            protos[rank].step(lambda x=x: protos[rank].model(x).pow(2).mean())

    in_parallel([lambda r=r: run(r) for r in range(PEERS)])
    probe = torch.randn(5, 3, generator=torch.Generator().manual_seed(99))
    outputs = []
    for proto in protos:
        twin = proto.eval_model().eval()
        with torch.no_grad():
            outputs.append(twin(probe))
        proto.close()
    return outputs


@pytest.mark.parametrize("protocol", ["allreduce", "diloco", "streaming-diloco"])
def test_after_a_sync_every_peer_evaluates_with_the_same_statistics(make_node, protocol):
    options = {"allreduce": {}, "diloco": {"sync_every": 2}, "streaming-diloco": {"sync_every": 2, "fragments": 2}}[
        protocol]
    outputs = _train(make_node, protocol, options)
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])


@pytest.mark.parametrize("protocol", ["allreduce", "diloco"])
def test_local_buffers_keep_each_peers_statistics(make_node, protocol):
    outputs = _train(make_node, protocol, {"sync_every": 2, "local_buffers": True} if protocol == "diloco"
                     else {"local_buffers": True})
    assert not torch.equal(outputs[0], outputs[1])
