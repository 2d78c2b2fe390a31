"""allreduce: the exact mean of gradients, bytes, failures, membership disagreement."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import in_parallel, linear, swarm, wait_until
from torch import nn

from starling.node.loop import AwakeDeadline
from starling.protocols import get_protocol

LR = 0.1


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g) * (rank + 1)


def loss_of(model: nn.Module, rank: int) -> torch.Tensor:
    x, y = batch(rank)
    return nn.functional.mse_loss(model(x), y)


def expected_after_one_step(world: int) -> list[torch.Tensor]:
    """Parameters after one SGD step on the gradient averaged over every peer's batch."""
    grads = []
    for rank in range(world):
        model = linear()
        loss_of(model, rank).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model = linear()
    return [p.detach() - LR * torch.stack(gs).mean(0) for p, gs in zip(model.parameters(), zip(*grads))]


def test_one_step_equals_sgd_on_the_exact_mean_gradient(make_node):
    world = 4
    nodes = swarm(make_node, world)
    protos = [get_protocol("allreduce").create(n, linear(), {"lr": LR}) for n in nodes]
    reports = in_parallel([lambda r=r: protos[r].step(lambda: loss_of(protos[r].model, r)) for r in range(world)])
    expected = expected_after_one_step(world)
    for proto, report in zip(protos, reports):
        assert report.synced and report.peers == world and report.lost_peers == ()
        for p, e in zip(proto.model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-6)


def test_a_batch_that_was_half_padding_weighs_half_in_the_average_gradient(make_node):
    """`weigh_next_step`: a member of a swarm of its own data is weighed by the text it trained."""
    nodes = swarm(make_node, 2)
    protos = [get_protocol("allreduce").create(n, linear(), {"lr": LR}) for n in nodes]
    protos[1].weigh_next_step(0.5)
    in_parallel([lambda r=r: protos[r].step(lambda: loss_of(protos[r].model, r)) for r in range(2)])
    grads = []
    for rank in range(2):
        model = linear()
        loss_of(model, rank).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    expected = [p.detach() - LR * (g0 + 0.5 * g1) / 1.5 for p, g0, g1 in zip(linear().parameters(), *grads)]
    for proto in protos:
        for p, e in zip(proto.model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)
        assert proto.next_step_work == 1.0


def test_each_peer_sends_about_two_vectors_times_p_minus_1_over_p(make_node):
    world, dim = 4, 4000
    nodes = swarm(make_node, world)
    models = [nn.Linear(dim, 1, bias=False) for _ in range(world)]
    # the gradient round alone: the drift guard's round is measured in test_drift_guard.py
    protos = [get_protocol("allreduce").create(n, m, {"check_every": 0}) for n, m in zip(nodes, models)]
    x = torch.randn(2, dim)
    reports = in_parallel([lambda r=r: protos[r].step(lambda: models[r](x).sum()) for r in range(world)])
    ideal = 2 * (world - 1) / world * dim * 4
    for report in reports:
        assert ideal <= report.bytes_sent <= ideal * 1.1, report
        assert ideal <= report.bytes_received <= ideal * 1.1, report


def test_compressed_replicas_stay_identical_and_near_exact(make_node):
    world = 3
    nodes = swarm(make_node, world)
    protos = [get_protocol("allreduce").create(n, linear(), {"lr": LR, "compressor": "fp16"}) for n in nodes]
    in_parallel([lambda r=r: protos[r].step(lambda: loss_of(protos[r].model, r)) for r in range(world)])
    expected = expected_after_one_step(world)
    for proto in protos[1:]:
        for a, b in zip(proto.model.parameters(), protos[0].model.parameters()):
            assert torch.equal(a, b)
    for p, e in zip(protos[0].model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-3)


def test_alone_it_is_local_sgd(make_node):
    proto = get_protocol("allreduce").create(make_node("inproc"), linear(), {"lr": LR, "momentum": 0.9})
    report = proto.step(lambda: loss_of(proto.model, 0))
    assert not report.synced and report.peers == 1 and report.bytes_sent == 0
    for p, e in zip(proto.model.parameters(), expected_after_one_step(1)):
        torch.testing.assert_close(p.detach(), e)


