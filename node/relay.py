"""Relays: how two clients (peers nobody can dial) talk, through a peer both can reach.

A client C with a message for another client D seals the message's frames for D and sends
them to a relay R (a reachable peer whose record offers to relay) as `$relay`
[D, nonce] + ciphertext. R forwards the ciphertext untouched to D as `$relayed` [C, nonce],
down the connection D opened to it. R learns nothing but the two ids and the size.

Sealing is AES-256-GCM under a key only C and D hold: HKDF-SHA256 over the X25519 agreement
of their curve keys (the same keys their records carry, signed), one key for each direction.
The associated data binds the source and the destination, so a relay that flips a byte,
swaps the claimed source, or sends a sealed message to someone else gets a message that
fails to open: it is rejected, counted (`relay_tampered`), and nothing reaches a handler.

Replays. A nonce is one 96-bit number that grows with every message a node seals: its
record's incarnation (the wall-clock nanosecond it started) shifted up 32 bits, plus a
counter that is the milliseconds since then, or one more than the last if that is more (two
messages in a millisecond, a clock stepped back). So a nonce says when it was sealed, to the
millisecond, unless its source seals more than a thousand a second for long enough to run
its counter ahead of its clock. The destination keeps, per
source peer, the highest nonce it opened and a bitmask of the `replay_window` below it; a
nonce seen before, or too far behind, is refused (`replayed`). A nonce at or below the
source's current incarnation (as its signed record in the table says) was sealed by an
earlier run of that peer and is refused too, whatever state the destination kept. Windows
are kept per source, so no other sender can push one out. They are as many as the sources in
the peer table: a source the table forgets leaves its highest nonce behind, below which
nothing from it is taken again. Of those marks the last `max_keys` are kept; when one goes,
the time it was left (less `REPLAY_SKEW_S` for the clocks' disagreement) becomes a floor:
from any source with no mark here, what was sealed before it is refused. The table forgets
a departed peer `forget_after_s` after it left, so everything such a peer sealed lies below
the floor its mark leaves when it goes, however many sources pushed it out: no bound on
memory decides a replay. (An honest source with no mark here is unaffected: it seals now.)

Which relay: a client names the relays it holds connections to in its heartbeat meta
(`$via`). A sender picks the first of D's relays that is alive; if the send to it fails it
tries the next, so a relay that dies costs the messages in flight through it (their
requests time out and are retried as any lost message) and nothing more.

What a member can make a relay do is bounded:

- **Where.** A relay forwards only to a client (a record with no addresses) that holds a
  connection to it and has spoken on it, down that connection. A reachable member, a peer
  that is not live, or a client attached elsewhere is refused at once (`no_route`); the
  relay never dials anyone to forward. So a forward never waits: it is handed to ZeroMQ
  without blocking, or dropped.
- **How many at once.** Forwards in flight are capped (`max_forwarding`), and each source
  may hold at most `max_forwarding / (sources in flight + 1)` of them (at least one), so
  there is always room for one more source. Past either, `busy`.
- **How many bytes per client.** ZeroMQ does not say when a message has left its queue, so
  the relay counts the bytes it has handed out for each client and not yet seen read:
  `max_queued_bytes` and `max_queued_messages` per client (`busy` past them; a message bigger
  than the bound is refused whole). Bytes count as read once the client answers a probe the
  relay sent after them: `$relay_probe` carries a random token down the same connection, in
  order behind the forwarded messages, and only a client that has read up to it can echo it
  (`$relay_read`). A client that never reads pins at most the bound; a slow one is forwarded
  as fast as it proves it reads. Within one client's bound, a source that already holds some
  of it may hold at most `1 / (sources holding + 1)` of the bytes and of the messages, so one
  sender cannot take a client's whole queue from the others.

Every refusal is counted twice: by its wire reason in the node's stats (`no_route`, `busy`,
`replayed`, ...) and by its cause in `Relay.refused`, which `node status` shows under
`relaying`.
"""
from __future__ import annotations

import math
import os
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from starling.node.dispatch import Dispatcher
from starling.node.local import LocalPeer
from starling.node.membership import PeerStatus, PeerTable
from starling.node.outbox import Outbox, Spawn, UnknownPeerError
from starling.node.relay_delivery import ACK, ACKS, Deliveries
from starling.node.transport import SendError
from starling.node.wire import Message, RejectReason, WireError

