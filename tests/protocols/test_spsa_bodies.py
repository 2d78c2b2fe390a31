"""spsa's bodies: each goes out as the map spsa always sent (the same msgpack bytes), comes
back the same, and a bad one raises BodyError naming what is wrong; a peer that sends one is
counted and changes nothing."""
from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from conftest import wait_until
from torch import nn

from starling.node.node import NodeConfig
from starling.node.rpc import Refusal, Reply, refusal, refusal_of
from starling.node.swim import Liveness
from starling.protocols import get_protocol
from starling.protocols.spsa.arith import NO_DIGEST
from starling.protocols.spsa.bodies import (
    LOG_BATCH,
    BodyError,
    Contribution,
    Declined,
    LogAsk,
    LogRecords,
    SpsaState,
    StateAsk,
    StepClosed,
)
from starling.protocols.spsa.protocol import STATE_TOPIC
from starling.protocols.spsa.records import MAX_CONTRIBUTORS, Record

KEYS = (3, 11, 40)
CODES = b"\x01\x02\xff\xfe\x05\x06"  # two samples per contributor
RECORD = Record(7, "leader-a", KEYS, CODES, 1234, 11)


def packed(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def record_map(step: int = 7, **changes) -> dict:
    """A record as spsa always sent it (`records.py`), with `changes`."""
    return {"t": step, "l": "leader-a", "k": struct.pack("<3q", *KEYS), "g": CODES, "d": 1234, "s": 11, **changes}


def test_bodies_go_out_as_the_old_maps_and_come_back_the_same() -> None:
    cases = [
        (Contribution(5, b"\x01\x7f", 99), {"step": 5, "g": b"\x01\x7f", "d": 99}, lambda o: Contribution.from_wire(o, 2)),
        (Contribution(5, b"\x01\x7f"), {"step": 5, "g": b"\x01\x7f", "d": NO_DIGEST},
         lambda o: Contribution.from_wire(o, 2)),
        (StepClosed(RECORD, 9, False), {"ok": True, "record": record_map(), "upto": 9, "late": False},
         lambda o: StepClosed.from_wire(o, 2)),
        (LogAsk(12), {"since": 12}, LogAsk.from_wire),
        (LogRecords((RECORD, Record(8, "leader-a", KEYS, CODES)), 8),
         {"ok": True, "records": [record_map(), record_map(8, d=NO_DIGEST, s=NO_DIGEST)], "upto": 8},
         lambda o: LogRecords.from_wire(o, 2)),
        (LogRecords((), -1), {"ok": True, "records": [], "upto": -1}, lambda o: LogRecords.from_wire(o, 2)),
        (StateAsk(), {}, StateAsk.from_wire),
        (SpsaState(20, -3, 0.125, KEYS, "leader-a"),
         {"ok": True, "step": 20, "scale": [-3, 0.125], "keys": struct.pack("<3q", *KEYS), "leader": "leader-a"},
         SpsaState.from_wire),
        (SpsaState(0, 0, 1.0, (), "me"), {"ok": True, "step": 0, "scale": [0, 1.0], "keys": b"", "leader": "me"},
         SpsaState.from_wire),
    ]
    for body, old, read in cases:
        assert packed(body.to_wire()) == packed(old), body
        assert read(msgpack.unpackb(packed(body.to_wire()), raw=False)) == body


def test_a_closed_step_leaves_out_the_codes_its_contributor_sent() -> None:
    closed = StepClosed(RECORD, 9, True)
    wire = closed.to_wire(omit=11, samples=2)
    assert packed(wire) == packed({"ok": True, "record": record_map(g=b"\x01\x02\x05\x06", o=True), "upto": 9,
                                   "late": True})
    assert StepClosed.from_wire(wire, 2, mine=(11, b"\xff\xfe")) == closed
    with pytest.raises(BodyError, match="requester"):
        StepClosed.from_wire(wire, 2)


def test_a_refusal_reads_as_declined() -> None:
    assert Declined.from_wire(StepClosed(RECORD, 9, False).to_wire()) is None
    assert Declined.from_wire(refusal(Refusal.TOO_OLD, "before this log", too_old=True, upto=40)) == \
        Declined("too_old: before this log", True, 40)
    assert Declined.from_wire(refusal(Refusal.BUSY)) == Declined("busy")
    assert Declined.from_wire(refusal(Refusal.UNKNOWN_STEP, "far", upto="x")).upto == -1
    assert Declined.from_wire([1]) == Declined("malformed answer: list")


@pytest.mark.parametrize(("read", "obj", "what"), [
    (lambda o: Contribution.from_wire(o, 2), [1, b"\x01\x02"], "map"),
    (lambda o: Contribution.from_wire(o, 2), {"g": b"\x01\x02"}, "step"),
    (lambda o: Contribution.from_wire(o, 2), {"step": True, "g": b"\x01\x02"}, "step"),
    (lambda o: Contribution.from_wire(o, 2), {"step": 1.0, "g": b"\x01\x02"}, "step"),
    (lambda o: Contribution.from_wire(o, 2), {"step": 1, "g": b"\x01"}, "2 bytes, got 1"),
    (lambda o: Contribution.from_wire(o, 2), {"step": 1, "g": [1, 2]}, "2 bytes, got list"),
    (lambda o: Contribution.from_wire(o, 2), {"step": 1, "g": b"\x80\x01"}, "reserved"),
    (lambda o: Contribution.from_wire(o, 2), {"step": 1, "g": b"\x01\x02", "d": -2}, "d must be"),
    (lambda o: Contribution.from_wire(o, 2), {"step": 1, "g": b"\x01\x02", "d": float("nan")}, "d must be"),
    (lambda o: StepClosed.from_wire(o, 2), {"ok": True, "record": record_map(), "upto": 9}, "late"),
    (lambda o: StepClosed.from_wire(o, 2), {"ok": True, "record": record_map(), "late": False}, "upto"),
    (lambda o: StepClosed.from_wire(o, 2), {"ok": True, "record": record_map(), "upto": -2, "late": False}, "upto"),
    (lambda o: StepClosed.from_wire(o, 2), {"ok": True, "record": None, "upto": 9, "late": False}, "record must"),
    (lambda o: StepClosed.from_wire(o, 2), refusal(Refusal.BUSY), "refused: busy"),
    (lambda o: StepClosed.from_wire(o, 3), {"ok": True, "record": record_map(), "upto": 9, "late": False},
     "6 codes for 3 contributors x 3"),
    (LogAsk.from_wire, {"since": "x"}, "since"),
    (LogAsk.from_wire, {"since": -1}, "since"),
    (LogAsk.from_wire, {}, "since"),
    (lambda o: LogRecords.from_wire(o, 2), {"ok": True, "records": {}, "upto": 1}, "records must be a list"),
    (lambda o: LogRecords.from_wire(o, 2), {"ok": True, "records": [record_map()] * (LOG_BATCH + 1), "upto": 1},
     f"at most {LOG_BATCH}"),
    (lambda o: LogRecords.from_wire(o, 2), {"ok": True, "records": [record_map(7), record_map(9)], "upto": 9},
     "consecutive"),
    (lambda o: LogRecords.from_wire(o, 2), {"ok": True, "records": [record_map(s=-5)], "upto": 7}, "source"),
    (lambda o: LogRecords.from_wire(o, 2), {"ok": True, "records": [record_map(l="x" * 65)], "upto": 7}, "leader"),
    (lambda o: LogRecords.from_wire(o, 2), {"ok": True, "records": [record_map(t=-1)], "upto": 7}, "step"),
    (StateAsk.from_wire, {"since": 1}, "empty"),
    (StateAsk.from_wire, "", "map"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0, float("nan")], "keys": b"", "leader": "a"}, "scale"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0, 0.0], "keys": b"", "leader": "a"}, "scale"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0.5, 1.0], "keys": b"", "leader": "a"}, "scale"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0], "keys": b"", "leader": "a"}, "scale"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0, 1.0], "keys": b"1234567", "leader": "a"}, "keys"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0, 1.0], "keys": b"\x00" * 8 * (MAX_CONTRIBUTORS + 1),
                           "leader": "a"}, "keys"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0, 1.0], "keys": struct.pack("<2q", 5, 3),
                           "leader": "a"}, "ascending"),
    (SpsaState.from_wire, {"ok": True, "step": 1, "scale": [0, 1.0], "keys": b"", "leader": ""}, "leader"),
    (SpsaState.from_wire, {"ok": True, "scale": [0, 1.0], "keys": b"", "leader": "a"}, "step"),
])
def test_a_bad_body_is_named(read, obj, what) -> None:
    with pytest.raises(BodyError, match=what):
        read(obj)


