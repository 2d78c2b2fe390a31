"""The failure detector: SWIM's probes and indirect probes, suspicion, refutation and death,
with Lifeguard's local health (`node.swim` holds the arithmetic on an injected clock; this is
the messages).

Each period a member probes one other (`$probe`, a request), in round-robin order (past its
socket cap, over its fingers, `node.ring`); without an answer it asks `indirect_probes` others
to try (`$probe-via`), and without theirs it claims the member suspect. A suspicion times out
into death unless the accused refutes it with a newer beat. A peer whose connection drops is
probed at once and, silent or refusing to reconnect, claimed dead. Part of the membership
protocol, `node.swarm`, whose `Swarm` this is a part of.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from starling.node import rpc
from starling.node.dissemination import GOSSIP, PROBE, PROBE_VIA
from starling.node.loop import AwakeDeadline
from starling.node.membership import (
    PeerInfo,
    PeerStatus,
)
from starling.node.outbox import UnknownPeerError
from starling.node.swim import (
    URGENT,
)
from starling.node.table_sync import MAX_WANTED, TOMBSTONE_PULLS
from starling.node.transport import Inbound, NoSocket, SendError
from starling.node.updates import DEAD, MAX_LIVE, SUSPECT, Beat, Claim, Record
from starling.node.wire import RejectReason, WireError

log = logging.getLogger(__name__)

MAX_PROBES_VIA = 16  # indirect probes this node runs for others at once
NO_SOCKET: Any = object()  # `_ask`'s answer when this node had no socket to send on


class FailureDetector:
    """Probing, suspicion and death (a part of `Swarm`)."""

    def connection_lost(self, peer_id: str) -> None:
        """Our connection to a peer dropped (transport's socket monitor). A live peer becomes
        suspect at once, on this node's own evidence, and is probed; if nothing is heard from
        it within the probe timeout it is dead, and this node tells the swarm (a dead claim it
        signs), so a crash seen by the few members with a connection is known to all in the
        time the claim takes to spread. A peer whose connection merely blipped answers the
        probe once ZeroMQ has reconnected."""
        info = self.table.get(peer_id)
        if self._closed() or info is None or info.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
            return
        if peer_id in self._probing:
            return  # one probe per peer at a time: a peer that flaps cannot pile them up
        dropped_at = time.monotonic()
        log.info("%s: connection to %s dropped; probing it", self.local.peer_id, peer_id)
        change = self.table.suspect(peer_id)
        if change is not None:
            self.notify(change)
        self._probing.add(peer_id)
        self._spawn(self._probe_dropped(peer_id, dropped_at))

    def connection_refused(self, peer_id: str) -> None:
        """An attempt to connect to a peer failed (transport's socket monitor): its time is
        kept, the last two per peer, for a probe of it that goes unanswered (`_refused_since`)."""
        if peer_id not in self._refusals and len(self._refusals) >= MAX_WANTED:
            self._refusals.clear()  # bounded; a probe under way then finds none, and waits
        last = self._refusals.get(peer_id, (-math.inf, -math.inf))[1]
        self._refusals[peer_id] = (last, time.monotonic())

    def _refused_since(self, peer_id: str, since: float) -> bool:
        """Whether the last two attempts to connect to `peer_id` failed after `since`: the
        evidence that makes a peer dead at once, after a dropped connection or an unanswered
        probe."""
        return self._refusals.get(peer_id, (-math.inf, -math.inf))[0] > since

    def _lately(self, started: float) -> float:
        """Since when a refusal is recent, for a probe that started at `started`: then, or two of
        the transport's longest reconnect intervals ago (a DEALER past its first attempts
        retries that seldom, and may have found no moment inside a short probe)."""
        transport = self.outbox.transport
        ivl_max_s = transport.config.reconnect_ivl_max_ms / 1000 if transport is not None else 0.0
        return min(started, time.monotonic() - 2 * ivl_max_s)

    async def _probe_dropped(self, peer_id: str, dropped_at: float) -> None:
        try:
            await self._probe_and_judge(peer_id, dropped_at)
        finally:
            self._probing.discard(peer_id)

    async def _probe_and_judge(self, peer_id: str, dropped_at: float) -> None:
        """Dead unless heard from within the probe timeout, or sooner: once two attempts to
        connect again have failed (`_refused_since`). A process that is gone leaves
        an address nothing listens on, and the kernel refuses each attempt within the
        reconnect interval (0.1 s, then 0.2 s); a live peer's kernel accepts even while its
        process is too busy to answer, and a link that loses packets fails attempts only after
        the kernel's own timeouts, seconds later, so neither is judged early."""
        timeout_s = self.liveness.probe_timeout_s
        # Counted in awake time: a stall of this process is not the peer's silence.
        deadline = AwakeDeadline(timeout_s, tick_s=min(0.05, timeout_s / 4))
        # sent once ZeroMQ has reconnected, if it can; the silence decides otherwise
        send = asyncio.ensure_future(self.outbox.send(peer_id, GOSSIP, {"u": [], "ack": True}, timeout_s=timeout_s))
        send.add_done_callback(lambda task: task.cancelled() or task.exception())  # read, never raised
        refused = False
        try:
            while not deadline.expired():
                info = self.table.get(peer_id)
                if info is None or info.status is not PeerStatus.SUSPECT or info.last_seen > dropped_at:
                    return  # heard from it (or it left, or a claim got there first)
                if self._refused_since(peer_id, dropped_at):
                    refused = True
                    break
                await deadline.sleep(min(0.05, max(deadline.left, 0.0)))
        finally:
            send.cancel()
        at = self.table.live_at(peer_id)
        claim = Claim.sign(self.local.identity, DEAD, peer_id, *at) if at is not None else None
        change = self.table.declare_dead(peer_id, dropped_at, proof=claim)
        if change is not None and claim is not None:
            log.info("%s: %s %s", self.local.peer_id, peer_id,
                     f"refused two connections in {time.monotonic() - dropped_at:.2g} s after its "
                     "connection dropped" if refused else
                     f"did not answer a probe within {timeout_s:.2g} s of its connection dropping")
            if refused:
                self.stats.count_refused_death()
            self.notify(change)
            self._spread(claim, URGENT)

    async def run(self) -> None:
        """The node's liveness: probes, suspicions, gossip and anti-entropy, until the node
        closes. Anti-entropy has a loop of its own, not a turn in the probe loop's: a probe that
        goes to indirect probes takes seconds, and a forming swarm's pulls must keep to their
        period (while the table grows, one a period whatever the load; at rest they back off,
        scaled by awareness)."""
        self._spawn(self._gossip_loop())
        self._spawn(self.tables.run(lambda: self.awareness.scale(self.liveness.sync_interval(self.members()))))
        await self._probe_loop()

    def members(self) -> int:
        """The swarm's size as this node sees it (itself included)."""
        return len(self.table.live_ids) + 1

    async def _probe_loop(self) -> None:
        lv = self.liveness
        wake_at: float | None = None
        periods = 0
        while True:
            now = time.monotonic()
            # Woke a period or more late: the loop (or the whole process) was stalled, and the
            # answers and refutations that came meanwhile may still be unread. Peers are not
            # blamed for it: running suspicions wait that much longer.
            late = 0.0 if wake_at is None else now - wake_at
            if late > lv.probe_interval_s:
                self.stats.count_stall(late)  # running suspicions are pardoned by the gossip loop
                log.log(logging.INFO if late >= 3 * lv.probe_interval_s else logging.DEBUG,
                        "%s: liveness loop stalled %.2f s; not counted against peers", self.local.peer_id, late)
            self._sign_meta(now)
            target = None if self._closed() else self._next_target()
            if target is not None:
                await self._probe(target)
            self.relays.keep()
            now = time.monotonic()
            for tick in self.ticks:
                tick(now)
            periods += 1
            if periods % 16 == 0:  # walks the table: not every period
                self.tables.expire(now, self.forget_after_s)
                self._unverified.clear()  # records that never came: made up, or gone
                # a forgotten death's proof is kept for a few of a member's pulls at rest, so one
                # that missed it and still pages the peer on hears of it (`TableSync.on_sync`)
                tombstones_s = TOMBSTONE_PULLS * self.liveness.sync_interval(self.members())
                for gone in self.table.forget(self.forget_after_s, now, tombstones_s):
                    self.tables.forget(gone)
                    if self.outbox.transport is not None:
                        self.outbox.transport.disconnect(gone)
            period = self.awareness.scale(lv.probe_interval_s)
            wait = max(0.0, period - (time.monotonic() - now))
            wake_at = time.monotonic() + wait
            await asyncio.sleep(wait)

    def _can_probe(self, info: PeerInfo) -> bool:
        # `_next_finger` inlines this test for the members with no address: change both together
        transport = self.outbox.transport
        return info.record.reachable or (transport is not None and transport.can_send(info.peer_id))

    def _next_target(self) -> str | None:
        """The next member in probe order that we can reach (a client only a relay reaches is
        probed by its relays, and its death comes to us as their claim). Past the socket cap,
        the next of our fingers (`node.ring`), whose sockets stay open."""
        live, transport = self.table.live_ids, self.outbox.transport
        if transport is not None and len(live) > transport.dealer_cap:
            return self._next_finger(transport.dealer_cap)
        if self._pinned:
            self._pinned = frozenset()
            if transport is not None:
                transport.pin(self._pinned)
        for _ in range(min(len(live), 8)):
            peer_id = self._order.next(live)
            if peer_id is None:
                return None
            info = self.table.get(peer_id)
            if info is not None and self._can_probe(info):
                return peer_id
        return None

    def _next_finger(self, cap: int) -> str | None:
        """The next of our fingers on the ring, round-robin; their DEALERs are pinned open (at
        most half the cap of them), so a probe opens no socket and no monitor, and their
        connections are watched all along."""
        table, transport = self.table, self.outbox.transport
        live = table.live_ids
        # `_can_probe` for the few members whose records give no address; the rest can be.
        # While a swarm forms, every probe works the fingers out afresh: over the live ids'
        # ring keys as an array, not a walk of thousands of members in Python
        # (`benchmarks/membership_costs.py`: probe_target_speedup)
        skip = [at for p in table.unaddressed
                if (at := live.index(p)) is not None and not (transport is not None and transport.can_send(p))]
        limit = max(1, cap // 2)
        target = self._ring.next(live.ids, live.version, limit, live.keys(), skip)
        fingers = frozenset(self._ring.current[: cap // 2])
        if fingers != self._pinned and transport is not None:
            self._pinned = fingers
            transport.pin(fingers)
        return target

    async def _probe(self, target: str) -> None:
        """One SWIM probe: directly, then through `indirect_probes` others; suspect the target
        if nobody reached it and nothing was heard from it meanwhile."""
        lv, awareness = self.liveness, self.awareness
        started = time.monotonic()
        timeout = awareness.scale(lv.ack_timeout_s)
        direct = await self._ask(target, PROBE, {"u": self._introduce(target) + self._take()}, timeout)
        if direct is NO_SOCKET:
            return  # could not even send it: no verdict this period
        if direct is not None:
            awareness.apply(-1)
            return
        info = self.table.get(target)
        if info is None or info.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
            return
        helpers = self._helpers(lv.indirect_probes, but=target)
        answers = await asyncio.gather(*(self._ask(h, PROBE_VIA, {"t": target, "u": self._take()}, 2 * timeout)
                                         for h in helpers))
        if answers and all(a is NO_SOCKET for a in answers):
            return  # nobody could be asked: no verdict this period
        acked = any(isinstance(a, dict) and a.get("ack") is True for a in answers)
        nacks = sum(1 for a in answers if isinstance(a, dict) and a.get("ack") is False)
        # Lifeguard: a helper that sent no nack either is a sign this node is the slow one
        awareness.apply(len(helpers) - nacks - (len(helpers) if acked else 0))
        info = self.table.get(target)
        if acked or info is None or info.last_seen > started:
            return
        lag = self.loop_lag(started)
        if lag > timeout / 2:
            # our own loop fell behind by half an ack timeout or more while we waited: an answer
            # may be sitting unread, so the silence says nothing of the target (and we are slow)
            awareness.apply(1)
            log.info("%s: no answer from %s while this process ran %.2g s behind; no verdict",
                     self.local.peer_id, target, lag)
            return
        if helpers and not nacks:
            # nobody answered at all, helpers included: this node cannot tell its own slowness
            # (a starved process, a link down) from the target's, so it blames itself
            log.info("%s: no answer from %s nor from any of %d members asked about it; no verdict",
                     self.local.peer_id, target, len(helpers))
            return
        if self._refused_since(target, info.last_seen) and self._refusals[target][1] >= self._lately(started):
            # nobody reached it, and its address refused our connections, twice since we last
            # heard from it and lately: nothing listens there (the process is gone), which a
            # suspicion's wait (ours, or one another member's claim started) would only confirm
            log.info("%s: no answer from %s, nor through %d of %d members asked, and its address refused "
                     "us; dead", self.local.peer_id, target, nacks, len(helpers))
            at = self.table.live_at(target)
            if at is not None:
                self.stats.count_refused_death()
                self._apply_claim(Claim.sign(self.local.identity, DEAD, target, *at), mine=True)
            return
        if info.status is PeerStatus.ALIVE or (info.status is PeerStatus.SUSPECT and info.claim_at < 0):
            log.info("%s: no answer from %s in %.2g s, nor through %d of %d members asked; suspect",
                     self.local.peer_id, target, time.monotonic() - started, nacks, len(helpers))
            self._suspect(target)

    def _sample_members(self, k: int, *, but: str | None = None, open_share: float = 0.0) -> list[str]:
        """Up to `k` random live members other than `but`. Past the socket cap, a send to one we
        hold no socket to opens one and closes another (or is refused while all are busy), so
        `open_share` of the draws (all of them once the process ran out of descriptors) pick
        from the members we hold a socket to: our fingers (`node.ring`), spread over the swarm,
        and whoever the protocols talked to lately."""
        transport, live = self.outbox.transport, self.table.live_ids
        if transport is not None and len(live) > transport.dealer_cap and (
                transport.starved or self._rng.random() < open_share):
            picked = [p for p in transport.sample_open(self._rng, k + 1) if p != but and p in live][:k]
            if picked:
                return picked
        return list(live.sample(self._rng, k, but=(but,) if but is not None else ()))

    def _helpers(self, k: int, *, but: str | None = None) -> list[str]:
        """Up to `k` random members that can be asked to help (`_helper`: alive, and we can
        reach them), other than `but`. Past the socket cap, of those we hold a socket to (asking
        any other opens one and closes another); but when none of those can help (on a box too
        loaded to answer probes in time they are the members we probed, and now suspect), of
        every live member: with nobody asked, an indirect probe would suspect its target on our
        word alone, and a table pull would learn nothing and back off."""
        for open_share in (1.0, 0.0):
            helpers = [h for h in self._sample_members(k + 2, but=but, open_share=open_share) if self._helper(h)]
            if helpers:
                return helpers[:k]
        return []

    async def _ask(self, peer_id: str, topic: str, body: Any, timeout_s: float) -> Any:
        """A request's answer body, with its updates applied; None if none came in time."""
        try:
            reply = await self.outbox.request(peer_id, topic, body, timeout_s=timeout_s)
        except rpc.BadRequestError:
            if topic == PROBE and len(self._unknown_to) < MAX_WANTED:
                self._unknown_to.add(peer_id)  # it may not know us (it lost our record): introduce us next time
            return {}  # it answered (a refusal): alive
        except rpc.RemoteError:
            return {}  # it answered (a refusal): alive
        except NoSocket:
            return NO_SOCKET  # our own shortage: nothing learned of the peer
        except (rpc.RpcError, SendError, UnknownPeerError, asyncio.TimeoutError, TimeoutError):
            return None
        try:
            self._apply(reply.sender, self._updates_of(reply.body))
        except WireError as exc:  # an answer we cannot read still proves its sender alive
            self._reject(exc.reason, f"{topic} answer from {peer_id}: {exc}")
            return {}
        return reply.body

    def on_probe(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """A member probes us: apply what it carries, answer with ours.

        A peer we hold no record of may probe too, if it carries its own record first (it
        learned of us from others before its record reached us): we learn it as from a hello
        (the record's key must own the connection) and answer as to a member. Anything else
        from a stranger is refused, and nothing of it applied."""
        updates = self._updates_of(body)
        if member is None:
            if not updates or not isinstance(updates[0], Record):
                raise WireError(RejectReason.UNKNOWN_PEER, "a probe from a peer we do not know must carry its record",
                                field="sender")
            member, updates = self.first_hand(inbound, updates[0].body, "probe"), updates[1:]
        self._apply(member, updates)
        return {"u": self._take()}

    async def on_probe_via(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """A member could not reach `t` and asks us to try: ack True if it answered us, False
        (Lifeguard's nack: we are alive and tried) if not. At most `MAX_PROBES_VIA` at once."""
        if not isinstance(body, dict) or not isinstance(body.get("t"), str):
            raise WireError(RejectReason.BAD_FIELD, "probe-via body must be {t: peer id, u: updates}", field="body")
        self._apply(member, self._updates_of(body))
        target = self.table.get(body["t"])
        if target is None or target.peer_id == member or target.status not in (PeerStatus.ALIVE, PeerStatus.SUSPECT) \
                or not self._can_probe(target) or self._probes_via >= MAX_PROBES_VIA:
            return {"ack": False, "u": self._take()}
        self._probes_via += 1
        try:
            answer = await self._ask(target.peer_id, PROBE, {"u": self._take()},
                                     self.awareness.scale(self.liveness.ack_timeout_s))
        finally:
            self._probes_via -= 1
        if answer is NO_SOCKET:
            raise rpc.BusyError("no socket to spare for the probe")  # an answer that says nothing of the target
        return {"ack": answer is not None, "u": self._take()}

    def _suspect(self, peer_id: str) -> None:
        """Nobody reached `peer_id`: claim it suspect (signed), start its timer, tell the swarm
        and the peer itself (so it can refute at once)."""
        at = self.table.live_at(peer_id)
        if at is None:
            return
        claim = Claim.sign(self.local.identity, SUSPECT, peer_id, *at)
        self._apply_claim(claim, mine=True)
        self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [claim.to_wire()]}))

    def _expire_suspicions(self, now: float) -> None:
        for peer_id, suspicion in list(self._suspicions.items()):
            info = self.table.get(peer_id)
            if info is None or info.status is not PeerStatus.SUSPECT or info.claim_at < 0:
                del self._suspicions[peer_id]
                continue
            if now < suspicion.expires_at():
                continue
            at = (info.record.incarnation, info.claim_at)
            if info.last_seen > suspicion.start:
                # heard from it since: it is alive to us, only slow to refute (or its refutation
                # passed us by); remind it, and give it another timeout
                log.info("%s: %s outlived its suspicion here; asking it to refute", self.local.peer_id, peer_id)
                suspicion.start = now
                self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [
                    Claim.sign(self.local.identity, SUSPECT, peer_id, *at).to_wire()]}))
                continue
            ack_timeout_s = self.liveness.ack_timeout_s
            if (suspicion.last_probe is not None
                    and self.loop_lag(suspicion.last_probe) > self.awareness.scale(ack_timeout_s) / 2):
                # as for any probe: this process ran behind while it waited, so the answer may
                # be sitting unread; no verdict, and one more probe of our own
                self.awareness.apply(1)
                log.info("%s: no answer from suspect %s while this process ran behind; probing it again",
                         self.local.peer_id, peer_id)
                suspicion.last_probe = None
            if suspicion.last_probe is None:
                # one probe of our own before the verdict: a suspect whose refutation has not
                # reached us (dissemination saturated by a burst of joins) answers it, and the
                # answer leads to its refutation (see `_remind`); a dead one costs one timeout more
                suspicion.last_probe = now
                timeout = self.awareness.scale(ack_timeout_s)
                suspicion.start = now - suspicion.timeout_s + 2 * timeout  # it now expires in 2 timeouts
                self._spawn(self._ask(peer_id, PROBE, {"u": self._introduce(peer_id)}, timeout))
                continue
            del self._suspicions[peer_id]
            claim = Claim.sign(self.local.identity, DEAD, peer_id, *at)
            self._apply_claim(claim, mine=True)
            self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [claim.to_wire()]}))  # if it lives, it refutes

    def _refute(self, live: int) -> None:
        """A member claims we are suspect or dead at liveness incarnation `live`: sign a beat
        of a higher one and tell the swarm. Having to refute is also a sign we were slow."""
        if live < self._live or live >= MAX_LIVE:
            return  # stale, or past what a beat counter holds (parse_updates refuses those)
        self._live = live + 1
        self.awareness.apply(1)
        log.info("%s: refuting a claim that it is down (liveness incarnation %d)", self.local.peer_id, self._live)
        self._spread(Beat(self._own_beat()), URGENT)

    def _remind(self, peer_id: str) -> None:
        """Send `peer_id` our current beat (it holds a claim we refuted already), at most once
        per half probe period per peer."""
        now = time.monotonic()
        if now - self._reminded.get(peer_id, -math.inf) < self.liveness.probe_interval_s / 2:
            return
        if len(self._reminded) >= MAX_WANTED:
            self._reminded.clear()
        self._reminded[peer_id] = now
        self._spawn(self._send_quietly(peer_id, GOSSIP, {"u": [Beat(self._own_beat()).to_wire()]}))

    def _recheck(self, peer_id: str) -> None:
        """Probe a peer we hold dead whose record a member just passed us as alive (a table
        pull, records handed on): if it answers it is alive to us again. A false death whose
        refutation passed us by otherwise lasts until that peer next talks to us, which in a
        swarm past the socket cap can be an hour of round-robin probes away. At most once per
        suspicion timeout per peer."""
        now = time.monotonic()
        if now - self._rechecked.get(peer_id, -math.inf) < self.liveness.suspicion_base_s:
            return
        if len(self._rechecked) >= MAX_WANTED:
            self._rechecked.clear()
        self._rechecked[peer_id] = now
        self._spawn(self._ask(peer_id, PROBE, {"u": self._introduce(peer_id)},
                              self.awareness.scale(self.liveness.ack_timeout_s)))
