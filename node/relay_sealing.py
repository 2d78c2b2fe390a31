"""Sealed relay messages: what a client hands a relay for another client, and how that
client opens it.

A client C seals a message's frames for another client D (`Sealer.seal`) and sends them to a
relay as `$relay` [D, nonce] + ciphertext (`Sealed`); the relay forwards the ciphertext
untouched to D as `$relayed` [C, nonce], and D opens it (`Sealer.open`). A relay's probe of
what a client has read, and the client's echo, carry a `ProbeToken`. Which relay carries a
message, and what a relay takes on, is `node.relay`'s.

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
"""
from __future__ import annotations

import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from starling.node.relay_config import RelayConfig
from starling.node.wire import Message, RejectReason, WireError

RELAY, RELAYED = "$relay", "$relayed"
PROBE, READ = "$relay_probe", "$relay_read"  # relay -> client: read up to here?  client -> relay: yes
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


def sealed_ack(frames: Sequence[memoryview]) -> bytes | None:
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
