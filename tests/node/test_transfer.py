"""State transfer in digest-checked chunks, including a source that dies mid-way, and requesters
that try to hold a source's transfer slots."""
from __future__ import annotations

import asyncio
import logging
import os
import threading

import pytest
from conftest import TEST_LIVENESS, wait_until

from starling.node.node import Node, NodeConfig
from starling.node.rpc import Refusal, RefusedError
from starling.node.transfer import CHUNK_TOPIC, OPEN_TOPIC, BlobServer, TransferConfig, TransferError

SMALL_CHUNKS = TransferConfig(chunk_bytes=64 << 10, chunk_timeout_s=2.0, chunks_in_flight=2)


def test_fetch_blob_in_chunks(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    blob = os.urandom((3 << 20) + 123)  # not a multiple of the chunk size
    a.serve_blob("state", lambda: blob)
    peer, got = b.fetch_blob("state", config=TransferConfig(chunk_bytes=1 << 20))
    assert peer == a.peer_id and got == blob


def test_a_blob_over_the_size_asked_for_is_refused_before_it_is_fetched(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    a.serve_blob("big", lambda: b"x" * 5000)
    with pytest.raises(TransferError, match="more than the 4096 asked for"):
        b.fetch_blob("big", peers=[a.peer_id], max_bytes=4096)
    assert b.fetch_blob("big", peers=[a.peer_id], max_bytes=5000)[1] == b"x" * 5000


def test_empty_blob_and_unknown_name(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    a.serve_blob("empty", lambda: b"")
    assert b.fetch_blob("empty")[1] == b""
    with pytest.raises(TransferError, match="no blob named"):
        b.fetch_blob("missing", peers=[a.peer_id])


def test_source_dying_mid_transfer_fails_cleanly_then_retry_elsewhere(make_node):
    src = make_node("tcp")
    backup = make_node("tcp", join=[src.address])
    joiner = make_node("tcp", join=[src.address])
    assert wait_until(lambda: len(joiner.live_peers()) == 2)
    blob = os.urandom(2 << 20)
    backup.serve_blob("state", lambda: blob)
    server = BlobServer(src, SMALL_CHUNKS)
    server.publish("state", lambda: blob)
    served = []
    original = server._chunk

    def chunk_then_die(msg):
        served.append(msg.body["index"])
        if len(served) == 3:  # the source crashes after serving a few chunks
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(src._aclose()))
        return original(msg)

    src._handlers["starling.xfer.chunk"] = (chunk_then_die, False)
    with pytest.raises(TransferError, match=src.peer_id):
        joiner.fetch_blob("state", peers=[src.peer_id], config=SMALL_CHUNKS)
    peer, got = joiner.fetch_blob("state", peers=[src.peer_id, backup.peer_id], config=SMALL_CHUNKS)
    assert peer == backup.peer_id and got == blob


def test_corrupted_chunk_is_detected(make_node):
    a = make_node("inproc")
    b = make_node("inproc", join=[a.address])
    server = BlobServer(a, SMALL_CHUNKS)
    server.publish("state", lambda: b"x" * 200_000)
    original = server._chunk

    def corrupt(msg):
        reply = original(msg)
        return type(reply)(reply.body, (bytes(reply.payload[0])[:-1] + b"y",))

    a._handlers["starling.xfer.chunk"] = (corrupt, False)
    with pytest.raises(TransferError, match="digest"):
        b.fetch_blob("state", peers=[a.peer_id], config=SMALL_CHUNKS)


# ---------------------------------------------------------------- hostile requesters
def _serving(make_node, blob: bytes, **transfer) -> Node:
    """A tcp node serving `blob` as "state", with its own transfer limits."""
    config = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0,
                        transfer=TransferConfig(chunk_bytes=64 << 10, **transfer))
    node = make_node("tcp", config=config)
    node.serve_blob("state", lambda: blob)
    return node


def _open_many(requester: Node, server: Node, count: int) -> tuple[int, list[Refusal | None]]:
    opened, refused = 0, []
    for _ in range(count):
        try:
            requester.request(server.peer_id, OPEN_TOPIC, {"name": "state"})
            opened += 1
        except RefusedError as exc:
            refused.append(exc.reason)
    return opened, refused


def test_a_member_that_opens_every_transfer_and_leaves_blocks_no_joiner(make_node):
    """A member opens 8 transfers and leaves: a joiner must not find the source "too busy"
    (for 300 s, were the slots held). One peer holds at most its share, and leaving frees it."""
    blob = os.urandom(1 << 20)
    a = _serving(make_node, blob)
    mallory = make_node("tcp", join=[a.address])
    opened, refused = _open_many(mallory, a, 8)
    assert opened == 2 and refused == [Refusal.BUSY] * 6  # typed: busy, not "no such blob"
    assert a._blobs.open_transfers() == {mallory.peer_id: 2}
    joiner = make_node("tcp", join=[a.address])
    assert joiner.fetch_blob("state", peers=[a.peer_id]) == (a.peer_id, blob)
    mallory.leave()
    assert wait_until(lambda: a._blobs.open_transfers() == {})


def test_silent_members_holding_every_slot_delay_a_joiner_only_until_their_slots_idle_out(make_node, caplog):
    blob = os.urandom(300_000)
    a = _serving(make_node, blob, idle_timeout_s=1.0, max_transfers=4, max_transfers_per_peer=2)
    squatters = [make_node("tcp", join=[a.address]) for _ in range(2)]
    for squatter in squatters:
        assert _open_many(squatter, a, 2) == (2, [])  # then silent: members still, asking for nothing
    joiner = make_node("tcp", join=[a.address])
    assert wait_until(lambda: len(joiner.live_peers()) == 3)
    patient = TransferConfig(chunk_bytes=64 << 10, retry_backoff_s=0.2, retry_backoff_max_s=1.0)
    with caplog.at_level(logging.INFO, logger="starling.node.transfer"):
        peer, got = joiner.fetch_blob("state", config=patient, deadline_s=120)  # every live peer, again and again
    assert (peer, got) == (a.peer_id, blob)
    retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert retries and "1 busy, 2 without it" in retries[0]  # the squatters serve no state
    assert set(a._blobs.open_transfers()) <= {joiner.peer_id}


def test_a_joiner_gives_up_at_its_deadline_and_says_what_it_tried(make_node):
    a = _serving(make_node, b"x" * 100_000, idle_timeout_s=60.0, max_transfers=2)
    squatter = make_node("tcp", join=[a.address])
    assert _open_many(squatter, a, 2) == (2, [])
    joiner = make_node("tcp", join=[a.address])
    patient = TransferConfig(retry_backoff_s=0.1, retry_backoff_max_s=0.2)
    with pytest.raises(TransferError, match=r"attempts on 1 peers in \d+ rounds") as info:
        joiner.fetch_blob("state", peers=[a.peer_id], config=patient, deadline_s=1.0)
    assert info.value.reason is Refusal.BUSY and "1 busy" in str(info.value)


def test_stop_ends_a_patient_fetch_at_once(make_node, caplog):
    a = _serving(make_node, b"x" * 100_000, idle_timeout_s=60.0, max_transfers=2)
    squatter = make_node("tcp", join=[a.address])
    assert _open_many(squatter, a, 2) == (2, [])
    joiner = make_node("tcp", join=[a.address])
    stop, outcome = threading.Event(), []

    def fetch() -> None:
        try:
            joiner.fetch_blob("state", peers=[a.peer_id], deadline_s=600, stop=stop)
        except TransferError as exc:
            outcome.append(exc)

    with caplog.at_level(logging.INFO, logger="starling.node.transfer"):
        worker = threading.Thread(target=fetch)
        worker.start()
        assert wait_until(lambda: any("trying again" in r.getMessage() for r in caplog.records))
        stop.set()
        worker.join(30)
    assert not worker.is_alive() and len(outcome) == 1 and "(stopped)" in str(outcome[0])


def test_only_progress_keeps_a_transfer_open(make_node):
    """Asking for the same chunk again and again does not hold a slot past its idle timeout."""
    a = _serving(make_node, b"y" * 200_000, idle_timeout_s=0.5)
    b = make_node("tcp", join=[a.address])
    token = b.request(a.peer_id, OPEN_TOPIC, {"name": "state"}).body["token"]

    def refused() -> bool:
        try:
            b.request(a.peer_id, CHUNK_TOPIC, {"token": token, "index": 0})
            return False
        except RefusedError as exc:
            return exc.reason is Refusal.NOT_FOUND

    assert wait_until(refused, timeout_s=30, interval_s=0.1)
    assert a._blobs.open_transfers() == {}


def test_a_transfer_serves_only_the_peer_that_opened_it(make_node):
    a = _serving(make_node, b"z" * 100_000)
    b = make_node("tcp", join=[a.address])
    c = make_node("tcp", join=[a.address])
    token = b.request(a.peer_id, OPEN_TOPIC, {"name": "state"}).body["token"]
    assert wait_until(lambda: c.peer_id in a.live_peers())
    with pytest.raises(RefusedError) as info:
        c.request(a.peer_id, CHUNK_TOPIC, {"token": token, "index": 0})
    assert info.value.reason is Refusal.NOT_FOUND


def test_transfer_limits_are_checked():
    with pytest.raises(ValueError, match="max_transfers_per_peer"):
        TransferConfig(max_transfers=2, max_transfers_per_peer=3)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        TransferConfig(idle_timeout_s=0)
