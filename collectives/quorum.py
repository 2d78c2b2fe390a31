"""A quorum close: which members' contributions a round takes, decided by one peer and
announced, so that every member applies the same set, however different the members' speeds.

    leader(t) = members[(t + salt) % |members|]              # the member list a peer sent with
    member, when its contribution for round t is ready:
        ask leader(t): "I am in round t with weight w"       # a request
            <- ack: sign("quorum.ack", topic, t, me, w)      # the round is open: I am in it
               wait leader(t): a second request, answered with the set when the round closes
            <- or the closing set at once                    # this ask closed it, or came late
    leader, for round t:
        collect asks until every expected member is in, or
            K (= quorum) are in and quorum_grace_s has passed since the K-th, or
            round_timeout_s has passed since the first
        close: the set {(peer, weight)} and sign("quorum.close", topic, t, [[peer, weight], ...]);
            answer every waiting member with both
        an ask that comes after the close gets the same set at once (without its sender)

A member in the set then averages with exactly those members (the sharded all-reduce with
`members` = the set); a member left out learns so from the same reply: it missed the round,
and its protocol decides what becomes of its contribution (DiLoCo folds it into the
fragment's next round). A reply that is not a well-formed set is refused, counted in the
node's stats as `<topic>.malformed_close`, and read as no set at all, as a leader that
never answered is: the asker is then out of that round. So is a set, or an ack, whose
signature does not verify against the leader's key (`<topic>.bad_signature`).

The set is the leader's alone, so members never guess it from what each of them saw. Two
members whose member lists differ may ask different leaders; each leader's set then holds
only the members that asked it, and the all-reduce, which groups parts by member list, keeps
the two apart (the drift guard repairs what that costs).

**A leader answers for whom it leaves out.** The leader acks an ask only while the round is
open, in the same step of the event loop that counts the asker in (no await between the
two), so an acknowledged member is in the set whatever the leader's timers do; an ask that
finds the round closed gets the set, never an ack. A member that holds the leader's ack for
round t and the leader's signed set for round t without itself therefore holds proof that
the leader left it out: evidence `quorum.omitted`, which it gives to `node.trust.accuse`.
Every peer checks that evidence alone (`check_omission`: both signatures are the accused's,
and the asker is not in the set), and bans the leader. A leader can still keep a member out
by not answering it (its ask, or its wait), as a dead leader would: the member is out of the
round, and nothing it holds proves why.

Why an ack as the answer to the ask, then a second request for the set, rather than a
one-way ack message before the set: the ack is matched to its ask by the request itself, so
the member holds it, checked, before it waits, with no second handler and no ordering to
trust between a message and a reply; and an ask that closes the round or comes after the
close still takes one trip. The wait overlaps the grace window that a member waits anyway.

**A leader answers for what it signs.** Each member that gets a set shows it, one way, to
`ECHO_FANOUT` (2) other members of its list (`Echo`), and keeps the sets of the last 64 rounds.
A member that holds the set one leader signed for a round and is shown another set that the
same leader signed for the same round holds proof that the leader equivocated: evidence
`quorum.equivocated`, which every peer checks alone (`check_equivocation`: both signatures are
the accused's, and the sets differ), and which bans it. A leader that splits its members in
two halves is caught unless every member's picks stay within its own half. Sets of different
leaders (members whose lists differed asked different leaders) are never compared. A leader
that crashes after answering some members of a round, restarts with the same key and closes
the same round again would sign a second set: so a protocol that takes a state tells its
quorums (`resume_at`), which refuse every round before it as too old.

A leader remembers its last 64 closed rounds, to answer late asks with their set; an ask
for a round older than the ones it forgot is refused (`too_old`), never acknowledged, since
the leader no longer knows whether it closed it. A leader that restarts with the same key
has forgotten every round it closed before; its protocol takes the swarm's state at some round
and tells its quorums (`resume_at`), so an ask for an earlier round is refused as too old, not
acknowledged (which, with the earlier set, would read as an omission) nor closed again. An ask
that reaches it in the moment between its start and that state is the one gap.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starling.collectives.bodies import Ack, Ask, BodyError, Closing, Echo, Wait
from starling.collectives.reduce import ReduceTimeouts
from starling.collectives.requests import request_patiently
from starling.common.faults import fault_point
from starling.common.text import few
from starling.node.identity import peer_id_from_key
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, Refuser, refusal
from starling.node.trust import Evidence, statement

if TYPE_CHECKING:
    from starling.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)

__all__ = ["EQUIVOCATED", "OMITTED", "Closing", "QuorumClose", "ack_statement", "check_equivocation",
           "check_omission", "close_statement"]

OMITTED = "quorum.omitted"  # evidence: a leader acked an ask, then signed the round's set without the asker
_OMITTED_DETAIL = ("topic", "asker", "weight", "ack", "closed", "close_sig")
_MAX_CLOSED = 1 << 16  # entries of a set in evidence: more than a peer table holds
_KEEP_CLOSED_ROUNDS = 64  # closed rounds a leader remembers, to answer late asks with their set
EQUIVOCATED = "quorum.equivocated"  # evidence: a leader signed two different sets for one round
ECHO_FANOUT = 2  # members each member shows the set it got
_KEEP_ECHOES = 4  # echoes of a round a member keeps until its own set comes
_SILENT = object()  # no answer came from the leader


def ack_statement(topic: str, t: int, asker: str, weight: float) -> bytes:
    """What a leader signs when it counts `asker` in round t."""
    return statement("quorum.ack", topic, t, asker, weight)


def close_statement(topic: str, t: int, contributions: Sequence[tuple[str, float]]) -> bytes:
    """What a leader signs when it closes round t with `contributions`."""
    return statement("quorum.close", topic, t, [[peer, weight] for peer, weight in contributions])


def check_omission(evidence: Evidence) -> bool:
    """Whether `evidence` (kind `quorum.omitted`) proves by itself that the accused acked an
    ask for a round and signed that round's set without the asker. Never raises; its work is
    two signature checks and one pass over a set of at most `_MAX_CLOSED` entries."""
    detail, t = evidence.detail, evidence.round
    if not isinstance(detail, dict) or type(t) is not int:
        return False
    topic, asker, weight, ack, closed, close_sig = (detail.get(k) for k in _OMITTED_DETAIL)
    if not (isinstance(topic, str) and isinstance(asker, str) and type(weight) is float
            and isinstance(ack, bytes) and isinstance(closed, list) and len(closed) <= _MAX_CLOSED):
        return False
    try:
        if peer_id_from_key(evidence.key) != evidence.accused:
            return False
        closing = Closing.from_wire({"ok": True, "round": t, "closed": closed, "sig": close_sig}, t)
        acked, signed = ack_statement(topic, t, asker, weight), close_statement(topic, t, closing.contributions)
    except (TypeError, ValueError, OverflowError):  # not a key, not a set, not packable (BodyError is a ValueError)
        return False
    return (asker != evidence.accused and asker not in closing.members
            and evidence.signed_by_accused(acked, ack) and evidence.signed_by_accused(signed, closing.signature))


def check_equivocation(evidence: Evidence) -> bool:
    """Whether `evidence` (kind `quorum.equivocated`) proves by itself that the accused signed
    two different sets for one round of one topic. Never raises; two signature checks."""
    detail, t = evidence.detail, evidence.round
    if not isinstance(detail, dict) or type(t) is not int or not isinstance(detail.get("topic"), str):
        return False
    try:
        if peer_id_from_key(evidence.key) != evidence.accused:
            return False
        sets = []
        for closed, sig in ((detail.get("a"), detail.get("a_sig")), (detail.get("b"), detail.get("b_sig"))):
            if not isinstance(closed, list) or len(closed) > _MAX_CLOSED:
                return False
            closing = Closing.from_wire({"ok": True, "round": t, "closed": closed, "sig": sig}, t)
            if not evidence.signed_by_accused(close_statement(detail["topic"], t, closing.contributions),
                                              closing.signature):
                return False
            sets.append(closing.contributions)
    except (TypeError, ValueError, OverflowError):
        return False
    return sets[0] != sets[1]


@dataclass
class _Gathering:
    """A leader's round that is still open."""

    expected: set[str]
    weights: dict[str, float] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    closing: Closing | None = None
    grace: asyncio.TimerHandle | None = None
    timer: asyncio.Future[None] | None = None


