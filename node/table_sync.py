"""Table sync: how members learn one another's records besides gossip, under budgets.

- `$sync`: a member pages through another member's table (the records of the peers alive to
  it, in id order, at most `table_page_bytes` a page, and where to go on from). A joiner takes
  the whole table so, once a member (`node.bootstrap`): its first page, then the rest in
  ranges of the id space at once, so a join takes two round trips whatever the table's size;
  every member takes up to PULL_PAGES
  pages of what a random member holds and it lacks, now and then (anti-entropy, as memberlist's
  push-pull): its ask names the peers it holds alive (`have`: each id's first HAVE_CHARS
  characters), so the pages are news only. It pulls every probe period (or
  `Liveness.forming_pull_s`) while pulls bring news or its table grows (a swarm that is
  forming), backing off to `sync_interval` while they bring
  none, so a record whose announcement was lost comes back. A pull after one that brought
  nothing first asks only whether the member holds the same live peers (`sum`, a digest of
  their ids: 16 bytes where the `have` list is 6 bytes a peer), and pages only if it does
  not: a swarm at rest pulls in O(1) bytes, whatever its size. A member the puller only heard of
  may not know it: the ask then carries the puller's record (`me`), learned as from a hello.
  The first page also carries the signed deaths and leaves the member holds (entries and
  tombstones, `node.membership`) of peers the ask names (`ended`): a member that missed one
  learns it from its next pull, before the others forget the peer and take it back alive from
  its pages.
- `$want`: a beat names a peer we hold no record of; we ask the member that passed it on for
  the record (at most once a probe period per id), and it answers with `$announce`.
- Each member's pulls (`$sync` pages and `$want` answers) share one token bucket of
  `member_pull_bytes_per_s`: past it a page is turned down as busy (and the refusal charged
  too), and a member deep in that debt is not answered at all.

Records that come back are checked as relayed ones (allowlist, signature, table room) by the
membership protocol (`node.swarm`), which lends `learn` and `record_from`.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from starling.common.faults import fault_point
from starling.node import rpc
from starling.node.admission import AdmissionConfig, TokenBucket
from starling.node.have import HAVE_CHARS, Have, HaveError, encode_codes
from starling.node.local import LocalPeer
from starling.node.membership import PeerRecord, PeerStatus, PeerTable, RefusedAgain
from starling.node.outbox import Outbox, Spawn
from starling.node.stats import NodeStats
from starling.node.swim import Liveness
from starling.node.transport import Inbound
from starling.node.wire import ENVELOPE_BYTES, Message, RejectReason, WireError, fitting, frame_nbytes

log = logging.getLogger(__name__)

ANNOUNCE = "$announce"  # records, pushed: a seed's joiner to the members, and answers to WANT
WANT = "$want"  # asks a member for records it gossiped that we lack; answered with ANNOUNCE
# A member asks another for its whole table (anti-entropy, as memberlist's push-pull): peers
# that joined through one seed at the same time learn each other in one round trip, not over
# the many heartbeat intervals their digests take to spread in a big swarm.
SYNC = "$sync"
MAX_WANT = 256
MAX_WANTED = 4096  # ids asked for and not yet forgotten (see `want_from`)
MAX_SYNC_PAGES = 4096  # pages one `sync` reads before it stops (a table past that is not honest)
SYNC_BUSY_RETRIES = 5  # pulls a peer turned down over its budget, waited out and sent again
MAX_PARALLEL_PAGES = 8  # ranges of a table a whole walk (a joiner's) pages at once, after its first page
PULL_PAGES = 4  # pages of news one anti-entropy pull reads at most (within a member's 1 MB burst)
# A `$sync` ask's `have` names each peer the asker holds by its id's first HAVE_CHARS characters
# (30 bits of its key's hash, `node.have`): a page leaves those out. A made-up id that shares a
# peer's prefix only keeps that record out of one page; gossip and `$want` still bring it.
MAX_HAVE = 65536  # ids one ask may name (a table past that is not honest)
MAX_ENDED = 64  # proofs of deaths and leaves one page carries at most (the updates a message may)
SUM_BYTES = 16  # a `$sync` ask's `sum`: a digest of the asker and the peers it holds alive (`live_sum`)
# A forgotten death's tombstone lasts this many of a member's pulls at rest (`sync_interval`):
# a member that missed the death pulls at least twice meanwhile, and hears of it.
TOMBSTONE_PULLS = 3


class TableSync:
    """One node's side of `$sync` and `$want`, over its peer table."""

    def __init__(self, local: LocalPeer, table: PeerTable, outbox: Outbox, stats: NodeStats, spawn: Spawn,
                 rng: random.Random, *, liveness: Liveness, admission: AdmissionConfig,
                 learn: Callable[..., bool], record_from: Callable[[Any], PeerRecord],
                 reject: Callable[[RejectReason, str], None],
                 introduce: Callable[[str], list[Any]], first_hand: Callable[[Inbound, Any, str], str],
                 helpers: Callable[[int], list[str]], apply_ended: Callable[[str, list[Any]], None],
                 loop_lag: Callable[[float], float] = lambda since: 0.0) -> None:
        self._local = local
        self.table = table
        self.outbox = outbox
        self.stats = stats
        self.liveness = liveness
        self.admission = admission
        self._spawn = spawn
        self._rng = rng
        self._learn = learn
        self._record_from = record_from
        self._reject = reject
        self._introduce = introduce  # our record as an update, for a member that may not know us; or []
        self._first_hand = first_hand  # learns the record a stranger sent of itself; its id
        # up to k random members to pull from, alive and reachable: past the socket cap, ones we
        # hold a socket to while any of those can help
        self._helpers = helpers
        self._apply_ended = apply_ended  # applies the deaths and leaves a member's page carried, as its gossip
        self._loop_lag = loop_lag  # how far behind this process's loop ran since a time (`LoopLag.worst_since`)
        self._pulls: dict[str, TokenBucket] = {}  # member id -> the bytes its table pulls may still take
        self._wanted: dict[str, float] = {}  # peer id -> when we last asked for its record
        # the first pull a period or two in (a joiner's table is the seed's, as of its join);
        # then sooner while pulls bring news, later while they bring none (`anti_entropy`)
        self._quiet_s = liveness.forming_pull()
        self._held_at_pull = 0  # live peers held when the last pull ended
        self._settled = False  # the last pull brought nothing and the table did not grow: ask `sum` first
        self._sum: tuple[int, bytes] = (-1, b"")  # (live_ids.version, live_sum) of this node's table
        # anti-entropy pulls by outcome: news, none, same (the helper held the same peers alive),
        # no_helper, or the error's name
        self.pulls: dict[str, int] = {}
        self.pulled_s = 0.0  # their total time

    def forget(self, peer_id: str) -> None:
        """A peer left the table: its pull budget goes too."""
        self._pulls.pop(peer_id, None)

    def expire(self, now: float, forget_after_s: float) -> None:
        """Forget the ids asked for longer ago than `forget_after_s`."""
        self._wanted = {k: t for k, t in self._wanted.items() if now - t < forget_after_s}

    def on_sync(self, inbound: Inbound, member: str | None, body: Any) -> dict[str, Any]:
        """A member asks for a page of our table: the records of peers alive to us, in id order
        from after `after`, leaving out those `have` names, at most `table_page_bytes` of them,
        and `next` to go on from (None at the end). A first page also carries, within the same
        bytes, the proofs we hold of the deaths and leaves of peers `have` names (`ended`: what
        the asker missed). Each member's pulls share
        `member_pull_bytes_per_s`; past it the pull is turned down (busy) and may be sent again
        later."""
        after, have, me, asked_sum = parse_sync(body)
        admission, now = self.admission, time.monotonic()
        page_bytes = admission.table_page_bytes
        if member is None:  # a peer that heard of us before we of it (a mass join), with its record
            if me is None:
                raise WireError(RejectReason.UNKNOWN_PEER, "a table pull from a peer we do not know must carry its "
                                "record", field="sender")
            member = self._first_hand(inbound, me, "table pull")
            if member not in self.table:
                raise WireError(RejectReason.UNKNOWN_PEER, f"table pull from {member}, whose record we did not take",
                                field="sender")
            # a member from this message on, but its first page is held to what a stranger may get
            page_bytes = min(page_bytes, admission.stranger_reply_factor * frame_nbytes(inbound.frames))
        if after is not None and not have:  # a walk of the whole table, past the hello's answer: a joiner's
            fault_point("join.seed.paging")
        bucket = self.pull_bucket(member, now)
        if bucket.available(now) < -admission.table_page_bytes:
            raise rpc.Unanswered(f"{member} pulls on past its budget's refusals")
        if asked_sum is not None:  # does it hold the peers alive that we do? (worked out once per change)
            bucket.charge(ENVELOPE_BYTES, now)
            return {"same": asked_sum == self.live_sum()}
        budget = min(page_bytes, bucket.available(now)) - ENVELOPE_BYTES
        peers, following, nbytes = self.page(after, budget, have=have)
        if not peers and (following is not None or budget < 0):
            # the refusal is charged too, so pulling faster only puts the next page further off;
            # a member deep in that debt is not answered at all
            bucket.charge(ENVELOPE_BYTES, now)
            raise rpc.BusyError(f"table pulls over {admission.member_pull_bytes_per_s:.0f} bytes/s; try again later")
        reply: dict[str, Any] = {"peers": peers, "next": following}
        if have and after is None:
            ended, size = self.ended(have, budget - nbytes)
            if ended:
                reply["ended"] = ended
                nbytes += size
        bucket.charge(nbytes + ENVELOPE_BYTES, now)  # an empty page costs its envelope too
        return reply

    def ended(self, have: Have, budget: float) -> tuple[list[Any], int]:
        """The proofs of the deaths and leaves of peers `have` names, at most MAX_ENDED of them
        and `budget` bytes, as updates on the wire; and their bytes."""
        return fitting((proof.to_wire() for proof in self.table.proofs(have)[:MAX_ENDED]), budget)

    def pull_bucket(self, member: str, now: float) -> TokenBucket:
        bucket = self._pulls.get(member)
        if bucket is None:
            admission = self.admission
            bucket = self._pulls[member] = TokenBucket(admission.member_pull_bytes_per_s,
                                                       admission.member_pull_burst_bytes, now)
        return bucket

    def page(self, after: str | None, budget: float, but: str | None = None,
             have: Have | None = None) -> tuple[list[Any], str | None, int]:
        """Records of live peers with ids above `after` (all, for None) and none of those
        `have` names, in id order, that fit in `budget` bytes; the id to go on from (None if
        none are left); and their bytes."""
        table = self.table
        # from the live ids kept in order, not a sort: every member's pulls page every table
        # while a swarm forms, and a joiner's walk is dozens of pages
        live = table.live_ids
        ids = live.in_order()
        start = 0 if after is None else bisect.bisect_right(ids, after)
        if have:  # only the ids it lacks, found at once: a forming member's pull names nearly all
            lacking = have.lacking(live.codes_in_order())
            positions: Iterable[int] = lacking[np.searchsorted(lacking, start):].tolist()
        else:
            positions = range(start, len(ids))
        page: list[Any] = []
        nbytes = 0
        for at in positions:
            peer_id = ids[at]
            if peer_id == but:
                continue
            info = table.get(peer_id)
            assert info is not None  # live_ids follows the table's entries
            record = info.record
            size = record.wire_bytes
            if nbytes + size > budget:
                return page, (page[-1][0] if page else after or ""), nbytes
            page.append(record.wire)
            nbytes += size
        return page, None, nbytes

    async def sync(self, peer_id: str, after: str | None = None, pages: int = MAX_SYNC_PAGES,
                   collect: list[Any] | None = None, have: bytes | None = None,
                   timeout_s: float | None = None) -> int:
        """Learn the table of `peer_id` (a member), page by page from after `after`, at most
        `pages` of them: the number of records that were news. `have` (`have_digest`): leave
        out the peers it names, and hear of their deaths and leaves. A page turned down as over
        our pull budget is waited for.

        A walk of the whole table (no `have`, as a joiner's) reads its first page, then the rest
        in up to MAX_PARALLEL_PAGES ranges of the id space at once: ids are hashes, so the first
        page's span says how many pages are left, and a join takes about two round trips to the
        member whatever the table's size, not one a page.
        `collect`: the records that checked out are appended to it as they came on the wire (to
        hand to other nodes, `Node.add_records`)."""
        pages = min(pages, MAX_SYNC_PAGES)
        walk = _Walk(pages)
        learned = await self._walk(peer_id, after, None, walk, collect, have, timeout_s, first_only=True)
        if walk.next is None:
            return learned
        if have is None and walk.left > 1:
            ranges = split_ids(after, walk.next, min(MAX_PARALLEL_PAGES, walk.left))
            results = await asyncio.gather(*(
                self._walk(peer_id, start, until, walk, collect, None, timeout_s)
                for start, until in zip(ranges, [*ranges[1:], None], strict=True)), return_exceptions=True)
            for result in results:  # every range has ended: none goes on learning after we return
                if isinstance(result, BaseException):
                    raise result
            return learned + sum(r for r in results if isinstance(r, int))
        return learned + await self._walk(peer_id, walk.next, None, walk, collect, have, timeout_s)

    async def _walk(self, peer_id: str, after: str | None, until: str | None, walk: _Walk,
                    collect: list[Any] | None, have: bytes | None, timeout_s: float | None,
                    first_only: bool = False) -> int:
        """Pages of `peer_id`'s table from after `after` up to `until` (the next range's start;
        records from it on are that range's), while `walk` has pages left: the news learned.
        `walk.next` is where the last page said to go on from."""
        learned, busy = 0, 0
        while walk.left > 0:
            ask: dict[str, Any] = {} if after is None else {"after": after}
            if have is not None:
                ask["have"] = have
                introduction = self._introduce(peer_id)
                if introduction:  # a member we only heard of may not know us: our record comes along
                    ask["me"] = introduction[0][1]
            try:
                reply = await self.outbox.request(peer_id, SYNC, ask or None, timeout_s=timeout_s)
            except rpc.BusyError:
                busy += 1
                if busy > SYNC_BUSY_RETRIES:
                    raise
                await asyncio.sleep(1.0)
                continue
            walk.left -= 1
            body = reply.body
            if not isinstance(body, dict) or not isinstance(body.get("peers"), list):
                raise WireError(RejectReason.BAD_FIELD, "malformed sync reply", field="body")
            for raw in self._shuffled(body["peers"]):
                if until is not None and isinstance(raw, list) and raw and isinstance(raw[0], str) \
                        and raw[0] >= until:
                    continue  # the next range's, which pages it too
                try:
                    learned += self._learn(self._record_from(raw), told_by=peer_id)
                except RefusedAgain:
                    continue  # counted when it was first refused: a page may bring it every period
                except WireError as exc:
                    self.stats.count_rejected(exc.reason.value)
                    continue
                if collect is not None:
                    collect.append(raw)
            ended = body.get("ended")
            if ended is not None:
                # the first page of a pull that named its peers carries them, at most MAX_ENDED:
                # a member cannot make us check more signatures than the records it pages
                if "after" in ask or have is None or not isinstance(ended, list) or len(ended) > MAX_ENDED:
                    self._reject(RejectReason.BAD_FIELD, f"sync reply from {peer_id}: ended comes only on the "
                                 f"first page of a pull that names its peers, at most {MAX_ENDED}")
                else:
                    self._apply_ended(peer_id, ended)
            following = body.get("next")
            if following is not None and (not isinstance(following, str) or len(following) > 64
                                          or (after is not None and following <= after)):
                raise WireError(RejectReason.BAD_FIELD, "sync reply: next must come after the page asked for",
                                field="body")
            walk.next = following
            if following is None or first_only or (until is not None and following >= until):
                return learned
            after = following
        return learned

    def add_records(self, records: list[Any], told_by: str | None) -> int:
        """Learn records handed to this node (`Node.add_records`), each checked as one relayed
        by `told_by`; one that does not check out is counted and skipped. Returns the news."""
        learned = 0
        for raw in self._shuffled(records):
            try:
                learned += self._learn(self._record_from(raw), told_by=told_by)
            except RefusedAgain:
                continue  # counted when it was first refused
            except WireError as exc:
                self._reject(exc.reason, f"record handed to this node: {exc}")
        return learned

    def _shuffled(self, records: list[Any]) -> list[Any]:
        """Records to learn, in a random order of this node's own. A node opens sockets to the
        first peers it learns, up to its cap, and past the cap its gossip and pulls go to the
        peers it holds sockets to: learned in the order a page or a simulator lists them, every
        member of a swarm would hold sockets to the same few peers, which would serve every
        member's pulls, and news would reach the rest only through probes."""
        records = list(records)
        self._rng.shuffle(records)
        return records

    async def run(self, ceiling_s: Callable[[], float]) -> None:
        """Anti-entropy pulls (`anti_entropy`) for as long as the node runs: the first a period
        or two in (a joiner's table is the seed's, as of its join), each next one the wait the
        last chose, less or more by half at random."""
        soon_s = self.liveness.forming_pull()
        await asyncio.sleep(soon_s * (1 + self._rng.random()))
        while True:
            await self.anti_entropy(soon_s, ceiling_s())
            await asyncio.sleep(self._quiet_s * (0.5 + self._rng.random()))

    async def anti_entropy(self, soon_s: float, ceiling_s: float) -> int:
        """Up to PULL_PAGES pages of what a random member holds and this node lacks: what gossip
        missed (a record whose announcement was lost, the joiners of a mass join) comes back
        over time, at a bounded cost. Returns the records that were news.

        The next pull comes `soon_s` after one that brought news or while the table grows (or,
        while this process's loop runs behind by half of that, after twice the last wait, up to
        a probe period), and
        after twice the last wait (up to `ceiling_s`) after one that brought none: a swarm
        that is forming pulls every period until its tables agree, one at rest every
        `ceiling_s` (memberlist's push-pull interval). A record is news to a member once, so
        what a forming swarm pulls is what it had to learn anyway, a page per message rather
        than a few records riding on gossip, each sent on a dozen times."""
        learned, started = 0, time.monotonic()
        outcome = "no_helper"
        # A member that has spoken to us first-hand holds our record; one we only heard of may
        # not (in a mass join, most do not know a joiner yet) and drops our ask unanswered.
        helpers = self._helpers(8)
        helpers.sort(key=lambda h: getattr(self.table.get(h), "told_by", None) is not None)
        timeout_s = 2 * max(self.liveness.probe_interval_s, self.liveness.ack_timeout_s)
        try:
            if helpers and self._settled and await self._same_as(helpers[0], timeout_s):
                outcome = "same"
            elif helpers:
                try:
                    learned = await self.sync(helpers[0], pages=PULL_PAGES, have=self.have_digest(),
                                              timeout_s=timeout_s)
                except rpc.BadRequestError:  # a member that knows no `have`: a page from a random point
                    after = self._rng.choice(list(self.table.live_ids.sample(self._rng, 1)) or [None])
                    learned = await self.sync(helpers[0], after=after, pages=1, timeout_s=timeout_s)
                outcome = "news" if learned else "none"
        except Exception as exc:  # anti-entropy is best effort; the next round tries another member
            outcome = type(exc).__name__
            log.debug("%s: anti-entropy with %s failed: %s", self._local.peer_id, helpers[0], exc)
        finally:
            self.pulls[outcome] = self.pulls.get(outcome, 0) + 1
            self.pulled_s += time.monotonic() - started
            # a table that grew since the last pull (gossip brought joins) is one of a swarm still
            # forming: the next pull comes soon even if this helper had nothing (it may have
            # joined a moment ago), or a few empty pulls back a forming swarm off for minutes
            held = len(self.table.live_ids)
            grew, self._held_at_pull = held > self._held_at_pull, held
            self._settled = outcome in ("none", "same") and not grew
            if not (learned or grew):
                self._quiet_s = min(ceiling_s, max(soon_s, 2 * self._quiet_s))
            elif self._loop_lag(started) > soon_s / 2:
                # this process's loop ran behind: a pull sooner than the probe period would queue
                # behind the work already waiting (two swarms forming on one box), so the wait
                # doubles toward the period instead
                self._quiet_s = min(self.liveness.probe_interval_s, max(soon_s, 2 * self._quiet_s))
            else:
                self._quiet_s = soon_s
        return learned

    def have_digest(self) -> bytes:
        """The peers this node holds alive or suspect, as a `$sync` ask's `have`: one it holds
        dead that the helper holds alive comes back, and is probed again (`Swarm.learn`), so a
        false death that no refutation reached still ends."""
        return encode_codes(self.table.live_ids.codes_in_order())

    def live_sum(self) -> bytes:
        """A digest of the ids of this node and the peers it holds alive or suspect (the swarm
        as it sees it: a member that sees the same one has the same sum), worked out again
        only once they changed."""
        live = self.table.live_ids
        version, digest = self._sum
        if version != live.version:
            ids = live.in_order()
            at, own = bisect.bisect_left(ids, self._local.peer_id), self._local.peer_id
            digest = hashlib.blake2b("\n".join([*ids[:at], own, *ids[at:]]).encode(), digest_size=SUM_BYTES).digest()
            self._sum = (live.version, digest)
        return digest

    async def _same_as(self, peer_id: str, timeout_s: float) -> bool:
        """Whether `peer_id` holds alive the same peers as we do (a `$sync` ask with `sum`
        only): a pull whose pages would be empty, in 16 bytes. Not the same for a member that
        knows no `sum` (it pages as before), and for a reply that says neither (counted)."""
        ask: dict[str, Any] = {"sum": self.live_sum()}
        introduction = self._introduce(peer_id)
        if introduction:
            ask["me"] = introduction[0][1]
        try:
            reply = await self.outbox.request(peer_id, SYNC, ask, timeout_s=timeout_s)
        except rpc.BadRequestError:
            return False
        same = reply.body.get("same") if isinstance(reply.body, dict) else None
        if not isinstance(same, bool):
            self._reject(RejectReason.BAD_FIELD, f"sync reply from {peer_id}: a sum is answered with same: bool")
            return False
        return same

    def want_from(self, peer_id: str, unknown: str) -> None:
        """Ask `peer_id` for the record of `unknown`, at most once an interval per id, and with a
        bounded memory of ids asked for (names a peer makes up must not grow it)."""
        now = time.monotonic()
        if len(self._wanted) >= MAX_WANTED or now - self._wanted.get(unknown, -math.inf) < \
                self.liveness.probe_interval_s:
            return
        self._wanted[unknown] = now
        self._spawn(self.outbox.send(peer_id, WANT, [unknown]))

    def on_want(self, msg: Message) -> None:
        """Send a member the records it asked for, out of the same budget as its `$sync` pulls:
        what does not fit now is left out (it asks again when beats name those ids)."""
        body = msg.body
        if not isinstance(body, list) or len(body) > MAX_WANT or not all(isinstance(x, str) for x in body):
            raise WireError(RejectReason.BAD_FIELD, f"want body must be a list of at most {MAX_WANT} ids",
                            field="body")
        now = time.monotonic()
        bucket = self.pull_bucket(msg.sender, now)
        records = []
        for peer_id in dict.fromkeys(body):
            info = self.table.get(peer_id)
            if info is not None and info.status in (PeerStatus.ALIVE, PeerStatus.SUSPECT):
                if not bucket.spend(info.record.wire_bytes, now):
                    self._reject(RejectReason.RATE_LIMITED, f"want from {msg.sender}: over its budget")
                    break
                records.append(info.record.to_wire())
        if records:
            bucket.charge(ENVELOPE_BYTES, now)
            self._spawn(self.outbox.send(msg.sender, ANNOUNCE, records))


