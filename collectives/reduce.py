"""A sharded all-reduce over Starling's transport: the round engine that `allreduce`,
`diloco` and `sketch-dp` average their vectors with.

Reduce-scatter by shard owners (hivemind's butterfly all-reduce), one request per chunk:

    members  = sorted(live peers + me)                 # the caller's view of round t
    split v into P = |owners| contiguous shards, owners being the reachable members (all
    members when none is reachable); shard i is owned by owners[i]
    split each shard into chunks of at most chunk_numel values
    for each chunk c of each shard i, in parallel:
        send chunk (i, c) to shard i's owner (TOPIC)   # the owner's reply is the average
    owner of shard i, for each chunk c:
        sum the parts of (t, members, i, c) until every expected member has sent one,
            or round_timeout_s after the first part arrived
        reply to every contributor with (sum / count, contributors); a part that comes after
            the group closed gets the same reply (kept two rounds)
    chunk whose average did not come back in time: `unaveraged` on every member alike (0 for
        an update), or the local values where the reducer averages state (owner reported lost)

Chunks pipeline the round (an owner sums and answers the first chunks while later ones are
still on the wire), and keep the buffers a round allocates (encoded parts, received frames,
sums) small enough for the allocator to recycle: glibc maps buffers of tens of MB fresh from
the kernel each time, and their page faults can cost more than the copies. All of a round's
requests are in flight at once. With a zero-copy (lossless) codec, parts and averages are
read in place from the wire buffers (`decode(copy=False)`), and an average goes out without a
copy (`encode(copy=False)`); a blocking `reduce` also sends its parts as slices of the
caller's vector (`start(lend=True)`).

Each peer sends (P-1)/P of the vector as parts and (P-1)/P as averages: 2(P-1)/P in all,
the bandwidth-optimal figure. Every member decodes the same averaged packet, so replicas stay
bit-identical even under a lossy compressor (which gets error feedback in both directions).

Honesty about membership: a part names its sender's member list; an owner groups parts by
(round, member list, shard), so peers whose views disagree never mix shard boundaries. An
owner stops waiting for a member that it has seen contribute under a different view of the
same round, that has moved on to a later round, or that died or left; a member never waits
past round_timeout_s + reply_grace_s. Both timeouts count the loop's awake time
(`node.loop.AwakeDeadline`): a stall of this process does not close a group while the part
it waits for sits unread in the socket, and every timeout still ends by _STRETCH times its
length in wall time.

A member whose view of round t differs from an owner's hears so from that owner's answer (the
owner is not among its shard's contributors) and stops waiting for the owner's part there.

Each part may name a digest of the state its author began the round with (`state`); an owner
whose contributors named different ones flags its average, and `ReduceResult.diverged` tells
the members, whose drift guard then checks right after the round (`protocols/guard.py`).

A member that will send nothing in round t says so (`skip(t)`): a joiner whose state was taken
after the round began, or one that jumped past the round to catch up. Every live peer's groups
of round t then stop waiting for it, and so do its own; without this, each of them waited for
round_timeout_s. A member that skipped a round is reported as `skipped`, not `lost`.

A reducer serves one vector of a fixed length under one topic; a protocol that averages
several vectors (DiLoCo's fragments) makes one reducer per vector, each with its own topic,
so that their rounds are independent and several may be in flight at once.

What members and owners send each other (parts, skips, averages) is typed in
`collectives/bodies.py`; bad input is refused through `node.rpc.Refuser`, which counts it.

For audits (`protocols/audit.py`), an owner keeps the signed parts of the authors it will audit
past their groups' close: `keep(t, authors)` before round t, `take_kept(t)` after its `wait()`.

What this file holds is the round itself; the rest joins it at seams, each in its own file:

    placement.py    who owns which chunks of round t over a member list
    contributions   signatures on parts and averages, and the evidence they make
    screening.py    RoundDefence: what an owner holds against the parts it sums, and the
                    robust aggregator's centres (on_part, on_close, on_chosen)
    retention.py    RoundDefence: signed parts kept past their close for audits (on_close)
    gathering.py    an author's kept parts, gathered from every owner that kept them
    voting.py       a member's vote among a chunk's replicated owners
    checking.py     RoundDefence: an owner keeps its groups' parts (on_close) for members
                    drawn after the round, who average them again (`Checks.after_round`)
    suspicion.py    owners score each part against its chunk's median in their signed
                    averages; every member runs the same test on the scores
    secure.py       SecureStage: members mask their parts, an owner unmasks its group's sum
                    (`close`) instead of averaging it

and a round's outcome is decided in one method, `_apply`, which a reader can check alone.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starling.collectives.accumulator import ShardGroup, Verdict
from starling.collectives.bodies import Average, BodyError, Part, Refused, Skip
from starling.collectives.checking import Checks, Recount
from starling.collectives.codec import encode, make_codec, packet_from_wire
from starling.collectives.compact import HeaderTemplates, KnownViews, view_digest
from starling.collectives.contributions import Contributions, Recipe, SignedPart, content_digest, vote_key
from starling.collectives.defences import Defences, RoundDefence
from starling.collectives.gathering import Gathering
from starling.collectives.layout import DEFAULT_CHUNK_NUMEL
from starling.collectives.outcome import ReduceResult, ReduceTimeouts, ShardResult
from starling.collectives.placement import Placement
from starling.collectives.requests import request_patiently
from starling.collectives.retention import KeptPart, Retention
from starling.collectives.screening import Screening
from starling.collectives.secure import Masked, SecureAggregation, SecureStage
from starling.collectives.staging import HostStaging, to_device
from starling.collectives.suspicion import Suspicion
from starling.collectives.voting import OwnerVote
from starling.common.faults import fault_point
from starling.compressors import Packet, decode
from starling.node.loop import AwakeDeadline, close_in_time
from starling.node.rpc import Refusal, Refuser, RemoteError, Reply, refusal, refusal_of
from starling.node.trust import Evidence
from starling.node.wire import Message

if TYPE_CHECKING:
    from starling.node import Node

log = logging.getLogger(__name__)

_KEEP_CLOSED_ROUNDS = 64  # how long an owner remembers finished rounds, to answer late parts
_KEEP_SKIPS = 2 * _KEEP_CLOSED_ROUNDS  # rounds whose skips a reducer remembers (peers can send any round)
UNBOUNDED = "avg.unbounded"  # witness evidence: an average larger than its own signed scores allow
MISSCORED = "avg.misscored"  # witness evidence: an owner signed a size of my part that is not its size
LOSSY_AVERAGE_SLACK = 1.5  # a lossy average's |values|^2 may exceed the exact one's by this (int4: ~1.23)
_KEEP_ANSWERS = 2  # rounds whose closed groups' averages an owner still gives to a late part
GroupKey = tuple[int, tuple[str, ...], int, int]  # (round, members, shard, chunk)
_STRETCH = AwakeDeadline.STRETCH  # a round's timeouts count awake time, and end by this many times their length


@dataclass
class _Slot:
    """One chunk of a round as this member sends it: its owners, my own values for my own
    group (if I own it), the packet for the other owners and my signature of it."""

    shard: int
    chunk: int
    owners: tuple[str, ...]
    lo: int
    numel: int
    own: torch.Tensor | None
    packet: Packet | None
    sig: bytes | None = None


class PendingReduce:
    """A round in flight. `wait()` (on the caller's thread) decodes the averages into the
    caller's vector and returns the outcome; `done()` says whether it would not block."""

    def __init__(self, reducer: ShardedReducer, t: int, members: tuple[str, ...], vector: torch.Tensor,
                 future: concurrent.futures.Future[list[ShardResult]] | None, wait_s: float = 0.0,
                 lent: list[torch.Tensor] | None = None) -> None:
        self._reducer, self.round, self._members, self._vector = reducer, t, members, vector
        self._future, self._wait_s = future, wait_s
        self._lent = lent or []  # pinned host buffers my parts went out in (device vectors only)
        self._result: ReduceResult | None = None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> ReduceResult:
        if self._result is None:
            if self._future is None:
                self._result = ReduceResult(self.round, False, 1, (), self.round)
            else:
                results = self._future.result(timeout=self._wait_s)
                self._reducer._staging.give_back(self._lent)  # the round is over: nothing reads them now
                self._lent = []
                self._result = self._reducer._apply(self.round, self._members, self._vector, results)
        return self._result


class ShardedReducer:
    """Averages one float32 vector of `numel` values with the same reducer on other peers.

    `reduce` blocks the calling (training) thread; `start` returns a `PendingReduce` so
    that the caller can keep computing while the round runs (Streaming DiLoCo's overlap).
    """

    def __init__(self, node: Node, topic: str, numel: int, compressor: str = "none",
                 timeouts: ReduceTimeouts | None = None, is_open: Callable[[], bool] = lambda: True,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL, min_shard_numel: int = 1,
                 part_feedback: bool = True, average_compressor: str | None = None,
                 part_feedback_decay: float = 1.0, defences: Defences | None = None,
                 secure: SecureAggregation | None = None, max_owners: int = 0,
                 unaveraged: float | None = None) -> None:
        self.node = node
        self.topic = topic
        self.numel = numel
        self.defences = defences or Defences()
        # who owns which chunks of a round (collectives/placement.py): every peer of a swarm must
        # use the same chunk_numel, min_shard_numel, max_owners and owner replication
        self.placement = Placement(numel, chunk_numel, min_shard_numel, max_owners,
                                   self.defences.owner_replication, node.is_reachable)
        self.timeouts = timeouts or ReduceTimeouts()
        self._is_open = is_open
        # A chunk that no owner averaged (its owner died before it answered, its owners disagree,
        # its unmasking failed): None keeps each member's local values, which is right for state
        # that is averaged (BatchNorm statistics) and wrong for an update, where every member would
        # apply its own; a number is written there on every member alike (0: the chunk's update is
        # skipped the same way everywhere, and the members stay identical).
        self.unaveraged = unaveraged
        # part_feedback_decay < 1: SparseLoCo's decaying accumulator on my parts (owners' average
        # residuals never decay: what the second hop dropped is everyone's, owed in full)
        self.codec, self._part_feedback = make_codec(compressor, part_feedback_decay)
        if not part_feedback:  # what my lossy parts drop is lost (owners still feed back their averages')
            self._part_feedback = None
        # Owners may encode averages with another codec: a sparse one that keeps the union of the
        # parts' supports (K P a chunk), so the second hop drops no support (docs/architecture.md).
        self.average_codec, self._avg_feedback = make_codec(average_compressor or compressor)
        # headers both ends can rebuild stay off the wire (collectives/compact.py)
        self._part_headers, self._avg_headers = HeaderTemplates(self.codec), HeaderTemplates(self.average_codec)
        self._known_views = KnownViews()  # member lists parts may name by digest (network thread)
        self._staging = HostStaging()  # where a device vector's encoded parts cross to the host
        # Network-thread state: open accumulators, finished keys, who used which view when.
        self._groups: dict[GroupKey, ShardGroup] = {}
        self._closed: dict[GroupKey, int] = {}
        # the answers of the last _KEEP_ANSWERS rounds' closed groups: a member whose part came
        # after its group closed gets the average the others got, not a refusal that would leave
        # it alone with its own values for the chunk
        self._answers: dict[GroupKey, tuple[dict[str, Any], tuple[torch.Tensor, ...]]] = {}
        self._views: dict[tuple[int, str], tuple[str, ...]] = {}
        self._peer_round: dict[str, int] = {}  # the latest round each peer is known to be in
        self._gone: set[str] = set()
        self._latest_round = -1  # the latest round this peer has started
        # round -> members that said they send nothing in it (frozen: the caller's thread reads it)
        self._skipped: dict[int, frozenset[str]] = {}
        self._refuse = Refuser(node.stats, topic, node.peer_id)
        # Against members it cannot trust (collectives/defences.py): signatures on every part and
        # average (collectives/contributions.py), then the round's seams: what an owner holds
        # against members and the robust aggregator's centres (screening.py), the parts kept for
        # audits (retention.py), and each member's vote among replicated owners (voting.py).
        self._trust = node.trust
        self._contributions = Contributions(node, topic, self.defences.max_weight)
        if self.defences.fixed_answers:
            # Replicated owners must send the same bits for the same parts, and checkers must get
            # them again from the parts: an average's error feedback is an owner's own history
            # (one that missed a part once would differ for good).
            self._avg_feedback = None
        self.screening = Screening(node.peer_id, topic, self._trust, self.defences, self._contributions,
                                   self._refuse)
        self.retention = Retention(node.peer_id, topic)
        self._seams: tuple[RoundDefence, ...] = (self.screening, self.retention)
        self._votes = OwnerVote(node.peer_id, topic, self._trust, self.defences.accuse_after)
        # With a robust aggregator, owners score each part against its chunk's median and every
        # member runs the same test on the signed scores (collectives/suspicion.py).
        self.suspicion = (Suspicion(node.peer_id, topic, self._trust, numel, self.defences.suspicion)
                          if self.defences.aggregator.robust else None)
        self._averaging: set[asyncio.Future[None]] = set()  # averages running off the loop (robust, secure)
        # Secure aggregation (collectives/secure.py): parts masked in a ring, owners learn only sums
        self._secure: SecureStage | None = None
        if secure is not None:
            if compressor != "none" or average_compressor not in (None, "none"):
                raise ValueError(f"{topic}: secure aggregation encodes parts itself; the compressor must be 'none'")
            if self.defences.aggregator.robust or self.defences.fixed_answers:
                raise ValueError(f"{topic}: secure aggregation hides the parts that a robust aggregator, "
                                 "replicated owners or checkers must see")
            self._secure = SecureStage(node, topic, secure, self._refuse, self.placement.owner_set, self._resolve_view,
                                       reveal_timeout_s=self.timeouts.reply_grace_s / 2, groups=self.placement.groups,
                                       held_wait_s=self.timeouts.round_timeout_s)
        # With one owner per shard, members drawn after each round check its averages
        # (collectives/checking.py): the owner keeps its groups' parts for them (on_close).
        self.checks: Checks | None = None
        if self.defences.check_rate > 0.0:
            recount = Recount(topic, self.defences.aggregator, average_compressor or compressor, self.suspicion,
                              self._contributions, self._chunk_bounds)
            self.checks = Checks(node, topic, self.defences.check_rate, recount, self._refuse,
                                 self._reply_within_s, self.timeouts.retry_interval_s)
            self._seams += (self.checks,)
        # an author's kept parts, gathered from every owner (collectives/gathering.py)
        self.gathering = Gathering(node, topic, self.placement, self.retention, self._contributions,
                                   self.timeouts, self._refuse, self._resolve_view)
        node.on(topic, self._on_part)

    # ------------------------------------------------------------------ caller's thread
    def reduce(self, t: int, members: tuple[str, ...], vector: torch.Tensor) -> ReduceResult:
        """Average `vector` (float32, 1-D, `numel` values) in place over `members` for round t.
        Blocks until the round has ended, so the round reads `vector` in place (`lend`)."""
        return self.start(t, members, vector, lend=True).wait()

    def start(self, t: int, members: tuple[str, ...], vector: torch.Tensor, lend: bool = False,
              weight: float | None = None, recipe: Recipe | None = None, noise_std: float = 0.0,
              state: bytes | None = None) -> PendingReduce:
        """Encode my parts now and run round t on the network thread; `wait()` on the
        result writes the average into `vector`. Encoding and decoding happen on the
        caller's thread, so the network loop only moves bytes.

        By default the caller may write `vector` as soon as this returns: my parts, own
        ones included, are copies. With `lend` the round reads `vector` in place instead (a
        zero-copy codec sends its slices as they are, and my own shard's sum starts
        from a view of it), which saves a copy of the whole vector; the caller must then not
        write `vector` before `wait()` has returned. `wait()` returns only once the round has
        ended (every timer of the round ends by _STRETCH times its length), so that nothing
        of the round reads `vector` later. One edge remains: a part that never reached an
        owner (not connected) may still sit in ZeroMQ's queue, and would carry later writes;
        that owner refuses it as late once it has closed the round.

        `weight`: what my parts count for in the average (the tokens they were computed on;
        None counts 1). Owners average by the members' weights; equal ones give the plain average.
        `recipe`: what my parts were computed from (plain data), signed with each of them.
        `noise_std` (secure aggregation only): my share of the round's noise, added to my
        integers before they are masked (see `SecureStage.mask`). `state`: a short digest
        (`STATE_DIGEST_BYTES`) of the state I begin the round with, where the members should hold
        the same: an owner whose contributors named different ones says so in its average, and
        the result's `diverged` tells every member that got it."""
        if weight is not None and not (math.isfinite(weight) and weight >= 0.0):
            raise ValueError(f"{self.topic}: weight must be a finite number >= 0, got {weight!r}")
        if vector.dim() != 1 or vector.numel() != self.numel or vector.dtype != torch.float32:
            raise ValueError(f"{self.topic}: expected a 1-D float32 vector of {self.numel} values (on any device), "
                             f"got {vector.dtype} of shape {tuple(vector.shape)}")
        if noise_std and self._secure is None:
            raise ValueError(f"{self.topic}: noise in the ring needs secure aggregation")
        if len(members) <= 1:
            return PendingReduce(self, t, members, vector, None)
        if self._secure is not None:
            return self._start_secure(t, members, vector, weight, recipe, noise_std, state)
        me = self.node.peer_id
        lend = lend and vector.is_contiguous()  # a strided vector's slices are not wire buffers
        # A vector on an accelerator is encoded there; only the encoded bytes cross to the host,
        # through pinned buffers reused round after round. My own part, which the network
        # thread sums with the others on the host, crosses as a private copy.
        on_device = HostStaging.needed(vector)
        slots: list[_Slot] = []  # shard by shard, chunk by chunk
        lent: list[torch.Tensor] = []
        for i, (chunks, owners) in enumerate(self.placement.shards(members, t)):
            for c, (lo, hi) in enumerate(chunks):
                own = packet = None
                if me in owners:  # my own part never crosses the wire
                    if on_device:
                        own = vector[lo:hi].to("cpu")
                    else:
                        own = vector[lo:hi] if lend else vector[lo:hi].clone()
                # Encoded once, for every other owner of the shard; and, where checkers may ask
                # for it, for myself: a lossy part I own is summed as the others see it, and shown
                # as I signed it (not as float32, which would cost a check 8 times an int4 part).
                shown = own is not None and self.checks is not None and not self.codec.lossless
                if any(o != me for o in owners) or shown:
                    if lend and self.codec.zero_copy:  # lossless too: no error feedback to apply
                        packet = self.codec.encode(vector[lo:hi], copy=False)
                    else:
                        packet = encode(self.codec, self._part_feedback, vector[lo:hi],
                                        f"part{i}.{c}/{len(members)}")
                    if on_device:
                        packet, more = self._staging.stage(packet)
                        lent.extend(more)
                    if own is not None and not self.codec.lossless:
                        own = None  # decoded below, once the bytes are final: every owner sums what the others got
                slots.append(_Slot(i, c, owners, lo, hi - lo, own, packet))
        if lent:
            self._staging.ready([vector.device])  # the network thread reads them next
        view = view_digest(members)
        for slot in slots:  # signed once the bytes are final (staged ones are, after `ready`)
            if slot.own is None and me in slot.owners:  # an owner sums my part as the others see it
                assert slot.packet is not None
                slot.own = decode(slot.packet).reshape(-1)
            if slot.packet is not None:
                slot.sig = self._contributions.sign_part(t, slot.shard, slot.chunk, view, weight, slot.packet,
                                                         recipe, state)
        round_ = self._round(t, members, slots, own_private=not lend or on_device, weight=weight, recipe=recipe,
                             state=state)
        return PendingReduce(self, t, members, vector, self.node.submit(round_), self._backstop_s, lent)

    @property
    def _reply_within_s(self) -> float:
        """How long a member waits for an owner's average: the group's timeout and the grace,
        and with secure aggregation the owner's unmasking too (the round's unmasker waits up to
        a round timeout for every group's held set, then each owner may wait for it and ask the
        survivors itself: a reveal timeout each)."""
        # the unmasker's own time, then an owner's wait for it and its own two rounds of asks
        unmasking = 0.0 if self._secure is None else (self._secure.unmask_within_s + self._secure.reveal_timeout_s
                                                      + 2 * (self._secure.reveal_timeout_s + 1.0))
        return self.timeouts.round_timeout_s + self.timeouts.reply_grace_s + unmasking

    @property
    def _backstop_s(self) -> float:
        """How long `wait()` waits at most. A backstop only: the network side always ends a
        round by then (see AwakeDeadline)."""
        return _STRETCH * self._reply_within_s + 5.0

    def _start_secure(self, t: int, members: tuple[str, ...], vector: torch.Tensor, weight: float | None,
                      recipe: Recipe | None, noise_std: float = 0.0, state: bytes | None = None) -> PendingReduce:
        """`start` with secure aggregation: the whole vector masked once in its ring, each
        chunk sent as the ring's 32-bit words (bytes only the owner's sum makes sense of), my
        own part masked like the others (my pair masks must cancel in my own shard's sum too)."""
        assert self._secure is not None
        if recipe is not None:
            raise ValueError(f"{self.topic}: secure aggregation carries its own recipe; audits cannot see its parts")
        me, view = self.node.peer_id, view_digest(members)
        masked = self._secure.mask(t, members, view, vector, weight, noise_std)
        ring = torch.from_numpy(masked.ring.view(np.int32)).view(torch.float32)  # the same bytes, a lossless frame
        slots: list[_Slot] = []
        for i, (chunks, owners) in enumerate(self.placement.shards(members, t)):
            for c, (lo, hi) in enumerate(chunks):
                own = ring[lo:hi] if me in owners else None
                packet = self.codec.encode(ring[lo:hi], copy=False) if any(o != me for o in owners) else None
                slot = _Slot(i, c, owners, lo, hi - lo, own, packet)
                if packet is not None:
                    slot.sig = self._contributions.sign_part(t, i, c, view, weight, packet, masked.recipe, state)
                slots.append(slot)
        round_ = self._round(t, members, slots, own_private=True, weight=weight, recipe=masked.recipe,
                             masked=masked, state=state)
        return PendingReduce(self, t, members, vector, self.node.submit(round_), self._backstop_s)

    def _chunk_bounds(self, members: tuple[str, ...], t: int, i: int, c: int) -> tuple[int, int] | None:
        shards = self.placement.shards(members, t)
        if not (0 <= i < len(shards) and 0 <= c < len(shards[i][0])):
            return None
        return shards[i][0][c]

    def _resolve_view(self, view: bytes) -> tuple[str, ...] | None:
        try:
            return self._known_views.resolve(view, self._current_view)
        except ValueError:
            return None

    @property
    def _replicated(self) -> bool:
        return self.defences.owner_replication > 1

    def skip(self, t: int) -> None:
        """This peer sends nothing in round t (it took the swarm's state after the round began,
        or jumped past it to catch up): its own groups of round t stop waiting for it, and it
        tells every live peer, whose groups stop waiting too. Call from the caller's thread."""
        self.node.run(self._skip_here(t))
        for peer in self.node.live_peers():
            self.node.send(peer, self.topic, Skip(t).to_wire())  # one way: a peer that died meanwhile misses it

    async def _skip_here(self, t: int) -> None:
        self._saw_skip(t, self.node.peer_id)

    def keep(self, t: int, authors: frozenset[str] | set[str]) -> None:
        """Keep the signed parts that `authors` send my groups in round t past the groups' close,
        for `take_kept(t)` (collectives/retention.py). Call from the caller's thread before
        `start(t, ...)`."""
        self.retention.ask(t, authors)

    def take_kept(self, t: int) -> dict[str, list[KeptPart]]:
        """Caller's thread, after round t's `wait()`: each kept author's parts of round t, chunk by
        chunk, decoded; forgotten here once taken."""
        return self.retention.decoded(t, self.node.run(self._take_kept_here(t)))

    async def _take_kept_here(self, t: int) -> Any:
        return self.retention.take(t)

    def _apply(self, t: int, members: tuple[str, ...], vector: torch.Tensor,
               results: list[ShardResult]) -> ReduceResult:
        """The round's outcome, decided here and nowhere else. Each chunk commits or is skipped,
        the same way on every member: one that came back averaged is written over the local
        values (every member decodes the same signed packet); one that did not (its owner died
        or stalled before it answered, its owners disagreed, it could not be unmasked) takes
        `unaveraged` on every member (0 for an update: nobody applies its own), or keeps the
        local values where the reducer averages state. Then who was missing is collected."""
        me, synced, lost = self.node.peer_id, False, set()
        missing: dict[str, int] = {}  # member -> averages it is missing from
        averaged = 0
        skipped = self._skipped.get(t, frozenset())
        bounds = self.placement.bounds(members, t)
        for (lo, hi), res in zip(bounds, results):
            avg = None
            if res.packet is None:
                reason = res.reason
            else:
                try:
                    avg = _decode_flat(to_device(res.packet, vector.device))  # decoded where it is used
                    if avg.numel() != hi - lo:
                        raise ValueError(f"{avg.numel()} values for a chunk of {hi - lo}")
                except Exception as exc:  # a bad reply costs one chunk's average, not the round
                    log.warning("%s: bad average for %s shard %d chunk %d from %s: %s", me, self.topic, res.shard,
                                res.chunk, res.owner, exc)
                    avg, reason = None, f"bad average: {exc}"
                if avg is not None and not self._within_bound(t, (lo, hi), res, avg, vector[lo:hi]):
                    avg, reason = None, "an average larger than its parts allow"
            if avg is None:
                log.info("%s: %s shard %d chunk %d of round %d was not averaged (%s): %s", me, self.topic, res.shard,
                         res.chunk, t, reason, "keeps its local values" if self.unaveraged is None
                         else f"every member writes {self.unaveraged:g}")
                if self.unaveraged is not None:
                    vector[lo:hi].fill_(self.unaveraged)
                lost.add(res.owner)
                continue
            vector[lo:hi].copy_(avg)
            left_out = set(members) - set(res.contributors)
            lost.update(left_out)
            averaged += 1
            for member in left_out:  # this peer too: `lost` drops it below, `absent` keeps it
                missing[member] = missing.get(member, 0) + 1
            synced = synced or len(res.contributors) > 1
        lost.discard(me)
        ahead = max([t] + [r.owner_round for r in results])
        shares = next((r.shares for r in results if r.shares), ())
        absent = {m for m, n in missing.items() if n == averaged} - skipped
        if not averaged and self.unaveraged is not None and len(members) > 1:
            absent = set(members) - skipped  # every chunk skipped: nobody's part counted
        if ahead > t:  # the owners had gone on: nothing of this peer's counted in this round
            absent.add(me)
        diverged = any(r.diverged for r in results if r.packet is not None)
        return ReduceResult(t, synced, len(members) - len(lost), tuple(sorted(lost - skipped)), ahead,
                            tuple(sorted(lost & skipped)), shares, tuple(sorted(absent)), diverged)

    def _within_bound(self, t: int, bounds: tuple[int, int], res: ShardResult, avg: torch.Tensor,
                      mine: torch.Tensor) -> bool:
        """Caller's thread: whether an owner's robust average stays within what its signed
        scores allow (`Suspicion.over_bound`), where its parts alone give it (checked or
        replicated owners). Every member sees the same signed answer, so every member leaves an
        answer over the bound out alike, and accuses its owner. A member whose own |part|^2 the
        owner misstated (to widen the bound) accuses it too: only that member can tell."""
        if (self.suspicion is None or not self.defences.fixed_answers or res.scores is None
                or res.owner == self.node.peer_id):
            return True
        slack = 1.0 + 1e-5 if self.average_codec.lossless else LOSSY_AVERAGE_SLACK
        me = self.node.peer_id
        if (me in res.contributors and self.codec.lossless and mine.device.type == "cpu"
                and self.suspicion.own_row_wrong(bounds, mine, res.scores[1][res.contributors.index(me)])):
            log.warning("%s: %s round %d: %s signed a size of my part that is not my part's", me, self.topic, t,
                        res.owner)
            self.node.submit(self._accuse_owner(res.owner, t, MISSCORED, res))
        if not self.suspicion.over_bound(bounds, avg, res.scores, slack):
            return True
        log.warning("%s: %s shard %d chunk %d of round %d: %s's average is larger than its parts allow; left out",
                    me, self.topic, res.shard, res.chunk, t, res.owner)
        self.node.submit(self._accuse_owner(res.owner, t, UNBOUNDED, res))
        return False

    async def _accuse_owner(self, owner: str, t: int, kind: str, res: ShardResult) -> None:
        key = self._trust.key_of(owner)
        if key is not None:
            self._trust.accuse(Evidence(kind, owner, key, t, {"topic": self.topic, "shard": res.shard,
                                                              "chunk": res.chunk}))

    # ------------------------------------------------------------------ network thread
    async def _round(self, t: int, members: tuple[str, ...], slots: list[_Slot],
                     own_private: bool, weight: float | None = None,
                     recipe: Recipe | None = None, masked: Masked | None = None,
                     state: bytes | None = None) -> list[ShardResult]:
        me = self.node.peer_id
        self._latest_round = max(self._latest_round, t)
        view = self._known_views.add(members)  # my parts name it by digest; owners know it from theirs
        riding: dict[tuple[int, int, str], tuple[int, bytes]] = {}  # (shard, chunk, owner) -> my share for it
        if masked is not None and self._secure is not None:
            # My seed's shares: each rides on my first part to its holder where the holder owns a
            # shard, the others go on their own, before my parts.
            loose = dict(masked.deals)
            for slot in slots:
                for owner in slot.owners:
                    deal = loose.pop(owner, None)
                    if deal is not None:
                        riding[slot.shard, slot.chunk, owner] = (deal.x, deal.box)
            await self._secure.deal(masked, loose)
        jobs = []
        for slot in slots:
            for owner in slot.owners:
                if owner == me:
                    assert slot.own is not None
                    signed = None  # my own part as I signed it, where checkers may ask for it
                    if slot.packet is not None and slot.sig is not None and self.checks is not None:
                        signed = SignedPart(view, weight, slot.packet, slot.sig,
                                            content_digest(slot.packet.header, slot.packet.buffers), recipe, state)
                    jobs.append(self._reduce_own(t, members, view, slot.shard, slot.chunk, slot.own, own_private,
                                                 weight, state, signed))
                else:
                    assert slot.packet is not None and slot.sig is not None
                    jobs.append(self._send_part(t, members, view, slot, owner, weight, recipe,
                                                riding.get((slot.shard, slot.chunk, owner)), state))
        results = iter(await asyncio.gather(*jobs))
        self._forget_before(t - _KEEP_CLOSED_ROUNDS)
        chosen = [self._vote(t, view, slot, [next(results) for _ in slot.owners]) for slot in slots]
        if self.checks is not None:
            self.checks.after_round(t, members, chosen)
        if self.suspicion is not None:
            self.suspicion.verdict(t)
        return chosen

    def _vote(self, t: int, view: bytes, slot: _Slot, answers: list[ShardResult]) -> ShardResult:
        """One chunk's answer from its owners' signed ones (collectives/voting.py), shown to the
        round's seams."""
        chosen = self._votes.choose(t, view, answers)
        for seam in self._seams:
            seam.on_chosen(t, (slot.lo, slot.lo + slot.numel), slot.owners, chosen)
        if self.suspicion is not None and chosen.packet is not None:
            self.suspicion.take(t, chosen.contributors, chosen.scores)
        return chosen

    async def _reduce_own(self, t: int, members: tuple[str, ...], view: bytes, i: int, c: int,
                          part: torch.Tensor, private: bool, weight: float | None,
                          state: bytes | None = None, signed: SignedPart | None = None) -> ShardResult:
        me = self.node.peer_id
        # private: start() cloned it, so it may become the sum; else a view of the caller's
        # vector, which the group reads and never writes
        reply, buffers = await self._reduce((t, members, i, c), me, part, owned=private,
                                            weight=1.0 if weight is None else weight, state=state, signed=signed)
        refused = Refused.from_wire(reply)
        if refused is not None:
            return ShardResult(i, c, me, None, reason=refused.reason)
        average = Average.from_wire(reply, members)  # my own group's answer: well formed
        packet = Packet(self._avg_headers.incoming(average.header, part.numel()), buffers)
        content = vote_key(content_digest(packet.header, packet.buffers), average.scores) if self._replicated else None
        return ShardResult(i, c, me, packet, average.contributors, shares=average.shares, content=content,
                           sig=average.sig, diverged=average.diverged, scores=average.scores)

    async def _send_part(self, t: int, members: tuple[str, ...], view: bytes, slot: _Slot, owner: str,
                         weight: float | None = None, recipe: Recipe | None = None,
                         deal: tuple[int, bytes] | None = None, state: bytes | None = None) -> ShardResult:
        i, c, numel, packet = slot.shard, slot.chunk, slot.numel, slot.packet
        assert packet is not None
        # Counted in awake time: an average that came while this loop was stalled is read, not dropped.
        deadline = AwakeDeadline(self._reply_within_s)
        part = Part(t, i, c, self._part_headers.outgoing(packet.header, numel), view=view, weight=weight,
                    sig=slot.sig, recipe=recipe, deal=deal, state=state)
        try:
            msg = await request_patiently(self.node, owner, self.topic, part.to_wire(), packet.buffers, deadline,
                                          self.timeouts.retry_interval_s)
            if refusal_of(msg.body) is Refusal.UNKNOWN_VIEW:  # the owner never saw my list: send it whole
                msg = await request_patiently(self.node, owner, self.topic, part.with_members(members).to_wire(),
                                              packet.buffers, deadline, self.timeouts.retry_interval_s)
        except RemoteError as exc:
            return ShardResult(i, c, owner, None, reason=str(exc))
        except Exception as exc:  # timeout, dead or unknown owner
            return ShardResult(i, c, owner, None, reason=f"{type(exc).__name__}: {exc}")
        refused = Refused.from_wire(msg.body)
        if refused is not None:
            if refused.owner_round > t:  # the owner has moved past this round: my groups stop waiting for it
                self._saw_ahead(owner, refused.owner_round)
            return ShardResult(i, c, owner, None, reason=f"owner refused: {refused.reason}",
                                owner_round=refused.owner_round)
        try:
            average = Average.from_wire(msg.body, members)
            result = packet_from_wire(self._avg_headers.incoming(average.header, numel), msg.payload)
        except Exception as exc:
            return ShardResult(i, c, owner, None, reason=f"malformed average: {exc}")
        content = self._contributions.verify_average(owner, t, i, c, view, average.contributors, result, average.sig,
                                                     average.scores)
        if content is None:  # altered on the way, or not the owner's word: worth nothing
            self._trust.note(owner, "bad_signature")
            self._refuse.count("bad_average_signature", f"round {t} shard {i} chunk {c} from {owner}")
            return ShardResult(i, c, owner, None, reason="average not signed by its owner")
        contributors = average.contributors
        if owner not in contributors:
            # An owner's group waits for the owner's own part unless it saw the owner take part
            # in round t under another view (or move past it): my groups of round t stop waiting
            # for it too. A joiner that counts everyone in round t, which the others began before
            # they knew it, gets no part from them and would wait out the round timeout.
            self._saw_view(t, owner, ())
        fault_point("reduce.member.first_average", t)
        return ShardResult(i, c, owner, result, contributors, shares=average.shares, content=content,
                           sig=average.sig, diverged=average.diverged, scores=average.scores)

    async def _on_part(self, msg: Message) -> Reply | dict[str, Any]:
        """An owner receives one member's part; its answer is the shard's average."""
        me = self.node.peer_id
        if not self._is_open():
            return refusal(Refusal.CLOSED, "protocol closed")
        try:
            if Skip.is_one(msg.body):  # the sender sends nothing in that round
                self._saw_skip(Skip.from_wire(msg.body).round, msg.sender)
                return {"ok": True}
            body = Part.from_wire(msg.body)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, str(exc))
        members = body.members
        if members is None:  # named by digest: a list I know, or none
            members = self._known_views.resolve(body.view, self._current_view)
        if members is None:  # not bad input: my view changed, or the sender's; it sends the list
            return refusal(Refusal.UNKNOWN_VIEW, "no member list of that digest here: send it whole")
        if msg.sender not in members:
            return self._refuse(Refusal.MALFORMED, "members must include the sender")
        t, i, c = body.step, body.shard, body.chunk
        if body.deal is not None and self._secure is not None:  # the sender's share of its mask seed, for me
            self._secure.take_deal(msg.sender, t, view_digest(members), *body.deal)
        shards = self.placement.shards(members, t)
        if i >= len(shards) or me not in shards[i][1]:
            return self._refuse(Refusal.NOT_OWNER, f"this peer does not own shard {i} of that member list")
        chunks = shards[i][0]
        if c >= len(chunks):
            return self._refuse(Refusal.BAD_CHUNK, f"shard {i} has {len(chunks)} chunks, not a chunk {c}")
        if body.members is not None:
            self._known_views.add(members)
        key = (t, members, i, c)
        answer = self._answers.get(key)  # the group closed: a late part gets its average, once signed
        if answer is None and (key in self._closed or t < self._latest_round):
            return refusal(Refusal.LATE, "the round already closed", step=self._latest_round)
        lo, hi = chunks[c]
        try:
            packet = packet_from_wire(self._part_headers.incoming(body.header, hi - lo), msg.payload)
        except Exception as exc:
            return self._refuse(Refusal.BAD_PART, f"bad part: {exc}")
        view = body.view if body.view is not None else view_digest(members)
        content = self._contributions.verify_part(msg.sender, t, i, c, view, body.weight, packet, body.sig,
                                                  body.recipe, body.state)
        if content is None:  # altered on the way, or not its sender's: held against nobody
            self._trust.note(msg.sender, "bad_signature")
            return self._refuse(Refusal.BAD_SIGNATURE, f"round {t} shard {i} chunk {c}: not signed by its sender")
        if answer is not None:  # late: the average the group's contributors got, without this part
            self._saw_view(t, msg.sender, members)
            return Reply(*answer)
        signed = SignedPart(view, body.weight, packet, body.sig, content, body.recipe,  # type: ignore[arg-type]
                            body.state)
        for seam in self._seams:  # a defence may turn the part away (and take its signature as evidence)
            turned_away = seam.on_part(msg.sender, t, i, c, signed, packet)
            if turned_away is not None:
                return turned_away
        try:
            part = _decode_flat(packet)
            if part.numel() != hi - lo:
                raise ValueError(f"{part.numel()} values for a chunk of {hi - lo}")
        except Exception as exc:
            return self._refuse(Refusal.BAD_PART, f"bad part: {exc}")
        reply, buffers = await self._reduce(key, msg.sender, part, owned=not _shares_memory(part, packet),
                                            weight=1.0 if body.weight is None else body.weight, signed=signed,
                                            state=body.state)
        return Reply(reply, buffers)

    def _current_view(self) -> tuple[str, ...]:
        return tuple(sorted({*self.node.live_peers_here(), self.node.peer_id}))

    async def _reduce(self, key: GroupKey, sender: str, part: torch.Tensor, owned: bool = False,
                      weight: float = 1.0, signed: SignedPart | None = None, state: bytes | None = None
                      ) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
        """Add a part to its group and wait for the group to close (all in, or timeout)."""
        t, members = key[0], key[1]
        group = self._groups.get(key)
        if group is not None and group.closing and sender not in group.contributors:
            await group.replied.wait()  # late for a group being averaged: it gets what the others get
            return group.reply if group.reply is not None else (refusal(Refusal.LATE, "the round already closed"), ())
        if key in self._closed:
            answer = self._answers.get(key)
            return answer if answer is not None else (refusal(Refusal.LATE, "the round already closed"), ())
        if group is None:
            others = {p for p in members if self._views.get((t, p), members) != members
                      or self._peer_round.get(p, t) > t}
            group = ShardGroup(members, set(members) - self._gone - others - self._skipped.get(t, frozenset()),
                               summing=self._secure is None)
            self._groups[key] = group
            # closes it round_timeout_s after its first part, in awake time: a part that came
            # while the loop was stalled is read before the group gives up on it
            group.timer = asyncio.ensure_future(close_in_time(self.timeouts.round_timeout_s, group.done,
                                                              lambda: self._finish(key, group)))
        if sender in group.contributors:
            return self._refuse(Refusal.DUPLICATE, "duplicate part"), ()
        group.add(sender, part, owned, weight)
        if signed is not None:  # kept until the group closes: the evidence, if the part turns out bad
            group.signed[sender] = signed
        if state is not None:
            group.states[sender] = state
        self._saw_view(t, sender, members)
        if group.complete():
            self._finish(key, group)
        if not group.done.is_set():
            await group.done.wait()  # set by _finish: all parts in, or the group's timer
        if group.reply is None and group.closing:  # a robust average still on its worker thread
            await group.replied.wait()
        assert group.reply is not None
        if sender in group.bad:
            return self._refuse(Refusal.NOT_FINITE, "bad part: values that are not finite (NaN or Inf)"), ()
        return group.reply

    def _finish(self, key: GroupKey, group: ShardGroup) -> None:
        """Close a group: average it and answer every contributor. The plain mean is one pass,
        done here. A robust aggregator is many (sorts, clipping iterations: about a second for
        64 parts of 1M values), so it runs on a worker thread; secure aggregation first asks the
        survivors for the shares that unmask the sum. Meanwhile this loop keeps moving other
        rounds' bytes, and the group takes no part."""
        if group.reply is not None or group.closing:
            return
        group.closing = True
        t, members, i, c = key
        if any(s != self.node.peer_id for s in group.contributors):
            fault_point("reduce.owner.closing", t)
        bounds = self.placement.shards(members, t)[i][0][c]
        aggregator = self.defences.aggregator
        if self._secure is not None:
            self._answer_later(key, group, bounds, self._secure.close(t, members, view_digest(members), i, c, bounds,
                                                                      group))
        elif aggregator.robust:
            # checked or replicated owners start from the median: their average is their parts' alone
            center = None if self.defences.fixed_answers else self.screening.center(bounds)
            self._answer_later(key, group, bounds, asyncio.get_running_loop().run_in_executor(
                None, group.average, aggregator, center))
        else:
            self._answer(key, group, bounds, group.average)

    def _answer_later(self, key: GroupKey, group: ShardGroup, bounds: tuple[int, int], averaging: Any) -> None:
        """Answer once `averaging` (an awaitable of what `group.average` returns) is done; one
        that fails answers its failure, so that no group stays open."""
        async def then() -> None:
            try:
                result = await averaging
            except Exception as exc:
                failure = exc

                def failed() -> Any:
                    raise failure
                self._answer(key, group, bounds, failed)
            else:
                self._answer(key, group, bounds, lambda: result)
        task = asyncio.ensure_future(then())
        self._averaging.add(task)
        task.add_done_callback(self._averaging.discard)

    def _answer(self, key: GroupKey, group: ShardGroup, bounds: tuple[int, int],
                average: Callable[[], tuple[torch.Tensor, dict[str, float] | None, Verdict]]) -> None:
        """Judge the group's parts, sign its average and answer every contributor (network thread)."""
        t, members, i, c = key
        try:
            avg, shares, verdict = average()
            for seam in self._seams:
                seam.on_close(t, i, c, bounds, group, verdict, avg)
            if not group.contributors:
                group.reply = (refusal(Refusal.NOT_FINITE, "no part was finite"), ())
            else:
                if self.average_codec.zero_copy:  # lossless too, and the sum is private and final: send it
                    packet = self.average_codec.encode(avg, copy=False)
                else:
                    packet = encode(self.average_codec, self._avg_feedback, avg, f"avg{i}.{c}/{len(members)}")
                contributors = tuple(sorted(group.contributors))
                scores = (self.suspicion.scores(bounds, [group.received.get(m) for m in contributors])
                          if self.suspicion is not None else None)
                sig = self._contributions.sign_average(t, i, c, view_digest(members), contributors, packet, scores)
                # shares only when weights differed: equal ones send what they always did
                diverged = len({s for m in contributors if (s := group.states.get(m)) is not None}) > 1
                answer = Average(self._avg_headers.outgoing(packet.header, avg.numel()), contributors,
                                 tuple(sorted(shares.items())) if shares is not None else (), sig, diverged, scores)
                group.reply = (answer.to_wire(members), packet.buffers)
                self._answers[key] = group.reply
                for old in [k for k in self._answers if k[0] <= t - _KEEP_ANSWERS]:
                    del self._answers[old]
        except Exception as exc:  # every contributor gets an answer, never a group that stays open
            log.exception("%s: %s shard %d chunk %d of round %d: averaging failed", self.node.peer_id,
                          self.topic, i, c, t)
            group.reply = (refusal(Refusal.CLOSE_FAILED, f"the owner could not average: {type(exc).__name__}: {exc}"),
                           ())
        missing = group.expected - set(group.contributors)
        if missing:
            log.info("%s: %s shard %d chunk %d of round %d closed without %s", self.node.peer_id, self.topic,
                     i, c, t, sorted(missing))
        group.done.set()
        group.replied.set()
        self._groups.pop(key, None)
        self._closed[key] = t

    def _saw_skip(self, t: int, peer: str) -> None:
        """`peer` sends nothing in round t: no group of round t waits for it, nor will one made later."""
        self._skipped[t] = self._skipped.get(t, frozenset()) | {peer}
        if len(self._skipped) > _KEEP_SKIPS:
            del self._skipped[min(self._skipped)]
        for key, group in list(self._groups.items()):
            if key[0] == t:
                self._stop_waiting_for(key, group, peer)

    def _saw_view(self, t: int, sender: str, members: tuple[str, ...]) -> None:
        """A sender used `members` in round t: groups of other views of that round, and groups
        of earlier rounds (it has moved past them), stop waiting for it."""
        self._views[(t, sender)] = members
        self._peer_round[sender] = max(self._peer_round.get(sender, t), t)
        for key, group in list(self._groups.items()):
            if key[0] < t or (key[0] == t and key[1] != members):
                self._stop_waiting_for(key, group, sender)

    def _saw_ahead(self, peer: str, t: int) -> None:
        """A peer said it is in round t: groups of earlier rounds stop waiting for it."""
        self._peer_round[peer] = max(self._peer_round.get(peer, t), t)
        for key, group in list(self._groups.items()):
            if key[0] < t:
                self._stop_waiting_for(key, group, peer)

    def _stop_waiting_for(self, key: GroupKey, group: ShardGroup, peer: str) -> None:
        group.expected.discard(peer)
        if group.contributors and group.complete():
            self._finish(key, group)

    def _forget_before(self, t: int) -> None:
        self._closed = {k: r for k, r in self._closed.items() if r >= t}
        self._views = {k: v for k, v in self._views.items() if k[0] >= t}
        self._skipped = {r: p for r, p in self._skipped.items() if r >= t}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This peer's error-feedback residuals (of its parts, and of the averages it owns):
        private to this peer, for its own checkpoints, never for a joiner."""
        return {"parts": self._part_feedback.state_dict() if self._part_feedback else None,
                "averages": self._avg_feedback.state_dict() if self._avg_feedback else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for feedback, key in ((self._part_feedback, "parts"), (self._avg_feedback, "averages")):
            if feedback is not None and state.get(key) is not None:
                feedback.load_state_dict(state[key])

    # ------------------------------------------------------------------ membership hooks
    def peer_left(self, peer_id: str) -> None:
        """Network thread: a member that left or died is no longer waited for."""
        self._gone.add(peer_id)
        for key, group in list(self._groups.items()):
            self._stop_waiting_for(key, group, peer_id)

    def peer_joined(self, peer_id: str) -> None:
        self._gone.discard(peer_id)


def _decode_flat(packet: Packet) -> torch.Tensor:
    """The packet's values as a 1-D tensor, by the codec its header names. A zero-copy codec's
    packet is read in place, as a view of its wire buffer: a copy would be wasted, since every
    value is read once (added to a sum, or copied into the caller's vector) and never written."""
    return decode(packet, copy=False).reshape(-1)


def _shares_memory(part: torch.Tensor, packet: Packet) -> bool:
    """Whether a decoded part is a view of the wire buffers it came from."""
    storage = part.untyped_storage().data_ptr()
    return any(b.untyped_storage().data_ptr() == storage for b in packet.buffers)

