"""State transfer: a peer fetches a named blob (e.g. the training state) from another
peer in chunks, each checked against a digest.

The server snapshots the blob when a transfer opens, so chunks of one transfer all
come from the same version even while training goes on. A source that dies mid-way
makes the fetch fail with TransferError; `fetch_from_any` then tries the next peer.
Built on the Node's public request API only.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starling.node.rpc import Refusal, RefusedError, Reply, RpcError

if TYPE_CHECKING:
    from starling.node.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

OPEN_TOPIC = "starling.xfer.open"
CHUNK_TOPIC = "starling.xfer.chunk"
BlobProvider = Callable[[], bytes | bytearray | memoryview]


class TransferError(Exception):
    """A transfer failed (source gone, timeout, digest mismatch, unknown blob)."""


@dataclass(frozen=True)
class TransferConfig:
    chunk_bytes: int = 1 << 20
    chunk_timeout_s: float = 10.0
    chunks_in_flight: int = 4  # pipelining hides one round trip per chunk
    snapshot_ttl_s: float = 300.0  # an abandoned snapshot is dropped after this
    max_snapshots: int = 8


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class _Snapshot:
    data: memoryview
    expires: float


class BlobServer:
    """Serves named blobs to peers. Providers run on the network thread: return a
    ready snapshot (bytes) quickly; the server keeps it until the transfer ends."""

    def __init__(self, node: Node, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self._providers: dict[str, BlobProvider] = {}
        self._snapshots: dict[int, _Snapshot] = {}
        self._tokens = itertools.count(1)
        node.on(OPEN_TOPIC, self._open)
        node.on(CHUNK_TOPIC, self._chunk)

    def publish(self, name: str, provider: BlobProvider) -> None:
        self._providers[name] = provider

    def _open(self, msg: Message) -> dict[str, Any]:
        name = msg.body.get("name") if isinstance(msg.body, dict) else None
        if not isinstance(name, str) or name not in self._providers:
            raise RefusedError(Refusal.NOT_FOUND, f"no blob named {name!r}")
        now = time.monotonic()
        for token in [t for t, s in self._snapshots.items() if s.expires < now]:
            del self._snapshots[token]
        if len(self._snapshots) >= self.config.max_snapshots:
            raise RefusedError(Refusal.BUSY, "too many transfers in progress; retry later")
        data = memoryview(bytes(self._providers[name]()))
        token = next(self._tokens)
        self._snapshots[token] = _Snapshot(data, now + self.config.snapshot_ttl_s)
        cb = self.config.chunk_bytes
        digests = [_digest(data[i:i + cb]) for i in range(0, len(data), cb)]
        return {"token": token, "size": len(data), "chunk_bytes": cb, "digest": _digest(data),
                "chunk_digests": digests}

    def _chunk(self, msg: Message) -> Reply:
        body = msg.body if isinstance(msg.body, dict) else {}
        token, index = body.get("token"), body.get("index")
        snap = self._snapshots.get(token) if isinstance(token, int) else None
        if snap is None or not isinstance(index, int) or index < 0:
            raise RefusedError(Refusal.NOT_FOUND, "unknown transfer or bad chunk index")
        cb = self.config.chunk_bytes
        chunk = snap.data[index * cb:(index + 1) * cb]
        if (index + 1) * cb >= len(snap.data):
            del self._snapshots[token]  # last chunk served: the transfer is over
        else:
            snap.expires = time.monotonic() + self.config.snapshot_ttl_s
        return Reply(None, (chunk,))


async def afetch(node: Node, peer: str, name: str, config: TransferConfig | None = None) -> bytes:
    """Fetch blob `name` from `peer`, verifying every chunk and the whole."""
    cfg = config or TransferConfig()
    try:
        meta = (await node.arequest(peer, OPEN_TOPIC, {"name": name}, timeout_s=cfg.chunk_timeout_s)).body
        size, cb, digests = int(meta["size"]), int(meta["chunk_bytes"]), list(meta["chunk_digests"])
        if cb <= 0 or len(digests) != (size + cb - 1) // cb:
            raise TransferError(f"{peer} sent inconsistent transfer metadata")
        out = bytearray(size)
        window = asyncio.Semaphore(cfg.chunks_in_flight)

        async def one(index: int) -> None:
            async with window:
                reply = await node.arequest(peer, CHUNK_TOPIC, {"token": meta["token"], "index": index},
                                            timeout_s=cfg.chunk_timeout_s)
            data = reply.payload[0] if reply.payload else b""
            if _digest(data) != digests[index]:
                raise TransferError(f"chunk {index} of {name!r} from {peer} failed its digest check")
            out[index * cb:index * cb + len(data)] = data

        await asyncio.gather(*(one(i) for i in range(len(digests))))
    except TransferError:
        raise
    except (RpcError, KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"transfer of {name!r} from {peer} failed: {exc}") from None
    if _digest(out) != meta["digest"]:
        raise TransferError(f"{name!r} from {peer} failed its digest check")
    return bytes(out)


async def afetch_from_any(node: Node, peers: Sequence[str], name: str,
                          config: TransferConfig | None = None) -> tuple[str, bytes]:
    """Try each peer in turn; returns (peer, blob). Raises TransferError if all fail."""
    errors = []
    for peer in peers:
        try:
            return peer, await afetch(node, peer, name, config)
        except TransferError as exc:
            log.warning("%s", exc)
            errors.append(str(exc))
    raise TransferError("no peer could supply " + repr(name) + ": " + "; ".join(errors or ["no peers"]))