# ---------------------------------------------------------------------- what a receiver does with a bad one
CONFIG = NodeConfig(liveness=Liveness(probe_interval_s=0.2, suspicion_base_s=30.0), request_timeout_s=5.0)


def spsa_and_peer(make_node):
    node = make_node("inproc", config=CONFIG)
    torch.manual_seed(0)
    proto = get_protocol("spsa").create(node, nn.Sequential(nn.Linear(4, 2)), {"round_timeout_s": 5.0})
    peer = make_node("inproc", join=[node.address], config=CONFIG)  # speaks spsa's topics by hand
    assert wait_until(lambda: peer.peer_id in node.live_peers())
    return proto, peer


def test_a_malformed_state_request_is_refused_and_counted(make_node):
    proto, peer = spsa_and_peer(make_node)
    reply = peer.request(proto.me, STATE_TOPIC, {"give": "all"}, timeout_s=10.0)
    assert refusal_of(reply.body) is Refusal.MALFORMED and not reply.payload
    assert proto.node.stats.rejected["spsa.malformed"] == 1 and proto.counters["rejected.malformed"] == 1
    reply = peer.request(proto.me, STATE_TOPIC, StateAsk().to_wire(), timeout_s=10.0)
    assert SpsaState.from_wire(reply.body).leader == proto.me and reply.payload[0].numel() == proto.space.numel


@pytest.mark.parametrize("answer", [
    {"ok": True, "step": 50, "scale": [0, float("nan")], "keys": b"", "leader": "x"},
    {"ok": True, "step": 50, "scale": [0, 1.0], "keys": b"\x01", "leader": "x"},
    {"ok": True, "step": "50", "scale": [0, 1.0], "keys": b"", "leader": "x"},
])
def test_a_malformed_state_answer_changes_nothing(make_node, answer):
    proto, peer = spsa_and_peer(make_node)
    peer.on(STATE_TOPIC, lambda msg: Reply(answer, (torch.ones(proto.space.numel),)))
    before = (proto.step_count, proto.digest(), proto.scale.scale_log2, proto.scale.mean_abs, proto._lineage)
    proto._fetch_state(peer.peer_id, "a test")
    assert (proto.step_count, proto.digest(), proto.scale.scale_log2, proto.scale.mean_abs, proto._lineage) == before
    assert proto.counters["repairs"] == 0
