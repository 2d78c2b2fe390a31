"""Peers of different speeds: token-weighted averages, the quorum close, late
contributions carried into the next round once, time-based inner rounds, and bad input."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from conftest import in_parallel, join_with_state, linear, loss_of, swarm, wait_until

from starling.protocols import ProtocolError, get_protocol
from starling.protocols.base import PRIVATE_STATE
from starling.protocols.fragments import SyncClock
from starling.protocols.outer_sync import TokenLedger

EXACT = {"compressor": "none", "inner_optimizer": "sgd", "lr": 0.1, "check_every": 0}


def train(proto, rank: int, steps: int) -> list:
    return [proto.step(lambda: loss_of(proto.model, rank, proto.step_count)) for _ in range(steps)]


def outer(proto) -> torch.Tensor:
    return torch.cat([o.reshape(-1) for o in proto.outer])


# ---------------------------------------------------------------- weights


def test_the_ledger_counts_steps_and_folds_a_late_part_once():
    ledger = TokenLedger(staleness_weight=0.5)
    for _ in range(3):
        ledger.stepped()
    part, weight = ledger.contribution(torch.ones(2))
    assert weight == 3.0 and torch.equal(part, torch.ones(2)) and ledger.steps == 0
    ledger.missed(part, weight)
    ledger.stepped()
    folded, weight = ledger.contribution(torch.zeros(2))  # 1 new step, 3 late ones at gamma 0.5
    assert weight == 1.0 + 0.5 * 3.0
    torch.testing.assert_close(folded, torch.full((2,), 1.5 / 2.5))
    ledger.included()
    ledger.stepped()
    assert ledger.contribution(torch.zeros(2))[1] == 1.0  # the carry was spent once


def test_each_fragment_counts_its_own_steps_and_the_checkpoint_keeps_them(make_node):
    proto = get_protocol("streaming-diloco").create(make_node("inproc"), linear(),
                                                    {**EXACT, "sync_every": 8, "fragments": 2, "overlap_steps": 0})
    train(proto, 0, 4)  # fragment 0 sent after step 4: its count restarts, fragment 1's goes on
    assert [f.ledger.steps for f in proto.fragments] == [0, 4]
    proto.fragments[1].ledger.missed(torch.ones(proto.fragments[1].view.numel), 2.0)
    saved = proto.state_dict()[PRIVATE_STATE]["ledger"]
    assert saved["steps"] == [0, 4] and saved["carry"][0] is None and saved["carry"][1]["weight"] == 2.0
    other = get_protocol("streaming-diloco").create(make_node("inproc"), linear(),
                                                    {**EXACT, "sync_every": 8, "fragments": 2, "overlap_steps": 0})
    other.load_private_state({"ledger": saved})
    assert [f.ledger.steps for f in other.fragments] == [0, 4] and other.fragments[0].ledger.carry is None
    assert torch.equal(other.fragments[1].ledger.carry[0], torch.ones(proto.fragments[1].view.numel))


# ---------------------------------------------------------------- the quorum close
def quorum_swarm(make_node, n: int, **options):
    nodes = swarm(make_node, n)
    opts = {**EXACT, "sync_every": 2, "quorum": n - 1, "quorum_grace_s": 1.0, "round_timeout_s": 20.0, **options}
    return nodes, [get_protocol("diloco").create(node, linear(), opts) for node in nodes]


def slow_peer_rounds(make_node, **options) -> torch.Tensor:
    """Three rounds of a quorum of 2 among 3 peers: in the first the slow peer is held back
    until the two fast ones merged; in the next two all are on time. The shared outer
    parameters at the end."""
    nodes, (pa, pb, pc) = quorum_swarm(make_node, 3, **options)
    ids = [n.peer_id for n in nodes]
    slow_may_go = threading.Event()

    def slow() -> list:
        assert slow_may_go.wait(60)
        return train(pc, 2, 2)

    def release_when_fast_merged() -> None:
        assert wait_until(lambda: pa.versions == [1] and pb.versions == [1], 30)
        slow_may_go.set()

    with_slow = in_parallel([lambda: train(pa, 0, 2), lambda: train(pb, 1, 2), slow, release_when_fast_merged])
    # round 0 closed with the two fast peers only, and the slow one was told the same set
    assert pa.last_closing[0].members == pb.last_closing[0].members == tuple(sorted(ids[:2]))
    assert pc.last_closing[0] == pa.last_closing[0]
    assert with_slow[0][-1].synced and with_slow[0][-1].peers == 2
    assert pc.weight_log["missed"] == 1 and pc.fragments[0].ledger.carry is not None
    assert pa.versions == pb.versions == pc.versions == [1]
    assert torch.equal(outer(pa), outer(pc)) and torch.equal(outer(pb), outer(pc))

    # round 1: all three on time; the slow peer's late part rides along, at gamma 0.5
    in_parallel([lambda: train(pa, 0, 2), lambda: train(pb, 1, 2), lambda: train(pc, 2, 2)])
    closing = pa.last_closing[0]
    assert closing == pb.last_closing[0] == pc.last_closing[0]
    assert dict(closing.contributions) == {ids[0]: 2.0, ids[1]: 2.0, ids[2]: 2.0 + 0.5 * 2.0}
    assert math.isclose(sum(pa.last_shares.values()), 1.0) and math.isclose(pa.last_shares[ids[2]], 3.0 / 7.0)
    assert pc.fragments[0].ledger.carry is None
    # round 2: spent once, it is not counted again
    in_parallel([lambda: train(pa, 0, 2), lambda: train(pb, 1, 2), lambda: train(pc, 2, 2)])
    assert dict(pa.last_closing[0].contributions) == dict.fromkeys(ids, 2.0)
    assert pa.versions == pb.versions == pc.versions == [3]
    assert torch.equal(outer(pa), outer(pc)) and torch.equal(outer(pb), outer(pc))
    assert torch.equal(pa.momentum[0], pc.momentum[0])
    return outer(pa)


def test_a_round_closes_at_quorum_without_the_slow_peer_and_its_part_lands_once_later(make_node):
    slow_peer_rounds(make_node)


def test_a_quorum_of_masked_parts_closes_and_carries_late_parts_as_the_plain_one_does(make_node):
    """Secure aggregation under a quorum: the closing set's members mask among themselves,
    the slow peer fetches the merged result, its late part rides along masked in the next
    round; the same closings and, within the ring's rounding, the same model as in the clear."""
    plain = slow_peer_rounds(make_node)
    secure = slow_peer_rounds(make_node, secure_aggregation="on")
    torch.testing.assert_close(secure, plain, rtol=0, atol=1e-3)
    assert not torch.equal(secure, plain)  # the ring's rounding: the masked rounds did run


