"""One peer's placement (device, parameter dtype, autocast, where the outer state lives), and
the swarm's one starting point (the digest of its initial state)."""
from __future__ import annotations

import threading

import pytest
import torch
from conftest import in_parallel, swarm

from starling.protocols import get_protocol
from starling.runtime import Trainer, TrainSpec, TrainSpecError
from starling.runtime.modelspec import INITIAL_STATE_KEY, state_digest
from starling.runtime.placement import Placement
from starling.tasks import get_task

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SPEC = TrainSpec(protocol="streaming-diloco", task="quadratic",
                 options={"sync_every": 4, "fragments": 2, "overlap_steps": 1, "compressor": "int8"},
                 task_options={"dim": 64, "init_scale": 1.0, "noise_std": 0.1})


def _train_together(trainers: list[Trainer], steps: int) -> None:
    stop = threading.Event()
    in_parallel([lambda t=t: t.run(steps, stop) for t in trainers])


def _outer(trainer: Trainer) -> torch.Tensor:
    return torch.cat([o.to("cpu") for o in trainer.proto.outer])


def test_a_bfloat16_peer_and_a_float32_peer_share_float32_outer_parameters_bit_for_bit(make_node):
    nodes = swarm(make_node, 2)
    half = Trainer(nodes[0], SPEC, rank=0, world=2, placement=Placement.parse(dtype="bf16"))
    full = Trainer(nodes[1], SPEC, rank=1, world=2)
    for trainer in (half, full):
        trainer.create_protocol()
    assert half.proto.model.x.dtype is torch.bfloat16 and full.proto.model.x.dtype is torch.float32
    _train_together([half, full], 12)
    assert all(o.dtype is torch.float32 for o in half.proto.outer)  # the outer step stays float32
    assert torch.equal(_outer(half), _outer(full))
    # after a merge the local parameters are the outer ones, rounded to each peer's dtype
    assert half.proto.versions == full.proto.versions
    for trainer in (half, full):
        trainer.close()


def test_the_outer_state_can_live_apart_from_the_model(make_node):
    """place_state("cpu") with the model on the CPU: nothing to pin, and training is unchanged."""
    nodes = swarm(make_node, 2)
    placed = Trainer(nodes[0], SPEC, rank=0, world=2, placement=Placement.parse(state_device="cpu"))
    plain = Trainer(nodes[1], SPEC, rank=1, world=2)
    for trainer in (placed, plain):
        trainer.create_protocol()
    assert placed.proto.placement.device == torch.device("cpu") and not placed.proto.placement.pin
    _train_together([placed, plain], 8)
    assert torch.equal(_outer(placed), _outer(plain))
    for trainer in (placed, plain):
        trainer.close()


def test_autocast_wraps_the_loss_only():
    placement = Placement.parse(autocast="bf16")
    model = torch.nn.Linear(4, 4)
    with placement.autocast(model):
        assert model(torch.randn(2, 4)).dtype is torch.bfloat16
    assert model(torch.randn(2, 4)).dtype is torch.float32
    assert Placement.batch((torch.ones(1), "tag"), model)[1] == "tag"


def test_a_protocol_that_runs_on_the_cpu_only_refuses_another_device(make_node):
    """The meta device stands in for an accelerator: the check reads where the model went."""
    node = make_node("inproc")
    spec = TrainSpec(protocol="gossip", task="quadratic", task_options={"dim": 8})
    trainer = Trainer(node, spec, rank=0, world=1, placement=Placement(device=torch.device("meta")))
    with pytest.raises(TrainSpecError, match="'gossip' runs on the CPU only.*meta.*--device cpu"):
        trainer.create_protocol()
    assert get_protocol("diloco").runs_on_accelerators and get_protocol("allreduce").runs_on_accelerators


def test_a_peer_with_another_initial_state_learns_it_and_takes_the_swarms(make_node):
    first, joiner = swarm(make_node, 2)
    leader = Trainer(first, SPEC, rank=0, world=2)
    leader.create_protocol()
    digest = first.swarm_config[INITIAL_STATE_KEY]
    assert digest == state_digest(get_task("quadratic", dim=64, init_scale=1.0, noise_std=0.1).make_model())
    joiner.swarm_config = dict(first.swarm_config)  # what a joiner learns at join
    task = get_task("quadratic", **SPEC.task_options)
    own_start = task.make_model
    task.make_model = lambda: _shifted(own_start())
    other = Trainer(joiner, SPEC, rank=1, world=2, task=task)
    other.create_protocol()
    assert other.initial_state_differs and not leader.initial_state_differs
    other.fetch_state()
    assert torch.equal(_outer(other), _outer(leader))
    _train_together([leader, other], 8)
    assert torch.equal(_outer(other), _outer(leader))
    for trainer in (leader, other):
        trainer.close()


def _shifted(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(3.0)
    return model


@cuda
@pytest.mark.parametrize("state_device", [None, "cpu"])
def test_a_cuda_peer_and_a_cpu_peer_agree_bit_for_bit(make_node, state_device):
    nodes = swarm(make_node, 2)
    gpu = Trainer(nodes[0], SPEC, rank=0, world=2, placement=Placement.parse("cuda", state_device=state_device))
    cpu = Trainer(nodes[1], SPEC, rank=1, world=2)
    for trainer in (gpu, cpu):
        trainer.create_protocol()
    assert gpu.proto.model.x.device.type == "cuda"
    if state_device == "cpu":
        assert all(o.is_pinned() for o in gpu.proto.outer)
    _train_together([gpu, cpu], 12)
    # both decode the same averaged packets; the outer step is the same float32 arithmetic
    torch.testing.assert_close(_outer(gpu), _outer(cpu), rtol=0, atol=1e-6)
    for trainer in (gpu, cpu):
        trainer.close()