class QuorumClose:
    """Rounds of one topic, closed at a quorum: `ask(t, members, weight)` from the caller's
    thread returns a future of the round's `Closing` (None: no valid set came back in time)."""

    def __init__(self, node: Node, topic: str, quorum: int, grace_s: float, timeouts: ReduceTimeouts,
                 is_open: Callable[[], bool] = lambda: True, salt: int = 0) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        if not (math.isfinite(grace_s) and grace_s >= 0.0):
            raise ValueError(f"quorum_grace_s must be >= 0, got {grace_s}")
        self.node, self.topic, self.quorum, self.grace_s = node, topic, quorum, grace_s
        self.timeouts, self.salt, self._is_open = timeouts, salt, is_open
        self.trust = node.trust
        # network thread only
        self._open: dict[int, _Gathering] = {}
        self._closed: dict[int, Closing] = {}
        self._forgotten = -1  # the newest closed round dropped from `_closed`: older asks get no ack
        self._gone: set[str] = set()
        self._refuse = Refuser(node.stats, topic, node.peer_id)
        # one check per kind per node: every quorum of the node registers the same function,
        # which reads the topic from the evidence
        self.trust.register_check(OMITTED, check_omission)
        self.trust.register_check(EQUIVOCATED, check_equivocation)
        # What members got (network thread): round -> (leader, its set), mine, and the sets
        # others showed me for rounds whose set I do not have yet (a few per round).
        self._got: dict[int, tuple[str, Closing]] = {}
        self._echoes: dict[int, list[tuple[str, Closing]]] = {}
        self._accused: set[str] = set()
        self.echoes = 0  # sets other members showed me, with a good signature
        self._rng = random.Random()
        node.on(topic, self._on_request)

    def leader(self, t: int, members: tuple[str, ...]) -> str:
        return members[(t + self.salt) % len(members)]

    # ------------------------------------------------------------------ caller's thread
    def resume_at(self, t: int) -> None:
        """This peer took a state at round t (a restart from a checkpoint, a join): rounds before
        t closed without this leader's memory of them, so an ask for one is refused as too old,
        never acknowledged or closed again (a second set for a round it may have closed before a
        crash would read as an equivocation, an ack as an omission)."""
        self._forgotten = max(self._forgotten, t - 1)

    def ask(self, t: int, members: tuple[str, ...], weight: float) -> concurrent.futures.Future[Closing | None]:
        if not (math.isfinite(weight) and weight >= 0.0):
            raise ValueError(f"{self.topic}: weight must be a finite number >= 0, got {weight!r}")
        return self.node.submit(self._ask(t, tuple(members), float(weight)))

    # ------------------------------------------------------------------ network thread: a member
    async def _ask(self, t: int, members: tuple[str, ...], weight: float) -> Closing | None:
        me = self.node.peer_id
        leader = self.leader(t, members)
        if leader == me:
            return await self._gather(t, members, weight)
        deadline = AwakeDeadline(self.timeouts.round_timeout_s + self.timeouts.reply_grace_s)
        reply = await self._answer(leader, t, Ask(t, members, weight).to_wire(), deadline)
        ack: Ack | None = None
        try:
            if reply is not _SILENT and Ack.is_one(reply):
                ack = Ack.from_wire(reply, t)
                if not self.trust.verify(leader, ack_statement(self.topic, t, me, weight), ack.signature):
                    self._refuse.count("bad_signature", f"round {t}: an ack that {leader} did not sign")
                    return None
                reply = await self._answer(leader, t, Wait(t).to_wire(), deadline)
            if reply is _SILENT:
                return None
            closing = Closing.from_wire(reply, t)
        except BodyError as exc:
            self._refuse.count("malformed_close", f"round {t}: the closing set from {leader}: {exc}")
            return None
        if not self.trust.verify(leader, close_statement(self.topic, t, closing.contributions), closing.signature):
            self._refuse.count("bad_signature", f"round {t}: a closing set that {leader} did not sign")
            return None
        if ack is not None and me not in closing.members:
            self._accuse_omission(leader, t, weight, ack, closing)
        self._show(t, leader, members, closing)
        return closing

    def _show(self, t: int, leader: str, members: tuple[str, ...], closing: Closing) -> None:
        """Keep the set I got, hold it against what others showed me, and show it to a few
        members: a leader that gives two members two sets of one round is caught when one of
        them shows its set to a member that holds the other (with two members and ECHO_FANOUT
        picks each among n, about 1 - (1 - 2/n)^4 of the time)."""
        me = self.node.peer_id
        self._got[t] = (leader, closing)
        while len(self._got) > _KEEP_CLOSED_ROUNDS:
            del self._got[min(self._got)]
        for shower, shown in self._echoes.pop(t, []):
            self._compare(t, leader, closing, shown, shower)
        others = [m for m in members if m not in (me, leader)]
        body = Echo(leader, closing).to_wire()
        for peer in self._rng.sample(others, min(ECHO_FANOUT, len(others))):
            self.node.send(peer, self.topic, body)  # one way: a peer that died meanwhile misses it

    def _on_echo(self, msg: Message) -> dict[str, Any]:
        """A member shows me the set it got."""
        try:
            echo = Echo.from_wire(msg.body)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, str(exc))
        t, closing = echo.closing.round, echo.closing
        if not self.trust.verify(echo.leader, close_statement(self.topic, t, closing.contributions),
                                 closing.signature):
            return self._refuse(Refusal.BAD_SIGNATURE, f"round {t}: a set that {echo.leader} did not sign")
        self.echoes += 1
        got = self._got.get(t)
        if got is not None:
            if got[0] == echo.leader:
                self._compare(t, echo.leader, got[1], closing, msg.sender)
        elif not self._got or t > min(self._got):  # a round I may still get the set of
            shown = self._echoes.setdefault(t, [])
            if len(shown) < _KEEP_ECHOES:
                shown.append((echo.leader, closing))
            while len(self._echoes) > _KEEP_CLOSED_ROUNDS:
                del self._echoes[min(self._echoes)]
        return {"ok": True}

    def _compare(self, t: int, leader: str, mine: Closing, theirs: Closing, shower: str) -> None:
        if theirs.contributions == mine.contributions or leader in self._accused:
            return
        key = self.trust.key_of(leader)
        if key is None:
            return
        self._accused.add(leader)
        log.warning("%s: %s round %d: %s signed two different sets (mine, and the one %s showed me)",
                    self.node.peer_id, self.topic, t, leader, shower)
        detail = {"topic": self.topic, "a": [[p, w] for p, w in mine.contributions], "a_sig": mine.signature,
                  "b": [[p, w] for p, w in theirs.contributions], "b_sig": theirs.signature}
        self.trust.accuse(Evidence(EQUIVOCATED, leader, key, t, detail))

    async def _answer(self, leader: str, t: int, body: dict[str, Any], deadline: AwakeDeadline) -> Any:
        """The leader's answer to `body` within the round's deadline, or _SILENT."""
        try:
            msg = await request_patiently(self.node, leader, self.topic, body, (), deadline,
                                          self.timeouts.retry_interval_s)
        except Exception as exc:  # dead or silent leader, or it refused: out of this round
            log.info("%s: %s round %d: no closing set from %s: %s", self.node.peer_id, self.topic, t, leader, exc)
            return _SILENT
        return msg.body

    def _accuse_omission(self, leader: str, t: int, weight: float, ack: Ack, closing: Closing) -> None:
        key = self.trust.key_of(leader)
        if key is None:  # it left the table since its set verified
            return
        log.warning("%s: %s round %d: %s acknowledged my ask and closed without me", self.node.peer_id,
                    self.topic, t, leader)
        detail = {"topic": self.topic, "asker": self.node.peer_id, "weight": weight, "ack": ack.signature,
                  "closed": [[peer, w] for peer, w in closing.contributions], "close_sig": closing.signature}
        self.trust.accuse(Evidence(OMITTED, leader, key, t, detail))

    # ------------------------------------------------------------------ network thread: the leader
    async def _on_request(self, msg: Message) -> dict[str, Any]:
        if not self._is_open():
            return refusal(Refusal.CLOSED, "protocol closed")
        if Echo.is_one(msg.body):
            return self._on_echo(msg)
        if Wait.is_one(msg.body):
            try:
                wait = Wait.from_wire(msg.body)
            except BodyError as exc:
                return self._refuse(Refusal.MALFORMED, str(exc))
            return await self._on_wait(wait.round)
        try:
            ask = Ask.from_wire(msg.body)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, str(exc))
        if msg.sender not in ask.members:
            return self._refuse(Refusal.MALFORMED, "members must include the sender")
        if self.leader(ask.round, ask.members) != self.node.peer_id:
            return self._refuse(Refusal.NOT_OWNER, f"this peer does not lead round {ask.round} of that member list")
        # No await from here to the answer: the round cannot close between counting the asker
        # in and signing its ack, so an acknowledged asker is always in the set.
        admitted = self._admit(ask.round, ask.members, msg.sender, ask.weight)
        if admitted is None:
            return refusal(Refusal.TOO_OLD, f"round {ask.round} is older than the rounds this leader remembers")
        if isinstance(admitted, Closing):
            return admitted.to_wire()
        weight = admitted.weights[msg.sender]  # a repeated ask keeps the first weight
        return Ack(ask.round, self.trust.sign(ack_statement(self.topic, ask.round, msg.sender, weight))).to_wire()

    async def _on_wait(self, t: int) -> dict[str, Any]:
        closing = self._closed.get(t)
        if closing is None:
            gathering = self._open.get(t)
            if gathering is None:
                return self._refuse(Refusal.NOT_FOUND, f"no round {t} here to wait for (ask first)")
            await gathering.done.wait()
            closing = gathering.closing
            assert closing is not None
        return closing.to_wire()

    async def _gather(self, t: int, members: tuple[str, ...], weight: float) -> Closing | None:
        """The leader's own ask: counted in like any other, then the set once the round closes."""
        admitted = self._admit(t, members, self.node.peer_id, weight)
        if isinstance(admitted, _Gathering):
            await admitted.done.wait()
            return admitted.closing
        return admitted

    def _admit(self, t: int, members: tuple[str, ...], sender: str, weight: float) -> Closing | _Gathering | None:
        """Count `sender` in round t, all in this step of the loop: the round's set if it is
        closed (before this ask, which then is not in it, or by it), else the open round that
        now holds the sender; None for a round older than those this leader remembers."""
        closing = self._closed.get(t)
        if closing is not None:
            return closing
        gathering = self._open.get(t)
        if gathering is None:
            if t <= self._forgotten:
                return None
            gathering = self._open[t] = _Gathering(set(members) - self._gone)
            gathering.timer = asyncio.ensure_future(self._close_in_time(t, gathering))
        gathering.weights.setdefault(sender, weight)
        self._check(t, gathering)
        return gathering.closing or gathering

    def _check(self, t: int, gathering: _Gathering) -> None:
        """Close now when every expected member is in; start the grace window at the quorum."""
        if gathering.closing is not None:
            return
        if gathering.expected <= set(gathering.weights):
            self._close(t, gathering)
        elif len(gathering.weights) >= min(self.quorum, len(gathering.expected)) and gathering.grace is None:
            gathering.grace = asyncio.get_running_loop().call_later(self.grace_s, self._close, t, gathering)

    async def _close_in_time(self, t: int, gathering: _Gathering) -> None:
        try:
            await AwakeDeadline(self.timeouts.round_timeout_s).wait(gathering.done.wait())
        except asyncio.TimeoutError:
            self._close(t, gathering)

    def _close(self, t: int, gathering: _Gathering) -> None:
        if gathering.closing is not None:
            return
        fault_point("quorum.leader.closing", t)
        contributions = tuple(sorted(gathering.weights.items()))
        signature = self.trust.sign(close_statement(self.topic, t, contributions))
        gathering.closing = Closing(t, contributions, signature)
        missing = gathering.expected - set(gathering.weights)
        if missing:
            log.info("%s: %s round %d closed without %s", self.node.peer_id, self.topic, t, few(sorted(missing)))
        if gathering.grace is not None:
            gathering.grace.cancel()
        self._open.pop(t, None)
        self._closed[t] = gathering.closing
        while len(self._closed) > _KEEP_CLOSED_ROUNDS:
            oldest = min(self._closed)
            del self._closed[oldest]
            self._forgotten = max(self._forgotten, oldest)
        gathering.done.set()

    # ------------------------------------------------------------------ membership hooks
    def peer_left(self, peer_id: str) -> None:
        """Network thread: open rounds stop waiting for a member that left or died."""
        self._gone.add(peer_id)
        for t, gathering in list(self._open.items()):
            gathering.expected.discard(peer_id)
            self._check(t, gathering)

    def peer_joined(self, peer_id: str) -> None:
        self._gone.discard(peer_id)