def test_time_based_rounds_with_a_slow_peer_keep_outer_parameters_bit_identical(make_node):
    """sync_every_s: each peer runs the steps that fit; a peer 4x slower runs fewer, weighs
    less, and every peer ends each round with the same outer parameters."""
    nodes = swarm(make_node, 3)
    opts = {**EXACT, "sync_every_s": 0.8, "fragments": 2, "sync_every": 2, "quorum": 2, "quorum_grace_s": 0.3,
            "round_timeout_s": 20.0}
    protos = [get_protocol("streaming-diloco").create(n, linear(), {**opts, "overlap_steps": 1}) for n in nodes]
    pause = [0.01, 0.01, 0.04]

    def run(r):
        proto = protos[r]
        while min(proto.versions) < 3:
            proto.step(lambda: (time.sleep(pause[r]), loss_of(proto.model, r, proto.step_count))[1])

    in_parallel([lambda r=r: run(r) for r in range(3)])
    assert protos[0].versions == protos[1].versions == protos[2].versions == [3, 3]
    assert torch.equal(outer(protos[0]), outer(protos[2])) and torch.equal(outer(protos[1]), outer(protos[2]))
    assert protos[2].step_count < protos[0].step_count  # fewer steps fit in the slow peer's windows
    slow_share = protos[2].weight_log["share_sum"] / protos[2].weight_log["rounds"]
    assert slow_share < 1 / 3


