"""Relays: how two clients (peers nobody can dial) talk, through a peer both can reach.

A client C with a message for another client D seals the message's frames for D and sends
them to a relay R (a reachable peer whose record offers to relay) as `$relay`
[D, nonce] + ciphertext. R forwards the ciphertext untouched to D as `$relayed` [C, nonce],
down the connection D opened to it. R learns nothing but the two ids and the size.

Sealing is AES-256-GCM under a key only C and D hold: HKDF-SHA256 over the X25519 agreement
of their curve keys (the same keys their records carry, signed). The associated data binds
the source and the destination, so a relay that flips a byte, swaps the claimed source, or
sends a sealed message to someone else gets a message that fails to open: it is rejected,
counted (`relay_tampered`), and nothing reaches a handler. A relay that replays a message
is caught by the nonce's counter (`replayed`).

Which relay: a client names the relays it holds connections to in its heartbeat meta
(`$via`). A sender picks the first of D's relays that is alive; if the send to it fails it
tries the next, so a relay that dies costs the messages in flight through it (their
requests time out and are retried as any lost message) and nothing more.

Work a member can cause at a relay is bounded: forwards in flight are capped
(`max_forwarding`); past the cap a `$relay` is dropped and counted (`busy`).
"""
from __future__ import annotations

import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from starling.node.identity import Identity
from starling.node.membership import PeerStatus
from starling.node.transport import SendError
from starling.node.wire import Message, RejectReason, WireError

if TYPE_CHECKING:
    from starling.node.node import Node

RELAY, RELAYED = "$relay", "$relayed"
VIA = "$via"  # heartbeat meta of a client: the relays it is attached to, comma-separated
NONCE_BYTES = 12  # 4 random bytes per sender session, then a 64-bit counter
TAG_BYTES = 16
_LEN = struct.Struct("<I")
_KDF_INFO = b"starling relay v1"


@dataclass(frozen=True)
class RelayConfig:
    max_forwarding: int = 64  # forwards in flight at a relay; past it `$relay` is dropped
    max_relays: int = 3  # relays a client names in `$via`
    max_keys: int = 4096  # pair keys kept (derivation is an X25519 agreement plus HKDF)
    replay_window: int = 4096  # counters this far below the highest seen are refused


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


def _envelope(msg: Message, who: str) -> tuple[str, bytes, memoryview]:
    """(peer id, nonce, sealed bytes) of a `$relay` or `$relayed` message; WireError if malformed."""
    body, payload = msg.body, msg.payload
    if (not isinstance(body, list) or len(body) != 2 or not isinstance(body[0], str)
            or not isinstance(body[1], bytes) or len(payload) != 1 or not isinstance(payload[0], memoryview)):
        raise WireError(RejectReason.BAD_FIELD, f"{msg.topic} body must be [{who}, nonce] and one bytes frame",
                        field="body")
    return body[0], body[1], payload[0]


def _aad(src: str, dest: str) -> bytes:
    return f"starling-relay-v1\0{src}\0{dest}".encode()


class Sealer:
    """Pair keys and nonces of one node: seal for a peer, open what a peer sealed for us."""

    def __init__(self, curve_secret: bytes, self_id: str, config: RelayConfig) -> None:
        self._secret = X25519PrivateKey.from_private_bytes(curve_secret)
        self._self = self_id
        self._config = config
        self._keys: OrderedDict[tuple[str, bytes], AESGCM] = OrderedDict()
        self._session = os.urandom(4)
        self._counter = 0
        self._seen: OrderedDict[tuple[str, bytes], tuple[int, int]] = OrderedDict()  # replay guard

    def _key(self, peer: str, curve_key: bytes) -> AESGCM:
        cached = self._keys.get((peer, curve_key))
        if cached is not None:
            self._keys.move_to_end((peer, curve_key))
            return cached
        shared = self._secret.exchange(X25519PublicKey.from_public_bytes(curve_key))
        pair = "\0".join(sorted((self._self, peer))).encode()
        key = HKDF(hashes.SHA256(), 32, salt=None, info=_KDF_INFO + b"\0" + pair).derive(shared)
        aead = AESGCM(key)
        self._keys[(peer, curve_key)] = aead
        if len(self._keys) > self._config.max_keys:
            self._keys.popitem(last=False)
        return aead

    def seal(self, dest: str, curve_key: bytes, frames: list[Any]) -> tuple[bytes, bytes]:
        self._counter += 1
        nonce = self._session + self._counter.to_bytes(8, "big")
        return nonce, self._key(dest, curve_key).encrypt(nonce, pack_frames(frames), _aad(self._self, dest))

    def open(self, src: str, curve_key: bytes, nonce: bytes, sealed: bytes | memoryview,
             max_frames: int) -> list[memoryview]:
        if len(nonce) != NONCE_BYTES:
            raise WireError(RejectReason.BAD_FIELD, f"relay nonce must be {NONCE_BYTES} bytes", field="body")
        try:
            plain = self._key(src, curve_key).decrypt(nonce, bytes(sealed), _aad(src, self._self))
        except InvalidTag:
            raise WireError(RejectReason.RELAY_TAMPERED,
                            f"a message relayed from {src} does not open: altered, or not sealed by it") from None
        self._check_fresh(src, nonce)
        return unpack_frames(plain, max_frames)

    def _check_fresh(self, src: str, nonce: bytes) -> None:
        """Refuse a counter seen before, or one too far behind (a relay replaying old messages).
        Per sender session: the highest counter and a bitmask of the `replay_window` below it."""
        session, counter = nonce[:4], int.from_bytes(nonce[4:], "big")
        highest, seen = self._seen.get((src, session), (0, 0))
        window = self._config.replay_window
        if counter > highest:
            seen = ((seen << (counter - highest)) | 1) & ((1 << window) - 1)
            highest = counter
        else:
            behind = highest - counter
            if behind >= window or (seen >> behind) & 1:
                raise WireError(RejectReason.REPLAYED, f"a message relayed from {src} was delivered before")
            seen |= 1 << behind
        self._seen[(src, session)] = (highest, seen)
        self._seen.move_to_end((src, session))
        if len(self._seen) > self._config.max_keys:
            self._seen.popitem(last=False)


