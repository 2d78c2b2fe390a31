"""State transfer in digest-checked chunks, including a source that dies mid-way."""
from __future__ import annotations

import asyncio
import os

import pytest
from conftest import wait_until

from starling.node.transfer import BlobServer, TransferConfig, TransferError

SMALL_CHUNKS = TransferConfig(chunk_bytes=64 << 10, chunk_timeout_s=2.0, chunks_in_flight=2)


def test_fetch_blob_in_chunks(make_node):
    a = make_node("tcp")
    b = make_node("tcp", join=[a.address])
    blob = os.urandom((3 << 20) + 123)  # not a multiple of the chunk size
    a.serve_blob("state", lambda: blob)
    peer, got = b.fetch_blob("state", config=TransferConfig(chunk_bytes=1 << 20))
    assert peer == a.peer_id and got == blob


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