RELAY, RELAYED = "$relay", "$relayed"
PROBE, READ = "$relay_probe", "$relay_read"  # relay -> client: read up to here?  client -> relay: yes
VIA = "$via"  # heartbeat meta of a client: the relays it is attached to, comma-separated
NONCE_BYTES = 12  # one big-endian number: the sealer's incarnation << COUNTER_BITS, plus a counter (see "Replays")
COUNTER_BITS = 32
# How far two peers' clocks may disagree and a forgotten source's floor still hold (see
# "Replays"): well under the table's `forget_after_s`, well over what NTP leaves.
REPLAY_SKEW_S = 10.0
TOKEN_BYTES = 8  # a probe's token
SEALED_ACK = b"\0ack"  # an acknowledgement sealed through a relay: this, then the nonce it acknowledges
TAG_BYTES = 16
_LEN = struct.Struct("<I")
_KDF_INFO = b"starling relay v2"

# Causes of a relay's refusals, the keys of `Relay.refused`.
NOT_A_RELAY = "not_a_relay"  # this node offers no relaying
NOT_LIVE = "not_live"  # the destination is no live member (or is the sender)
NOT_A_CLIENT = "not_a_client"  # the destination can be dialled: a relay forwards only to clients
NOT_ATTACHED = "not_attached"  # the destination holds no connection to this relay
FORWARDS = "forwards"  # forwards in flight: all of them, or the source's share
QUEUE_FULL = "queue_full"  # the destination's queued bytes or messages: all of them, or the source's share
TOO_LARGE = "too_large"  # a message bigger than a client's whole queue
REFUSALS = (NOT_A_RELAY, NOT_LIVE, NOT_A_CLIENT, NOT_ATTACHED, FORWARDS, QUEUE_FULL, TOO_LARGE)


@dataclass(frozen=True)
class RelayConfig:
    max_forwarding: int = 256  # forwards in flight at a relay; past it `$relay` is dropped
    max_relays: int = 3  # relays a client names in `$via`
    max_keys: int = 4096  # pair keys kept (derivation is an X25519 agreement plus HKDF); forgotten sources' marks
    replay_window: int = 4096  # nonces this far below a source's highest are refused
    max_queued_bytes: int = 16 << 20  # sealed bytes a relay has handed out for one client, not yet seen read
    max_queued_messages: int = 256  # messages of those (below ZeroMQ's 1000 a connection: a reader loses none)
    probe_interval_s: float = 0.25  # a probe unanswered this long is followed by another
    max_probes: int = 8  # probes awaiting an answer, per client
    # A relayed message unacknowledged after ack_timeout_s, plus a second per ack_bytes_per_s
    # of it, goes to the next relay (`node.relay_delivery`).
    ack_timeout_s: float = 2.0
    ack_bytes_per_s: float = 1e6
    max_unacked: int = 1024  # messages awaiting an acknowledgement; past it the oldest is given up
    max_unacked_bytes: int = 64 << 20
    drop_halflife_s: float = 60.0  # a relay's drops, as its senders count them, halve this often

    def __post_init__(self) -> None:
        for name in ("max_forwarding", "max_relays", "max_keys", "replay_window", "max_queued_bytes",
                     "max_queued_messages", "max_probes", "max_unacked", "max_unacked_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RelayConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("probe_interval_s", "ack_timeout_s", "ack_bytes_per_s", "drop_halflife_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"RelayConfig.{name} must be a finite number > 0, got {value!r}")


def pack_frames(frames: list[Any]) -> bytes:
    """Frames as one buffer: a count, each length, then the bytes, all little-endian u32."""
    views = [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in frames]
    head = _LEN.pack(len(views)) + b"".join(_LEN.pack(v.nbytes) for v in views)
    return b"".join([head, *views])


def unpack_frames(data: bytes | memoryview, max_frames: int) -> list[memoryview]:
    """The inverse of `pack_frames`; raises WireError on a count or a length that does not fit."""
    view = memoryview(data)
    if view.nbytes < 4:
        raise WireError(RejectReason.MALFORMED, "sealed message shorter than its frame count")
    (count,) = _LEN.unpack_from(view, 0)
    if not 0 < count <= max_frames + 1 or view.nbytes < 4 + 4 * count:
        raise WireError(RejectReason.MALFORMED, f"sealed message claims {count} frames")
    lengths = [_LEN.unpack_from(view, 4 + 4 * i)[0] for i in range(count)]
    offset = 4 + 4 * count
    if offset + sum(lengths) != view.nbytes:
        raise WireError(RejectReason.MALFORMED, "sealed message's frame lengths do not add up to its size")
    frames = []
    for n in lengths:
        frames.append(view[offset:offset + n])
        offset += n
    return frames