class Relay:
    """One node's relay side: forward for others (if it offers to), seal and open its own."""

    def __init__(self, node: Node, config: RelayConfig) -> None:
        self.node = node
        self.config = config
        self.sealer = Sealer(node.identity.curve_secret, node.peer_id, config)
        self.forwarding = 0

    def use_identity(self, identity: Identity) -> None:
        """Seal and open with this identity's keys from now on."""
        self.sealer = Sealer(identity.curve_secret, identity.peer_id, self.config)

    def register(self) -> None:
        dispatch = self.node._dispatch
        dispatch.on_internal_message(RELAY, self.on_relay)
        dispatch.on_internal_message(RELAYED, self.on_relayed)

    # ---------------------------------------------------------------- as a client
    def relays_for(self, dest: str) -> list[str]:
        """The live relays `dest` named in its heartbeats, then any other live relay."""
        table = self.node._table
        info = table.get(dest)
        named = str(info.meta.get(VIA, "")).split(",") if info is not None else []
        live = {p.peer_id: p for p in table.live() if p.record.relay and p.record.reachable}
        return [r for r in named if r in live] + sorted(r for r in live if r not in named)

    def via(self) -> str:
        """The relays this client is attached to, for `$via`: those that have sent it something
        down the DEALER it holds to them, which proves they hold its connection's routing id.
        An open DEALER is not enough: a relay that has not yet read a message of ours on it
        cannot forward to us, and refused the messages that named it (`no_route`)."""
        transport = self.node._transport
        if transport is None:
            return ""
        held = sorted(p.peer_id for p in self.node._table.live()
                      if p.record.relay and p.record.reachable and transport.heard(p.peer_id))
        return ",".join(held[: self.config.max_relays])

    async def send(self, dest: str, frames: list[Any], *, wait: bool, timeout_s: float | None) -> None:
        """Seal `frames` for `dest` and hand them to the first relay that takes them."""
        info = self.node._table.get(dest)
        if info is None:
            raise SendError(f"no relay route to unknown peer {dest}")
        nonce, sealed = self.sealer.seal(dest, info.record.curve_key, frames)
        errors = []
        for relay in self.relays_for(dest):
            try:
                await self.node._asend_raw(relay, RELAY, [dest, nonce], [sealed], wait=wait, timeout_s=timeout_s)
                return
            except SendError as exc:
                errors.append(f"{relay}: {exc}")
        raise SendError(f"no relay took a message for {dest}: " + ("; ".join(errors) or "no relay is alive"))

    # ---------------------------------------------------------------- as the relay
    def on_relay(self, msg: Message) -> None:
        node = self.node
        dest, nonce, sealed = _envelope(msg, "dest")
        if node.record is None or not node.record.relay:
            raise WireError(RejectReason.NO_ROUTE, f"{msg.sender} asked to relay, and this node is no relay")
        info = node._table.get(dest)
        if info is None or info.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT) or dest == msg.sender:
            raise WireError(RejectReason.NO_ROUTE, f"relay to {dest}: not a live member")
        if node._transport is None or not node._transport.can_send(dest):
            # never relayed onwards: a relay forwards only down a connection `dest` holds to it
            raise WireError(RejectReason.NO_ROUTE, f"relay to {dest}: it holds no connection to this relay")
        if self.forwarding >= self.config.max_forwarding:
            raise WireError(RejectReason.BUSY, f"relay: {self.forwarding} forwards in flight")
        self.forwarding += 1
        node._spawn(self._forward(dest, [msg.sender, nonce], sealed))

    async def _forward(self, dest: str, body: list[Any], sealed: memoryview) -> None:
        try:
            await self.node._asend_raw(dest, RELAYED, body, [sealed])
        except (SendError, ValueError) as exc:
            self.node._dispatch.reject(RejectReason.NO_ROUTE, f"relay to {dest} failed: {exc}")
        finally:
            self.forwarding -= 1

    # ---------------------------------------------------------------- as the destination
    def on_relayed(self, msg: Message) -> None:
        node = self.node
        src, nonce, sealed = _envelope(msg, "src")
        info = node._table.get(src)
        if info is None or info.status is PeerStatus.LEFT:
            if info is None:  # a peer that joined a moment ago: the relay has its record
                node._swarm.want_from(msg.sender, src)
            raise WireError(RejectReason.UNKNOWN_PEER, f"relayed message from unknown peer {src}")
        frames = self.sealer.open(src, info.record.curve_key, nonce, sealed, node.config.limits.max_frames)
        node._spawn(node._dispatch.on_opened(src, frames))
