"""spsa: exact perturbation, the one-byte code, identical peers, replay, join, repair, refusals."""
from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from conftest import in_parallel, wait_until
from torch import nn

from starling.node.node import NodeConfig
from starling.node.swim import Liveness
from starling.protocols import ProtocolError, get_protocol
from starling.protocols.spsa.arith import (
    MAX_CODE,
    REL_ERROR,
    SATURATE_LOG2,
    UNDERFLOW_LOG2,
    ParamSpace,
    ScaleTracker,
    codes_from_bytes,
    codes_to_bytes,
    decode_code,
    encode_g,
)
from starling.protocols.spsa.records import Record

# Lenient failure detection: on a loaded 2-core box a whole process can stall for seconds, and
# these tests are about arithmetic and records, not about telling a stall from a crash.
CONFIG = NodeConfig(liveness=Liveness(probe_interval_s=0.2, suspicion_base_s=30.0),
                    request_timeout_s=5.0)
QUICK = {"lr": 0.05, "eps": 1e-2, "samples": 2, "round_timeout_s": 5.0, "digest_every": 4}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 4, generator=g)
    return nn.functional.mse_loss(model(x), x[:, :2] * (1 + rank))


def spsa_swarm(make_node, n: int, transport: str = "inproc") -> list:
    nodes = [make_node(transport, config=CONFIG)]
    nodes += [make_node(transport, join=[nodes[0].address], config=CONFIG) for _ in range(n - 1)]
    for node in nodes:
        assert wait_until(lambda node=node: len(node.live_peers()) == n - 1)
    return nodes


def train_to(proto, rank: int, steps: int) -> None:
    """Step until the swarm's step count reaches `steps` (a catch-up may jump several)."""
    while proto.step_count < steps:
        t = proto.step_count
        proto.step(lambda: loss_of(proto.model, rank, t))


def params(proto) -> list[torch.Tensor]:
    return [p.detach().clone() for p in proto.model.parameters()]


# ---------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("distribution", ["rademacher", "normal"])
def test_perturb_and_restore_return_every_bit_in_float32(distribution):
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 3))
    with torch.no_grad():  # tiny, zero, large and binade-edge values: where naive adds lose bits
        model[0].weight.mul_(torch.logspace(-9, 1, 48).unsqueeze(1))
        model[0].bias.zero_()
        model[0].bias[:8] = -0.0
        model[1].weight[0, :8] = torch.tensor([1 - 2**-24, 2 - 2**-23, 0.5, -1e-30, 3e4, -7.5, 1e-8, 2**-126])
    eps = 1e-3
    space = ParamSpace(model, "", chunk_numel=1000, eps=eps, z_max=6.0)  # chunks straddle tensors
    space.snap()
    start = [p.detach().clone() for p in model.parameters()]
    assert not torch.signbit(model[0].bias).any()  # snapping made -0.0 into +0.0
    for seed in range(4):
        space.perturb(seed, distribution, +1)
        moved = [p.detach().clone() for p in model.parameters()]
        space.perturb(seed, distribution, -2)
        space.perturb(seed, distribution, +1)
        for before, after in zip(start, model.parameters()):
            assert torch.equal(before.view(torch.int32), after.detach().view(torch.int32))  # every bit
        # the perturbation is eps * z, up to half a grid step
        z = torch.cat([(m - s).reshape(-1) for m, s in zip(moved, start)]) / eps
        assert z.abs().max() <= 6.0 * 1.001 and z.abs().mean() > 0.5
    # the same three adds in plain float32 do lose bits on these values
    naive = model[0].weight.detach().clone()
    d = 1e-3 * torch.randn(naive.shape, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(((naive + d) - 2 * d) + d, naive)


def test_grid_is_a_function_of_the_values():
    model = mlp()
    space = ParamSpace(model, "", 1 << 10, 1e-3, 1.0)
    original = [p.detach().clone() for p in model.parameters()]
    space.snap()
    for p, o, grid in zip(model.parameters(), original, space.grids):
        assert (p.detach() - o).abs().max() <= grid / 2
    copy = mlp()
    copy.load_state_dict(model.state_dict())
    other = ParamSpace(copy, "", 1 << 10, 1e-3, 1.0)
    other.snap()  # loading snapped values derives the same grid and changes nothing
    assert other.grids == space.grids
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copy.parameters()))


