"""Whether a relay delivered: end-to-end acknowledgements of relayed messages, the fall back to
another relay when one does not come, and the score that keeps a relay that drops at the back.

A relay sees only the two ids and the size of what it forwards, so it can drop a message
without anyone noticing but the two ends. The destination therefore acknowledges every
relayed message it opens: `$relay_ack` [nonce] straight to the source, or sealed through a
relay when the source is a client too (an acknowledgement is never acknowledged). Only the
destination can send it (a direct message is authenticated by its connection, a sealed one
by its key), so a relay cannot forge one for a message it dropped.

The source keeps each message it handed a relay until its acknowledgement comes
(`Deliveries`). Without one within `ack_timeout_s` (plus a second for every `ack_bytes_per_s`
of its size, so a large message on a slow link is not written off), the relay is charged one
drop and the same sealed bytes go to the next relay that has not carried them. The
destination opens a nonce once: a copy that arrives twice (the first relay was only slow) is
refused as a replay and acknowledged again, so a fall back never delivers twice. Once every
relay was tried the message is given up (`undelivered`), as any lost message is: a request's
caller retries it.

Each node orders relays by its own drops, most reliable first, and by a rank of its own
among equals: what other members claim about a relay (a suspicion, say) does not move it, so
no member can steer another's traffic onto itself by accusing the relay it uses. A relay's
drops are forgiven one at a time by acknowledgements of messages it carried, and halve every
`drop_halflife_s` (from at most `MAX_DROPS`), so a relay that was briefly overloaded comes back.

A destination says it acknowledges by the meta of its beats (`$acks`), which it signs: a
sender does not expect acknowledgements from a peer of an earlier build, and a relay cannot
strip the flag from a signed beat.

Memory is bounded: at most `max_unacked` messages and `max_unacked_bytes` wait for an
acknowledgement; past either the oldest is given up without a fall back (`evicted`).
"""
from __future__ import annotations

import asyncio
import heapq
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from starling.node.outbox import Spawn
from starling.node.transport import SendError

ACK = "$relay_ack"  # destination -> source: [nonce] of a relayed message it opened
ACKS = "$acks"  # beat meta of a client that acknowledges what it is relayed
OUTCOMES = ("acked", "fell_back", "undelivered", "evicted", "late")
MAX_DROPS = 8.0  # a relay's score stops here: back in front within a few half-lives of behaving


@dataclass
class _Unacked:
    """A message handed to a relay and not yet acknowledged."""

    dest: str
    body: list[Any]
    payload: list[Any]
    nbytes: int
    tried: list[str]
    deadline: float


@dataclass
class _Score:
    drops: float = 0.0
    at: float = field(default_factory=time.monotonic)


