"""Relays: how two clients (peers nobody can dial) talk, through a peer both can reach.

A client C with a message for another client D seals the message's frames for D and sends
them to a relay R (a reachable peer whose record offers to relay) as `$relay`
[D, nonce] + ciphertext. R forwards the ciphertext untouched to D as `$relayed` [C, nonce],
down the connection D opened to it. R learns nothing but the two ids and the size.

A message is sealed for D alone, and D opens each one once: how, and what a relay therefore
cannot do to it, is `node.relay_sealing`'s.

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
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starling.node.dispatch import Dispatcher
from starling.node.local import LocalPeer
from starling.node.membership import PeerStatus, PeerTable
from starling.node.outbox import Outbox, Spawn, UnknownPeerError
from starling.node.relay_config import RelayConfig
from starling.node.relay_delivery import ACK, ACKS, Deliveries
from starling.node.relay_sealing import (
    COUNTER_BITS,
    NONCE_BYTES,
    PROBE,
    READ,
    RELAY,
    RELAYED,
    REPLAY_SKEW_S,
    SEALED_ACK,
    TAG_BYTES,
    TOKEN_BYTES,
    ProbeToken,
    Redelivered,
    ReplayGuard,
    Sealed,
    Sealer,
    pack_frames,
    sealed_ack,
    sealed_ns,
    unpack_frames,
)
from starling.node.transport import SendError
from starling.node.wire import Message, RejectReason, WireError

# Importable from here as they always were: their homes are `node.relay_config` and `node.relay_sealing`.
__all__ = [
    "COUNTER_BITS", "FORWARDS", "NONCE_BYTES", "NOT_ATTACHED", "NOT_A_CLIENT", "NOT_A_RELAY", "NOT_LIVE", "PROBE",
    "QUEUE_FULL", "READ", "REFUSALS", "RELAY", "RELAYED", "REPLAY_SKEW_S", "SEALED_ACK", "TAG_BYTES", "TOKEN_BYTES",
    "TOO_LARGE", "VIA", "ProbeToken", "Redelivered", "Relay", "RelayConfig", "ReplayGuard", "Sealed", "Sealer",
    "pack_frames", "sealed_ns", "unpack_frames",
]

VIA = "$via"  # heartbeat meta of a client: the relays it is attached to, comma-separated

# Causes of a relay's refusals, the keys of `Relay.refused`.
NOT_A_RELAY = "not_a_relay"  # this node offers no relaying
NOT_LIVE = "not_live"  # the destination is no live member (or is the sender)
NOT_A_CLIENT = "not_a_client"  # the destination can be dialled: a relay forwards only to clients
NOT_ATTACHED = "not_attached"  # the destination holds no connection to this relay
FORWARDS = "forwards"  # forwards in flight: all of them, or the source's share
QUEUE_FULL = "queue_full"  # the destination's queued bytes or messages: all of them, or the source's share
TOO_LARGE = "too_large"  # a message bigger than a client's whole queue
REFUSALS = (NOT_A_RELAY, NOT_LIVE, NOT_A_CLIENT, NOT_ATTACHED, FORWARDS, QUEUE_FULL, TOO_LARGE)


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
            if not sealed_ack(again.frames):
                self._spawn(self._acknowledge(src, envelope.nonce, msg.sender))
            raise
        acked = sealed_ack(frames)
        if acked is not None:  # an acknowledgement sealed through a relay: no message, and not acknowledged
            self.deliveries.acked(src, acked)
            return
        self._spawn(self._acknowledge(src, envelope.nonce, msg.sender))
        guard = self.sealer.guard
        if len(guard) >= self._guard_checked_at:
            guard.forget(self.table.__contains__)
            self._guard_checked_at = max(64, 2 * len(guard))
        self._spawn(self._deliver(src, frames))