def test_one_byte_code_error_bound():
    rnd = random.Random(0)
    for scale_log2 in (-12, 0, 5):
        scale = 2.0**scale_log2
        for _ in range(4000):
            g = rnd.choice((-1, 1)) * scale * 2.0 ** rnd.uniform(-12, 12)
            code = encode_g(g, scale_log2)
            assert -MAX_CODE <= code <= MAX_CODE
            ghat = decode_code(code, scale_log2)
            assert ghat == 0.0 or math.copysign(1, ghat) == math.copysign(1, g)
            log_ratio = math.log2(abs(g) / scale)
            if UNDERFLOW_LOG2 <= log_ratio <= SATURATE_LOG2 + 1 / 16:
                assert abs(ghat - g) <= REL_ERROR * abs(g) * (1 + 1e-12)
            elif log_ratio < UNDERFLOW_LOG2:
                assert ghat == 0.0
            else:
                assert abs(ghat) == scale * 2.0**SATURATE_LOG2 <= abs(g)
    assert encode_g(0.0, 0) == encode_g(float("nan"), 0) == encode_g(float("inf"), 0) == 0
    codes = list(range(-MAX_CODE, MAX_CODE + 1))
    assert codes_from_bytes(codes_to_bytes(codes)) == codes
    with pytest.raises(ValueError, match="reserved"):
        codes_from_bytes(bytes([0x80]))
    # the scale follows the magnitudes it decodes, the same way on every peer
    tracker = ScaleTracker.start(1.0)
    for _ in range(60):
        tracker.update([decode_code(encode_g(300.0, tracker.scale_log2), tracker.scale_log2)] * 4)
    assert abs(tracker.scale_log2 - math.log2(300.0)) <= 1


# ---------------------------------------------------------------------------- swarm
@pytest.mark.parametrize("directions", ["shared", "per-peer"])
def test_two_peers_with_the_same_contributions_end_bit_identical(make_node, directions):
    nodes = spsa_swarm(make_node, 2)
    protos = [get_protocol("spsa").create(n, mlp(), {**QUICK, "directions": directions}) for n in nodes]
    start = params(protos[0])
    before = loss_of(protos[0].model, 0, 999).item() + loss_of(protos[0].model, 1, 999).item()
    in_parallel([lambda r=r: train_to(protos[r], r, 30) for r in range(2)])
    for a, b in zip(protos[0].model.parameters(), protos[1].model.parameters()):
        assert torch.equal(a, b)
    assert protos[0].digest() == protos[1].digest()
    assert not all(torch.equal(a, b) for a, b in zip(start, protos[0].model.parameters()))
    after = loss_of(protos[0].model, 0, 999).item() + loss_of(protos[0].model, 1, 999).item()
    assert after < before
    records = protos[0].log_records(0)
    assert len(records) == 30 and any(len(r.keys) == 2 for r in records)
    assert all(len(r.codes) == len(r.keys) * QUICK["samples"] for r in records)