def parse_sync(body: Any) -> tuple[str | None, Have | None, Any, bytes | None]:
    """A `$sync` ask: empty, or a map of `after` (a peer id to go on from), `have` (peers the
    asker holds, `TableSync.have_digest`) and `me` (the asker's own record, for a member that
    may not know it, checked where it is learned); or of `sum` (`TableSync.live_sum`: are the
    peers alive the same?) and `me`. WireError BAD_FIELD otherwise."""
    if body is None:
        return None, None, None, None
    if not isinstance(body, dict) or not body or not (set(body) <= {"after", "have", "me"}
                                                      or ("sum" in body and set(body) <= {"sum", "me"})):
        raise WireError(RejectReason.BAD_FIELD, "sync body must be empty, {after: peer id, have: bytes, me: record} "
                        "or {sum: bytes, me: record}", field="body")
    asked_sum = body.get("sum")
    if "sum" in body and not (isinstance(asked_sum, bytes) and len(asked_sum) == SUM_BYTES):
        raise WireError(RejectReason.BAD_FIELD, f"sync sum must be {SUM_BYTES} bytes", field="body")
    after, have, me = body.get("after"), body.get("have", b""), body.get("me")
    if after is not None and not (isinstance(after, str) and len(after) <= 64):
        raise WireError(RejectReason.BAD_FIELD, "sync after must be a peer id", field="body")
    if not isinstance(have, bytes):
        raise WireError(RejectReason.BAD_FIELD, f"sync have must be at most {MAX_HAVE} {HAVE_CHARS}-byte id prefixes",
                        field="body")
    if me is not None and not isinstance(me, list):
        raise WireError(RejectReason.BAD_FIELD, "sync me must be a peer record", field="body")
    try:
        held = Have.parse(have, MAX_HAVE)
    except HaveError as exc:
        raise WireError(RejectReason.BAD_FIELD, f"sync have must be {exc}", field="body") from None
    return after, held if held else None, me, asked_sum