@dataclass(frozen=True)
class Sealed:
    """A sealed message on its way through a relay: `$relay` [dest, nonce] from the source to
    the relay (`peer` is the destination), `$relayed` [src, nonce] from the relay to the
    destination (`peer` is the source); the ciphertext rides as the one payload frame, so the
    relay forwards it without a copy."""

    peer: str
    nonce: bytes
    sealed: bytes | memoryview

    def to_wire(self) -> tuple[list[Any], list[bytes | memoryview]]:
        """(body, payload) of the message."""
        return [self.peer, self.nonce], [self.sealed]

    @classmethod
    def from_wire(cls, msg: Message) -> Sealed:
        """Read a `$relay` or `$relayed` message; WireError (bad_field) if malformed."""
        body, payload = msg.body, msg.payload
        if (not isinstance(body, list) or len(body) != 2 or not isinstance(body[0], str)
                or not isinstance(body[1], bytes) or len(payload) != 1 or not isinstance(payload[0], memoryview)):
            who = "dest" if msg.topic == RELAY else "src"
            raise WireError(RejectReason.BAD_FIELD, f"{msg.topic} body must be [{who}, nonce] and one bytes frame",
                            field="body")
        if len(body[1]) != NONCE_BYTES:
            raise WireError(RejectReason.BAD_FIELD, f"relay nonce must be {NONCE_BYTES} bytes", field="body")
        return cls(body[0], body[1], payload[0])


@dataclass(frozen=True)
class ProbeToken:
    """`$relay_probe` [token] from a relay to a client, and the client's `$relay_read` [token]
    echoing it once it has read everything forwarded before it."""

    token: bytes

    def to_wire(self) -> list[bytes]:
        return [self.token]

    @classmethod
    def from_wire(cls, msg: Message) -> ProbeToken:
        """Read a probe or its echo; WireError (bad_field) if malformed."""
        body = msg.body
        if not isinstance(body, list) or len(body) != 1 or not isinstance(body[0], bytes) \
                or len(body[0]) != TOKEN_BYTES or msg.payload:
            raise WireError(RejectReason.BAD_FIELD, f"{msg.topic} body must be [token of {TOKEN_BYTES} bytes]",
                            field="body")
        return cls(body[0])


def _aad(src: str, dest: str) -> bytes:
    return f"starling-relay-v2\0{src}\0{dest}".encode()


def sealed_ns(incarnation: int, nonce: int) -> int:
    """When a nonce of a source whose run started at `incarnation` says it was sealed (wall-clock
    ns, to the millisecond; see "Replays")."""
    return incarnation + (nonce - (incarnation << COUNTER_BITS) - 1) * 1_000_000


class Redelivered(WireError):
    """A message opened here before, arriving again (its first relay was slow, and the source
    fell back to another): refused, and acknowledged again. `frames` are what it opened to."""

    frames: Sequence[memoryview] = ()


def _sealed_ack(frames: Sequence[memoryview]) -> bytes | None:
    """The nonce an opened relayed message acknowledges, if it is an acknowledgement: one frame,
    `SEALED_ACK` and the nonce (an encoded message's first frame is a msgpack map, never this)."""
    if len(frames) == 1 and frames[0].nbytes == len(SEALED_ACK) + NONCE_BYTES \
            and bytes(frames[0][:len(SEALED_ACK)]) == SEALED_ACK:
        return bytes(frames[0][len(SEALED_ACK):])
    return None


