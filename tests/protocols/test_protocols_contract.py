"""Contract tests every registered protocol must pass (parametrized over the registry)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import in_parallel, swarm

from starling.protocols import ProtocolError, StepReport, get_protocol, registered_protocols
from starling.tasks import get_task

# Protocols shipped in starling.protocols; other test modules register test-only ones
# in the same session, which this contract does not cover.
BUILT_IN = [n for n in registered_protocols() if get_protocol(n).__module__.startswith("starling.protocols")]

TASK = get_task("quadratic", dim=16, peer_spread=1.0)
QUICK = {"round_timeout_s": 5.0}




def test_builtin_protocols_are_registered():
    assert {"allreduce", "gossip"} <= set(registered_protocols())


@pytest.mark.parametrize("name", BUILT_IN)
def test_step_returns_a_report_with_finite_loss(make_node, name):
    nodes = swarm(make_node, 2)
    protos = [get_protocol(name).create(node, TASK.make_model(), QUICK) for node in nodes]

    def train(rank: int) -> list[StepReport]:
        batches = TASK.batches(rank, 2, seed=0)
        return [protos[rank].step(lambda: TASK.loss(protos[rank].model, next(batches))) for _ in range(3)]

    for reports in in_parallel([lambda r=r: train(r) for r in range(2)]):
        assert [r.step for r in reports] == [0, 1, 2]
        for r in reports:
            assert isinstance(r, StepReport) and math.isfinite(r.loss)
            assert r.bytes_sent >= 0 and r.bytes_received >= 0 and r.peers >= 1
    assert all(math.isfinite(v) for v in TASK.evaluate(protos[0].eval_model()).values())


@pytest.mark.parametrize("name", BUILT_IN)
def test_state_dict_round_trip_gives_identical_parameters(make_node, name):
    donor_node, joiner_node = make_node("inproc"), make_node("inproc")
    donor = get_protocol(name).create(donor_node, TASK.make_model(), {"lr": 0.1})
    batches = TASK.batches(0, 1, seed=0)
    for _ in range(2):
        donor.step(lambda: TASK.loss(donor.model, next(batches)))
    joiner_model = TASK.make_model()
    with torch.no_grad():
        for p in joiner_model.parameters():
            p.add_(1.0)
    joiner = get_protocol(name).create(joiner_node, joiner_model, {"lr": 0.1})
    joiner.load_state_dict(donor.state_dict())
    assert joiner.step_count == donor.step_count
    for a, b in zip(donor.eval_model().state_dict().values(), joiner.eval_model().state_dict().values()):
        assert torch.equal(a, b)
    # the joiner continues exactly as the donor does
    batch = next(batches)
    donor.step(lambda: TASK.loss(donor.model, batch))
    joiner.step(lambda: TASK.loss(joiner.model, batch))
    for a, b in zip(donor.model.parameters(), joiner.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", BUILT_IN)
def test_describe_is_plain_data(make_node, name):
    proto = get_protocol(name).create(make_node("inproc"), TASK.make_model(), {})
    info = proto.describe()
    assert info["name"] == name
    json.dumps(info)


@pytest.mark.parametrize("name", BUILT_IN)
def test_bad_options_raise_protocol_error(make_node, name):
    node = make_node("inproc")
    with pytest.raises(ProtocolError, match="no_such_option"):
        get_protocol(name).create(node, TASK.make_model(), {"no_such_option": 1})
    with pytest.raises(ProtocolError, match="lr"):
        get_protocol(name).create(node, TASK.make_model(), {"lr": "fast"})
    with pytest.raises(ProtocolError):
        get_protocol(name).create(node, TASK.make_model(), {"compressor": "no-such-codec"})


def test_unknown_protocol_name():
    with pytest.raises(ProtocolError, match="unknown protocol"):
        get_protocol("no-such-protocol")


def test_a_tied_weight_is_stored_once_in_the_state(make_node):
    """An output layer that is the input embedding: one tensor in the state, not two copies."""
    import io

    from torch import nn

    from starling.protocols import get_protocol

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

    node = make_node("inproc")
    proto = get_protocol("diloco").create(node, Tied(), {"sync_every": 2})
    state = proto.state_dict()
    assert state["model"]["head.weight"] is state["model"]["embed.weight"]
    once, twice = io.BytesIO(), io.BytesIO()
    torch.save(state["model"], once)
    torch.save({k: v.clone() for k, v in state["model"].items()}, twice)
    assert len(twice.getvalue()) - len(once.getvalue()) >= 50 * 8 * 4  # one 50x8 float32 table less
    proto.load_state_dict(state)
    assert proto.model.head.weight is proto.model.embed.weight
