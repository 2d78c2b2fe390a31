"""Bounds on the work other processes can make a node do: requests in flight per connection
and per process, rates for strangers, and stats that stay bounded (node.admission)."""
from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
from conftest import raw_dealer, wait_until

from starling.node import BusyError, ErrorCode, Identity, NodeConfig
from starling.node.admission import Admission, AdmissionConfig, ProcessLoad, TokenBucket
from starling.node.client import ClientError, query
from starling.node.rpc import REQUEST_TOPIC, parse_reply, request_body
from starling.node.stats import OTHERS, STRANGERS, NodeStats
from starling.node.wire import decode, encode

from conftest import TEST_LIVENESS  # isort: skip


async def _slow(msg) -> str:
    await asyncio.sleep(1.0)
    return "done"


def _replies(sock: zmq.Socket, count: int, timeout_s: float = 10.0) -> list[tuple[int, bool, object]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < deadline:
        if sock.poll(100):
            out.append(parse_reply(decode(sock.recv_multipart())))
    return out


# ------------------------------------------------------------------ the bounds themselves
def test_caps_on_requests_in_flight_per_connection_for_strangers_and_per_process():
    cfg = AdmissionConfig(requests_per_connection=3, stranger_requests_per_connection=1,
                          stranger_requests_per_process=2, requests_per_process=5)
    load = ProcessLoad()
    a, b = Admission(cfg, load), Admission(cfg, load)  # two nodes of one process
    assert a.admit(b"s1", member=False) is None
    assert a.admit(b"s1", member=False) == "connection"
    assert b.admit(b"s2", member=False) is None
    assert a.admit(b"s3", member=False) == "strangers"  # the process's strangers, across nodes
    assert [a.admit(b"m", member=True) for _ in range(4)] == [None, None, None, "connection"]
    assert b.admit(b"m2", member=True) == "process"  # 2 strangers + 3 members
    a.release(b"m", member=True)
    assert b.admit(b"m2", member=True) is None
    for adm, route, member in [(a, b"s1", False), (b, b"s2", False), (a, b"m", True), (a, b"m", True),
                               (b, b"m2", True)]:
        adm.release(route, member)
    assert load == ProcessLoad() and a.in_flight() == b.in_flight() == 0


def test_a_strangers_connection_spends_its_own_bucket_and_the_nodes():
    clock = [0.0]
    cfg = AdmissionConfig(stranger_rate_per_s=2, stranger_burst=3, strangers_rate_per_s=1, strangers_burst=5)
    adm = Admission(cfg, ProcessLoad(), clock=lambda: clock[0])
    assert adm.readable(b"r")  # a connection never charged is read
    assert [adm.charge(b"r") for _ in range(4)] == [True, True, True, False]
    assert not adm.readable(b"r")  # dropped unread until it refills
    clock[0] += 0.5
    assert adm.readable(b"r") and adm.charge(b"r") and not adm.readable(b"r")
    # another connection has a bucket of its own, but all strangers share the node's 5
    assert [adm.charge(b"other") for _ in range(2)] == [True, False]
    clock[0] += 1.0
    assert adm.charge(b"third")


def test_stranger_buckets_are_bounded_and_waste_pauses_every_batch():
    adm = Admission(AdmissionConfig(tracked_connections=2, waste_batch=3), ProcessLoad())
    for route in (b"a", b"b", b"c"):
        adm.charge(route)
    assert adm.tracked == 2
    assert [adm.wasted() for _ in range(6)] == [False, False, True, False, False, True]


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst():
    bucket = TokenBucket(rate=10, burst=2, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [True, True, False]
    assert bucket.take(0.1) and not bucket.take(0.1)
    assert bucket.has(100.0) and bucket.tokens == 2


def test_stats_keep_entries_for_so_many_peers_and_topics_then_one_more():
    stats = NodeStats(max_peers=2, max_topics=2)
    for peer in ("p1", "p2", "p3", "p4"):
        stats.count_received(peer, "t", 1)
    for topic in ("a", "b", "c", "d"):
        stats.count_sent("p1", topic, 1)
    snap = stats.snapshot()
    assert snap["bytes_received"] == {"p1": {"t": 1}, "p2": {"t": 1}, OTHERS: {"t": 2}}
    assert snap["bytes_sent"] == {"p1": {"a": 1, "b": 1, OTHERS: 2}}


def test_stats_for_no_peer_apart_keep_exact_totals_and_refuse_a_negative_cap():
    """What a simulator runs its nodes with: every peer's bytes under one entry, by topic."""
    stats = NodeStats(max_peers=0)
    for peer in ("p1", "p2", "p3"):
        stats.count_sent(peer, "t", 2)
        stats.count_received(peer, "u", 3)
    snap = stats.snapshot()
    assert snap["bytes_sent"] == {OTHERS: {"t": 6}} and snap["bytes_received"] == {OTHERS: {"u": 9}}
    assert stats.total_sent() == 6 and stats.total_received("u") == 9 and snap["messages_sent"] == 3
    with pytest.raises(ValueError, match="max_peers"):
        NodeStats(max_peers=-1)


# ------------------------------------------------------------------ on a live node
def test_a_stranger_past_its_cap_is_answered_busy_and_a_member_is_not(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    a.on("slow", _slow, public=True)
    sock = raw_dealer(a.address)
    try:
        for rid in range(1, 7):
            sock.send_multipart(encode(REQUEST_TOPIC, "stranger", rid, request_body("slow", rid, None)))
        replies = _replies(sock, 6)
    finally:
        sock.close()
    assert sorted(rid for rid, ok, _ in replies if ok) == [1, 2, 3, 4]  # stranger_requests_per_connection
    busy = [body for _, ok, body in replies if not ok]
    assert len(busy) == 2 and all(body.code is ErrorCode.BUSY for body in busy)
    assert a.stats.snapshot()["rejected"]["busy"] == 2
    # a member's twenty at once all run
    futures = [b.submit(b.arequest(a.peer_id, "slow", None, timeout_s=20)) for _ in range(20)]
    assert [f.result(30).body for f in futures] == ["done"] * 20


def test_a_member_past_its_cap_gets_a_typed_busy_error(make_node):
    config = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0,
                        admission=AdmissionConfig(requests_per_connection=2))
    a = make_node("tcp", config=config)
    b = make_node("tcp", join=[a.address])
    a.on("slow", _slow)
    futures = [b.submit(b.arequest(a.peer_id, "slow", None, timeout_s=20)) for _ in range(3)]
    errors = [f.exception(30) for f in futures]
    assert sum(e is None for e in errors) == 2
    refused = [e for e in errors if e is not None]
    assert len(refused) == 1 and isinstance(refused[0], BusyError) and refused[0].code is ErrorCode.BUSY


def test_a_stranger_pipelining_status_is_rate_limited_and_a_member_is_still_answered(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    sock = raw_dealer(a.address)
    frames = encode(REQUEST_TOPIC, "flooder", 0, request_body("$status", 1, None))
    start = time.monotonic()
    try:
        for _ in range(2000):
            sock.send_multipart(frames)
        assert wait_until(lambda: a.stats.snapshot()["rejected"].get("rate_limited", 0) > 1000)
        t0 = time.monotonic()
        assert query(a.address, identity=b.identity, timeout_s=5)["id"] == a.peer_id
        assert time.monotonic() - t0 < 2.0
        answered = len(_replies(sock, 2000, timeout_s=1.0))
    finally:
        sock.close()
    cfg = a.config.admission
    assert answered <= cfg.stranger_burst + cfg.stranger_rate_per_s * (time.monotonic() - start) + 1


def _paths(value: object, prefix: str = "") -> set[str]:
    """Every leaf of a status as its path of keys and list indices."""
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in _paths(v, f"{prefix}/{k}")}
    if isinstance(value, list):
        return {p for i, v in enumerate(value) for p in _paths(v, f"{prefix}[{i}]")}
    return {prefix}


def test_a_node_that_counts_no_peer_apart_sums_its_members_bytes_under_one_entry(make_node):
    a = make_node("tcp", config=NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0, stats_peers=0))
    b = make_node("tcp", join=[a.address])
    query(a.address, identity=b.identity, timeout_s=5)
    snap = a.stats.snapshot()
    assert set(snap["bytes_received"]) == {OTHERS} and set(snap["bytes_sent"]) == {OTHERS}, snap
    assert a.stats.total_received() > 0 and a.stats.total_sent() > 0


def test_stats_keep_no_entry_per_stranger(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    query(a.address, timeout_s=5)  # the first stranger adds its topic under STRANGERS
    before = query(a.address, identity=b.identity, timeout_s=5)
    strangers = [Identity.generate() for _ in range(30)]
    for stranger in strangers:  # each with a fresh identity, as `starling node status` does
        query(a.address, identity=stranger, timeout_s=5)
    received = a.stats.snapshot()["bytes_received"]
    assert set(received) == {b.peer_id, STRANGERS}
    assert set(received[STRANGERS]) == {"$hello", "$status"}  # b joined as a stranger
    after = query(a.address, identity=b.identity, timeout_s=5)
    text = msgpack.packb(after)
    assert not any(s.peer_id.encode() in text for s in strangers)  # no stranger is named anywhere
    # Entries the member's own traffic adds meanwhile (its probes, this query's reply) may
    # appear, more of them on a loaded box; one per stranger would be 30.
    added = _paths(after) - _paths(before)
    assert len(added) < len(strangers), sorted(added)
    assert len(text) < len(msgpack.packb(before)) + 30 * 16, sorted(added)  # 16: a peer id's bytes


def test_a_client_refused_as_busy_says_so(make_node):
    config = NodeConfig(liveness=TEST_LIVENESS, admission=AdmissionConfig(strangers_burst=1,
                                                                          strangers_rate_per_s=0.01))
    a = make_node("tcp", config=config)
    query(a.address, timeout_s=5)
    with pytest.raises(ClientError, match="busy"):
        query(a.address, timeout_s=5)