@pytest.mark.timeout(90)
def test_a_stall_of_the_network_thread_does_not_close_a_step_without_its_codes(make_node):
    """The leader's step timer counts the loop's awake time: codes that arrived while the
    shared network thread was stalled past the round timeout are read, not left out."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    timeout_s, stall_s = 2.0, 4.0  # the stall is twice the timeout, within its wall bound (3x)
    nodes = spsa_swarm(make_node, 2)
    protos = [get_protocol("spsa").create(n, mlp(), {**QUICK, "round_timeout_s": timeout_s}) for n in nodes]
    lead = min(range(2), key=lambda r: nodes[r].peer_id)  # the lowest id leads the first step
    other = 1 - lead

    async def stall() -> None:
        time.sleep(stall_s)  # blocks the network thread that both nodes share

    with ThreadPoolExecutor(1) as pool:
        leading = pool.submit(lambda: protos[lead].step(lambda: loss_of(protos[lead].model, lead, 0)))
        assert wait_until(lambda: bool(protos[lead].sequencer._groups))  # step 0 is open, its timer runs
        stalled = nodes[lead].submit(stall())
        protos[other].step(lambda: loss_of(protos[other].model, other, 0))  # queued behind the stall
        leading.result(timeout=60)
    stalled.result(timeout=1)
    (record,) = protos[lead].log_records(0)[:1]
    assert record.step == 0 and len(record.keys) == 2
    for a, b in zip(protos[0].model.parameters(), protos[1].model.parameters()):
        assert torch.equal(a, b)


def test_replay_from_the_log_equals_live_training(make_node):
    nodes = spsa_swarm(make_node, 2)
    options = {**QUICK, "directions": "per-peer"}
    protos = [get_protocol("spsa").create(n, mlp(), options) for n in nodes]
    initial = protos[0].state_dict()
    in_parallel([lambda r=r: train_to(protos[r], r, 20) for r in range(2)])
    replayer = get_protocol("spsa").create(make_node("inproc", config=CONFIG), mlp(), options)
    with torch.no_grad():
        for p in replayer.model.parameters():
            p.add_(1.0)  # whatever it held is overwritten by the state
    replayer.load_state_dict(initial)
    assert replayer.replay(protos[0].log_records(0)) == 20
    assert replayer.step_count == 20
    for a, b in zip(protos[0].model.parameters(), replayer.model.parameters()):
        assert torch.equal(a, b)
    # a record for another step is not applied
    assert replayer.replay([Record(3, "x", (1,), bytes(QUICK["samples"]))]) == 0


@pytest.mark.slow
def test_a_late_joiner_replays_to_the_swarms_digest(make_node):
    nodes = spsa_swarm(make_node, 2)
    protos = [get_protocol("spsa").create(n, mlp(), QUICK) for n in nodes]
    in_parallel([lambda r=r: train_to(protos[r], r, 10) for r in range(2)])
    snapshot = protos[0].state_dict()  # a download that takes a while: the swarm goes on
    in_parallel([lambda r=r: train_to(protos[r], r, 18) for r in range(2)])
    joiner_node = make_node("inproc", join=[nodes[0].address], config=CONFIG)
    assert wait_until(lambda: len(joiner_node.live_peers()) == 2)
    joiner = get_protocol("spsa").create(joiner_node, mlp(), QUICK)
    joiner.load_state_dict(snapshot)
    protos.append(joiner)
    in_parallel([lambda r=r: train_to(protos[r], r, 30) for r in range(3)])
    assert joiner.counters["replayed"] >= 8
    assert len({p.digest() for p in protos}) == 1
    # the joiner contributes once it is in step; under load it may miss a round's deadline and
    # catch that step up by replay, so any record since it joined counts, not only the last one
    assert any(len(r.keys) == 3 for r in protos[0].log_records(18)), \
        [len(r.keys) for r in protos[0].log_records(18)]


def test_a_lost_update_is_found_by_the_digest_and_repaired(make_node, caplog):
    nodes = spsa_swarm(make_node, 3)
    protos = [get_protocol("spsa").create(n, mlp(), QUICK) for n in nodes]
    in_parallel([lambda r=r: train_to(protos[r], r, 5) for r in range(3)])
    # peer 2 loses one record's update (as if the message never reached its parameters)
    victim = protos[2]
    real_update = victim.space.update
    calls = []

    def lossy_update(terms, distribution):
        calls.append(1)
        if len(calls) != 1:
            real_update(terms, distribution)

    victim.space.update = lossy_update
    with caplog.at_level(logging.WARNING, logger="starling.protocols.spsa"):
        in_parallel([lambda r=r: train_to(protos[r], r, 16) for r in range(3)])
    assert victim.counters["drift"] >= 1 and victim.counters["repairs"] >= 1
    assert any("drifted" in r.message for r in caplog.records)
    assert any("repaired from" in r.message for r in caplog.records)
    assert len({p.digest() for p in protos}) == 1
    assert all(p.counters["repairs"] == 0 for p in protos[:2])


@pytest.mark.slow
def test_lossy_links_still_end_identical(make_node):
    from starling.runtime import LinkEmulator, LinkModel

    nodes = spsa_swarm(make_node, 3)
    nodes[1].shaper = LinkEmulator(LinkModel(loss=0.15, seed=3))  # its requests and replies go missing
    options = {**QUICK, "round_timeout_s": 0.5, "reply_grace_s": 0.3}
    protos = [get_protocol("spsa").create(n, mlp(), options) for n in nodes]
    in_parallel([lambda r=r: train_to(protos[r], r, 20) for r in range(3)])
    assert nodes[1].shaper.counters.dropped >= 1
    assert len({p.digest() for p in protos}) == 1


def test_malformed_bytes_and_unknown_steps_are_refused_and_counted(make_node):
    leader_node = make_node("inproc", config=CONFIG)
    proto = get_protocol("spsa").create(leader_node, mlp(), {**QUICK, "samples": 3})
    proto.step(lambda: loss_of(proto.model, 0, 0))
    other = make_node("inproc", join=[leader_node.address], config=CONFIG)  # a member without spsa
    assert wait_until(lambda: other.peer_id in leader_node.live_peers())
    before = (proto.step_count, proto.digest(), proto.log.upto)
    bad = [
        ({"step": 1, "g": b"\x01\x02"}, "malformed"),  # two codes, three expected
        ({"step": 1, "g": b"\x01\x80\x02"}, "malformed"),  # -128 is reserved
        ({"step": 1, "g": "abc"}, "malformed"),
        ([1, 2, 3], "malformed"),
        ({"step": 10**6, "g": b"\x01\x02\x03"}, "unknown_step"),  # far past this leader
        ({"step": 3, "g": b"\x01\x02\x03"}, "unknown_step"),  # near, but the sender cannot fill the gap
        ({"step": -1, "g": b"\x01\x02\x03"}, "unknown_step"),
    ]
    for body, reason in bad:
        reply = other.request(leader_node.peer_id, "spsa.contrib", body, timeout_s=10).body
        assert reply["ok"] is False and reply["reason"].startswith(reason), (body, reply)
    rejected = leader_node.stats.snapshot()["rejected"]
    assert rejected["spsa.malformed"] == 4 and rejected["spsa.unknown_step"] == 3
    assert proto.counters["rejected.malformed"] == 4
    assert (proto.step_count, proto.digest(), proto.log.upto) == before
    bad_log = other.request(leader_node.peer_id, "spsa.log", {"since": "x"}, timeout_s=5).body
    assert bad_log["ok"] is False and rejected["spsa.malformed"] + 1 == \
        leader_node.stats.snapshot()["rejected"]["spsa.malformed"]


def test_param_filter_trains_only_matching_parameters(make_node):
    proto = get_protocol("spsa").create(make_node("inproc", config=CONFIG), mlp(),
                                        {**QUICK, "param_filter": r"\.bias$"})
    weights = [proto.model[0].weight.detach().clone(), proto.model[2].weight.detach().clone()]
    biases = [proto.model[0].bias.detach().clone(), proto.model[2].bias.detach().clone()]
    for t in range(5):
        proto.step(lambda: loss_of(proto.model, 0, t))
    assert torch.equal(weights[0], proto.model[0].weight) and torch.equal(weights[1], proto.model[2].weight)
    assert not torch.equal(biases[0], proto.model[0].bias)
    assert proto.describe()["parameters"] == 8 + 2


def test_bad_config_and_models_are_refused(make_node):
    node = make_node("inproc", config=CONFIG)
    for options, match in (({"directions": "each"}, "directions"), ({"eps": 0}, "eps"),
                           ({"samples": 0}, "samples"), ({"param_filter": "("}, "param_filter"),
                           ({"param_filter": "nothing-matches"}, "no trainable"),
                           ({"compressor": "int8"}, "compressor")):
        with pytest.raises(ProtocolError, match=match):
            get_protocol("spsa").create(node, mlp(), options)
    with pytest.raises(ProtocolError, match="float32"):
        get_protocol("spsa").create(node, mlp().double(), {})


@pytest.mark.slow
def test_over_tcp_a_peer_that_leaves_does_not_stall_the_others(make_node):
    nodes = spsa_swarm(make_node, 3, transport="tcp")
    protos = [get_protocol("spsa").create(n, mlp(), {**QUICK, "round_timeout_s": 30.0}) for n in nodes]
    in_parallel([lambda r=r: train_to(protos[r], r, 6) for r in range(3)])
    assert len({p.digest() for p in protos}) == 1
    protos[2].close()
    nodes[2].leave()
    reports = in_parallel([lambda r=r: [protos[r].step(lambda: loss_of(protos[r].model, r, 0)) for _ in range(4)]
                           for r in range(2)])
    assert all(rep.wall_s < 15.0 for per in reports for rep in per)
    assert protos[0].digest() == protos[1].digest()
    assert reports[0][-1].peers == 2
