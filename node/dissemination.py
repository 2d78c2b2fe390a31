"""Dissemination: how membership updates spread and how a node applies what it hears.

Updates (`node.updates`: beats, records, claims, leaves) ride on probes, their answers and a
small gossip fan-out (`$gossip`), each sent on a bounded number of times by every member that
hears it (`node.swim.Broadcasts`), so one member's work per period is constant however large
the swarm. A node signs its own beat (with its meta) at most once every `meta_interval_s`.
Applying an update checks its signature: a forged one is refused and counted. Part of the
membership protocol, `node.swarm`, whose `Swarm` this is a part of.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from starling.node.identity import verify_signature
from starling.node.membership import (
    LIVE_SHIFT,
    PeerStatus,
    RefusedAgain,
    leave_statement,
    parse_beat,
    sign_beat,
)
from starling.node.outbox import UnknownPeerError
from starling.node.swim import (
    NEWS,
    ROUTINE,
    URGENT,
    Suspicion,
)
from starling.node.table_sync import MAX_WANTED
from starling.node.transport import SendError
from starling.node.updates import DEAD, SUSPECT, Beat, Claim, Leave, Record, Update, parse_updates
from starling.node.wire import Message, RejectReason, WireError

log = logging.getLogger(__name__)

# the messages updates ride on: a probe and its answer, an indirect probe, and gossip
PROBE, PROBE_VIA, GOSSIP = "$probe", "$probe-via", "$gossip"
# A burst's fan-out: in a push epidemic where each member that hears news sends it once to f
# others, about e^-f of the members are missed; 5 leaves 0.7%, so one wave reaches 99%.
BURST_FANOUT = 5
MAX_UNVERIFIED = 64  # peers (claimants, or the dead) whose claims wait for their record


class Dissemination:
    """Spreading updates and applying them (a part of `Swarm`)."""

    def on_gossip(self, msg: Message) -> None:
        """Updates pushed to us; `ack` asks for a probe of the sender at once (its connection to
        us dropped and it wants to know we are alive)."""
        body = msg.body
        self._apply(msg.sender, self._updates_of(body))
        if body.get("ack") is True:
            now = time.monotonic()
            if now - self._acked.get(msg.sender, -math.inf) >= self.liveness.probe_interval_s / 2:
                if len(self._acked) >= MAX_WANTED:
                    self._acked.clear()
                self._acked[msg.sender] = now
                self._spawn(self._ask(msg.sender, PROBE, {"u": self._take()},
                                      self.awareness.scale(self.liveness.ack_timeout_s)))

    @staticmethod
    def _updates_of(body: Any) -> list[Update]:
        if not isinstance(body, dict) or set(body) - {"u", "t", "ack"}:
            raise WireError(RejectReason.BAD_FIELD, "membership body must be a map {u: updates, ...}", field="body")
        return parse_updates(body.get("u", []))

    def _take(self, eager_only: bool = False) -> list[list[Any]]:
        lv, members = self.liveness, self.members()
        self.broadcasts.expire_news(time.monotonic() - lv.news_for_s(members))
        return self.broadcasts.take(lv.piggyback_bytes, lv.retransmit_limit(members), eager_only=eager_only)

    def _spread(self, update: Update, priority: int, *, at_once: bool = True) -> None:
        """Queue an update to be sent on (each key holds the newest update about one thing):
        `URGENT` claims, refutations and leaves, `NEWS` joins and our own new meta, `ROUTINE`
        beats passed on (`node.swim.Broadcasts`). Urgent updates, and news while little is
        queued, go out in a gossip round at once (`_gossip_now`) unless `at_once` is False."""
        now = time.monotonic()
        self.broadcasts.add(update.key, update.to_wire(), priority, now)
        if priority == NEWS:  # what is counted next is news still live
            self.broadcasts.expire_news(now - self.liveness.news_for_s(self.members()))
        # a join goes at once only when it is the one join waiting: a mass join (a swarm forming)
        # keeps every member's queue full of them, and bursts would only add to the load
        if at_once and (priority == URGENT or (priority == NEWS and self.broadcasts.count(NEWS) <= 2)):
            self._gossip_now()

    def _gossip_now(self) -> None:
        """A gossip round as soon as the update at hand is applied, not at the next tick, while
        this node has a burst token: a member that hears a death or a join passes it on within
        the loop's latency, so news crosses a swarm in about log5(n) hops. Tokens come one per
        gossip interval and `gossip_burst` keep: a storm of updates (a mass join) gets at most
        one round more per interval than the ticks give, never a flood. Suspicions wait for
        the ticks: spread at once, they would gather confirmations, and so shorten their own
        timeouts, fastest on a loaded box, where most suspicions are false."""
        lv = self.liveness
        if self._burst_pending or lv.gossip_burst == 0 or self.awareness.score > 0 or self._closed():
            return  # (a node that finds itself slow, Lifeguard's awareness, adds no load of its own)
        now = time.monotonic()
        self._burst_tokens = min(float(lv.gossip_burst),
                                 self._burst_tokens + (now - self._burst_at) / lv.gossip_interval_s)
        self._burst_at = now
        if self._burst_tokens < 1:
            return
        self._burst_tokens -= 1
        self._burst_pending = True
        self._spawn(self._burst())

    async def _burst(self) -> None:
        """The news to BURST_FANOUT random members and, past the socket cap, to each of our
        fingers (`node.ring`). A random push misses about e^-5 of the members in its first wave,
        and past the cap its targets are the few members we hold a socket to, so the waves after
        it came from the same few: at 256 members, one member in about three runs never heard a
        SIGKILL's death, kept the dead peer alive, and handed it back to the others once they
        had forgotten it (known dead again 72 s on). Every member is the finger of as many
        members as it has fingers, and the fingers reach everyone in log2(n) hops, so news that
        each member passes to its fingers once reaches every member whose view agrees and whose
        fingers it has probed since they last moved (their sockets are open)."""
        await asyncio.sleep(0)  # the rest of the message that brought the news is applied first
        self._burst_pending = False
        self.bursts += 1
        # Fingers not yet opened are left to their probe: a forming swarm's fingers move at nearly
        # every probe, and opening each for news cost 7.5 sockets a member at 1024.
        transport = self.outbox.transport
        flood = frozenset(p for p in self._pinned
                          if transport is not None and transport.is_open(p) and self._helper(p))
        self._gossip_round(max(self.liveness.gossip_fanout, BURST_FANOUT), flood=flood)

    async def _gossip_loop(self) -> None:
        """Urgent changes (claims, refutations, joins, leaves) to a few random members every
        gossip interval, on top of what rides on probes; and the suspicions' timeouts."""
        lv = self.liveness
        while True:
            wake_at = time.monotonic() + lv.gossip_interval_s
            await asyncio.sleep(lv.gossip_interval_s)
            now = time.monotonic()
            late = now - wake_at
            if late > lv.gossip_interval_s:
                # This process could not run: a refutation may be waiting unread. Suspicions are
                # pardoned before any of them may expire (this loop wakes first and most often).
                for suspicion in self._suspicions.values():
                    suspicion.pardon(late)
            if not self._closed():  # a node that no longer judges its peers lets suspicions be
                self._expire_suspicions(now)
            self._sign_meta(now)  # here too: a probe can take several timeouts under load
            self._gossip_round()

    def _gossip_round(self, fanout: int | None = None, flood: frozenset[str] = frozenset()) -> None:
        """Urgent updates and news, if any wait, to `fanout` (`gossip_fanout`) random members,
        and the same updates to each member in `flood`, members we can reach (one send of them
        as the queue counts)."""
        lv = self.liveness
        fanout = lv.gossip_fanout if fanout is None else fanout
        if not self.broadcasts.eager:
            return
        if flood:
            updates = self._take(eager_only=True)
            for peer_id in flood:
                self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": updates}))
        # Past the socket cap, to members we hold a socket to: a send to anyone else opens a
        # socket and its monitor and closes another (the costliest thing a simulated box's
        # membership does), or is refused while all are busy. Those are our fingers on the
        # ring (`node.ring`: log2(n) hops reach everyone, and every member is the finger of as
        # many as it has) and whoever the protocols talked to lately.
        targets = self._sample_members(fanout + 2, open_share=1.0)
        sent = 0
        for peer_id in targets:
            if sent >= fanout or peer_id in flood or not self._helper(peer_id):
                continue
            updates = self._take(eager_only=True)
            if not updates:
                break
            sent += 1
            self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": updates}))

    async def _send_quietly(self, peer_id: str, topic: str, body: Any) -> None:
        try:
            await self.outbox.send(peer_id, topic, body, timeout_s=self.liveness.probe_interval_s, check_body=False)
        except (SendError, UnknownPeerError, asyncio.TimeoutError):
            pass  # the failure detector decides, not one lost message

    def _sign_meta(self, now: float) -> None:
        """A changed meta becomes a new beat, at most once per `meta_interval_s`."""
        signed = self._signed_beat
        if signed is None or (signed[3] is not self.local.meta
                              and now - self._beat_signed_at >= self.liveness.meta_interval_s):
            self._meta_seq += 1
            # A new meta is news at its source: the member gossips it to a few others at once
            # (to the whole of a small swarm); they pass it on with their probes and answers.
            # (its ticks' rounds carry it: a burst is for news from elsewhere)
            self._spread(Beat(self._own_beat()), NEWS if signed is not None else ROUTINE, at_once=False)

    def _own_beat(self) -> list[Any]:
        """Our beat, signed once per counter and meta (a node replaces its meta, never edits it)."""
        local, signed = self.local, self._signed_beat
        assert local.record is not None
        beat = (self._live << LIVE_SHIFT) | (self._meta_seq & (2**LIVE_SHIFT - 1))
        if signed is None or signed[1] != local.record.incarnation or signed[2] != beat or signed[3] is not local.meta:
            if signed is not None and signed[2] == beat:
                self._meta_seq += 1  # a new meta never reuses a signed counter
                beat = (self._live << LIVE_SHIFT) | (self._meta_seq & (2**LIVE_SHIFT - 1))
            signed = self._signed_beat = sign_beat(local.identity, local.record.incarnation, beat, local.meta)
            self._beat_signed_at = time.monotonic()
        return signed

    def _apply_ended(self, sender: str, raw: list[Any]) -> None:
        """The deaths and leaves a member's table page carried (`TableSync.on_sync`): applied
        as its gossip, each checked against its signer's key. Anything else there is refused."""
        try:
            updates = parse_updates(raw)
            if not all(isinstance(u, Leave) or (isinstance(u, Claim) and u.kind == DEAD) for u in updates):
                raise WireError(RejectReason.BAD_FIELD, "a page's ended updates must be deaths and leaves",
                                field="body")
        except WireError as exc:
            self._reject(exc.reason, f"table page from {sender}: {exc}")
            return
        self._apply(sender, updates)

    def _apply(self, sender: str | None, updates: list[Update]) -> None:
        for update in updates:
            try:
                self._apply_one(update, sender)
            except RefusedAgain:
                continue  # gossip passes a join on several times: its refusal was counted once
            except WireError as exc:  # a forged or malformed update: that one only
                self._reject(exc.reason, str(exc))

    def _apply_one(self, update: Update, sender: str | None) -> None:
        table, me = self.table, self.local.peer_id
        if isinstance(update, Beat):
            entry = parse_beat(update.body)
            if entry[0] == me:
                return
            news = table.is_news(entry)
            if news is None:
                if sender is not None and self._refused.get(entry[0]) != entry[1]:
                    self.tables.want_from(sender, entry[0])
                return
            if news:
                now = time.monotonic()
                change = table.heartbeat(entry, now)
                if change is not None:
                    self._suspicions.pop(entry[0], None)
                    if change.old in (PeerStatus.SUSPECT, PeerStatus.DEAD):
                        self.claims.refuted(entry[0], now)
                    self.notify(change, refuted=True)
                # passed on as the copy the table now holds, the process's shared one (`verified_beat`):
                # a queue of updates is n per member, n^2 in a simulated swarm
                held = table.get(entry[0])
                assert held is not None and held.signed_beat is not None  # `heartbeat` just took it
                self._spread(Beat(held.signed_beat), URGENT if change is not None else ROUTINE)
        elif isinstance(update, Record):
            record = self.record_from(update.body)
            if self.learn(record, told_by=sender):
                self._spread(Record(record.wire), NEWS)  # the shared record's wire form, not our copy
        elif isinstance(update, Claim):
            self._apply_claim(update, mine=False, sender=sender)
        else:
            if update.peer_id == me:
                return
            info = table.get(update.peer_id)
            if info is None or info.status is PeerStatus.LEFT or update.incarnation < info.record.incarnation:
                return
            if not verify_signature(info.record.verify_key, leave_statement(update.peer_id, update.incarnation),
                                    update.signature):
                raise WireError(RejectReason.BAD_SIGNATURE, f"leave of {update.peer_id} is not signed by it",
                                field="body")
            change = table.left(update.peer_id, update.incarnation, proof=update)
            if change is not None:
                self.notify(change)
                self._spread(update, URGENT)

    def _await_record(self, peer_id: str, claim: Claim, sender: str) -> bool:
        """Keep a claim until `peer_id`'s record is learned (`Swarm.notify` applies it then):
        at most 8 per peer, for `MAX_UNVERIFIED` peers. False if there was no room."""
        waiting = self._unverified.get(peer_id)
        if waiting is None and len(self._unverified) >= MAX_UNVERIFIED:
            return False
        waiting = self._unverified.setdefault(peer_id, [])
        if len(waiting) < 8:
            waiting.append((claim, sender))
        return True

    def _apply_claim(self, claim: Claim, *, mine: bool, sender: str | None = None) -> None:
        """A signed suspect or dead claim [kind, peer, incarnation, live, claimant, signature]:
        one this node just made (`mine`), or one heard, checked against its claimant's key
        (ours too: a member cannot pass a claim off as this node's own)."""
        kind, peer_id, incarnation, live, claimant = claim.kind, claim.peer_id, claim.incarnation, claim.live, \
            claim.claimant
        me, table = self.local.peer_id, self.table
        if not mine:
            key = self.local.identity.verify_key if claimant == me else None
            if key is None:
                author = table.get(claimant)
                if author is None:
                    # a claimant we do not know yet (it joined a moment ago): ask for its record,
                    # and check the claim when it comes, above all one about us that we must refute
                    if sender is not None and self._await_record(claimant, claim, sender):
                        self.tables.want_from(sender, claimant)
                    return
                key = author.record.verify_key
            if not claim.is_signed(key):
                raise WireError(RejectReason.BAD_SIGNATURE, f"{kind!r} claim about {peer_id} is not signed by "
                                f"{claimant}", field="body")
        if peer_id == me:
            assert self.local.record is not None
            if incarnation == self.local.record.incarnation:
                if live < self._live and sender is not None:
                    self._remind(sender)  # refuted already; the refutation has not reached the sender
                else:
                    self._refute(live)
            return
        if not mine and not self.claims.believed(claimant, peer_id, time.monotonic()):
            return  # its claims about this peer were refuted too often (`ClaimLedger`)
        status = PeerStatus.SUSPECT if kind == SUSPECT else PeerStatus.DEAD
        if status is PeerStatus.DEAD and sender is not None and table.get(peer_id) is None:
            # the death of a peer we never learned (its join has not reached us): kept until its
            # record comes, if it does, so a table page from a member that missed the death does
            # not make it alive here
            self._await_record(peer_id, claim, sender)
            return
        held, change = table.claim(status, peer_id, incarnation, live, proof=claim)
        if held:
            self.claims.held(peer_id, claimant)
            if status is PeerStatus.SUSPECT:
                low, high = self.liveness.suspicion_bounds(self.members())
                expected = max(0, min(self.liveness.confirmations, self.members() - 2))
                self._suspicions[peer_id] = Suspicion((incarnation, live), claimant, time.monotonic(), low, high,
                                                      expected)
            else:
                self._suspicions.pop(peer_id, None)
                log.info("%s: %s declared %s dead", self.local.peer_id, claimant, peer_id)
            if change is not None:
                self.notify(change)
            self._spread(claim, URGENT, at_once=status is PeerStatus.DEAD)
            if not mine and self._rng.random() < self.liveness.gossip_fanout / self.members():
                # Gossip to the accused: a member that holds it suspect or dead no longer sends it
                # anything, so if the claimant's one message to it was lost it would never refute.
                # Each holder sends it the claim with probability fanout / n: about `fanout` copies.
                self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [claim.to_wire()]}))
        elif status is PeerStatus.SUSPECT:
            suspicion = self._suspicions.get(peer_id)
            if suspicion is not None and suspicion.at == (incarnation, live) and suspicion.confirm(claimant):
                self._spread(claim, URGENT, at_once=False)
