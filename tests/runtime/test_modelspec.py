"""A swarm's architecture: names, shapes and dtypes of every tensor, and the first that differs;
a trainer whose model differs from the swarm's is refused before it fetches any state."""
from __future__ import annotations

import pytest
import torch
from conftest import swarm
from torch import nn

from starling.runtime import Trainer, TrainSpec, TrainSpecError
from starling.runtime.modelspec import ARCHITECTURE_KEY, architecture, first_difference
from starling.tasks import get_task


def _bn_net(width: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(3, width), nn.BatchNorm1d(width))


def test_architecture_lists_parameters_and_buffers_in_state_dict_order():
    arch = architecture(_bn_net())
    assert arch == ["0.weight:4x3:float32", "0.bias:4:float32", "1.weight:4:float32", "1.bias:4:float32",
                    "1.running_mean:4:float32", "1.running_var:4:float32", "1.num_batches_tracked::int64"]


def test_first_difference_names_the_tensor():
    swarm_arch = architecture(_bn_net(4))
    assert first_difference(swarm_arch, architecture(_bn_net(4))) is None
    assert first_difference(swarm_arch, architecture(_bn_net(5))) == \
        "tensor '0.weight': the swarm's is 4x3 float32, this peer's is 5x3 float32"
    half = _bn_net(4).to(torch.bfloat16)
    assert "'0.weight': the swarm's is 4x3 float32, this peer's is 4x3 bfloat16" in \
        first_difference(swarm_arch, architecture(half))
    assert "'1.running_mean' (4 float32) of the swarm's model is missing" in \
        first_difference(swarm_arch, architecture(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))))
    assert "'2.weight' (1x4 float32) of this peer's model is not in the swarm's" in \
        first_difference(swarm_arch, architecture(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4),
                                                                nn.Linear(4, 1))))
    assert "malformed entry" in first_difference(["garbage", 3], architecture(_bn_net()))


def test_a_trainer_with_another_model_is_refused_before_it_fetches_state(make_node):
    first, joiner = swarm(make_node, 2)
    spec = TrainSpec(protocol="diloco", task="quadratic", task_options={"dim": 8})
    Trainer(first, spec, rank=0, world=2).create_protocol()
    assert first.swarm_config[ARCHITECTURE_KEY] == ["x:8:float32"]
    joiner.swarm_config = dict(first.swarm_config)  # what a joiner learns at join
    other = Trainer(joiner, spec, rank=1, world=2, task=get_task("quadratic", dim=16))
    with pytest.raises(TrainSpecError, match="tensor 'x': the swarm's is 8 float32, this peer's is 16 float32"):
        other.create_protocol()
    same = Trainer(joiner, spec, rank=1, world=2)
    same.create_protocol()
    same.fetch_state()
    assert same.proto.step_count == 0