def test_a_joiner_weighs_the_steps_it_took_from_its_first_contribution(make_node):
    a, b = swarm(make_node, 2)
    opts = {**EXACT, "sync_every": 4, "round_timeout_s": 20.0}
    pa, pb = (get_protocol("diloco").create(n, linear(), opts) for n in (a, b))
    in_parallel([lambda: train(pa, 0, 2), lambda: train(pb, 1, 2)])
    # as a Trainer sends it: the donor's own ledger is not the joiner's
    c, pc = join_with_state(make_node, [a, b], "diloco", linear(), opts, donor=pa)
    in_parallel([lambda: train(pa, 0, 2), lambda: train(pb, 1, 2), lambda: train(pc, 2, 2)])
    assert pa.versions == pb.versions == pc.versions == [1]
    shares = pa.last_shares
    assert shares == pc.last_shares
    assert math.isclose(shares[c.peer_id], 2 / 10) and math.isclose(shares[a.peer_id], 4 / 10)
    assert torch.equal(outer(pa), outer(pc)) and torch.equal(outer(pb), outer(pc))


# ---------------------------------------------------------------- eager updates
def test_eager_updates_merge_a_stand_in_at_the_send_and_leave_the_outer_step_as_it_was(make_node):
    """H 4, tau 2: fragment 0 leaves after step 2 and merges after 4. With eager updates the
    local parameters take, at the send, the outer step my own pseudo-gradient would make;
    the outer parameters after the merge are those of the same swarm without."""
    alpha, lr, mu = 0.5, 0.7, 0.9
    opts = {**EXACT, "sync_every": 4, "fragments": 1, "overlap_steps": 2, "alpha": alpha, "outer_lr": lr,
            "outer_momentum": mu}
    swarms = {}
    for eager in (False, True):
        nodes = swarm(make_node, 2)
        swarms[eager] = [get_protocol("streaming-diloco").create(n, linear(), {**opts, "eager_updates": eager})
                         for n in nodes]
        in_parallel([lambda r=r, eager=eager: train(swarms[eager][r], r, 2) for r in range(2)])
    theta0 = outer(swarms[False][0])
    for r in range(2):
        local_send = torch.cat([p.detach().reshape(-1) for p in swarms[False][r].model.parameters()])
        delta = theta0 - local_send
        stand_in = theta0 - lr * (1 + mu) * delta
        eager_local = torch.cat([p.detach().reshape(-1) for p in swarms[True][r].model.parameters()])
        torch.testing.assert_close(eager_local, alpha * local_send + (1 - alpha) * stand_in)
    for eager in (False, True):
        in_parallel([lambda r=r, eager=eager: train(swarms[eager][r], r, 2) for r in range(2)])
    assert torch.equal(outer(swarms[True][0]), outer(swarms[False][0]))
    assert torch.equal(outer(swarms[True][0]), outer(swarms[True][1]))
    assert not torch.equal(swarms[True][0].model.weight, swarms[False][0].model.weight)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("options, message", [
    ({"quorum": -1}, "quorum must be >= 0"),
    ({"quorum_grace_s": -0.5}, "quorum_grace_s must be"),
    ({"staleness_weight": 1.5}, r"staleness_weight must be in \[0, 1\]"),
    ({"sync_every_s": -1}, "sync_every_s must be"),
    ({"sync_every_s": float("nan")}, "sync_every_s must be"),
    ({"eager_updates": True, "overlap_steps": 0}, "eager_updates needs overlap_steps >= 1"),
    ({"overlap_window_share": 1.0}, r"overlap_window_share must be in \[0, 1\)"),
    ({"overlap_window_share": -0.1}, r"overlap_window_share must be in \[0, 1\)"),
])
def test_bad_heterogeneity_options_are_refused(make_node, options, message):
    with pytest.raises(ProtocolError, match=message):
        get_protocol("streaming-diloco").create(make_node("inproc"), linear(), options)


