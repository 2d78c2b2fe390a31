"""The drift guard of the protocols whose peers hold the same state bit for bit: the
parameters of allreduce and sketch-dp, the outer parameters of DiLoCo.

    every check_every rounds t, after the update:
        same = agree(t, members, digest of my parameters)    # collectives/agreement.py
        if not same:                                          # every member reaches the same verdict
            d[m] = m's sha256 of its parameters, for every member m ("<prefix>digest", in parallel;
                   a member that does not answer holds none)
            D = the digest more than half of the members hold, if any; else, among the digests
                held by the most members, the one whose holder comes first in an order drawn
                from (t, members)                             # donor_digest
            if d[me] == D: keep my state, and serve a copy of it for round t
            else: for each holder of D, in member order:
                      fetch its state ("<prefix>sync"); if its parameters hash to D: take it, log it, stop

Peers drift apart when they were built with different initial weights, or when the members of
a round saw different member lists (a join or a death in its middle) and averaged in groups
of their own. The state taken is whatever the protocol says (its parameters and optimizer
state; DiLoCo's outer parameters and momentum), so that the peers also step alike afterwards.
A round that went on without a member gives no verdict: the next check decides.

Where more than half of the members hold one state, it is the one taken. Where none is (a
swarm of two that differs, one split evenly, every member apart), repair needs no majority:
every member draws the same donor among the most-held states, from an order of the members
seeded by the round and the member list, so that a peer cannot grind a key to be chosen, and
the swarm holds one state after one check. Each member answers only its own digest, and a
fetched state is taken only if it hashes to the chosen digest, so a member that claims it and
serves another state is skipped for the next holder.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives import ReduceTimeouts
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

    def round_digest(self, context: bytes = b"") -> bytes:
        """What a member's parts say of the state it begins a round with (`ShardedReducer.start`'s
        `state`): a sampled digest, taken every round. An owner whose contributors named
        different ones flags its average, and every member that gets it checks right after the
        round (`run`, whatever `due` says): members that averaged apart in some round (their
        views of it differed) find out in the next, and hold one state at its end. `context`:
        what else the members must hold alike (the runtime's data ledger), hashed in."""
        sampled = sampled_digest(self._tensors(), DIGEST_SIZE)
        return hashlib.sha256(sampled + context).digest()[:STATE_DIGEST_BYTES] if context else \
            sampled[:STATE_DIGEST_BYTES]

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
        digests = {**self.node.run(self._digests(t, [m for m in members if m != me])), me: mine}
        counts = Counter(digests.get(m) for m in members)
        chosen, how = donor_digest(t, members, digests)
        if chosen is None:
            self._served = (t, None)
            log.warning("%s: %s differ across the swarm at round %d and no member gave a digest; the next check "
                        "decides", me, self.what, t)
            return same
        if mine == chosen:
            self._served = (t, self._snapshot())
            log.warning("%s: %s differ across the swarm at round %d (%s); mine are the %s, the others take them",
                        me, self.what, t, _describe(counts), how)
            return same
        holders = [m for m in members if m != me and digests.get(m) == chosen]
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
            return refusal(Refusal.NOT_FOUND, f"I serve no state for round {t}: no mismatch, or mine is not the "
                           "chosen one", step=served_round)
        return Reply(GuardState(t, state[0]).to_wire(), state[1])


def donor_digest(t: int, members: tuple[str, ...], digests: Mapping[str, bytes]) -> tuple[bytes | None, str]:
    """The state every member of round t converges on, and how it was chosen: the digest more
    than half of the members hold; else, among the digests held by the most members, the one
    whose holder comes first in an order drawn from the round and the member list (every member
    with the same digests draws the same, and no member can place itself first by choosing its
    key); None when no member gave one."""
    counts = Counter(d for m in members if (d := digests.get(m)) is not None)
    if not counts:
        return None, ""
    best, n = counts.most_common(1)[0]
    if 2 * n > len(members):
        return best, f"majority's ({n} of {len(members)} members)"
    tied = {d for d, k in counts.items() if k == n}
    seed = derive_seed("guard.donor", t, int.from_bytes(view_digest(members)[:8], "little"))
    order = sorted((m for m in members if digests.get(m) in tied), key=lambda m: (derive_seed(seed, peer_hash(m)), m))
    return digests[order[0]], f"donor's, drawn among {len(tied)} states held by {n} of {len(members)} members each"


def _describe(counts: Counter[bytes | None]) -> str:
    """'3 hold 1a2b3c4d, 1 holds 5e6f7a8b, 1 gave none', most held first."""
    parts = [f"{n} {'hold' if n > 1 else 'holds'} {d.hex()[:8]}" if d is not None
             else f"{n} gave none" for d, n in counts.most_common()]
    return ", ".join(parts)