class ReplayGuard:
    """Which nonces each source has had opened here (see the module's "Replays")."""

    def __init__(self, window: int, max_retired: int, skew_s: float = REPLAY_SKEW_S) -> None:
        self.window = window
        self._max_retired = max_retired
        self._skew_ns = int(skew_s * 1e9)
        self._windows: dict[str, tuple[int, int]] = {}  # source -> (highest nonce, bitmask of the window below)
        # forgotten source -> (its highest nonce, the wall-clock ns it was forgotten at)
        self._retired: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.floor_ns = 0  # from a source with neither, what was sealed at or before this is refused

    def __len__(self) -> int:
        return len(self._windows)

    def check(self, src: str, incarnation: int, nonce: int) -> None:
        """Raise WireError (REPLAYED) unless `nonce` from `src` is new; changes nothing."""
        if nonce <= incarnation << COUNTER_BITS:
            raise WireError(RejectReason.REPLAYED, f"a message relayed from {src} was sealed by an earlier run of it")
        if src not in self._windows and src not in self._retired and sealed_ns(incarnation, nonce) <= self.floor_ns:
            raise WireError(RejectReason.REPLAYED, f"a message relayed from {src} was sealed before what this node "
                            "still remembers of forgotten sources")
        highest, seen = self._state(src)
        if nonce > highest:
            return
        behind = highest - nonce
        if behind < self.window and (seen >> behind) & 1 and src in self._windows:
            raise Redelivered(RejectReason.REPLAYED, f"a message relayed from {src} was delivered before")
        if behind >= self.window or (seen >> behind) & 1:
            raise WireError(RejectReason.REPLAYED, f"a message relayed from {src} was delivered before")

    def accept(self, src: str, nonce: int) -> None:
        """Mark `nonce` (which passed `check`) as seen."""
        highest, seen = self._state(src)
        if nonce > highest:
            ahead = nonce - highest
            # a jump past the window (a new incarnation) clears it: no shift by a huge count
            seen = 1 if ahead >= self.window else ((seen << ahead) | 1) & ((1 << self.window) - 1)
            highest = nonce
        else:
            seen |= 1 << (highest - nonce)
        self._windows[src] = (highest, seen)
        self._retired.pop(src, None)

    def _state(self, src: str) -> tuple[int, int]:
        state = self._windows.get(src)
        if state is not None:
            return state
        # a source forgotten before: everything up to its highest counts as seen
        retired = self._retired.get(src)
        return (0 if retired is None else retired[0]), (1 << self.window) - 1

    def forget(self, keep: Callable[[str], bool], now_ns: int | None = None) -> None:
        """Drop the windows of sources `keep` says no; remember their highest nonce. Past
        `max_retired` marks, the oldest go, and the floor rises to when they were left."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        for src in [s for s in self._windows if not keep(s)]:
            self._retired[src] = (self._windows.pop(src)[0], now_ns)
            self._retired.move_to_end(src)
        while len(self._retired) > self._max_retired:
            _, (_, left_at) = self._retired.popitem(last=False)
            self.floor_ns = max(self.floor_ns, left_at - self._skew_ns)


class Sealer:
    """Pair keys and nonces of one node: seal for a peer, open what a peer sealed for us."""

    def __init__(self, curve_secret: bytes, self_id: str, config: RelayConfig,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self._secret = X25519PrivateKey.from_private_bytes(curve_secret)
        self._self = self_id
        self._config = config
        self._clock = clock  # wall-clock ns, which nonces carry
        self._keys: OrderedDict[tuple[str, bytes, bool], AESGCM] = OrderedDict()
        self._last = 0  # the last nonce sealed, as a number
        self.guard = ReplayGuard(config.replay_window, config.max_keys)

    def _key(self, peer: str, curve_key: bytes, outbound: bool) -> AESGCM:
        """The key of messages from us to `peer` (outbound) or from `peer` to us. Each
        direction has its own, so the two never seal under the same key and nonce."""
        slot = (peer, curve_key, outbound)
        cached = self._keys.get(slot)
        if cached is not None:
            self._keys.move_to_end(slot)
            return cached
        shared = self._secret.exchange(X25519PublicKey.from_public_bytes(curve_key))
        src, dest = (self._self, peer) if outbound else (peer, self._self)
        info = b"\0".join([_KDF_INFO, src.encode(), dest.encode()])
        aead = AESGCM(HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared))
        self._keys[slot] = aead
        if len(self._keys) > self._config.max_keys:
            self._keys.popitem(last=False)
        return aead

    def seal(self, dest: str, curve_key: bytes, frames: list[Any], incarnation: int = 0) -> tuple[bytes, bytes]:
        """(nonce, ciphertext) of `frames` for `dest`; `incarnation` is this node's record's."""
        elapsed_ms = max(0, self._clock() - incarnation) // 1_000_000
        self._last = max(self._last + 1, (incarnation << COUNTER_BITS) + 1 + elapsed_ms)
        nonce = self._last.to_bytes(NONCE_BYTES, "big")
        return nonce, self._key(dest, curve_key, True).encrypt(nonce, pack_frames(frames), _aad(self._self, dest))

    def open(self, src: str, curve_key: bytes, nonce: bytes, sealed: bytes | memoryview,
             max_frames: int, incarnation: int = 0) -> list[memoryview]:
        """The frames `src` sealed for us; `incarnation` is that of `src`'s record as we know it.
        WireError if it does not open, was opened before, or is from an earlier run of `src`."""
        if len(nonce) != NONCE_BYTES:
            raise WireError(RejectReason.BAD_FIELD, f"relay nonce must be {NONCE_BYTES} bytes", field="body")
        try:
            plain = self._key(src, curve_key, False).decrypt(nonce, bytes(sealed), _aad(src, self._self))
        except InvalidTag:
            raise WireError(RejectReason.RELAY_TAMPERED,
                            f"a message relayed from {src} does not open: altered, or not sealed by it") from None
        number = int.from_bytes(nonce, "big")
        try:
            self.guard.check(src, incarnation, number)
        except Redelivered as again:
            again.frames = unpack_frames(plain, max_frames)
            raise
        frames = unpack_frames(plain, max_frames)
        self.guard.accept(src, number)
        return frames


@dataclass
class _Held:
    """What one source holds of a client's queue at a relay."""

    nbytes: int = 0
    messages: int = 0