def test_owner_not_up_yet_gets_the_part_when_it_starts(make_node):
    """A peer whose protocol starts late is retried, not dropped."""
    a, b = swarm(make_node, 2)
    pa = get_protocol("allreduce").create(a, linear(), {"lr": LR, "round_timeout_s": 10.0})
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: pa.step(lambda: loss_of(pa.model, 0)))
        time.sleep(0.3)  # a's parts to b are refused ("no handler") until b's protocol exists
        pb = get_protocol("allreduce").create(b, linear(), {"lr": LR, "round_timeout_s": 10.0})
        rb = pb.step(lambda: loss_of(pb.model, 1))
        ra = fut.result(timeout=30)
    assert ra.synced and rb.synced and ra.lost_peers == rb.lost_peers == ()
    for p, e in zip(pa.model.parameters(), expected_after_one_step(2)):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_peer_killed_mid_round_does_not_hang_the_others(make_node):
    """The round timeout is a minute: only the news of the death (a dropped connection and an
    unanswered probe, or missed heartbeats) can release the survivors before it. (A protocol
    whose reducer missed peer events, as allreduce's once did, waited the timeout out.)"""
    timeout_s, grace_s = 60.0, 5.0
    nodes = swarm(make_node, 3)
    options = {"lr": LR, "round_timeout_s": timeout_s, "reply_grace_s": grace_s}
    protos = [get_protocol("allreduce").create(n, linear(), options) for n in nodes]
    assert all(p.reducer in p.reducers for p in protos)
    in_parallel([lambda r=r: protos[r].step(lambda: loss_of(protos[r].model, r)) for r in range(3)])
    victim = nodes[2]
    before = victim.stats.total_received("allreduce.part")
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(lambda r=r: protos[r].step(lambda: loss_of(protos[r].model, r))) for r in range(2)]
        # both survivors are in the round: their parts reached the victim, which now dies
        assert wait_until(lambda: victim.stats.total_received("allreduce.part") >= 2 * before)
        victim.close()
        start = time.monotonic()  # from the death: the time to get there is the box's, not the protocol's
        reports = [f.result(timeout=2 * AwakeDeadline.STRETCH * timeout_s) for f in futs]
        elapsed = time.monotonic() - start
    assert elapsed < timeout_s, elapsed  # released by the death, not by the round's timer
    for report in reports:
        assert report.lost_peers == (victim.peer_id,)
        assert report.synced and report.peers == 2


def test_disagreeing_views_do_not_mix_shards(make_node, monkeypatch):
    """One peer misses another in its view: no round mixes shard boundaries, none hangs."""
    import starling.protocols.allreduce as allreduce

    timeout_s, grace_s = 2.0, 1.0
    nodes = swarm(make_node, 3)
    ids = sorted(n.peer_id for n in nodes)
    odd = next(n for n in nodes if n.peer_id == ids[0])
    real = allreduce.membership
    monkeypatch.setattr(allreduce, "membership",
                        lambda node: tuple(p for p in real(node) if node is not odd or p != ids[1]))
    options = {"lr": LR, "round_timeout_s": timeout_s, "reply_grace_s": grace_s}
    protos = [get_protocol("allreduce").create(n, linear(), options) for n in nodes]
    start = time.monotonic()
    reports = in_parallel([lambda r=r: protos[r].step(lambda: loss_of(protos[r].model, r)) for r in range(3)])
    assert time.monotonic() - start < timeout_s + grace_s + 2.0
    for report in reports:
        assert report.lost_peers and report.peers < 3
    for proto in protos:
        assert all(torch.isfinite(p).all() for p in proto.model.parameters())


def test_a_joiner_with_stale_state_catches_up_without_a_timeout(make_node):
    timeout_s = 20.0  # hitting it would fail the time bound below
    a, b = swarm(make_node, 2)
    options = {"lr": LR, "round_timeout_s": timeout_s}
    pa, pb = (get_protocol("allreduce").create(n, linear(), options) for n in (a, b))
    for _ in range(3):
        in_parallel([lambda: pa.step(lambda: loss_of(pa.model, 0)), lambda: pb.step(lambda: loss_of(pb.model, 1))])
    c = make_node("inproc", join=[a.address])
    for node in (a, b, c):
        assert wait_until(lambda node=node: len(node.live_peers()) == 2)
    stale = pa.state_dict()
    stale["step"] = 1  # the joiner's snapshot is two rounds old
    pc = get_protocol("allreduce").create(c, linear(), options)
    pc.load_state_dict(stale)
    start = time.monotonic()

    def catch_up() -> list:
        # c's late rounds are refused and it jumps to the round its owners report, which is
        # 2 or 3 depending on whether a and b have started round 3 yet: so loop, not count
        out = []
        while pc.step_count < 5:
            out.append(pc.step(lambda: loss_of(pc.model, 2)))
        return out

    reports = in_parallel([lambda p=p, r=r: [p.step(lambda: loss_of(p.model, r)) for _ in range(2)]
                           for r, p in enumerate((pa, pb))] + [catch_up])
    assert time.monotonic() - start < timeout_s / 2
    assert pa.step_count == pb.step_count == pc.step_count == 5
    steps = [r.step for r in reports[2]]
    assert steps[0] == 1 and steps[-1] == 4 and steps == sorted(set(steps)) and len(steps) <= 4
    assert all(r.peers == 3 and not r.lost_peers for r in reports[0] + reports[1] + reports[2][-2:])