class Deliveries:
    """One node's relayed messages awaiting acknowledgement, and its relays' drop scores.

    `resend(relay, dest, body, payload)` hands the same sealed message to another relay;
    `candidates(dest)` lists the relays that may carry a message to `dest`, best first."""

    def __init__(self, spawn: Spawn, *, ack_timeout_s: float, ack_bytes_per_s: float, max_unacked: int,
                 max_unacked_bytes: int, drop_halflife_s: float,
                 candidates: Callable[[str], list[str]],
                 resend: Callable[[str, str, list[Any], list[Any]], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.ack_timeout_s = ack_timeout_s
        self.ack_bytes_per_s = ack_bytes_per_s
        self.max_unacked = max_unacked
        self.max_unacked_bytes = max_unacked_bytes
        self.drop_halflife_s = drop_halflife_s
        self.max_drops = MAX_DROPS
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self._spawn = spawn
        self._candidates = candidates
        self._resend = resend
        self._clock = clock
        self._rng = rng or random.Random()
        self._unacked: OrderedDict[bytes, _Unacked] = OrderedDict()  # by nonce, oldest deadline first
        self._deadlines: list[tuple[float, bytes]] = []  # (deadline, nonce), settled ones left in
        self._nbytes = 0
        self._scores: dict[str, _Score] = {}
        self._ranks: dict[str, float] = {}
        self._watching = False

    def __len__(self) -> int:
        return len(self._unacked)

    # ---------------------------------------------------------------- scores
    def drops(self, relay: str) -> float:
        """`relay`'s drops as this node counts them now (decayed)."""
        score = self._scores.get(relay)
        if score is None:
            return 0.0
        now = self._clock()
        score.drops *= 0.5 ** ((now - score.at) / self.drop_halflife_s)
        score.at = now
        if score.drops < 0.05:
            del self._scores[relay]
            return 0.0
        return score.drops

    def order(self, relays: list[str], preferred: Collection[str] = ()) -> list[str]:
        """`relays` best first: fewest drops here, then those in `preferred` (the ones the
        destination names), then this node's own rank of each (so that senders spread over a
        client's relays, and none of them decides which comes first)."""
        ranks = self._ranks
        for relay in relays:
            if relay not in ranks:
                if len(ranks) >= 4096:
                    ranks.clear()
                ranks[relay] = self._rng.random()
        drops = {relay: round(self.drops(relay)) for relay in relays}
        return sorted(relays, key=lambda r: (drops[r], r not in preferred, ranks[r]))

    def _charge(self, relay: str, amount: float) -> None:
        drops = min(self.max_drops, self.drops(relay) + amount)
        if drops < 0.05:
            self._scores.pop(relay, None)
            return
        if relay not in self._scores and len(self._scores) >= 4096:
            self._scores.pop(next(iter(self._scores)))
        self._scores[relay] = _Score(drops, self._clock())

    def status(self) -> dict[str, Any]:
        return {**self.counts, "unacked": len(self._unacked), "unacked_bytes": self._nbytes,
                "drops": {r: round(self.drops(r), 2) for r in list(self._scores)}}

    # ---------------------------------------------------------------- messages
    def timeout_s(self, nbytes: int) -> float:
        return self.ack_timeout_s + nbytes / self.ack_bytes_per_s

    def sent(self, nonce: bytes, dest: str, relay: str, body: list[Any], payload: list[Any], nbytes: int) -> None:
        """A message sealed for `dest` was handed to `relay`: await its acknowledgement."""
        self._track(nonce, _Unacked(dest, body, payload, nbytes, [relay], 0.0))

    def _track(self, nonce: bytes, entry: _Unacked) -> None:
        old = self._unacked.pop(nonce, None)
        if old is not None:
            self._nbytes -= old.nbytes
        entry.deadline = self._clock() + self.timeout_s(entry.nbytes)
        self._unacked[nonce] = entry
        heapq.heappush(self._deadlines, (entry.deadline, nonce))
        self._nbytes += entry.nbytes
        while len(self._unacked) > self.max_unacked or self._nbytes > self.max_unacked_bytes:
            _, oldest = self._unacked.popitem(last=False)
            self._nbytes -= oldest.nbytes
            self.counts["evicted"] += 1
        if len(self._deadlines) > 4 * self.max_unacked:  # settled ones left behind: rebuild
            self._deadlines = [(e.deadline, n) for n, e in self._unacked.items()]
            heapq.heapify(self._deadlines)
        if not self._watching:
            self._watching = True
            self._spawn(self._watch())

    def acked(self, src: str, nonce: bytes) -> bool:
        """`src` acknowledged `nonce`: True if that settles a message we sent it. The relay that
        carried it has one drop forgiven."""
        entry = self._unacked.get(nonce)
        if entry is None or entry.dest != src:
            self.counts["late"] += 1
            return False
        del self._unacked[nonce]
        self._nbytes -= entry.nbytes
        self.counts["acked"] += 1
        self._charge(entry.tried[-1], -1.0)
        return True

    async def _watch(self) -> None:
        """Fall back for every message whose acknowledgement is overdue, until none waits."""
        try:
            while self._deadlines:
                deadline, nonce = self._deadlines[0]
                entry = self._unacked.get(nonce)
                if entry is None or entry.deadline != deadline:  # settled, or tracked again since
                    heapq.heappop(self._deadlines)
                    continue
                now = self._clock()
                if deadline > now:
                    await asyncio.sleep(min(deadline - now, 1.0))
                    continue
                heapq.heappop(self._deadlines)
                del self._unacked[nonce]
                self._nbytes -= entry.nbytes
                self._charge(entry.tried[-1], 1.0)
                self._spawn(self._fall_back(nonce, entry))
        finally:
            self._watching = False

    async def _fall_back(self, nonce: bytes, entry: _Unacked) -> None:
        """Hand the same sealed message to the best relay that has not carried it yet."""
        for relay in self._candidates(entry.dest):
            if relay in entry.tried:
                continue
            entry.tried.append(relay)
            self._track(nonce, entry)
            try:
                await self._resend(relay, entry.dest, entry.body, entry.payload)
            except (SendError, ValueError):  # it could not be handed over: try the next relay
                if self._unacked.get(nonce) is entry:
                    del self._unacked[nonce]
                    self._nbytes -= entry.nbytes
                continue
            self.counts["fell_back"] += 1
            return
        self.counts["undelivered"] += 1