@dataclass
class _Lane:
    """What a relay has handed ZeroMQ for one client and not yet seen it read, in order."""

    queue: deque[tuple[int, str, int]] = field(default_factory=deque)  # (sequence number, source, bytes)
    handed: int = 0  # sequence number of the last message reserved
    sent: int = 0  # of those, how many forwards have run (they run in the order they were reserved)
    nbytes: int = 0
    by_source: dict[str, _Held] = field(default_factory=dict)
    probes: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # token -> messages sent before it
    probed_at: float = -math.inf

    @property
    def idle(self) -> bool:
        return not self.queue and not self.probes and self.sent == self.handed

    def refusal(self, src: str, nbytes: int, config: RelayConfig) -> tuple[str, str] | None:
        """(cause, detail) if `src` may not add a message of `nbytes` now, else None."""
        if nbytes > config.max_queued_bytes:
            return TOO_LARGE, f"{nbytes} bytes, more than a client's queue at this relay ({config.max_queued_bytes})"
        if self.nbytes + nbytes > config.max_queued_bytes or len(self.queue) >= config.max_queued_messages:
            return QUEUE_FULL, f"{self.nbytes} bytes in {len(self.queue)} messages not yet read"
        mine = self.by_source.get(src)
        if mine is not None:  # a source holding nothing may always add one message that fits
            holders = len(self.by_source) + 1
            if (mine.nbytes + nbytes > config.max_queued_bytes // holders
                    or mine.messages + 1 > max(1, config.max_queued_messages // holders)):
                return QUEUE_FULL, f"its sender holds {mine.nbytes} bytes in {mine.messages} messages, its share"
        return None

    def reserve(self, src: str, nbytes: int) -> None:
        self.handed += 1
        self.queue.append((self.handed, src, nbytes))
        self.nbytes += nbytes
        held = self.by_source.setdefault(src, _Held())
        held.nbytes += nbytes
        held.messages += 1

    def read_up_to(self, sent: int) -> None:
        """The client has read the first `sent` messages: they no longer count."""
        while self.queue and self.queue[0][0] <= sent:
            _, src, nbytes = self.queue.popleft()
            self.nbytes -= nbytes
            held = self.by_source[src]
            held.nbytes -= nbytes
            held.messages -= 1
            if not held.messages:
                del self.by_source[src]

    def probe_due(self, now: float, config: RelayConfig) -> bool:
        """Whether to ask the client to prove it read: once it holds an eighth of its bound,
        and no probe is awaited, or the last went unanswered for `probe_interval_s`."""
        if not self.queue or (self.probes and now - self.probed_at < config.probe_interval_s):
            return False
        return (self.nbytes >= config.max_queued_bytes // 8
                or len(self.queue) >= max(1, config.max_queued_messages // 8))


class Relay:
    """One node's relay side: forward for others (if it offers to), seal and open its own."""

    def __init__(self, local: LocalPeer, table: PeerTable, outbox: Outbox, spawn: Spawn, config: RelayConfig, *,
                 max_frames: int, reject: Callable[[RejectReason, str], None],
                 deliver: Callable[[str, list[Any]], Awaitable[None]],
                 want_from: Callable[[str, str], None], home: Callable[[], list[str]]) -> None:
        self.local = local
        self.table = table
        self.outbox = outbox
        self.config = config
        self.max_frames = max_frames
        self.sealer = Sealer(local.identity.curve_secret, local.peer_id, config)
        self._spawn = spawn
        self._reject = reject
        self._deliver = deliver  # an opened message, to the dispatcher (`Dispatcher.on_opened`)
        self._want_from = want_from  # a source we have no record of (`TableSync.want_from`)
        self._home = home  # as a client, the relays it keeps (`RelayKeeper.home`)
        self.forwarding = 0
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        self._in_flight: dict[str, int] = {}  # source -> its forwards in flight
        self._lanes: dict[str, _Lane] = {}  # client -> what this relay queued for it
        self._lanes_checked_at = 64  # lanes kept before the idle and unknown ones are dropped
        self._guard_checked_at = 64  # likewise, replay windows before those of forgotten sources
        self.deliveries = Deliveries(spawn, ack_timeout_s=config.ack_timeout_s, ack_bytes_per_s=config.ack_bytes_per_s,
                                     max_unacked=config.max_unacked, max_unacked_bytes=config.max_unacked_bytes,
                                     drop_halflife_s=config.drop_halflife_s, candidates=self._reachable_relays,
                                     resend=self._hand)

    def register(self, dispatch: Dispatcher) -> None:
        """Serve the relay topics on the node's dispatcher."""
        dispatch.on_internal_message(RELAY, self.on_relay)
        dispatch.on_internal_message(RELAYED, self.on_relayed)
        dispatch.on_internal_message(PROBE, self.on_probe)
        dispatch.on_internal_message(READ, self.on_read)
        dispatch.on_internal_message(ACK, self.on_ack)

    def status(self) -> dict[str, Any]:
        """Forwards in flight, clients with bytes queued here, those bytes, refusals by cause."""
        lanes = list(self._lanes.values())  # one copy: callable from any thread
        return {"forwarding": self.forwarding, "clients": sum(1 for lane in lanes if lane.queue),
                "queued_bytes": sum(lane.nbytes for lane in lanes),
                "queued_messages": sum(len(lane.queue) for lane in lanes), "refused": dict(self.refused),
                "delivery": self.deliveries.status()}

    def queued(self, client: str) -> tuple[int, int]:
        """(bytes, messages) handed out for `client` and not yet proven read."""
        lane = self._lanes.get(client)
        return (0, 0) if lane is None else (lane.nbytes, len(lane.queue))

    # ---------------------------------------------------------------- as a client
    def tick(self, now: float) -> None:
        """From the heartbeat loop: a client names the relays it holds connections to, and says
        that it acknowledges what it is relayed, in the meta its heartbeats carry."""
        record = self.local.record
        if record is None or record.reachable:
            return
        via = self.via()
        if self.local.meta.get(VIA) != via or ACKS not in self.local.meta:
            self.local.meta = {**self.local.meta, VIA: via, ACKS: 1}

    def relays_for(self, dest: str) -> list[str]:
        """The live relays, best first as this node has found them (`Deliveries.order`): its own
        drop counts, then the relays `dest` names in its beats, then a rank of this node's own.
        A suspect relay keeps its place: what other members claim about a relay does not move
        this node's traffic, only what this node saw it deliver (`node.relay_delivery`)."""
        table = self.table
        info = table.get(dest)
        named = set(str(info.meta.get(VIA, "")).split(",")) if info is not None else set()
        live = [p.peer_id for p in table.live() if p.record.relay and p.record.reachable and p.peer_id != dest]
        return self.deliveries.order(live, named)

    def _reachable_relays(self, dest: str) -> list[str]:
        """Of `relays_for(dest)`, those this node reaches itself: a relay reached through another
        relay would route through relays again, without end."""
        transport = self.outbox.transport
        return [r for r in self.relays_for(dest) if transport is not None and transport.can_send(r)]

    def via(self) -> str:
        """The relays this client is attached to, for `$via`: of those it keeps (its messages
        every period keep their routes to it fresh), the ones that have sent it something down the
        DEALER it holds to them, which proves they hold its connection's routing id. An open
        DEALER is not enough: a relay that has not yet read a message of ours on it cannot
        forward to us, and refused the messages that named it (`no_route`). They are named in
        the order this client chose them (at random), not by id, so no relay's id puts it first."""
        transport = self.outbox.transport
        if transport is None:
            return ""
        held = [r for r in self._home() if transport.heard(r)]
        return ",".join(held[: self.config.max_relays])

    async def send(self, dest: str, frames: list[Any], *, wait: bool, timeout_s: float | None,
                   via: str | None = None, track: bool = True) -> None:
        """Seal `frames` for `dest` and hand them to the first relay that takes them (`via`
        first, if named); then, if `dest` acknowledges and `track`, wait in the background for
        its acknowledgement and fall back to the next relay without one (`node.relay_delivery`)."""
        info = self.table.get(dest)
        record = self.local.record
        if info is None or record is None:
            raise SendError(f"no relay route to unknown peer {dest}")
        nonce, sealed = self.sealer.seal(dest, info.record.curve_key, frames, record.incarnation)
        if len(sealed) > self.config.max_queued_bytes:
            raise SendError(f"a message of {len(sealed)} sealed bytes for {dest} is more than a relay queues for "
                            f"a client (RelayConfig.max_queued_bytes, {self.config.max_queued_bytes})")
        body, payload = Sealed(dest, nonce, sealed).to_wire()
        errors = []
        relays = self._reachable_relays(dest)
        if via is not None and self.outbox.transport is not None and self.outbox.transport.can_send(via):
            relays = [via, *(r for r in relays if r != via)]
        for relay in relays:
            try:
                await self._hand(relay, dest, body, payload, wait=wait, timeout_s=timeout_s)
            except SendError as exc:
                errors.append(f"{relay}: {exc}")
                continue
            if track and info.meta.get(ACKS):
                self.deliveries.sent(nonce, dest, relay, body, payload, len(sealed))
            return
        raise SendError(f"no relay took a message for {dest}: " + ("; ".join(errors) or "no relay is alive"))

    async def _hand(self, relay: str, dest: str, body: list[Any], payload: list[Any], *, wait: bool = False,
                    timeout_s: float | None = None) -> None:
        await self.outbox.send(relay, RELAY, body, payload, wait=wait, timeout_s=timeout_s)

    def on_ack(self, msg: Message) -> None:
        """A destination acknowledged a message we had relayed to it."""
        body = msg.body
        if not isinstance(body, list) or len(body) != 1 or not isinstance(body[0], bytes) \
                or len(body[0]) != NONCE_BYTES or msg.payload:
            raise WireError(RejectReason.BAD_FIELD, f"{ACK} body must be [nonce of {NONCE_BYTES} bytes]", field="body")
        self.deliveries.acked(msg.sender, body[0])

    async def _acknowledge(self, src: str, nonce: bytes, relay: str) -> None:
        """Tell `src` we opened its message: straight if we reach it, else sealed back through
        the `relay` that delivered it (it holds `src`'s connection, which `src` just used, and
        it has proven it forwards between the two), or another. An acknowledgement is not
        acknowledged."""
        transport = self.outbox.transport
        try:
            if transport is not None and transport.can_send(src):
                await self.outbox.send(src, ACK, [nonce], wait=False)
            else:
                await self.send(src, [SEALED_ACK + nonce], wait=False, timeout_s=None, via=relay, track=False)
        except (SendError, ValueError, UnknownPeerError):
            pass  # the source falls back to another relay, and this copy is acknowledged then

    # ---------------------------------------------------------------- as the relay
    def _refuse(self, cause: str, reason: RejectReason, detail: str) -> WireError:
        self.refused[cause] += 1
        return WireError(reason, detail)

    def on_relay(self, msg: Message) -> None:
        """Forward a sealed message to a client attached here, or refuse it (see the module's bounds)."""
        envelope = Sealed.from_wire(msg)
        dest, sealed = envelope.peer, envelope.sealed
        src = msg.sender
        record = self.local.record
        if record is None or not record.relay:
            raise self._refuse(NOT_A_RELAY, RejectReason.NO_ROUTE, f"{src} asked to relay, and this node is no relay")
        info = self.table.get(dest)
        if info is None or info.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT) or dest == src:
            raise self._refuse(NOT_LIVE, RejectReason.NO_ROUTE, f"relay to {dest}: not a live member")
        if info.record.reachable:
            raise self._refuse(NOT_A_CLIENT, RejectReason.NO_ROUTE,
                               f"relay to {dest}: it can be dialled, and a relay forwards only to clients")
        transport = self.outbox.transport
        if transport is None or not transport.can_send(dest):
            # a client we can send to holds a connection to us: never relayed onwards
            raise self._refuse(NOT_ATTACHED, RejectReason.NO_ROUTE,
                               f"relay to {dest}: it holds no connection to this relay")
        busy = self._no_slot(src)
        if busy is not None:
            raise self._refuse(FORWARDS, RejectReason.BUSY, f"relay to {dest}: {busy}")
        lane = self._lanes.get(dest)
        if lane is None:
            lane = self._new_lane(dest)
        nbytes = memoryview(sealed).nbytes
        refusal = lane.refusal(src, nbytes, self.config)
        if refusal is not None:
            self._probe_if_due(dest, lane)  # the client may have read it all: ask, so the queue refills
            raise self._refuse(refusal[0], RejectReason.BUSY, f"relay to {dest}: {refusal[1]}")
        lane.reserve(src, nbytes)
        self.forwarding += 1
        self._in_flight[src] = self._in_flight.get(src, 0) + 1
        self._spawn(self._forward(dest, Sealed(src, envelope.nonce, sealed)))

    def _no_slot(self, src: str) -> str | None:
        """Why `src` may not start another forward now, or None."""
        if self.forwarding >= self.config.max_forwarding:
            return f"{self.forwarding} forwards in flight"
        mine = self._in_flight.get(src, 0)
        sources = len(self._in_flight) + (0 if mine else 1)
        share = max(1, self.config.max_forwarding // (sources + 1))
        if mine >= share:
            return f"{src} has {mine} forwards in flight, its share of {self.config.max_forwarding}"
        return None

    def _new_lane(self, dest: str) -> _Lane:
        if len(self._lanes) >= self._lanes_checked_at:
            table = self.table
            for client in [c for c, lane in self._lanes.items() if lane.idle or c not in table]:
                del self._lanes[client]
            self._lanes_checked_at = max(64, 2 * len(self._lanes))
        lane = self._lanes[dest] = _Lane()
        return lane

    async def _forward(self, dest: str, relayed: Sealed) -> None:
        """Hand one message to ZeroMQ for `dest`, without waiting: to a client attached here
        that means its connection's queue, which ZeroMQ fills or drops but never blocks on."""
        try:
            await self.outbox.send(dest, RELAYED, *relayed.to_wire(), wait=False)
        except (SendError, ValueError) as exc:
            self._reject(RejectReason.NO_ROUTE, f"relay to {dest} failed: {exc}")
        finally:
            self.forwarding -= 1
            src = relayed.peer
            left = self._in_flight.pop(src, 0) - 1
            if left > 0:
                self._in_flight[src] = left
            lane = self._lanes.get(dest)
            if lane is not None:
                lane.sent = min(lane.sent + 1, lane.handed)
                self._probe_if_due(dest, lane)

    def _probe_if_due(self, dest: str, lane: _Lane) -> None:
        """Send `dest` a probe behind the messages forwarded so far (see `_Lane.probe_due`)."""
        now = time.monotonic()
        if not lane.probe_due(now, self.config):
            return
        token = os.urandom(TOKEN_BYTES)
        lane.probes[token] = lane.sent
        lane.probed_at = now
        while len(lane.probes) > self.config.max_probes:
            lane.probes.popitem(last=False)
        self._spawn(self._send_probe(dest, token))

    async def _send_probe(self, dest: str, token: bytes) -> None:
        try:
            await self.outbox.send(dest, PROBE, ProbeToken(token).to_wire(), wait=False)
        except (SendError, ValueError):
            pass  # unanswered: the next forward or refusal after `probe_interval_s` asks again

    def on_read(self, msg: Message) -> None:
        """A client echoed a probe's token: it has read every message forwarded before it."""
        token = ProbeToken.from_wire(msg).token
        lane = self._lanes.get(msg.sender)
        if lane is None or token not in lane.probes:
            raise WireError(RejectReason.BAD_FIELD, f"{READ} from {msg.sender} matches no probe", field="body")
        while True:  # probes went out in order, so this answers every earlier one too
            earlier, sent = lane.probes.popitem(last=False)
            if earlier == token:
                break
        lane.read_up_to(sent)
        self._probe_if_due(msg.sender, lane)  # still an eighth held: ask again now, not at the next refusal

    # ---------------------------------------------------------------- as the destination
    def on_probe(self, msg: Message) -> None:
        """A relay asks whether we have read what it forwarded: echo its token."""
        token = ProbeToken.from_wire(msg).token
        info, transport = self.table.get(msg.sender), self.outbox.transport
        if info is None or not (info.record.relay and info.record.reachable) or transport is None \
                or not transport.can_send(msg.sender):
            raise WireError(RejectReason.NO_ROUTE, f"{PROBE} from {msg.sender}, which is no relay we hold a "
                            "connection to")
        self._spawn(self._answer_probe(msg.sender, token))

    async def _answer_probe(self, relay: str, token: bytes) -> None:
        try:
            await self.outbox.send(relay, READ, ProbeToken(token).to_wire(), wait=False)
        except (SendError, ValueError):
            pass  # the relay asks again

    def on_relayed(self, msg: Message) -> None:
        envelope = Sealed.from_wire(msg)
        src = envelope.peer
        info = self.table.get(src)
        if info is None or info.status is PeerStatus.LEFT:
            if info is None:  # a peer that joined a moment ago: the relay has its record
                self._want_from(msg.sender, src)
            raise WireError(RejectReason.UNKNOWN_PEER, f"relayed message from unknown peer {src}")
        try:
            frames = self.sealer.open(src, info.record.curve_key, envelope.nonce, envelope.sealed, self.max_frames,
                                      info.record.incarnation)
        except Redelivered as again:
            if not _sealed_ack(again.frames):
                self._spawn(self._acknowledge(src, envelope.nonce, msg.sender))
            raise
        acked = _sealed_ack(frames)
        if acked is not None:  # an acknowledgement sealed through a relay: no message, and not acknowledged
            self.deliveries.acked(src, acked)
            return
        self._spawn(self._acknowledge(src, envelope.nonce, msg.sender))
        guard = self.sealer.guard
        if len(guard) >= self._guard_checked_at:
            guard.forget(self.table.__contains__)
            self._guard_checked_at = max(64, 2 * len(guard))
        self._spawn(self._deliver(src, frames))
