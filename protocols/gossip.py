"""`gossip`: decentralized SGD with gossip averaging, asynchronous, no global rounds.

Exact pairwise averaging (a lossless compressor: "none"), every `local_steps` local SGD steps:

    members = sorted(live peers + me); N = neighbours(topology, members, me)
    for j in fanout random picks from N:
        send x_i to j ("gossip.pull")                     # j, under its training lock:
                                                          #   s_j = x_j; x_j += mixing (x_i - s_j)
        receive s_j;  x_i += mixing (s_j - x_i)           #   reply s_j
        send "gossip.ack" to j                            # j forgets its half
        (no reply in time: send "gossip.undo" to j)       # j takes its half back
    the two updates are exact negatives of each other, so the swarm mean is preserved
    (mixing = 0.5 makes both sides the pair's mean); a busy or dead neighbour is skipped.
    To undo, j keeps each half it applied until the ack, at most `max_undo_entries` of them
    (see `Gossip._keep_for_undo` for what the bound costs).

CHOCO-SGD (Koloskova et al. 2019) with a compressor, every `local_steps` steps:

    apply every neighbour's q_j received so far:   x_hat_j += q_j
    q_i = Q(x_i - x_hat_i);  x_hat_i += q_i;  send q_i to every neighbour ("gossip.choco")
    x_i += mixing * sum_j w_ij (x_hat_j - x_hat_i)        # w: Metropolis-Hastings weights

x_i - x_hat_i is what compression has not yet delivered; it is sent in later rounds, so it
acts as the error feedback. A neighbour's x_hat_j stays exact because q's from one peer
arrive in order; a neighbour first gets a full copy of x_hat, and asks for one again
("gossip.resync") when it sees a gap.

Topologies over the sorted members: complete; ring (i +- 1); torus (2-D grid with wrap,
rows = the largest divisor of n not above sqrt(n)); exponential (i +- 2^k). All are symmetric.

Buffers (BatchNorm statistics) are mixed at every exchange with the same weights as the
parameters: an exact exchange appends the floating buffers to x (so the undo takes them back
too); CHOCO sends them losslessly beside its packet and mixes them with the neighbours' latest
values, so a variance stays a convex combination of variances (a compressed copy could push it
below zero). Integer buffers (`num_batches_tracked`) take the maximum of both sides; an undo
leaves that maximum. Gossip never makes peers agree exactly, so their statistics only come
closer, as their parameters do. `local_buffers` keeps every buffer each peer's own (FedBN).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from starling.collectives import make_codec, membership, packet_from_wire
from starling.collectives.buffers import ModelBuffers
from starling.collectives.codec import check_compressor_spec
from starling.common import peer_hash
from starling.compressors import decode
from starling.node.membership import PeerStatus
from starling.node.node import Node
from starling.node.rpc import NoHandlerError, Refusal, Refuser, RemoteError, Reply, refusal
from starling.node.wire import Message
from starling.protocols.backprop import BackpropProtocol
from starling.protocols.base import LossFn, ProtocolConfig, ProtocolError, StepReport, register
from starling.protocols.bodies import BodyError, Choco, Pull, PullAck, Pulled, Resync, Undo
from starling.protocols.optim import check_optimizer

log = logging.getLogger(__name__)

_OneWay = TypeVar("_OneWay", Undo, PullAck, Choco, Resync)  # the bodies of gossip's one-way messages

PULL_TOPIC, CHOCO_TOPIC, RESYNC_TOPIC = "gossip.pull", "gossip.choco", "gossip.resync"
UNDO_TOPIC, ACK_TOPIC = "gossip.undo", "gossip.ack"
TOPOLOGIES = ("complete", "ring", "torus", "exponential")
_LOCK_POLL_S = 0.002


@dataclass(frozen=True)
class GossipConfig(ProtocolConfig):
    topology: str = "complete"  # complete | ring | torus | exponential
    local_steps: int = 1  # local SGD steps between gossip exchanges
    fanout: int = 1  # neighbours averaged with per exchange (exact mode)
    mixing: float = 0.5  # exact: step toward the neighbour (0.5 = pair mean); CHOCO: consensus gamma
    optimizer: str = "sgd"  # sgd | adamw
    momentum: float = 0.0
    weight_decay: float = 0.0
    pull_timeout_s: float = 5.0  # a neighbour that has not answered by then is skipped
    max_undo_entries: int = 8  # answered pulls kept (one parameter vector each) until acked
    local_buffers: bool = False  # True: buffers (BatchNorm statistics) stay each peer's own (FedBN)

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if self.local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {self.local_steps}")
        if self.fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {self.fanout}")
        if not 0.0 < self.mixing <= 1.0:
            raise ValueError(f"mixing must be in (0, 1], got {self.mixing}")
        check_optimizer(self, "optimizer", "momentum")
        if not self.pull_timeout_s > 0.0:
            raise ValueError(f"pull_timeout_s must be > 0, got {self.pull_timeout_s}")
        if self.max_undo_entries < 1:
            raise ValueError(f"max_undo_entries must be >= 1, got {self.max_undo_entries}")
        check_compressor_spec(self.compressor)


def neighbours(topology: str, members: tuple[str, ...], me: str) -> list[str]:
    """`me`'s neighbours in `topology` over the sorted member list (never `me` itself)."""
    n, i = len(members), members.index(me)
    if topology == "complete":  # everyone else, in member order: two slices, not a set sorted each step
        return [*members[:i], *members[i + 1:]]
    if topology == "ring":
        idx = {(i - 1) % n, (i + 1) % n}
    elif topology == "torus":
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        cols = n // rows
        r, c = divmod(i, cols)
        idx = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
               r * cols + (c - 1) % cols, r * cols + (c + 1) % cols}
    elif topology == "exponential":
        idx = {(i + s * 2**k) % n for k in range(max(n - 1, 1).bit_length()) for s in (1, -1)}
    else:
        raise ProtocolError(f"unknown topology {topology!r}")
    idx.discard(i)
    return [members[j] for j in sorted(idx)]


