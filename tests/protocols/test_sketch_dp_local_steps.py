"""sketch-dp with local_steps > 1: a round's update is the delta of several local SGD steps,
sketched, clipped and noised once per round, and accounted as one release."""
from __future__ import annotations

import io
import math

import pytest
import torch
from conftest import in_parallel, opacus_accountants, swarm

from starling.compressors import rng
from starling.protocols import ProtocolError, get_protocol
from starling.protocols.sketch_dp import SketchDPConfig
from starling.tasks import get_task

TEACHER = get_task("teacher")
QUICK = {"round_timeout_s": 10.0}


def create(node, options):
    return get_protocol("sketch-dp").create(node, TEACHER.make_model(), {**QUICK, **options})


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run(protos, steps: int):
    def one(rank: int):
        batches = TEACHER.batches(rank, len(protos), seed=0)
        out = []
        for _ in range(steps):
            batch = next(batches)
            out.append(protos[rank].step(lambda: TEACHER.loss(protos[rank].model, batch)))
        return out

    return in_parallel([lambda r=r: one(r) for r in range(len(protos))])


@pytest.mark.parametrize("options, message", [
    ({"local_steps": 0}, "local_steps must be >= 1"),
    ({"local_steps": 2, "dp_unit": "sample"}, "dp_unit='peer'"),
    ({"local_steps": 2, "lr": 0.0}, "lr > 0"),
    ({"local_steps": 4, "target_epsilon": 2.0, "budget_steps": 3}, "budget_steps >= local_steps"),
])
def test_bad_local_steps_are_refused(make_node, options, message):
    with pytest.raises(ProtocolError, match=message):
        create(make_node("inproc"), options)


def test_the_budget_is_planned_in_rounds_of_local_steps(make_node):
    proto = create(make_node("inproc"), {"local_steps": 3, "target_epsilon": 2.0, "budget_steps": 7})
    assert proto.config.budget_rounds == 2
    expected = opacus_accountants().utils.get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=1.0, steps=2, accountant="rdp")
    assert proto.sigma == pytest.approx(expected)
    assert SketchDPConfig(budget_steps=7).budget_rounds == 7  # local_steps = 1: one round per step


@pytest.mark.slow
def test_a_round_releases_the_sketched_delta_of_its_local_steps(make_node):
    world, lr, local_steps = 2, 0.1, 3
    options = {"sketch": "gsketch:64", "clip": "inf", "lr": lr, "seed": 5, "local_steps": local_steps}
    protos = [create(n, options) for n in swarm(make_node, world)]
    start = flat_params(protos[0].model)
    deltas = []
    for rank in range(world):  # replay each peer's local SGD
        model = TEACHER.make_model()
        batches = TEACHER.batches(rank, world, seed=0)
        for _ in range(local_steps):
            model.zero_grad()
            TEACHER.loss(model, next(batches)).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
        deltas.append((start - flat_params(model)) / lr)

    reports = run(protos, local_steps)
    for rs in reports:
        assert [r.step for r in rs] == [0, 1, 2]
        assert all(not r.synced and r.bytes_sent == 0 and math.isfinite(r.loss) for r in rs[:-1])  # nothing leaves
        assert rs[-1].synced and rs[-1].peers == world and rs[-1].bytes_sent > 0
    seed = rng.derive_seed(5, 0)  # round 0 spans steps 0..2
    sketches = protos[0].sketches
    expected = start - lr * sketches.unsketch(sketches.sketch(torch.stack(deltas), seed).mean(0), seed)
    for proto in protos:
        torch.testing.assert_close(flat_params(proto.model), expected, rtol=1e-4, atol=1e-5)
        assert proto.privacy.rounds == 1 and proto.describe()["update"] == "delta of 3 local steps"


def test_one_release_per_round_is_accounted_and_joiners_get_the_synced_parameters(make_node):
    options = {"noise_multiplier": 1.1, "clip": 0.5, "sketch": "gsketch:32", "local_steps": 2, "lr": 0.05}
    proto = create(make_node("inproc"), options)
    batches = TEACHER.batches(0, 1, seed=0)
    for _ in range(5):  # rounds 0 and 1, then one step into round 2
        batch = next(batches)
        proto.step(lambda: TEACHER.loss(proto.model, batch))
    reference = opacus_accountants().RDPAccountant()
    for _ in range(2):
        reference.step(noise_multiplier=1.1, sample_rate=1.0)
    assert proto.privacy.rounds == 2
    assert proto.privacy.epsilon == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)

    synced = proto.anchor.clone()
    assert not torch.equal(flat_params(proto.model), synced)  # mid-round: private local progress
    buffer = io.BytesIO()
    torch.save(proto.state_dict(), buffer)
    joiner = create(make_node("inproc"), options)
    joiner.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert joiner.step_count == 5 and joiner.privacy == proto.privacy
    assert torch.equal(flat_params(joiner.model), synced) and torch.equal(joiner.anchor, synced)
