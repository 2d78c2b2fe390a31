"""A remote failure arrives as a typed exception with an error code, never as text to match."""
from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import wait_until

from starling.node import (
    BadRequestError,
    BusyError,
    ConfigConflictError,
    ErrorCode,
    HandlerError,
    NoHandlerError,
    Refusal,
    RefusedError,
    RemoteError,
    RpcError,
    SwarmConfigError,
    WireError,
    refusal,
    refusal_of,
)
from starling.node.hello import Hello
from starling.node.rpc import MAX_UNANSWERED, REPLY_TOPIC, ErrorBody, PendingRequests, RequestTimeout
from starling.node.wire import Message


def test_a_request_nobody_serves_raises_no_handler_with_its_code(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    with pytest.raises(NoHandlerError) as info:
        b.request(a.peer_id, "nobody-serves-this", None)
    err = info.value
    assert isinstance(err, RemoteError) and isinstance(err, RpcError)
    assert err.code is ErrorCode.NO_HANDLER and err.reason is None and err.peer == a.peer_id
    assert "handler_error" not in a.stats.snapshot()["rejected"]  # an answer, not a fault


def test_a_handler_that_raises_gives_a_handler_error_and_is_counted(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    a.on("broken", lambda msg: {}["missing"])
    with pytest.raises(HandlerError) as info:
        b.request(a.peer_id, "broken", None)
    assert info.value.code is ErrorCode.HANDLER_ERROR and "KeyError" in str(info.value)
    assert a.stats.snapshot()["rejected"]["handler_error"] == 1


def test_an_answer_the_wire_cannot_carry_is_a_handler_error_not_a_timeout(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    deep: object = 0
    for _ in range(100):
        deep = [deep]
    a.on("deep", lambda msg: deep)
    with pytest.raises(HandlerError, match="cannot be sent"):
        b.request(a.peer_id, "deep", None, timeout_s=5)
    assert a.stats.snapshot()["rejected"]["handler_error"] == 1


def test_a_handler_refuses_for_a_named_reason(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])

    def busy(msg):
        raise RefusedError(Refusal.BUSY, "come back later")

    a.on("busy", busy)
    with pytest.raises(RefusedError) as info:
        b.request(a.peer_id, "busy", None)
    err = info.value
    assert err.code is ErrorCode.REFUSED and err.reason is Refusal.BUSY and err.detail == "come back later"
    assert "handler_error" not in a.stats.snapshot()["rejected"]


def test_an_error_a_handler_got_from_a_third_peer_is_its_own_handler_error(make_node):
    """A no-handler from C, passed on by A's handler, must not read as "A has no handler"
    (a requester would wait for A's protocol to come up)."""
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    c = make_node("inproc", join=[a.address])
    assert wait_until(lambda: c.peer_id in a.live_peers())

    async def relay(msg):
        return (await a.arequest(c.peer_id, "nobody-serves-this", None)).body

    a.on("relay", relay)
    with pytest.raises(HandlerError) as info:
        b.request(a.peer_id, "relay", None)
    assert info.value.code is ErrorCode.HANDLER_ERROR


def test_a_conflicting_hello_is_answered_with_the_config_conflict_code(make_node):
    a = make_node("inproc", swarm_config={"protocol": "gossip"})
    b = make_node("inproc", join=[a.address])
    with pytest.raises(ConfigConflictError) as info:
        b.request(a.peer_id, "$hello", Hello.ours(b.record.to_wire(), {"protocol": "diloco"}, False).to_wire())
    assert info.value.code is ErrorCode.CONFIG_CONFLICT and a.swarm_config == {"protocol": "gossip"}
    # and a joiner turns that code into SwarmConfigError
    with pytest.raises(SwarmConfigError, match="protocol"):
        make_node("inproc", join=[a.address], swarm_config={"protocol": "diloco"})


def test_a_malformed_hello_is_a_bad_request_counted_by_its_reason(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    with pytest.raises(BadRequestError) as info:
        b.request(a.peer_id, "$hello", Hello.ours("not a record", None, False).to_wire())
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert a.stats.snapshot()["rejected"]["bad_field"] == 1


@pytest.mark.parametrize("body", [
    "just text",  # a bare string, not a typed error body
    {"message": "x"},
    {"code": 7, "message": "x", "reason": None},
    {"code": "x" * 65, "message": "x", "reason": None},
    {"code": "refused", "message": "x", "reason": None},  # a refusal names its reason
    {"code": "handler_error", "message": "x", "reason": "busy"},
    {"code": "no_handler", "message": 3, "reason": None},
    {"code": "busy", "message": "x", "reason": None, "data": ["not", "a", "map"]},
])
def test_a_malformed_error_reply_is_refused_on_the_wire(body):
    with pytest.raises(WireError) as info:
        ErrorBody.from_wire(body)
    assert info.value.reason.value == "bad_field"


@pytest.mark.parametrize("body, text", [
    ({"code": "gone_fishing", "message": "back at 5", "reason": None}, "gone_fishing: back at 5"),
    ({"code": "refused", "message": "not today", "reason": "bored"}, "bored: not today"),
])
def test_a_code_or_reason_of_a_later_release_reads_as_a_handler_error_with_its_words(body, text):
    """A requester fails with what a newer peer said instead of dropping the answer and waiting
    out its timeout."""
    error = ErrorBody.from_wire(body).exception("peer-x")
    assert type(error) is HandlerError and error.detail == text


def test_an_error_carries_its_data_map_and_old_peers_see_the_shape_they_know():
    wire = ErrorBody.of(BusyError("busy", data={"members": [1, 2]})).to_wire()
    assert wire["data"] == {"members": [1, 2]}
    again = ErrorBody.from_wire(wire).exception("peer-x")
    assert type(again) is BusyError and again.data == {"members": [1, 2]}
    assert set(ErrorBody.of(BusyError("busy")).to_wire()) == {"code", "message", "reason"}  # as 0.1.x sent it


def test_error_bodies_round_trip_to_their_exception_types():
    for exc, kind in [(NoHandlerError("no handler for 'x'"), NoHandlerError),
                      (BusyError("too many requests in flight"), BusyError),
                      (RefusedError(Refusal.LATE, "round 3 closed"), RefusedError),
                      (ConfigConflictError("protocol differs"), ConfigConflictError),
                      (ValueError("bad"), HandlerError)]:
        body = ErrorBody.from_wire(ErrorBody.of(exc).to_wire())
        again = body.exception("peer-x")
        assert type(again) is kind and again.peer == "peer-x"
        assert again.reason is (Refusal.LATE if kind is RefusedError else None)


def test_a_refusal_body_carries_its_code_its_text_and_its_extra_fields():
    body = refusal(Refusal.LATE, "the round already closed", step=7)
    assert body == {"ok": False, "code": "late", "reason": "late: the round already closed", "step": 7}
    assert refusal_of(body) is Refusal.LATE
    assert refusal_of({"ok": True}) is None and refusal_of({"ok": False, "code": "??"}) is None
    with pytest.raises(ValueError):
        refusal(Refusal.BUSY, code="other")


def test_a_reply_that_comes_after_its_request_timed_out_is_counted_late_not_rejected(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])

    answer = threading.Event()

    async def slow(msg):
        while not answer.is_set():  # answered only once the request has timed out
            await asyncio.sleep(0.01)
        return {"answered": True}

    a.on("slow", slow)
    with pytest.raises(RequestTimeout):
        b.request(a.peer_id, "slow", None, timeout_s=0.2)
    answer.set()
    assert wait_until(lambda: b.stats.snapshot()["late_replies"] == 1, timeout_s=10)
    assert b.stats.snapshot()["rejected"].get("bad_field", 0) == 0


def test_only_the_first_reply_to_a_request_that_ended_unanswered_from_its_own_peer_is_late():
    async def scenario() -> tuple[bool, ...]:
        pending = PendingRequests()
        rid, _ = pending.open("peer-a")
        answered, _ = pending.open("peer-a")
        pending.resolve(answered, Message(REPLY_TOPIC, "peer-a", 0, 0.0, None, (), 0), True, None)
        pending.drop(rid)  # timed out
        pending.drop(answered)  # ended with its reply: nothing is late for it
        return (pending.late(rid, "peer-b"), pending.late(rid + 100, "peer-a"), pending.late(answered, "peer-a"),
                pending.late(rid, "peer-a"), pending.late(rid, "peer-a"))

    assert asyncio.run(scenario()) == (False, False, False, True, False)


def test_requests_remembered_as_unanswered_are_bounded():
    async def scenario() -> tuple[bool, bool]:
        pending = PendingRequests()
        first, _ = pending.open("peer")
        pending.drop(first)
        for _ in range(MAX_UNANSWERED):
            rid, _ = pending.open("peer")
            pending.drop(rid)
        return pending.late(first, "peer"), pending.late(rid, "peer")

    assert asyncio.run(scenario()) == (False, True)
