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
past round_timeout_s + reply_grace_s for an owner. An owner that never answered may have
answered others before it died or stalled: the member asks a few other members for its signed
average (one reply grace more) before it takes the chunk as unaveraged (`secondhand.py`).
Both timeouts count the loop's awake time (`node.loop.AwakeDeadline`): a stall of this
process does not close a group while the part it waits for sits unread in the socket, and
every timeout still ends by _STRETCH times its length in wall time.

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
`collectives/bodies/`; bad input is refused through `node.rpc.Refuser`, which counts it.

For audits (`protocols/audit.py`), an owner keeps the signed parts of the authors it will audit
past their groups' close: `keep(t, authors)` before round t, `take_kept(t)` after its `wait()`.

What this file holds is the reducer itself: its settings and seams, and `start`, which encodes
a member's parts. The round runs in two halves, each a base of `ShardedReducer` in its own file:

    member.py       MemberSide: a member's parts sent to their owners, the owners' answers
                    voted on, and `_apply`, where the round's outcome is decided
    owner.py        OwnerSide: an owner's groups of parts, closed when all are in or at their
                    timeout, averaged, signed and answered to every contributor

The rest joins the round at seams, each in its own file:

    placement.py    who owns which chunks of round t over a member list
    contributions   signatures on parts and averages, and the evidence they make
    screening.py    RoundDefence: what an owner holds against the parts it sums, and the
                    robust aggregator's centres (on_part, on_close, on_chosen)
    retention.py    RoundDefence: signed parts kept past their close for audits (on_close)
    gathering.py    an author's kept parts, gathered from every owner that kept them
    secondhand.py   an owner's signed average, relayed by a member it reached to one it did not
    voting.py       a member's vote among a chunk's replicated owners
    checking.py     RoundDefence: an owner keeps its groups' parts (on_close) for members
                    drawn after the round, who average them again (`Checks.after_round`)
    suspicion.py    owners score each part against its chunk's median in their signed
                    averages; every member runs the same test on the scores
    secure.py       SecureStage: members mask their parts, an owner unmasks its group's sum
                    (`close`, unmasking.py) instead of averaging it

and a round's outcome is decided in one method, `_apply` (member.py), which a reader can check alone.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starling.collectives.accumulator import ShardGroup
from starling.collectives.bodies import Skip
from starling.collectives.checking import Checks, Recount
from starling.collectives.codec import encode, make_codec
from starling.collectives.compact import HeaderTemplates, KnownViews, view_digest
from starling.collectives.contributions import Contributions, Recipe
from starling.collectives.defences import Defences, RoundDefence
from starling.collectives.gathering import Gathering
from starling.collectives.layout import DEFAULT_CHUNK_NUMEL
from starling.collectives.member import LOSSY_AVERAGE_SLACK, MISSCORED, UNBOUNDED, MemberSide, Slot
from starling.collectives.outcome import ReduceResult, ReduceTimeouts, ShardResult
from starling.collectives.owner import GroupKey, OwnerSide
from starling.collectives.placement import Placement
from starling.collectives.retention import KeptPart, Retention
from starling.collectives.screening import Screening
from starling.collectives.secondhand import SecondHand
from starling.collectives.secure import SecureAggregation, SecureStage
from starling.collectives.staging import HostStaging
from starling.collectives.suspicion import Suspicion
from starling.collectives.voting import OwnerVote
from starling.compressors import decode
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refuser

if TYPE_CHECKING:
    import asyncio

    from starling.node import Node

log = logging.getLogger(__name__)

_STRETCH = AwakeDeadline.STRETCH  # a round's timeouts count awake time, and end by this many times their length


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


class ShardedReducer(MemberSide, OwnerSide):
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
                                   self.defences.owner_replication, node.is_reachable, node.unreachable_peers)
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
                                       # another owner's group closes a round timeout after its
                                       # first part, which may come after mine closed: the grace
                                       # is that owner's lag, as a member's wait for an average
                                       held_wait_s=self.timeouts.round_timeout_s + self.timeouts.reply_grace_s)
        # With one owner per shard, members drawn after each round check its averages
        # (collectives/checking.py): the owner keeps its groups' parts for them (on_close).
        self.checks: Checks | None = None
        if self.defences.check_rate > 0.0:
            recount = Recount(topic, self.defences.aggregator, average_compressor or compressor, self.suspicion,
                              self._contributions, self._chunk_bounds)
            self.checks = Checks(node, topic, self.defences.check_rate, recount, self._refuse,
                                 self._reply_within_s, self.timeouts.retry_interval_s)
            self._seams += (self.checks,)
        # the averages this member received, for members that an owner's answer missed
        # (collectives/secondhand.py): kept while a member may still wait for them, at most two
        # float32 vectors' bytes
        self.secondhand = SecondHand(node, topic, self.placement, self._contributions, self.timeouts, self._refuse,
                                     self._resolve_view, keep_s=_STRETCH * self._reply_within_s,
                                     max_bytes=8 * numel)
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
        slots: list[Slot] = []  # shard by shard, chunk by chunk
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
                slots.append(Slot(i, c, owners, lo, hi - lo, own, packet))
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
        a round timeout and the grace for every group's held set, then each owner may wait for
        it and ask the survivors itself: a reveal timeout each)."""
        # the unmasker's own time, then an owner's wait for it and its own two rounds of asks
        unmasking = 0.0 if self._secure is None else (self._secure.unmask_within_s + self._secure.reveal_timeout_s
                                                      + 2 * (self._secure.reveal_timeout_s + 1.0))
        return self.timeouts.round_timeout_s + self.timeouts.reply_grace_s + unmasking

    @property
    def _backstop_s(self) -> float:
        """How long `wait()` waits at most. A backstop only: the network side always ends a
        round by then (see AwakeDeadline), an ask for averages that owners never sent included."""
        return _STRETCH * (self._reply_within_s + self.timeouts.reply_grace_s) + 5.0

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
        slots: list[Slot] = []
        for i, (chunks, owners) in enumerate(self.placement.shards(members, t)):
            for c, (lo, hi) in enumerate(chunks):
                own = ring[lo:hi] if me in owners else None
                packet = self.codec.encode(ring[lo:hi], copy=False) if any(o != me for o in owners) else None
                slot = Slot(i, c, owners, lo, hi - lo, own, packet)
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


__all__ = ["LOSSY_AVERAGE_SLACK", "MISSCORED", "UNBOUNDED", "PendingReduce", "ReduceResult", "ReduceTimeouts",
           "ShardedReducer"]