def test_the_sync_clock_sends_when_one_more_step_would_not_fit():
    clock = SyncClock(sync_every_s=4.0, fragments=2)
    clock.started(100.0)
    assert clock.due(0, 0) == 102.0 and clock.due(1, 0) == 104.0 and clock.due(0, 1) == 106.0
    clock.stepped(0.5)
    assert not clock.should_send(0, 0, 101.0) and clock.should_send(0, 0, 101.6)
    clock.stepped(1.5)  # a slower step: the average moves 30% of the way
    assert clock.step_s == pytest.approx(0.8) and clock.should_send(0, 0, 101.2)


def test_the_overlap_follows_the_window_in_each_peers_own_steps():
    """W 2 s, F 4: a fragment's window is 0.5 s, half of it 0.25 s. A peer of 0.05 s steps
    hides a round behind 5 of them, one 3x slower behind 1 (tau, the floor); share 0: tau."""
    fast, slow = (SyncClock(sync_every_s=2.0, fragments=4, overlap_steps=1, overlap_window_share=0.5)
                  for _ in range(2))
    assert fast.overlap() == 1  # no step timed yet: tau
    fast.stepped(0.05)
    slow.stepped(0.15)
    assert fast.overlap() == 5 and slow.overlap() == 1
    assert SyncClock(2.0, 4, overlap_steps=7, overlap_window_share=0.5).overlap() == 7  # before a step
    fixed = SyncClock(2.0, 4, overlap_steps=2, overlap_window_share=0.0)
    fixed.stepped(0.01)
    assert fixed.overlap() == 2
    with pytest.raises(ValueError, match="overlap_window_share"):
        SyncClock(2.0, 4, overlap_window_share=1.0)


class FakeTime:
    """Wall-clock time that moves only when a step's loss says so: every step takes `step_s`."""

    monotonic, sleep = staticmethod(time.monotonic), staticmethod(time.sleep)  # deadlines stay real

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 1000.0, step_s

    def time(self) -> float:
        return self.now

    def loss(self, proto, rank: int) -> torch.Tensor:
        self.now += self.step_s
        return loss_of(proto.model, rank, proto.step_count)


@pytest.mark.parametrize("step_s, share, merge_after", [(0.0625, 0.5, 8), (0.4, 0.5, 1), (0.0625, 0.0, 1)])
def test_with_time_based_rounds_a_fragment_merges_after_the_steps_that_fit_in_its_share_of_the_window(
        make_node, monkeypatch, step_s, share, merge_after):
    """W 2 s, F 2: fragment 0 is due 1 s after the epoch. Steps of 1/16 s send it after step 15
    (a 16th would end at its time) and, half of its 1 s window being 8 such steps, merge it
    after step 23; a peer of 0.4 s steps merges after 1 step (tau), as does share 0."""
    from starling.protocols import diloco

    clock = FakeTime(step_s)
    monkeypatch.setattr(diloco, "time", clock)
    opts = {**EXACT, "sync_every_s": 2.0, "fragments": 2, "sync_every": 2, "overlap_steps": 1,
            "overlap_window_share": share}
    proto = get_protocol("streaming-diloco").create(make_node("inproc"), linear(), opts)
    send = next(s for s in range(1, 100) if (s + 1) * step_s >= 1.0)
    for _ in range(send):
        proto.step(lambda: clock.loss(proto, 0))
    assert proto.step_count == send and proto.in_flight[0].merge_at == send + merge_after
    state = proto.state_dict()  # a checkpoint or a joiner takes the merge as a step count
    assert [e["merge_at"] for e in state["in_flight"]] == [send + merge_after]
    while proto.step_count < send + merge_after - 1:
        proto.step(lambda: clock.loss(proto, 0))
        assert 0 in proto.in_flight and proto.versions[0] == 0
    proto.step(lambda: clock.loss(proto, 0))
    assert 0 not in proto.in_flight and proto.versions[0] == 1
