"""State transfer: a peer fetches a named blob (e.g. the training state) from another
peer in chunks, each checked against a digest.

The server snapshots the blob when a transfer opens, so chunks of one transfer all
come from the same version even while training goes on. A source that dies mid-way
makes the fetch fail with TransferError; `afetch_patiently` then tries the other peers,
and then tries them all again with backoff until its deadline.

What a requester can hold on a server is bounded (transfers are a resource a remote peer
can tie up; a member that opened every slot and left once blocked every joiner):
- at most `max_transfers_per_peer` open transfers per requesting peer (its authenticated
  id), and `max_transfers` in all; past either the open is refused as `Refusal.BUSY`,
  which a joiner tells apart from `Refusal.NOT_FOUND` (no such blob here);
- a transfer that asks for no chunk it has not asked for before within `idle_timeout_s`
  is dropped: only progress keeps a slot, so a transfer lives at most its chunk count
  times that, however it is driven;
- a requester that leaves or is declared dead loses its transfers at once.
Built on the Node's public request API only.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starling.node.membership import PeerStatus, PeerTable, StatusChange
from starling.node.rpc import NoHandlerError, Refusal, RefusedError, Reply, RpcError

if TYPE_CHECKING:
    from starling.node.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

OPEN_TOPIC = "starling.xfer.open"
CHUNK_TOPIC = "starling.xfer.chunk"
BlobProvider = Callable[[], bytes | bytearray | memoryview]


class TransferError(Exception):
    """A transfer failed (source gone, timeout, digest mismatch, unknown blob, busy source).

    `reason` is the source's named refusal when it refused (`Refusal.BUSY`: it serves the
    blob but has no slot free now; `Refusal.NOT_FOUND`: it has no such blob), else None."""

    def __init__(self, message: str, *, reason: Refusal | None = None) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TransferConfig:
    chunk_bytes: int = 1 << 20
    chunk_timeout_s: float = 10.0
    chunks_in_flight: int = 4  # pipelining hides one round trip per chunk
    # Serving: a transfer that asks for no new chunk this long is dropped (longer than a
    # requester's chunk timeout, so an honest one gives up first).
    idle_timeout_s: float = 15.0
    max_transfers: int = 8  # open at once, from everyone
    max_transfers_per_peer: int = 2  # open at once, from one requester
    # Fetching with a deadline: the wait between rounds over the peers doubles from
    # `retry_backoff_s` up to `retry_backoff_max_s`, each wait drawn from [1/2, 1] of that.
    retry_backoff_s: float = 1.0
    retry_backoff_max_s: float = 16.0

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.chunks_in_flight < 1:
            raise ValueError("chunk_bytes and chunks_in_flight must be >= 1")
        if not 1 <= self.max_transfers_per_peer <= self.max_transfers:
            raise ValueError(f"need 1 <= max_transfers_per_peer <= max_transfers, got "
                             f"{self.max_transfers_per_peer} and {self.max_transfers}")
        if not (self.idle_timeout_s > 0 and 0 < self.retry_backoff_s <= self.retry_backoff_max_s):
            raise ValueError("need idle_timeout_s > 0 and 0 < retry_backoff_s <= retry_backoff_max_s")


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class _Transfer:
    peer: str  # who opened it
    data: memoryview
    unserved: set[int]  # chunk indices not asked for yet; the transfer ends when none are left
    idle_until: float


class BlobServer:
    """Serves named blobs to peers. Providers run on the network thread: return a
    ready snapshot (bytes) quickly; the server keeps it until the transfer ends."""

    def __init__(self, node: Node, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self._providers: dict[str, BlobProvider] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._tokens = itertools.count(1)
        node.on(OPEN_TOPIC, self._open)
        node.on(CHUNK_TOPIC, self._chunk)
        node.on_peer_change(self._on_peer_change)

    def publish(self, name: str, provider: BlobProvider) -> None:
        self._providers[name] = provider

    def open_transfers(self) -> dict[str, int]:
        """Open transfers per requesting peer (call on the network thread, or for a glance)."""
        counts: dict[str, int] = {}
        for t in list(self._transfers.values()):
            counts[t.peer] = counts.get(t.peer, 0) + 1
        return counts

    def _open(self, msg: Message) -> dict[str, Any]:
        name = msg.body.get("name") if isinstance(msg.body, dict) else None
        if not isinstance(name, str) or name not in self._providers:
            raise RefusedError(Refusal.NOT_FOUND, f"no blob named {name!r}")
        self._drop_idle(time.monotonic())
        cfg = self.config
        mine = sum(1 for t in self._transfers.values() if t.peer == msg.sender)
        if mine >= cfg.max_transfers_per_peer:
            raise RefusedError(Refusal.BUSY, f"{mine} transfers of yours are open here (at most "
                                             f"{cfg.max_transfers_per_peer} per peer); finish or abandon one")
        if len(self._transfers) >= cfg.max_transfers:
            raise RefusedError(Refusal.BUSY, f"too many transfers in progress ({len(self._transfers)}); retry later")
        data = memoryview(bytes(self._providers[name]()))
        cb = cfg.chunk_bytes
        count = (len(data) + cb - 1) // cb
        token = next(self._tokens)
        if count:  # an empty blob has no chunk to ask for: nothing to hold
            self._transfers[token] = _Transfer(msg.sender, data, set(range(count)),
                                               time.monotonic() + cfg.idle_timeout_s)
            asyncio.get_running_loop().call_later(cfg.idle_timeout_s, self._expire, token)
        digests = [_digest(data[i:i + cb]) for i in range(0, len(data), cb)]
        return {"token": token, "size": len(data), "chunk_bytes": cb, "digest": _digest(data),
                "chunk_digests": digests}

    def _chunk(self, msg: Message) -> Reply:
        body = msg.body if isinstance(msg.body, dict) else {}
        token, index = body.get("token"), body.get("index")
        transfer = self._transfers.get(token) if isinstance(token, int) else None
        now = time.monotonic()
        if transfer is not None and (transfer.peer != msg.sender or transfer.idle_until < now):
            transfer = None  # another peer's, or lapsed and not yet swept
        cb = self.config.chunk_bytes
        if transfer is None or not isinstance(index, int) or not 0 <= index * cb < len(transfer.data):
            raise RefusedError(Refusal.NOT_FOUND, "unknown or expired transfer, or a bad chunk index")
        if index in transfer.unserved:  # progress: only a chunk not asked for before keeps the slot
            transfer.unserved.discard(index)
            transfer.idle_until = now + self.config.idle_timeout_s
        chunk = transfer.data[index * cb:(index + 1) * cb]
        if not transfer.unserved:
            del self._transfers[token]  # every chunk served: the transfer is over
        return Reply(None, (chunk,))

    def _expire(self, token: int) -> None:
        """One timer per transfer: drop it once idle, else look again when it could be."""
        transfer = self._transfers.get(token)
        if transfer is None:
            return
        left = transfer.idle_until - time.monotonic()
        if left > 0:
            asyncio.get_running_loop().call_later(left, self._expire, token)
            return
        del self._transfers[token]
        log.info("dropped an idle transfer opened by %s (%d chunks never asked for)", transfer.peer,
                 len(transfer.unserved))

    def _drop_idle(self, now: float) -> None:
        for token in [k for k, t in self._transfers.items() if t.idle_until < now]:
            del self._transfers[token]

    def _on_peer_change(self, change: StatusChange) -> None:
        if change.new in (PeerStatus.DEAD, PeerStatus.LEFT):
            gone = [k for k, t in self._transfers.items() if t.peer == change.peer_id]
            for token in gone:
                del self._transfers[token]
            if gone:
                log.info("dropped %d transfers of %s, which is %s", len(gone), change.peer_id, change.new.value)


MAX_CHUNK_BYTES = 1 << 26  # a chunk size a server may name (servers use TransferConfig.chunk_bytes)


async def afetch(node: Node, peer: str, name: str, config: TransferConfig | None = None,
                 max_bytes: int | None = None) -> bytes:
    """Fetch blob `name` from `peer`, verifying every chunk and the whole; a blob said to be
    larger than `max_bytes` (None: any size) is refused before anything is allocated."""
    cfg = config or TransferConfig()
    try:
        meta = (await node.arequest(peer, OPEN_TOPIC, {"name": name}, timeout_s=cfg.chunk_timeout_s)).body
        size, cb, digests = int(meta["size"]), int(meta["chunk_bytes"]), list(meta["chunk_digests"])
        if not 0 < cb <= MAX_CHUNK_BYTES or size < 0 or len(digests) != (size + cb - 1) // cb:
            raise TransferError(f"{peer} sent inconsistent transfer metadata")
        if max_bytes is not None and size > max_bytes:
            raise TransferError(f"{peer} offers {name!r} of {size} bytes, more than the {max_bytes} asked for")
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
        # a peer that serves no blobs at all lacks this one as surely as one that names it
        reason = Refusal.NOT_FOUND if isinstance(exc, NoHandlerError) else getattr(exc, "reason", None)
        raise TransferError(f"transfer of {name!r} from {peer} failed: {exc}", reason=reason) from None
    if _digest(out) != meta["digest"]:
        raise TransferError(f"{name!r} from {peer} failed its digest check")
    return bytes(out)


def fetch_candidates(table: PeerTable, peers: Sequence[str] | None, rng: random.Random) -> Callable[[], list[str]]:
    """Whom each round of a fetch asks: `peers`, or (None) every live peer of that moment, in
    random order so joiners spread over the swarm."""

    def candidates() -> list[str]:
        if peers is not None:
            return list(peers)
        live = [p.peer_id for p in table.live()]
        rng.shuffle(live)
        return live

    return candidates


async def afetch_patiently(node: Node, candidates: Callable[[], Sequence[str]], name: str,
                           config: TransferConfig | None = None, deadline_s: float = 0.0,
                           rng: random.Random | None = None,
                           stop: threading.Event | None = None, max_bytes: int | None = None) -> tuple[str, bytes]:
    """Fetch `name` from whichever peer can supply it: each of `candidates()` in turn, then,
    until `deadline_s` has passed, every peer again in rounds after a backoff that doubles
    (with jitter: joiners turned away together do not come back together). A busy source,
    one that failed mid-way and one that lacks the blob are all retried: a peer that has not
    built its state yet serves it a moment later. The first round tries every peer whatever
    the deadline; `stop` (set by another thread) ends the waiting at once. Returns (peer,
    blob); raises TransferError saying how many peers and attempts were tried."""
    cfg = config or TransferConfig()
    rng = rng or random.Random()
    loop = asyncio.get_running_loop()
    started = loop.time()
    give_up_at = started + deadline_s
    rounds, attempts, tried = 0, 0, set()
    last: dict[str, TransferError] = {}
    while True:
        rounds += 1
        peers = list(candidates())
        for peer in peers:
            if rounds > 1 and (loop.time() >= give_up_at or _stopped(stop)):
                break
            attempts += 1
            tried.add(peer)
            try:
                return peer, await afetch(node, peer, name, cfg, max_bytes)
            except TransferError as exc:
                log.log(logging.INFO if exc.reason is Refusal.BUSY else logging.WARNING, "%s", exc)
                last[peer] = exc
        left = give_up_at - loop.time()
        if left <= 0 or _stopped(stop):
            break
        wait = min(left, rng.uniform(0.5, 1.0) * min(cfg.retry_backoff_max_s, cfg.retry_backoff_s * 2 ** (rounds - 1)))
        log.warning("%s: no peer could supply %r in round %d (%s); trying again in %.1f s (%.0f s left)",
                    node.peer_id, name, rounds, _outcomes(peers, last), wait, left)
        resume_at = loop.time() + wait
        while not _stopped(stop) and (pause := resume_at - loop.time()) > 0:
            await asyncio.sleep(min(pause, 0.1) if stop is not None else pause)
    elapsed = loop.time() - started
    errors = [str(e) for e in last.values()]
    if len(errors) > 3:
        errors[3:] = [f"and {len(errors) - 3} more"]
    why = "stopped" if _stopped(stop) else _outcomes(list(last), last)
    detail = "; ".join(errors) or "no peers to fetch from"
    all_busy = bool(last) and all(e.reason is Refusal.BUSY for e in last.values())
    raise TransferError(f"no peer could supply {name!r}: {attempts} attempts on {len(tried)} peers in "
                        f"{rounds} rounds over {elapsed:.1f} s ({why}): {detail}",
                        reason=Refusal.BUSY if all_busy else None)


def _stopped(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


def _outcomes(peers: list[str], errors: dict[str, TransferError]) -> str:
    """'2 busy, 1 without it, 1 failed', of `peers` in their last attempt."""
    if not peers:
        return "no peers"
    busy = sum(1 for p in peers if errors[p].reason is Refusal.BUSY)
    missing = sum(1 for p in peers if errors[p].reason is Refusal.NOT_FOUND)
    failed = len(peers) - busy - missing
    parts = [f"{busy} busy" if busy else "", f"{missing} without it" if missing else "",
             f"{failed} failed" if failed else ""]
    return ", ".join(x for x in parts if x)
