"""The bodies of gossip, DiLoCo's sync and the drift guard: each goes out as the map the
protocols always sent (the same msgpack bytes), comes back the same, and a bad one raises
BodyError naming what is wrong; a peer that sends one is counted and changes nothing."""
from __future__ import annotations

import msgpack
import pytest
import torch
from conftest import swarm, wait_until

from starling.collectives import ReduceTimeouts
from starling.collectives.agreement import digest_bytes
from starling.node.rpc import Refusal, Reply, refusal, refusal_of
from starling.protocols import get_protocol
from starling.protocols.bodies import (
    DIGEST_BYTES,
    MAX_FRAGMENTS,
    BodyError,
    Choco,
    Digest,
    GuardAsk,
    GuardState,
    NotYet,
    Pull,
    PullAck,
    Pulled,
    Resync,
    SyncAsk,
    SyncState,
    Undo,
)
from starling.protocols.diloco import SYNC_TOPIC
from starling.protocols.gossip import ACK_TOPIC, CHOCO_TOPIC, PULL_TOPIC, RESYNC_TOPIC, UNDO_TOPIC
from starling.protocols.guard import DriftGuard
from starling.tasks import get_task

HEADER = {"codec": "int8", "shape": [4], "scale": 0.5}
DIGEST = bytes(range(32))


