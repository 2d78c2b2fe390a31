"""gossip's undo table: an answered pull is kept until the requester acks or undoes it, at
most `max_undo_entries` of them; an undo of a kept one restores the swarm mean, an undo of a
dropped one is refused, counted, and changes nothing."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm, wait_until

from starling.node.membership import PeerStatus, live_incarnation
from starling.protocols import ProtocolError, get_protocol
from starling.protocols.gossip import ACK_TOPIC, PULL_TOPIC, UNDO_TOPIC
from starling.tasks import get_task

DIM = 256
TASK = get_task("quadratic", dim=DIM)
MIXING = 0.5


def point(seed: int) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(seed)) * 3


def responder_and_pullers(make_node, pullers: int, max_undo_entries: int):
    """One gossip peer and `pullers` bare nodes that speak its topics by hand (so a test
    decides when a pull is acked, undone, or left open)."""
    nodes = swarm(make_node, 1 + pullers)
    model = TASK.make_model()
    with torch.no_grad():
        model.x.copy_(point(0))
    proto = get_protocol("gossip").create(nodes[0], model, {"lr": 0.0, "mixing": MIXING,
                                                           "max_undo_entries": max_undo_entries})
    return proto, nodes[1:]


def pull(node, proto, xid: int, x: torch.Tensor) -> torch.Tensor:
    """One pull from a bare node: the responder applies its half and replies its parameters."""
    reply = node.request(proto.node.peer_id, PULL_TOPIC, {"step": 0, "xid": xid}, [x], timeout_s=10.0)
    assert reply.body["ok"], reply.body
    return reply.payload[0].reshape(-1)


def spy_on_table(proto) -> tuple[list[int], list[str]]:
    """The table's size right after every entry is kept, and the requesters whose older
    entry a newer pull replaced (not an eviction)."""
    sizes: list[int] = []
    replaced: list[str] = []
    keep = proto._keep_for_undo

    def spy(requester, xid, delta):
        if requester in proto._applied:
            replaced.append(requester)
        keep(requester, xid, delta)
        sizes.append(len(proto._applied))
    proto._keep_for_undo = spy
    return sizes, replaced


def test_max_undo_entries_must_be_positive(make_node):
    with pytest.raises(ProtocolError, match="max_undo_entries"):
        get_protocol("gossip").create(make_node("inproc"), TASK.make_model(), {"max_undo_entries": 0})


def test_table_never_exceeds_its_bound_under_many_pullers(make_node):
    bound, rounds = 3, 3
    proto, pullers = responder_and_pullers(make_node, 10, bound)
    sizes, replaced = spy_on_table(proto)
    for r in range(rounds):  # every puller pulls at once and never acks
        in_parallel([lambda n=n, i=i: pull(n, proto, r + 1, point(10 + i)) for i, n in enumerate(pullers)])
        assert len(proto._applied) == bound
    pulls = rounds * len(pullers)
    assert len(sizes) == pulls and max(sizes) == bound
    # every entry beyond the bound was evicted, but for those a newer pull of the same requester replaced
    assert proto.counters["undo_evicted"] == pulls - bound - len(replaced)
    assert proto.describe()["undo_entries"] == bound


def test_acked_pulls_leave_the_table_empty(make_node):
    protos = []
    for rank, node in enumerate(swarm(make_node, 4)):
        model = TASK.make_model()
        with torch.no_grad():
            model.x.copy_(point(rank))
        protos.append(get_protocol("gossip").create(node, model, {"lr": 0.0, "max_undo_entries": 1}))
    before = torch.stack([p.consensus_vector().double() for p in protos]).mean(0)
    in_parallel([lambda p=p: [p.step(lambda: TASK.loss(p.model, torch.zeros(DIM))) for _ in range(6)]
                 for p in protos])
    assert wait_until(lambda: all(not p._applied for p in protos))
    after = torch.stack([p.consensus_vector().double() for p in protos]).mean(0)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    assert not any(p.counters["undo_refused"] for p in protos)


def test_undo_of_a_kept_entry_restores_the_mean_exactly(make_node):
    proto, (p1, p2) = responder_and_pullers(make_node, 2, max_undo_entries=2)
    x0, x1, x2 = proto.consensus_vector(), point(1), point(2)
    start_mean = (x0.double() + x1.double() + x2.double()) / 3
    # p1 completes its exchange (applies its half, acks)
    s = pull(p1, proto, 1, x1)
    x1 = x1 + MIXING * (s - x1)
    p1.send(proto.node.peer_id, ACK_TOPIC, {"xid": 1}).result(5.0)
    after_first = proto.consensus_vector()
    # p2's reply "came too late": it applies nothing and asks for the responder's half back
    pull(p2, proto, 7, x2)
    assert not torch.equal(proto.consensus_vector(), after_first)
    p2.send(proto.node.peer_id, UNDO_TOPIC, {"xid": 7}).result(5.0)
    assert wait_until(lambda: proto.counters["undone"] == 1)
    torch.testing.assert_close(proto.consensus_vector(), after_first, rtol=0, atol=1e-6)
    end_mean = (proto.consensus_vector().double() + x1.double() + x2.double()) / 3
    torch.testing.assert_close(end_mean, start_mean, rtol=0, atol=1e-6)
    assert not proto._applied and proto.counters["undo_refused"] == 0


def test_undo_of_an_evicted_entry_is_refused_counted_and_changes_nothing(make_node):
    proto, (p1, p2) = responder_and_pullers(make_node, 2, max_undo_entries=1)
    pull(p1, proto, 1, point(1))
    pull(p2, proto, 1, point(2))  # evicts p1's entry
    assert list(proto._applied) == [p2.peer_id] and proto.counters["undo_evicted"] == 1
    params, cancelled = proto.consensus_vector(), dict(proto._cancelled)
    p1.send(proto.node.peer_id, UNDO_TOPIC, {"xid": 1}).result(5.0)
    assert wait_until(lambda: proto.counters["undo_refused"] == 1)
    assert torch.equal(proto.consensus_vector(), params)
    assert proto._cancelled == cancelled and list(proto._applied) == [p2.peer_id]
    assert proto.node.stats.rejected["gossip.undo_of_dropped_entry"] == 1
    assert proto.counters["undone"] == 0
    # the entry still kept can still be undone
    p2.send(proto.node.peer_id, UNDO_TOPIC, {"xid": 1}).result(5.0)
    assert wait_until(lambda: proto.counters["undone"] == 1)
    assert not proto._applied


def test_entry_of_a_peer_that_left_is_dropped(make_node):
    proto, (p1,) = responder_and_pullers(make_node, 1, max_undo_entries=4)
    pull(p1, proto, 1, point(1))
    assert list(proto._applied) == [p1.peer_id]
    p1.leave()  # a graceful leave: it will neither ack nor undo
    assert wait_until(lambda: not proto._applied)
    assert proto.counters["undo_dropped_peer_left"] == 1


def test_a_peer_wrongly_declared_dead_can_still_undo(make_node):
    """A requester that only stalled past the dead timeout is declared dead, comes back and
    asks for its half back: the entry was kept, so the swarm mean stays exact."""
    proto, (p1,) = responder_and_pullers(make_node, 1, max_undo_entries=4)
    before = proto.consensus_vector()
    pull(p1, proto, 1, point(1))
    node = proto.node

    async def declare_everyone_dead():  # what dead claims after a long stall do
        for info in node._table.all():
            _, change = node._table.claim(PeerStatus.DEAD, info.peer_id, info.record.incarnation,
                                          live_incarnation(info.beat))
            if change is not None:
                node._notify(change)
    node.run(declare_everyone_dead())
    assert node.status_of(p1.peer_id) is PeerStatus.DEAD
    assert list(proto._applied) == [p1.peer_id] and proto.counters["undo_dropped_peer_left"] == 0
    assert wait_until(lambda: node.status_of(p1.peer_id) is PeerStatus.ALIVE)  # its next message, or its refutation
    p1.send(node.peer_id, UNDO_TOPIC, {"xid": 1}).result(5.0)
    assert wait_until(lambda: proto.counters["undone"] == 1)
    torch.testing.assert_close(proto.consensus_vector(), before, rtol=0, atol=1e-6)