class _Walk:
    """One `TableSync.sync`: the pages it may still read (shared by its ranges), and where the
    last page said to go on from."""

    __slots__ = ("left", "next")

    def __init__(self, pages: int) -> None:
        self.left = pages
        self.next: str | None = None


# A peer id's characters (lowercase base32 of a hash, `node.identity`) in sort order: where an id
# falls among all ids, as a fraction, from its first characters.
_ID_ALPHABET = "234567abcdefghijklmnopqrstuvwxyz"
_ID_RANK = {c: i for i, c in enumerate(_ID_ALPHABET)}
_SPLIT_CHARS = 4  # the starts of ranges `split_ids` names: 32**4 places in the id space


def id_fraction(peer_id: str) -> float:
    """Where `peer_id` falls in the id space, from 0 to 1 (a character that is not base32
    counts as the lowest: ids from the wire are only ever used to place a split)."""
    x, scale = 0.0, 1.0
    for ch in peer_id[:8]:
        scale /= len(_ID_ALPHABET)
        x += _ID_RANK.get(ch, 0) * scale
    return x


def split_ids(after: str | None, next_id: str, most: int) -> list[str]:
    """Starts of up to `most` ranges that cover the id space from `next_id` (where a walk's
    first page, from after `after`, said to go on) to its end, each about as many pages as the
    first page took: `next_id` first, then ids in increasing order. Ids are uniform (hashes),
    so the first page's span stands for each page's."""
    low, high = id_fraction(after) if after else 0.0, id_fraction(next_id)
    span = high - low
    remaining = 1.0 - high
    if span <= 0 or remaining <= 0 or most <= 1:
        return [next_id]
    count = max(1, min(most, math.ceil(remaining / span)))
    starts = [next_id]
    for k in range(1, count):
        start = _id_at(high + remaining * k / count)
        if start > starts[-1]:
            starts.append(start)
    return starts


def _id_at(fraction: float) -> str:
    """The `_SPLIT_CHARS`-character id prefix at `fraction` of the id space."""
    size = len(_ID_ALPHABET)
    n = min(int(fraction * size ** _SPLIT_CHARS), size ** _SPLIT_CHARS - 1)
    chars = []
    for _ in range(_SPLIT_CHARS):
        n, r = divmod(n, size)
        chars.append(_ID_ALPHABET[r])
    return "".join(reversed(chars))