def packed(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


# What the protocols sent as dict literals before their bodies were typed, key for key.
@pytest.mark.parametrize(("body", "old"), [
    (Pull(3, 7), {"step": 3, "xid": 7}),
    (Pulled(), {"ok": True}),
    (Undo(7), {"xid": 7}),
    (PullAck(7), {"xid": 7}),
    (Choco(4, True), {"seq": 4, "full": True}),
    (Choco(4, True, None, 2), {"seq": 4, "full": True, "buffers": 2}),
    (Choco(5, False, HEADER), {"seq": 5, "full": False, "packet": HEADER}),
    (Choco(5, False, HEADER, 2), {"seq": 5, "full": False, "packet": HEADER, "buffers": 2}),
    (Resync(), {}),
    (SyncAsk((0, 1)), {"fragments": [0, 1]}),
    (SyncAsk((1,), 4), {"fragments": [1], "at_least": 4}),
    (SyncAsk((), 4), {"fragments": [], "at_least": 4}),
    (SyncState(12, (3, 2), (1,)), {"ok": True, "step": 12, "versions": [3, 2], "fragments": [1]}),
    (NotYet.before((3, 2), 4), {"ok": False, "reason": "at versions [3, 2], not yet 4", "versions": [3, 2]}),
    (GuardAsk(5), {"round": 5}),
    (Digest(5, DIGEST), {"ok": True, "round": 5, "digest": DIGEST}),
    (GuardState(5, {"step": 9}), {"ok": True, "round": 5, "state": {"step": 9}}),
])
def test_a_body_goes_out_as_the_old_map_and_comes_back_the_same(body, old) -> None:
    assert packed(body.to_wire()) == packed(old)
    assert type(body).from_wire(msgpack.unpackb(packed(body.to_wire()), raw=False)) == body


@pytest.mark.parametrize(("read", "obj", "what"), [
    (Pull.from_wire, [3, 7], "map"),
    (Pull.from_wire, {"step": 3}, "xid missing"),
    (Pull.from_wire, {"step": "3", "xid": 7}, "step"),
    (Pull.from_wire, {"step": 3, "xid": True}, "xid"),
    (Pull.from_wire, {"step": 3, "xid": 7.0}, "xid"),
    (Pull.from_wire, {"step": -1, "xid": 7}, "step"),
    (Pull.from_wire, {"step": 3, "xid": 1 << 63}, "xid"),
    (Pulled.from_wire, refusal(Refusal.BUSY), "refused: busy"),
    (Pulled.from_wire, {"ok": 1}, "ok"),
    (Undo.from_wire, {"xid": None}, "xid"),
    (Undo.from_wire, None, "map"),
    (PullAck.from_wire, {}, "xid missing"),
    (Choco.from_wire, {"full": True}, "seq missing"),
    (Choco.from_wire, {"seq": 1, "full": 1}, "full"),
    (Choco.from_wire, {"seq": 1, "full": False}, "packet header"),
    (Choco.from_wire, {"seq": 1, "full": False, "packet": [1, 2]}, "packet header"),
    (Choco.from_wire, {"seq": 1, "full": True, "packet": HEADER}, "no packet"),
    (Choco.from_wire, {"seq": 1, "full": True, "buffers": 3}, "buffers"),
    (Choco.from_wire, {"seq": 1, "full": True, "buffers": -1}, "buffers"),
    (Choco.from_wire, {"seq": float("nan"), "full": True}, "seq"),
    (Resync.from_wire, {"x": 1}, "empty"),
    (SyncAsk.from_wire, {"at_least": 1}, "fragments"),
    (SyncAsk.from_wire, {"fragments": [1, 0]}, "ascending"),
    (SyncAsk.from_wire, {"fragments": [0, 0]}, "unique"),
    (SyncAsk.from_wire, {"fragments": [0.0]}, "fragments"),
    (SyncAsk.from_wire, {"fragments": [-1]}, "fragments"),
    (SyncAsk.from_wire, {"fragments": list(range(MAX_FRAGMENTS + 1))}, "at most"),
    (SyncAsk.from_wire, {"fragments": [0], "at_least": float("nan")}, "at_least"),
    (SyncAsk.from_wire, {"fragments": [0], "at_least": -1}, "at_least"),
    (SyncState.from_wire, {"ok": False, "reason": "at versions [1], not yet 2", "versions": [1]}, "not yet 2"),
    (SyncState.from_wire, {"ok": True, "step": 1, "versions": "12", "fragments": []}, "versions"),
    (SyncState.from_wire, {"ok": True, "step": 1, "versions": [1], "fragments": None}, "fragments"),
    (SyncState.from_wire, {"ok": True, "versions": [1], "fragments": []}, "step missing"),
    (NotYet.from_wire, {"ok": False, "reason": 3, "versions": [1]}, "reason"),
    (NotYet.from_wire, {"ok": False, "reason": "x", "versions": [True]}, "versions"),
    (GuardAsk.from_wire, {"nope": 0}, "round missing"),
    (GuardAsk.from_wire, {"round": "0"}, "round"),
    (GuardAsk.from_wire, {"round": float("nan")}, "round"),
    (Digest.from_wire, {"ok": True, "round": 1, "digest": DIGEST[:8]}, "32 bytes"),
    (Digest.from_wire, {"ok": True, "round": 1, "digest": DIGEST.hex()}, "32 bytes"),
    (Digest.from_wire, {"ok": True, "digest": DIGEST}, "round missing"),
    (Digest.from_wire, refusal(Refusal.NOT_FOUND, "no mismatch"), "no mismatch"),
    (GuardState.from_wire, {"ok": True, "round": 1, "state": None}, "state must be a map"),
    (GuardState.from_wire, {"ok": True, "round": -1, "state": {}}, "round"),
])
def test_a_bad_body_is_named(read, obj, what) -> None:
    with pytest.raises(BodyError, match=what):
        read(obj)


def test_a_choco_update_is_a_full_copy_or_a_packet() -> None:
    with pytest.raises(ValueError, match="one of the two"):
        Choco(1, False)
    with pytest.raises(ValueError, match="one of the two"):
        Choco(1, True, HEADER)


def test_a_guard_request_for_a_round_before_every_check_is_well_formed() -> None:
    assert GuardAsk.from_wire({"round": -1}) == GuardAsk(-1)  # answered as past, not as malformed


# ---------------------------------------------------------------------- what a receiver does with a bad one
def gossip_and_peer(make_node):
    a, b = swarm(make_node, 2)
    task = get_task("quadratic", dim=8)
    proto = get_protocol("gossip").create(a, task.make_model(), {"lr": 0.0})
    return proto, b


def test_gossip_counts_a_malformed_pull_refuses_it_and_changes_nothing(make_node):
    proto, peer = gossip_and_peer(make_node)
    before = proto.consensus_vector()
    for body in ({"step": 0}, {"step": 0, "xid": "1"}, [0, 1]):
        reply = peer.request(proto.node.peer_id, PULL_TOPIC, body, [torch.ones(8)], timeout_s=10.0).body
        assert refusal_of(reply) is Refusal.MALFORMED, reply
    assert torch.equal(proto.consensus_vector(), before) and not proto._applied
    assert proto.node.stats.rejected[f"{PULL_TOPIC}.malformed"] == 3
    assert proto.counters["rejected.malformed"] == 3


def test_gossip_counts_malformed_one_way_messages_and_changes_nothing(make_node):
    proto, peer = gossip_and_peer(make_node)
    reply = peer.request(proto.node.peer_id, PULL_TOPIC, Pull(0, 5).to_wire(), [torch.ones(8)], timeout_s=10.0)
    Pulled.from_wire(reply.body)
    after_pull, applied, cancelled = proto.consensus_vector(), dict(proto._applied), dict(proto._cancelled)
    with proto._hat_lock:
        proto._has_my_hat.add(peer.peer_id)
    sent = [(UNDO_TOPIC, {"xid": "5"}), (UNDO_TOPIC, {}), (ACK_TOPIC, {"xid": None}),
            (CHOCO_TOPIC, {"seq": 0, "full": False}), (CHOCO_TOPIC, {"seq": -2, "full": True}),
            (RESYNC_TOPIC, {"please": True})]
    for topic, body in sent:
        peer.send(proto.node.peer_id, topic, body, [torch.ones(8)]).result(5.0)
    assert wait_until(lambda: proto.counters["rejected.malformed"] == len(sent))
    rejected = proto.node.stats.rejected
    assert [rejected[f"{t}.malformed"] for t in (UNDO_TOPIC, ACK_TOPIC, CHOCO_TOPIC, RESYNC_TOPIC)] == [2, 1, 2, 1]
    assert torch.equal(proto.consensus_vector(), after_pull)
    assert list(proto._applied) == list(applied) and proto._cancelled == cancelled
    assert not proto._inbox and peer.peer_id in proto._has_my_hat
    assert proto.counters["undone"] == proto.counters["undo_refused"] == 0
    # the well-formed undo of that exchange still takes it back
    peer.send(proto.node.peer_id, UNDO_TOPIC, Undo(5).to_wire()).result(5.0)
    assert wait_until(lambda: proto.counters["undone"] == 1)


def test_diloco_counts_a_malformed_sync_request_and_answers_a_good_one(make_node):
    a, b = swarm(make_node, 2)
    proto = get_protocol("diloco").create(b, torch.nn.Linear(3, 2), {})
    for body in ({"fragments": [99]}, {"fragments": [0, 0]}, {"fragments": "0"}, {"fragments": [0], "at_least": -1}):
        reply = a.request(b.peer_id, SYNC_TOPIC, body, timeout_s=10.0).body
        assert refusal_of(reply) is Refusal.MALFORMED, (body, reply)
    assert b.stats.rejected[f"{SYNC_TOPIC}.malformed"] == 4
    msg = a.request(b.peer_id, SYNC_TOPIC, SyncAsk((0,)).to_wire(), timeout_s=10.0)
    state = SyncState.from_wire(msg.body)
    assert state.fragments == (0,) and len(state.versions) == len(proto.fragments) and len(msg.payload) == 2
    not_yet = NotYet.from_wire(a.request(b.peer_id, SYNC_TOPIC, SyncAsk((0,), 5).to_wire(), timeout_s=10.0).body)
    assert not_yet.versions == state.versions and "not yet 5" in not_yet.reason


def guard_and_peer(make_node):
    """A guard over one plain tensor, and a peer that speaks its topics by hand."""
    a, b = swarm(make_node, 2)
    held = [torch.zeros(4)]

    def adopt(header, tensors) -> None:
        held[0] = tensors[0].clone()
    guard = DriftGuard(a, "test.", 1, ReduceTimeouts(round_timeout_s=2.0), lambda: True, lambda: held,
                       lambda: ({}, [held[0].clone()]), adopt, lambda header, tensors: tensors[:1])
    return guard, held, b


def test_the_guard_counts_a_malformed_request_and_refuses_it(make_node):
    guard, _, peer = guard_and_peer(make_node)
    for topic in (guard.topic, guard.digest_topic):
        for body in ({"nope": 0}, {"round": "0"}, {"round": 0.5}):
            reply = peer.request(guard.node.peer_id, topic, body, timeout_s=10.0).body
            assert refusal_of(reply) is Refusal.MALFORMED, reply
        assert refusal_of(peer.request(guard.node.peer_id, topic, GuardAsk(-1).to_wire(), timeout_s=10.0).body) \
            is Refusal.NOT_FOUND  # the latest check (none yet) was no mismatch
        assert guard.node.stats.rejected[f"{topic}.malformed"] == 3


@pytest.mark.parametrize("answer", [
    {"ok": True, "round": 3, "digest": b"short"},
    {"ok": True, "round": 2, "digest": DIGEST},  # another round's
    ["ok", DIGEST],
])
def test_the_guard_counts_a_malformed_digest_answer_and_holds_none(make_node, answer):
    guard, _, peer = guard_and_peer(make_node)
    peer.on(guard.digest_topic, lambda msg: answer)
    assert guard.node.run(guard._digests(3, [peer.peer_id])) == {}
    assert guard.node.stats.rejected[f"{guard.digest_topic}.malformed_answer"] == 1
    peer.on(guard.digest_topic, lambda msg: Digest(3, DIGEST).to_wire())
    assert guard.node.run(guard._digests(3, [peer.peer_id])) == {peer.peer_id: DIGEST}


@pytest.mark.parametrize("answer", [
    {"ok": True, "round": 3, "state": None},
    {"ok": True, "round": 4, "state": {}},  # another round's
    {"ok": True, "state": {}},
])
def test_the_guard_counts_a_malformed_state_answer_and_takes_nothing(make_node, answer):
    guard, held, peer = guard_and_peer(make_node)
    served = torch.ones(4)
    chosen = digest_bytes([served], DIGEST_BYTES)
    peer.on(guard.topic, lambda msg: Reply(answer, (served,)))
    assert guard._fetch(3, peer.peer_id, chosen) is False
    assert torch.equal(held[0], torch.zeros(4))
    assert guard.node.stats.rejected[f"{guard.topic}.malformed_answer"] == 1
    peer.on(guard.topic, lambda msg: Reply(GuardState(3, {}).to_wire(), (served,)))
    assert guard._fetch(3, peer.peer_id, chosen) is True and torch.equal(held[0], served)
