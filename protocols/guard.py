"""The drift guard of the protocols whose peers hold the same state bit for bit: the
parameters of allreduce and sketch-dp, the outer parameters of DiLoCo.

    every round t, my parts name a digest of the state I begin it with: of a sample of its
    values, or of all of them when round t is due (every check_every rounds); an owner that
    saw two digests among its contributors flags its average (`ReduceResult.diverged`)

    after round t's update, when it is due or an average I got was flagged:
        if due, none flagged, and every average came back counting every member
                (`ReduceResult.whole`): same = True               # no round of its own
        else: same = agree(t, members, digest of my parameters)  # collectives/agreement.py
        if not same:                                          # every member reaches the same verdict
            R = the first REFEREES members in an order drawn from (t, members)   # referees
            d[r] = r's sha256 of its parameters, for every referee r ("<prefix>digest", in
                   parallel; a referee that does not answer holds none)
            D = the digest more than half of the referees hold, if any; else, among the digests
                held by the most referees, the one whose holder comes first in R   # donor_digest
            if my digest == D: keep my state, and serve a copy of it for round t
            else: for each referee holding D, starting at one drawn from my id:
                      fetch its state ("<prefix>sync"); if its parameters hash to D: take it, log it, stop

Peers drift apart when they were built with different initial weights, or when the members of
a round saw different member lists (a join or a death in its middle) and averaged in groups
of their own. The state taken is whatever the protocol says (its parameters and optimizer
state; DiLoCo's outer parameters and momentum), so that the peers also step alike afterwards.
A round that went on without a member gives no verdict: the next check decides.

A due round whose averages each counted every member, none flagged, is its own check: every
owner compared every member's digest of the whole state, found one, and every member applied
the same averages to it, so they end the round alike. It costs no second round, which on a
large swarm is most of the check: its one owner waits for the last member to leave the step's
round, so the check adds that spread (a minute at 1024 peers on one box). Members whose round
was not whole (an owner that did not answer them, a member missing from an average) run the
agreement round; members whose round was whole are not in it, so it gives them no verdict, and
the next round's digests flag whatever differs.

Where more than half of the referees hold one state, it is the one taken. Where none is (a
swarm of two that differs, one split evenly, every member apart), repair needs no majority:
every member draws the same donor among the most-held states, from the same order, seeded by
the round and the member list, so that a peer cannot grind a key to be a referee or be chosen,
and the swarm holds one state after one check. Each referee answers only its own digest, and a
fetched state is taken only if it hashes to the chosen digest, so a referee that claims it and
serves another state is skipped for the next holder.

Referees keep a mismatch's cost linear in the members: every member asks the same REFEREES
members for their digests, not every other member (n^2 requests on a box that simulates n
peers: 65,000 at 256, more than one box answers within a round's timeout), and the members
that take a state spread over the referees holding it. A swarm of at most REFEREES
members asks every member, as a check over all of them would. With more, the state taken is
the one most held among a sample drawn where nobody can aim: a state that one member in a
hundred holds is chosen only if several of 16 referees hold it, and every member takes the same.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives import ReduceResult, ReduceTimeouts
from starling.collectives.agreement import AgreementCheck, digest_bytes, sampled_digest
from starling.collectives.bodies import STATE_DIGEST_BYTES
from starling.collectives.compact import view_digest
from starling.collectives.requests import request_patiently
from starling.common.hashing import derive_seed, peer_hash
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, Refuser, Reply, refusal, refusal_of
from starling.protocols.bodies import DIGEST_BYTES, BodyError, Digest, GuardAsk, GuardState

if TYPE_CHECKING:
    from starling.node.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

# A protocol's state as it travels: a msgpack-able header and tensors.
State = tuple[dict[str, Any], list[torch.Tensor]]

DIGEST_SIZE = DIGEST_BYTES  # the whole sha256: a served state must not be forged to match the chosen one
REFEREES = 16  # members asked for their digests after a mismatch (all of them in a smaller swarm)


class DriftGuard:
    """Checks every `every` rounds that the members' `tensors()` agree; on a mismatch, every
    member whose `tensors()` are not the chosen ones (`donor_digest`) takes a holder's `snapshot()`
    through `adopt(header, tensors)` (which raises ValueError for a state it cannot take), once
    `tensors_of(header, tensors)` (what `tensors()` would give after adopting it, or ValueError)
    hash to the chosen digest. Its logs call the tensors `what`."""

    def __init__(self, node: Node, prefix: str, every: int, timeouts: ReduceTimeouts, is_open: Callable[[], bool],
                 tensors: Callable[[], Sequence[torch.Tensor]], snapshot: Callable[[], State],
                 adopt: Callable[[dict[str, Any], list[torch.Tensor]], None],
                 tensors_of: Callable[[dict[str, Any], list[torch.Tensor]], Sequence[torch.Tensor]],
                 what: str = "parameters") -> None:
        self.node, self.every, self.timeouts, self._is_open, self.what = node, every, timeouts, is_open, what
        self._tensors, self._snapshot, self._adopt, self._tensors_of = tensors, snapshot, adopt, tensors_of
        self.check = AgreementCheck(node, f"{prefix}agree", timeouts, is_open)
        self.topic = f"{prefix}sync"
        self.digest_topic = f"{prefix}digest"
        # (round, my digest then or None): my latest checked round, and my digest if it was a mismatch
        self._checked: tuple[int, bytes | None] = (-1, None)
        # (round, my state then or None): my latest repair decision, and what I serve for it
        self._served: tuple[int, State | None] = (-1, None)
        self.repairs = 0  # times this peer took another's state
        self.passed_in_round = 0  # due checks that the round itself settled (`after_round`)
        self._named_whole = -1  # the latest round my parts named a digest of every value in
        # bad input from a peer: malformed requests, and malformed answers to mine
        self._refuse = {topic: Refuser(node.stats, topic, node.peer_id) for topic in (self.topic, self.digest_topic)}
        node.on(self.topic, self._on_sync)
        node.on(self.digest_topic, self._on_digest)

    @property
    def reducer(self) -> Any:
        return self.check.reducer

    @property
    def _wait_s(self) -> float:
        return self.timeouts.round_timeout_s + self.timeouts.reply_grace_s

    def due(self, t: int) -> bool:
        return self.every > 0 and t % self.every == 0

    def round_digest(self, context: bytes = b"", t: int | None = None) -> bytes:
        """What a member's parts say of the state it begins a round with (`ShardedReducer.start`'s
        `state`): a sampled digest; with the round `t`, when the guard is due to check it, the
        digest of every value, so that `after_round(t, ...)` may take a whole round as the check
        (a caller that changes the state between the round's start and its check passes no `t`).
        An owner whose contributors named different ones flags its average, and every member
        that gets it checks right after the round (`run`, whatever `due` says): members that
        averaged apart in some round (their views of it differed) find out in the next, and hold
        one state at its end. `context`: what else the members must hold alike (the runtime's
        data ledger), hashed in."""
        tensors = self._tensors()
        if t is not None and self.due(t):
            digest, self._named_whole = digest_bytes(tensors, DIGEST_SIZE), t
        else:
            digest = sampled_digest(tensors, DIGEST_SIZE)
        return hashlib.sha256(digest + context).digest()[:STATE_DIGEST_BYTES] if context else \
            digest[:STATE_DIGEST_BYTES]

    def after_round(self, t: int, members: tuple[str, ...], result: ReduceResult) -> bool | None:
        """Round t's check, after its update, when it is due or an average was flagged (None
        otherwise, and for a peer whose round was late: it checks at the swarm's next check).
        A due round that was whole and flagged nowhere, whose parts named digests of every value
        (`round_digest` with `t`), is the check (True, no round of its own); any other runs the
        agreement round (`run`)."""
        if len(members) <= 1 or result.ahead > t or not (self.due(t) or result.diverged):
            return None
        if result.whole and not result.diverged and self._named_whole == t:
            self._checked = self._served = (t, None)
            self.passed_in_round += 1
            return True
        return self.run(t, members)

    def run(self, t: int, members: tuple[str, ...]) -> bool | None:
        """Round t's check (training thread, every member of the round at once): the verdict,
        after any repair."""
        same = self.check.agree(t, members, self._tensors())
        me = self.node.peer_id
        if same is not False:
            self._checked = self._served = (t, None)
            return same
        mine = digest_bytes(self._tensors(), DIGEST_SIZE)
        self._checked = (t, mine)  # answered from now on: the others' decisions wait for it
        asked = referees(t, members)
        digests = self.node.run(self._digests(t, [m for m in asked if m != me]))
        if me in asked:
            digests[me] = mine
        counts = Counter(digests.get(m) for m in asked)
        chosen, how = donor_digest(t, members, digests)
        if chosen is None:
            self._served = (t, None)
            log.warning("%s: %s differ across the swarm at round %d and none of the members asked gave a digest; "
                        "the next check decides", me, self.what, t)
            return same
        if mine == chosen:  # only referees are asked for it: the others keep no copy
            self._served = (t, self._snapshot() if me in asked else None)
            log.warning("%s: %s differ across the swarm at round %d (%s); mine are the %s, the others take them",
                        me, self.what, t, _describe(counts), how)
            return same
        holders = sources(me, asked, digests, chosen)
        log.warning("%s: my %s differ from the %s at round %d (%s); taking them from %s", me, self.what, how, t,
                    _describe(counts), holders[0])
        for source in holders:
            if self._fetch(t, source, chosen):
                self.repairs += 1
                log.warning("%s: took %s's state for round %d", me, source, t)
                return same
        log.warning("%s: could not take the %s state for round %d from any of %s; checking again at the next "
                    "check", me, how, t, holders)
        return same

    async def _digests(self, t: int, peers: list[str]) -> dict[str, bytes]:
        """Network thread: round t's digest of each peer that gives it within the round's time."""
        answers = await asyncio.gather(*(self._digest_of(t, peer) for peer in peers))
        return {peer: d for peer, d in zip(peers, answers) if d is not None}

    async def _digest_of(self, t: int, peer: str) -> bytes | None:
        """`peer`'s own digest of round t, asked again while it has not checked that round yet;
        None if it refuses for good, fails, or gives something else."""
        deadline, retry_s = AwakeDeadline(self._wait_s), self.timeouts.retry_interval_s
        while not deadline.expired():
            try:
                msg = await request_patiently(self.node, peer, self.digest_topic, GuardAsk(t).to_wire(), (), deadline,
                                              retry_s)
            except Exception as exc:  # gone, or silent for the round's time
                log.debug("%s: %s from %s failed: %s", self.node.peer_id, self.digest_topic, peer, exc)
                return None
            refused = refusal_of(msg.body)
            if refused is None:  # an answer: the digest, or bad input
                try:
                    answer = Digest.from_wire(msg.body)
                    if answer.round != t:
                        raise BodyError(f"a digest of round {answer.round}, asked for {t}")
                    return answer.digest
                except BodyError as exc:
                    self._refuse[self.digest_topic].count("malformed_answer", f"{peer}: {exc}")
                    return None
            if refused is not Refusal.BUSY:
                log.info("%s: %s gave no digest for round %d: %s", self.node.peer_id, peer, t, msg.body)
                return None
            await deadline.sleep(retry_s)
        return None

    def _fetch(self, t: int, source: str, chosen: bytes) -> bool:
        """Ask `source` for its state of round t until it serves it, refuses for good, or the
        round's timeout (plus grace) has passed; take it if it hashes to `chosen`."""
        me = self.node.peer_id
        deadline = time.monotonic() + self._wait_s
        while time.monotonic() < deadline:
            try:
                msg = self.node.request(source, self.topic, GuardAsk(t).to_wire(),
                                        timeout_s=max(0.1, min(deadline - time.monotonic(), 10.0)))
            except Exception as exc:  # dead, or not serving yet: try until the deadline
                log.debug("%s: %s from %s failed: %s", me, self.topic, source, exc)
            else:
                refused = refusal_of(msg.body)
                if refused is None:  # an answer: the state, or bad input
                    try:
                        answer = GuardState.from_wire(msg.body)
                        if answer.round != t:
                            raise BodyError(f"a state of round {answer.round}, asked for {t}")
                    except BodyError as exc:
                        self._refuse[self.topic].count("malformed_answer", f"{source}: {exc}")
                        return False
                    header, tensors = answer.header, list(msg.payload)
                    try:
                        if digest_bytes(self._tensors_of(header, tensors), DIGEST_SIZE) != chosen:
                            log.warning("%s: %s claimed the chosen %s for round %d but served others; "
                                        "trying the next holder", me, source, self.what, t)
                            return False
                        self._adopt(header, tensors)
                        return True
                    except (ValueError, TypeError, KeyError, IndexError) as exc:
                        log.warning("%s: %s's state does not fit: %s", me, source, exc)
                        return False
                if refused is not Refusal.BUSY:  # not "not yet": it will not serve it
                    log.info("%s: %s refused its state: %s", me, source, msg.body)
                    return False
            time.sleep(self.timeouts.retry_interval_s)
        return False

    def _round_asked(self, msg: Message, topic: str, latest: int) -> tuple[int, dict[str, Any] | None]:
        """(the round a request names, or a refusal of it): refused while the protocol is closed,
        for a malformed body (counted), and for any round but my `latest` (BUSY before it,
        TOO_OLD past)."""
        if not self._is_open():
            return -1, refusal(Refusal.CLOSED, "protocol closed")
        try:
            t = GuardAsk.from_wire(msg.body).round
        except BodyError as exc:
            return -1, self._refuse[topic](Refusal.MALFORMED, f"{msg.sender}: {exc}; body must be {{round: int}}")
        if t > latest:
            return t, refusal(Refusal.BUSY, f"no verdict for round {t} yet", step=latest)
        if t < latest:
            return t, refusal(Refusal.TOO_OLD, f"round {t} is past; the last check was {latest}", step=latest)
        return t, None

    def _on_digest(self, msg: Message) -> dict[str, Any]:
        """Network thread: my own digest at round t, when my latest check was round t's mismatch."""
        checked_round, digest = self._checked
        t, refused = self._round_asked(msg, self.digest_topic, checked_round)
        if refused is not None:
            return refused
        if digest is None:
            return refusal(Refusal.NOT_FOUND, f"my verdict for round {t} was not a mismatch", step=checked_round)
        return Digest(t, digest).to_wire()

    def _on_sync(self, msg: Message) -> Reply | dict[str, Any]:
        """Network thread: my state as it was at the round of a mismatch, for the others, when it
        was the chosen one."""
        served_round, state = self._served
        t, refused = self._round_asked(msg, self.topic, served_round)
        if refused is not None:
            return refused
        if state is None:
            return refusal(Refusal.NOT_FOUND, f"I serve no state for round {t}: no mismatch, mine is not the "
                           "chosen one, or I am no referee", step=served_round)
        return Reply(GuardState(t, state[0]).to_wire(), state[1])


@functools.lru_cache(maxsize=8)  # a check asks for them twice: its requests, then `donor_digest`
def referees(t: int, members: tuple[str, ...]) -> tuple[str, ...]:
    """The members asked for their digests after round t's mismatch: the first REFEREES in an
    order drawn from the round and the member list (every member draws the same, and no member
    can place itself in it by choosing its key), so all of them in a swarm of REFEREES or fewer."""
    seed = derive_seed("guard.donor", t, int.from_bytes(view_digest(members)[:8], "little"))
    return tuple(heapq.nsmallest(REFEREES, members, key=lambda m: (derive_seed(seed, peer_hash(m)), m)))


def donor_digest(t: int, members: tuple[str, ...], digests: Mapping[str, bytes]) -> tuple[bytes | None, str]:
    """The state every member of round t converges on, and how it was chosen, from the digests
    its referees gave: the digest more than half of the referees hold; else, among the digests
    held by the most referees, the one whose holder comes first in the referees' order (every
    member with the same digests draws the same); None when no referee gave one."""
    asked = referees(t, members)
    counts = Counter(d for m in asked if (d := digests.get(m)) is not None)
    if not counts:
        return None, ""
    best, n = counts.most_common(1)[0]
    if 2 * n > len(asked):
        return best, f"majority's ({n} of {_of(asked, members)})"
    tied = {d for d, k in counts.items() if k == n}
    first = next(m for m in asked if digests.get(m) in tied)
    return digests[first], f"donor's, drawn among {len(tied)} states held by {n} of {_of(asked, members)} each"


def sources(me: str, asked: tuple[str, ...], digests: Mapping[str, bytes], chosen: bytes) -> list[str]:
    """The referees `me` asks for the chosen state, in turn: those holding it, in the referees'
    order from a place drawn from `me` (the members that take a state share its holders)."""
    holders = [m for m in asked if m != me and digests.get(m) == chosen]
    start = derive_seed("guard.fetch", peer_hash(me)) % max(1, len(holders))
    return holders[start:] + holders[:start]


def _of(asked: tuple[str, ...], members: tuple[str, ...]) -> str:
    """'4 members', or '16 referees of 256 members'."""
    if len(asked) == len(members):
        return f"{len(members)} members"
    return f"{len(asked)} referees of {len(members)} members"


def _describe(counts: Counter[bytes | None]) -> str:
    """'3 hold 1a2b3c4d, 1 holds 5e6f7a8b, 1 gave none', most held first."""
    parts = [f"{n} {'hold' if n > 1 else 'holds'} {d.hex()[:8]}" if d is not None
             else f"{n} gave none" for d, n in counts.most_common()]
    return ", ".join(parts)
