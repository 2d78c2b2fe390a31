"""The leader's side of `spsa`: it sequences steps, so that every peer applies the same set.

Runs on the node's network thread. For step t:

    expected = (contributors of step t-1, plus peers that were late for it) that are live
               (everyone live, for the first step this leader sees)
    collect (key, codes, digest) until every expected peer has sent, or round_timeout_s after
        the first; a peer that dies or leaves stops being waited for
    record   = contributors ascending by key, their codes, the majority digest and a holder
    reply the record to each contributor (without its own codes, which it has), and to anyone
        who asks later, with "late" if the step closed without it

A contribution for a step this leader has not reached (it took over from a leader that
closed steps it never saw) makes it fetch those records from the contributor first; one it
cannot place is refused as an unknown step. Refusals are counted by reason.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starling.node.loop import close_in_time
from starling.node.rpc import Refusal, refusal
from starling.protocols.spsa.arith import NO_DIGEST
from starling.protocols.spsa.bodies import LOG_BATCH, BodyError, LogAsk, LogRecords, StepClosed
from starling.protocols.spsa.records import Record, RecordLog

if TYPE_CHECKING:
    from starling.node.node import Node

log = logging.getLogger(__name__)

LOG_TOPIC = "spsa.log"  # LOG_BATCH records per reply, at most
MAX_GAP_STEPS = 64  # a leader fetches at most this many closed steps it missed from a contributor

Refuse = Callable[..., dict[str, Any]]  # refuse(Refusal, detail, **extra) -> a counted refusal body


@dataclass
class _Group:
    """An open step: who is expected, what has arrived."""

    step: int
    expected: set[int]
    codes: dict[int, bytes] = field(default_factory=dict)
    digests: dict[int, int] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    record: Record | None = None
    timer: asyncio.Future[None] | None = None  # closes the step when its time is up


class Sequencer:
    def __init__(self, node: Node, key: int, records: RecordLog, samples: int, round_timeout_s: float,
                 live_keys: Callable[[], set[int]], refuse: Refuse) -> None:
        self.node, self.me, self.key = node, node.peer_id, key
        self.log = records
        self.samples = samples
        self.round_timeout_s = round_timeout_s
        self.live_keys = live_keys  # keys of the live peers and this one
        self.refuse = refuse
        self._groups: dict[int, _Group] = {}
        self._welcome: set[int] = set()  # late contributors, expected again from the next step
        self._gap_lock: asyncio.Lock | None = None

    async def collect(self, key: int, sender: str, t: int, codes: bytes, digest: int) -> dict[str, Any]:
        """Add one contribution to step t and answer with the step's record once it closes."""
        closed = self.log.get(t)
        if closed is not None:
            return self._late(closed, key, codes)
        upto, oldest = self.log.upto, self.log.oldest
        if t < 0 or (oldest >= 0 and t < oldest):
            return self.refuse(Refusal.UNKNOWN_STEP, f"step {t} from {sender} is before this log ({oldest}..{upto})",
                               too_old=t >= 0, upto=upto)
        # My own step past my log (after a repair) opens a group; anyone else's must be filled in.
        if t > upto + 1 and sender != self.me and not await self._fill_gap(sender, upto + 1, t):
            return self.refuse(Refusal.UNKNOWN_STEP, f"step {t} from {sender}: this peer has closed only up to "
                               f"{upto} and could not fetch the steps between", upto=upto)
        closed = self.log.get(t)
        if closed is not None:
            return self._late(closed, key, codes)
        group = self._groups.get(t) or self._open_group(t)
        if key in group.codes and group.codes[key] != codes:
            return self.refuse(Refusal.DUPLICATE, f"{sender} sent different codes for step {t}")
        group.codes[key] = codes
        if digest != NO_DIGEST:
            group.digests[key] = digest
        if group.expected <= set(group.codes):
            self._close(group)
        if not group.done.is_set():
            await group.done.wait()  # set by _close: every expected peer in, or the group's timer
        if group.record is None:  # closing failed (logged by the timer): ask elsewhere
            return self.refuse(Refusal.CLOSE_FAILED, f"step {t} could not be closed on this leader")
        return self._reply(group.record, key, codes, late=key not in group.record.keys)

    def _late(self, record: Record, key: int, codes: bytes) -> dict[str, Any]:
        if key not in record.keys:
            self._welcome.add(key)
        return self._reply(record, key, codes, late=key not in record.keys)

    def _open_group(self, t: int) -> _Group:
        live = self.live_keys()
        previous = self.log.get(t - 1)
        expected = (set(previous.keys) | self._welcome) & live if previous is not None else live
        self._welcome = set()
        group = _Group(t, expected)
        self._groups[t] = group
        # closes the step round_timeout_s after it opened, in awake time: codes that came while
        # this process was stalled are read before the step gives up on them
        group.timer = asyncio.ensure_future(close_in_time(self.round_timeout_s, group.done,
                                                          lambda: self._close(group)))
        return group

    def _close(self, group: _Group) -> None:
        if group.record is not None:
            return
        keys = sorted(group.codes)
        digest, source = self._reference(group.digests)
        self.log.add(Record(group.step, self.me, tuple(keys), b"".join(group.codes[k] for k in keys),
                            digest, source))
        group.record = self.log.get(group.step)  # a record fetched meanwhile stands
        missing = group.expected - set(keys)
        if missing:
            log.info("%s: step %d closed without %d expected peer(s)", self.me, group.step, len(missing))
        group.done.set()
        self._groups.pop(group.step, None)

    def _reference(self, digests: dict[int, int]) -> tuple[int, int]:
        """The majority digest (ties: mine, then the smallest) and a contributor holding it."""
        if not digests:
            return NO_DIGEST, NO_DIGEST
        counts = Counter(digests.values())
        top = max(counts.values())
        tied = sorted(d for d, c in counts.items() if c == top)
        ref = digests[self.key] if digests.get(self.key) in tied else tied[0]
        holders = [k for k, d in digests.items() if d == ref]
        return ref, (self.key if self.key in holders else min(holders))

    def _reply(self, record: Record, key: int, codes: bytes, late: bool) -> dict[str, Any]:
        omit = key if key in record.keys and record.codes_of(key, self.samples) == codes else None
        return StepClosed(record, self.log.upto, late).to_wire(omit, self.samples)

    async def _fill_gap(self, sender: str, lo: int, hi: int) -> bool:
        """Steps lo..hi-1 closed elsewhere (a leader change): fetch their records from `sender`."""
        if hi - lo > MAX_GAP_STEPS:
            return False
        if self._gap_lock is None:
            self._gap_lock = asyncio.Lock()
        async with self._gap_lock:
            try:
                while self.log.upto < hi - 1:
                    reply = (await self.node.arequest(sender, LOG_TOPIC, LogAsk(self.log.upto + 1).to_wire(),
                                                      timeout_s=self.round_timeout_s)).body
                    records = LogRecords.from_wire(reply, self.samples).records
                    if not records:
                        return False
                    for record in records:
                        self.log.add(record)
                        group = self._groups.pop(record.step, None)
                        if group is not None:  # my own open group of that step yields to it
                            group.record = self.log.get(record.step)
                            group.done.set()
            except Exception as exc:
                log.info("%s: could not fetch steps %d..%d from %s: %s", self.me, lo, hi - 1, sender, exc)
                return False
        log.info("%s: took steps %d..%d closed elsewhere from %s", self.me, lo, hi - 1, sender)
        return True

    def serve_log(self, sender: str, body: Any) -> dict[str, Any]:
        """Answer "spsa.log": consecutive closed records from `since` on."""
        try:
            since = LogAsk.from_wire(body).since
        except BodyError as exc:
            return self.refuse(Refusal.MALFORMED, f"{sender}: {exc}")
        upto, oldest = self.log.upto, self.log.oldest
        if oldest >= 0 and since < oldest:
            return refusal(Refusal.TOO_OLD, f"step {since} is before this log ({oldest}..{upto})", too_old=True,
                           upto=upto)
        return LogRecords(tuple(self.log.since(since, LOG_BATCH)), upto).to_wire()

    def peer_left(self, key: int) -> None:
        """Stop waiting for a peer that died or left."""
        self._welcome.discard(key)
        for group in list(self._groups.values()):
            group.expected.discard(key)
            if group.codes and group.expected <= set(group.codes):
                self._close(group)