@register
class Gossip(BackpropProtocol, name="gossip", config_class=GossipConfig, topic_prefix="gossip."):
    config: GossipConfig

    def __init__(self, node: Node, model: nn.Module, config: GossipConfig) -> None:
        super().__init__(node, model, config)
        # Held by the training thread while it computes or writes parameters, and by the
        # pull handler while it averages: parameters never change under a backward pass.
        self._params_lock = threading.Lock()
        self._rng = random.Random(peer_hash(node.peer_id, byteorder="little"))
        self.codec, _ = make_codec(config.compressor)
        self.choco = not self.codec.lossless  # only a lossy codec needs CHOCO's public copies to converge
        buffers = ModelBuffers(model)
        self.buffers = None if config.local_buffers or not (buffers.float_numel or buffers.int_numel) else buffers
        # what an exact exchange mixes: the parameters, then the floating buffers
        self.numel = self.flat.numel + (self.buffers.float_numel if self.buffers and not self.choco else 0)
        self._int_frames = 1 if self.buffers else 0  # an exact exchange's integer buffers ride beside it
        # CHOCO state (training thread, except the inbox and the resync set).
        self.x_hat = torch.zeros(self.flat.numel) if self.choco else None
        self._hats: dict[str, torch.Tensor] = {}
        self._their_buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # neighbours' latest, lossless
        self._next_seq_in: dict[str, int] = {}
        self._seq_out = 0
        self._inbox: deque[tuple[str, Choco, tuple[torch.Tensor, ...]]] = deque()
        self._has_my_hat: set[str] = set()
        self._hat_lock = threading.Lock()  # guards _has_my_hat (the network thread clears entries)
        # Undo table (network thread only; see _keep_for_undo): requester -> (xid, the delta
        # applied for it), oldest first; and the xid of each requester's last dropped entry.
        self._applied: dict[str, tuple[int, torch.Tensor]] = {}
        self._dropped: dict[str, int] = {}
        self._exchange_ids = itertools.count(1)
        self._cancelled: dict[str, int] = {}
        # undone, undo_evicted, undo_dropped_peer_left, undo_refused, rejected.<reason>
        self.counters: Counter[str] = Counter()
        # bad input from a peer, per topic: counted (node stats `<topic>.<reason>`), logged, refused
        self._refuse = {topic: Refuser(node.stats, topic, node.peer_id, self.counters)
                        for topic in (PULL_TOPIC, CHOCO_TOPIC, RESYNC_TOPIC, UNDO_TOPIC, ACK_TOPIC)}
        self._serve({PULL_TOPIC: self._on_pull, CHOCO_TOPIC: self._on_choco, RESYNC_TOPIC: self._on_resync,
                     UNDO_TOPIC: self._on_undo, ACK_TOPIC: self._on_ack})

    # ------------------------------------------------------------------ training thread
    def step(self, loss_fn: LossFn) -> StepReport:
        clock = self._begin_step()
        with clock.computing(), self._params_lock:
            loss = self._backprop(loss_fn)
            self.optimizer.step()
        t = self.step_count
        self.step_count += 1
        partners: list[str] = []
        lost: list[str] = []
        if self.step_count % self.config.local_steps == 0:
            members = membership(self.node)
            nbrs = neighbours(self.config.topology, members, self.node.peer_id) if len(members) > 1 else []
            if self.choco:
                partners = self._choco_round(members, nbrs)
            else:
                partners, lost = self._pull_round(t, nbrs)
        return self._report(t, loss, clock, synced=bool(partners), peers=1 + len(partners), lost=tuple(lost))

    def _pull_round(self, t: int, nbrs: list[str]) -> tuple[list[str], list[str]]:
        """Exact pairwise averaging with up to `fanout` random neighbours, one after another."""
        partners, lost = [], []
        for j in self._rng.sample(nbrs, min(self.config.fanout, len(nbrs))):
            with self._params_lock:
                mine, ints = self._read_mixed(), self._read_ints()
            xid = next(self._exchange_ids)
            try:
                msg = self.node.request(j, PULL_TOPIC, Pull(t, xid).to_wire(), [mine, *ints],
                                        timeout_s=self.config.pull_timeout_s)
            except Exception as exc:  # dead, gone, or not running gossip yet
                log.info("%s: gossip with %s skipped: %s", self.node.peer_id, j, exc)
                if not isinstance(exc, RemoteError):
                    # No reply (a timeout, or j declared dead meanwhile): j may have applied
                    # its half already, so ask for it back. Unapplied, the undo cancels it.
                    self.node.send(j, UNDO_TOPIC, Undo(xid).to_wire())
                if not isinstance(exc, NoHandlerError):  # one not running gossip yet is not lost
                    lost.append(j)
                continue
            theirs = msg.payload[0] if msg.payload else None
            try:
                Pulled.from_wire(msg.body)
            except BodyError as exc:  # a refusal: j applied nothing
                log.debug("%s: %s declined to gossip: %s", self.node.peer_id, j, exc)
                continue
            their_ints = self._ints_of(msg.payload[1:])
            if not _same_shape(theirs, mine) or their_ints is None:  # j applied its half, we cannot apply ours
                log.info("%s: bad parameters from %s; asking it to undo", self.node.peer_id, j)
                self.node.send(j, UNDO_TOPIC, Undo(xid).to_wire())
                continue
            delta = (theirs.reshape(-1) - mine).mul_(self.config.mixing)  # exactly minus what j applied
            with self._params_lock:
                self._add_mixed(delta, their_ints)
            self.node.send(j, ACK_TOPIC, PullAck(xid).to_wire())  # j no longer needs to keep its half
            partners.append(j)
        return partners, lost

    def _choco_round(self, members: tuple[str, ...], nbrs: list[str]) -> list[str]:
        assert self.x_hat is not None
        self._drain_inbox()
        with self._params_lock:
            x = self.flat.read_params()
            buffers = self._read_buffers()
        packet = self.codec.encode(x - self.x_hat)
        self.x_hat.add_(decode(packet).reshape(-1))
        seq, self._seq_out = self._seq_out, self._seq_out + 1
        sends = []
        for j in nbrs:
            with self._hat_lock:
                full = j not in self._has_my_hat
                self._has_my_hat.add(j)
            # the buffers go lossless, after the parameters' frames
            if full:  # first contact (or after a gap): the whole public copy, once
                body, payload = Choco(seq, True, None, len(buffers)), (self.x_hat.clone(),)
            else:
                body, payload = Choco(seq, False, packet.header, len(buffers)), packet.buffers
            sends.append((j, self.node.send(j, CHOCO_TOPIC, body.to_wire(), (*payload, *buffers))))
        for j, fut in sends:
            try:
                fut.result(self.config.pull_timeout_s)
            except Exception as exc:
                log.info("%s: CHOCO update to %s not sent: %s", self.node.peer_id, j, exc)
                with self._hat_lock:
                    self._has_my_hat.discard(j)
        # x_i += gamma * sum_j w_ij (x_hat_j - x_hat_i), over neighbours whose copy we hold
        degree = {p: len(neighbours(self.config.topology, members, p)) for p in [self.node.peer_id, *nbrs]}
        weights = {j: 1.0 / (1 + max(degree[self.node.peer_id], degree[j])) for j in nbrs}
        mix = torch.zeros_like(self.x_hat)
        used = []
        for j in nbrs:
            hat = self._hats.get(j)
            if hat is not None and hat.numel() == mix.numel():
                mix.add_(hat - self.x_hat, alpha=weights[j])
                used.append(j)
        with self._params_lock:
            self.flat.add_to_params(mix.mul_(self.config.mixing))
            self._mix_buffers(weights)
        return used

    def _mix_buffers(self, weights: dict[str, float]) -> None:
        """CHOCO's step on the buffers, with the parameters' weights and each neighbour's latest
        lossless buffers; the integers take the maximum."""
        if self.buffers is None:
            return
        floats = self.buffers.read_floats()
        mix = torch.zeros_like(floats)
        for j, w in weights.items():
            got = self._their_buffers.get(j)
            if got is not None:
                mix.add_(got[0].to(floats.device) - floats, alpha=w)
                self.buffers.max_ints(got[1])
        self.buffers.add_to_floats(mix.mul_(self.config.mixing))

    def _drain_inbox(self) -> None:
        while self._inbox:
            sender, body, payload = self._inbox.popleft()
            payload = self._take_buffers(sender, body, payload)
            try:
                seq = body.seq
                if body.full:
                    hat = payload[0].reshape(-1).to(torch.float32, copy=True)
                    if hat.numel() != self.flat.numel:
                        raise ValueError(f"{hat.numel()} values for {self.flat.numel} parameters")
                    self._hats[sender] = hat
                elif sender in self._hats and self._next_seq_in.get(sender) == seq:
                    self._hats[sender].add_(decode(packet_from_wire(body.header, payload)).reshape(-1))
                else:
                    raise ValueError(f"update {seq} does not follow {self._next_seq_in.get(sender)}")
                self._next_seq_in[sender] = seq + 1
            except Exception as exc:  # a gap or a bad packet: forget the copy, ask for a full one
                log.info("%s: resync public copy of %s: %s", self.node.peer_id, sender, exc)
                self._hats.pop(sender, None)
                self._next_seq_in.pop(sender, None)
                self.node.send(sender, RESYNC_TOPIC, Resync().to_wire())

    # ------------------------------------------------------------------ network thread
    async def _on_pull(self, msg: Message) -> Reply | dict[str, Any]:
        """Average with a requester: apply my half of the exchange, reply my parameters."""
        theirs = msg.payload[0] if len(msg.payload) == 1 + self._int_frames else None
        their_ints = self._ints_of(msg.payload[1:])
        if not self._open:
            return refusal(Refusal.CLOSED)
        refuse = self._refuse[PULL_TOPIC]
        try:
            xid = Pull.from_wire(msg.body).xid
        except BodyError as exc:
            return refuse(Refusal.MALFORMED, f"{msg.sender}: {exc}")
        if (not isinstance(theirs, torch.Tensor) or theirs.dtype != torch.float32 or theirs.numel() != self.numel
                or their_ints is None):
            return refuse(Refusal.MALFORMED, f"{msg.sender}: expected {self.numel} float32 parameters and buffers"
                          + (f", then {self.buffers.int_numel} int64 buffers" if self._int_frames else ""))
        if not bool(torch.isfinite(theirs).all()):
            return refuse(Refusal.NOT_FINITE, f"{msg.sender}: non-finite parameters")
        deadline = time.monotonic() + self.config.pull_timeout_s / 2
        while not self._params_lock.acquire(blocking=False):  # never block the network thread
            if time.monotonic() > deadline:
                return refusal(Refusal.BUSY)
            await asyncio.sleep(_LOCK_POLL_S)
        if self._cancelled.get(msg.sender) == xid:
            self._params_lock.release()
            return refusal(Refusal.CANCELLED, "cancelled by the requester")
        try:
            mine, ints = self._read_mixed(), self._read_ints()
            delta = (theirs.reshape(-1) - mine).mul_(self.config.mixing)
            self._add_mixed(delta, their_ints)
            self._keep_for_undo(msg.sender, xid, delta)
        finally:
            self._params_lock.release()
        return Reply(Pulled().to_wire(), (mine, *ints))

    def _keep_for_undo(self, requester: str, xid: int, delta: torch.Tensor) -> None:
        """Keep the half-exchange just applied for `requester` until it acks or undoes it.

        A requester whose reply came too late asks for its half back (`gossip.undo`) so that
        the swarm mean stays exact; one that got the reply says so (`gossip.ack`) and the entry
        goes at once. So the table holds only exchanges whose reply or ack is still in flight.
        It keeps at most `max_undo_entries` (memory: that many parameter vectors, not one per
        requester) and drops the oldest beyond that. An undo that arrives for a dropped entry
        is refused and counted (`undo_refused`), and changes nothing: that one exchange then
        moves the swarm mean by mixing * (x_requester - x_mine) / n. That needs more than
        `max_undo_entries` replies in flight at once and the dropped one to time out.
        """
        self._applied.pop(requester, None)  # one open exchange per requester: its new pull ends the old one
        self._applied[requester] = (xid, delta)
        while len(self._applied) > self.config.max_undo_entries:
            self._drop_undo_entry(next(iter(self._applied)), "undo_evicted")

    def _drop_undo_entry(self, requester: str, counter: str) -> None:
        xid, _ = self._applied.pop(requester)
        self._dropped[requester] = xid
        self.counters[counter] += 1

    def _entry_to_undo(self, requester: str, xid: int) -> tuple[int, torch.Tensor] | None:
        """The kept entry that an undo of `xid` takes back, or None (having refused it, or
        noted that the pull, not applied yet, must never be)."""
        entry = self._applied.get(requester)
        if entry is not None and entry[0] == xid:
            return entry
        if self._dropped.get(requester) == xid:
            self.counters["undo_refused"] += 1
            self.node.stats.count_rejected("gossip.undo_of_dropped_entry")
            log.warning("%s: cannot undo exchange %s with %s: its entry was dropped (over max_undo_entries=%d "
                        "or the peer left); the swarm mean moves by that half-exchange",
                        self.node.peer_id, xid, requester, self.config.max_undo_entries)
        else:
            self._cancelled[requester] = xid  # the pull has not been applied yet: never apply it
        return None

    async def _on_undo(self, msg: Message) -> None:
        """Take back the half-exchange a timed-out requester never completed."""
        undo = self._read(msg, UNDO_TOPIC, Undo)
        if undo is None or self._entry_to_undo(msg.sender, undo.xid) is None:
            return
        while not self._params_lock.acquire(blocking=False):  # never block the network thread
            await asyncio.sleep(_LOCK_POLL_S)
        try:
            entry = self._entry_to_undo(msg.sender, undo.xid)  # again: it may have been dropped meanwhile
            if entry is not None:
                del self._applied[msg.sender]
                self._add_mixed(-entry[1], None)  # the integers keep their maximum: it undoes nothing
                self.counters["undone"] += 1
        finally:
            self._params_lock.release()

    def _on_ack(self, msg: Message) -> None:
        """The requester applied its half: the exchange is complete, forget mine."""
        ack = self._read(msg, ACK_TOPIC, PullAck)
        entry = self._applied.get(msg.sender)
        if ack is not None and entry is not None and entry[0] == ack.xid:
            del self._applied[msg.sender]

    def _read(self, msg: Message, topic: str, body_type: type[_OneWay]) -> _OneWay | None:
        """A one-way message's body, or None (counted and logged) for a malformed one."""
        try:
            return body_type.from_wire(msg.body)
        except BodyError as exc:
            self._refuse[topic].count(Refusal.MALFORMED.value, f"{msg.sender}: {exc}")
            return None

    # ------------------------------------------------------------------ buffers (with the params lock held)
    def _read_mixed(self) -> torch.Tensor:
        """What an exact exchange mixes: the parameters, then the floating buffers."""
        params = self.flat.read_params()
        if self.numel == self.flat.numel:
            return params
        assert self.buffers is not None
        return torch.cat([params, self.buffers.read_floats().to(params.device)])

    def _add_mixed(self, delta: torch.Tensor, their_ints: torch.Tensor | None) -> None:
        self.flat.add_to_params(delta[:self.flat.numel])
        if self.numel > self.flat.numel:
            assert self.buffers is not None
            self.buffers.add_to_floats(delta[self.flat.numel:])
        if their_ints is not None and self._int_frames:
            assert self.buffers is not None
            self.buffers.max_ints(their_ints)

    def _read_ints(self) -> list[torch.Tensor]:
        return [self.buffers.read_ints().cpu()] if self.buffers else []

    def _read_buffers(self) -> list[torch.Tensor]:
        """CHOCO: the buffers as sent after the packet, floats then integers (either may be empty)."""
        return [self.buffers.read_floats().cpu(), *self._read_ints()] if self.buffers else []

    def _ints_of(self, frames: Any) -> torch.Tensor | None:
        """A peer's integer buffers from the frames after its vector (none when buffers stay
        local); None when they do not fit this model."""
        if len(frames) != self._int_frames:
            return None
        if self.buffers is None:
            return torch.zeros(0, dtype=torch.int64)
        ints = frames[0]
        ok = isinstance(ints, torch.Tensor) and ints.dtype == torch.int64 and ints.numel() == self.buffers.int_numel
        return ints.reshape(-1) if ok else None

    def _take_buffers(self, sender: str, body: Choco, payload: tuple[torch.Tensor, ...]
                      ) -> tuple[torch.Tensor, ...]:
        """CHOCO: keep a neighbour's buffers from the end of its message; the rest is its packet."""
        count = body.buffers
        if count > len(payload):
            return payload  # the packet's own check refuses it
        frames, payload = payload[len(payload) - count:], payload[:len(payload) - count]
        if self.buffers is None:
            return payload
        ints = self._ints_of(frames[1:])
        floats = frames[0] if frames else None
        if (ints is None or floats is None or floats.dtype != torch.float32
                or floats.numel() != self.buffers.float_numel or not bool(torch.isfinite(floats).all())):
            log.info("%s: buffers from %s do not fit this model; not mixed", self.node.peer_id, sender)
        else:
            self._their_buffers[sender] = (floats.reshape(-1), ints)
        return payload

    def _on_choco(self, msg: Message) -> None:
        if not self._open:
            return
        body = self._read(msg, CHOCO_TOPIC, Choco)
        if body is not None:
            payload = tuple(p.clone() if isinstance(p, torch.Tensor)
                            else torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in msg.payload)
            self._inbox.append((msg.sender, body, payload))

    def _on_resync(self, msg: Message) -> None:
        if self._read(msg, RESYNC_TOPIC, Resync) is not None:
            with self._hat_lock:
                self._has_my_hat.discard(msg.sender)

    # ------------------------------------------------------------------ hooks and state
    def on_peer_joined(self, peer_id: str) -> None:
        with self._hat_lock:  # it may have lost our public copy while away
            self._has_my_hat.discard(peer_id)

    def on_peer_left(self, peer_id: str) -> None:
        with self._hat_lock:
            self._has_my_hat.discard(peer_id)
        self._their_buffers.pop(peer_id, None)
        # One that left will neither ack nor undo. One declared dead may only have stalled
        # (and still undo): its entry stays, bounded by max_undo_entries like any other.
        if peer_id in self._applied and self.node.status_of(peer_id) is PeerStatus.LEFT:
            self._drop_undo_entry(peer_id, "undo_dropped_peer_left")

    def consensus_vector(self) -> torch.Tensor:
        """This peer's parameters as one float32 vector (for measuring consensus)."""
        with self._params_lock:
            return self.flat.read_params()

    def state_dict(self) -> dict[str, Any]:
        with self._params_lock:
            return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._params_lock:
            super().load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "step": self.step_count, "mode": "choco" if self.choco else "exact",
                "parameters": self.flat.numel, "undo_entries": len(self._applied), "counters": dict(self.counters)}


def _same_shape(theirs: Any, mine: torch.Tensor) -> bool:
    return (isinstance(theirs, torch.Tensor) and theirs.dtype == mine.dtype and theirs.numel() == mine.numel()
            and bool(torch.isfinite(theirs).all()))
