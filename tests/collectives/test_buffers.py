"""A model's buffers at a sync: floating ones (BatchNorm statistics) averaged, integer ones
(num_batches_tracked) set to their maximum, so that every peer's eval_model() gives the same
output, even when the peers' data differ in scale; kept local with local_buffers (FedBN)."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm
from torch import nn

from starling.collectives import buffers
from starling.collectives.buffers import BufferAverager, _join, _split
from starling.collectives.reduce import ReduceTimeouts
from starling.protocols import get_protocol

PEERS = 3
SYNCED = {"allreduce": {}, "diloco": {"sync_every": 2}, "streaming-diloco": {"sync_every": 2, "fragments": 2}}


def _train(make_node, protocol: str, options: dict) -> tuple[list[torch.Tensor], list[int]]:
    """Each peer's eval output on one probe, and its evaluated model's num_batches_tracked,
    after 6 steps on data of its own scale; peer r starts with 10 r batches counted."""
    nodes = swarm(make_node, PEERS)
    protos = []
    for rank, node in enumerate(nodes):
        torch.manual_seed(0)  # one starting point
        model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        model[1].num_batches_tracked.fill_(10 * rank)
        protos.append(get_protocol(protocol).create(node, model, {"lr": 0.01, "compressor": "none", **options}))

    def run(rank: int) -> None:
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            x = torch.randn(16, 3, generator=g) * (rank + 1) + rank  # each peer's own scale and shift
            protos[rank].step(lambda x=x: protos[rank].model(x).pow(2).mean())

    in_parallel([lambda r=r: run(r) for r in range(PEERS)])
    probe = torch.randn(5, 3, generator=torch.Generator().manual_seed(99))
    outputs, counts = [], []
    for proto in protos:
        twin = proto.eval_model().eval()
        with torch.no_grad():
            outputs.append(twin(probe))
        counts.append(int(twin[1].num_batches_tracked))
        proto.close()
    return outputs, counts


@pytest.mark.parametrize("protocol", ["allreduce", "diloco", "streaming-diloco"])
def test_after_a_sync_every_peer_evaluates_with_the_same_statistics(make_node, protocol):
    outputs, counts = _train(make_node, protocol, SYNCED[protocol])
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    # the maximum: peer 2 started at 20, so a mean (at most 10 + 6) would be below it
    assert len(set(counts)) == 1 and counts[0] >= 20 + 2, counts
    if protocol == "allreduce":  # synced at every step: the largest count, 20 + 6
        assert counts[0] == 26


@pytest.mark.parametrize("protocol", ["allreduce", "diloco"])
def test_local_buffers_keep_each_peers_statistics(make_node, protocol):
    outputs, counts = _train(make_node, protocol, {**SYNCED[protocol], "local_buffers": True})
    assert not torch.equal(outputs[0], outputs[1])
    assert counts == [6, 16, 26]


def test_integers_survive_the_pieces_and_the_mean_exactly():
    values = torch.tensor([0, 1, -1, 65535, 65536, -65537, 2**40 + 12345, -(2**62) - 7, 2**63 - 1, -(2**63)])
    assert torch.equal(_join(_split(values)), values)
    for members in (1, 2, 3, 7, 16, 1000):
        mean = _split(values) / members  # what an owner replies: a piece plus zeros, over the members
        assert torch.equal(_join(mean * members), values), members


@pytest.mark.parametrize("max_owners", [0, 1])  # an owner per member, or one owner for all
def test_the_maximum_is_taken_over_every_member_in_rounds_of_slots(make_node, monkeypatch, max_owners):
    monkeypatch.setattr(buffers, "SLOTS", 2)  # 3 members: two rounds of slots
    nodes = swarm(make_node, PEERS)
    members = tuple(sorted(n.peer_id for n in nodes))
    models = []
    for rank in range(PEERS):
        model = nn.Module()
        model.register_buffer("count", torch.tensor([5, -(2**40) + rank, 2**50 * rank]))
        model.register_buffer("small", torch.tensor([rank, 7 - rank], dtype=torch.int32))
        model.register_buffer("flag", torch.tensor([rank == 1, False]))
        model.register_buffer("mean", torch.full((2,), float(rank)))
        models.append(model)
    syncs = [BufferAverager(n, m, "test.buffers", ReduceTimeouts(round_timeout_s=10.0), lambda: True, max_owners)
             for n, m in zip(nodes, models)]
    assert syncs[0].max_reducer is not None and syncs[0].max_reducer.numel == 2 * 7 * buffers.PIECES
    in_parallel([lambda s=s: s.sync(4, members) for s in syncs])
    for model, sync in zip(models, syncs):
        assert model.count.tolist() == [5, -(2**40) + 2, 2**51]
        assert model.small.tolist() == [2, 7] and model.small.dtype == torch.int32
        assert model.flag.tolist() == [True, False]
        assert model.mean.tolist() == [1.0, 1.0]
        assert sync.maxed is not None and sync.maxed.tolist() == [5, -(2**40) + 2, 2**51, 2, 7, 1, 0]


def test_non_persistent_buffers_are_not_exchanged():
    """A constant the model derives from its config (a mask, position ids) is not state."""
    from torch import nn

    from starling.collectives.buffers import ModelBuffers

    model = nn.BatchNorm1d(3)
    model.register_buffer("position_ids", torch.arange(512), persistent=False)
    model.register_buffer("mask", torch.ones(4, 4), persistent=False)
    buffers = ModelBuffers(model)
    assert buffers.float_numel == 6 and buffers.int_numel == 1  # running stats and num_batches_tracked
