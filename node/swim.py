"""Failure detection and dissemination in the style of SWIM, with Lifeguard's refinements:
the arithmetic, on an injected clock, with no sockets.

- Each period a member probes one other, in round-robin order over a shuffled list (every
  member is probed once per pass, so a crash is found within a bounded number of periods).
  A probe that gets no answer is retried through `indirect_probes` other members; if none
  reaches the target either, it is suspected.
- A suspicion is a statement signed by the member that holds it, about one incarnation of the
  peer (its record's incarnation and its beat counter). It times out into death after a
  timeout that grows with log n and shrinks as independent members confirm it (`Suspicion`).
  The suspected peer refutes by signing a newer beat.
- A member's own health (`Awareness`) stretches its probe period and timeouts: a starved
  process slows its own verdicts instead of declaring others dead.
- Changes ride on probes, their answers and a small gossip fan-out (`Broadcasts`), each sent on
  about `retransmit_mult * log10(n)` times by every member that hears it, so one member's work
  per period is constant however large the swarm. Claims and refutations go first; joins are
  news, with a third of every message kept for them while they wait; beats passed on take what
  is left.

Everything here is state and arithmetic; `node.swarm` sends and receives the messages.
"""
from __future__ import annotations

import array
import bisect
import collections
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from starling.node.updates import MAX_UPDATES


@dataclass(frozen=True)
class Liveness:
    """Failure-detector timing, all in seconds (see the module doc)."""

    probe_interval_s: float = 1.0  # one probe per period
    ack_timeout_s: float = 0.5  # a direct probe's answer; an indirect one gets twice that
    indirect_probes: int = 3  # members asked to probe a target that did not answer us
    # A suspicion's shortest timeout: base + per_decade * log10(n); it starts at max_mult
    # times that and falls to it as `confirmations` other members suspect the same peer.
    suspicion_base_s: float = 3.0
    suspicion_per_decade_s: float = 0.5
    suspicion_max_mult: float = 4.0
    confirmations: int = 3
    awareness_max: int = 8  # the local health score's ceiling: periods stretch up to 8x
    retransmit_mult: int = 3  # an update is sent on retransmit_mult * ceil(log10(n + 1)) times
    gossip_interval_s: float = 0.2  # urgent changes (deaths, refutations, joins) also go out this often
    gossip_fanout: int = 3  # to this many random members
    # News from elsewhere (a claim, a join, a refutation) goes out in a round of its own at once,
    # not at the next tick, while this many rounds are saved up (one per gossip interval; 0: never)
    gossip_burst: int = 2
    piggyback_bytes: int = 1200  # updates one message carries, at most
    meta_interval_s: float = 2.0  # a changed meta is signed into a new beat at most this often
    sync_interval_s: float = 30.0  # anti-entropy: one page of a random member's table, this often
    # A peer whose connection drops (its process died: the kernel closes its sockets) is
    # suspect at once and probed; silent this long after the drop, it is dead.
    probe_timeout_s: float = 1.0
    # While a member's table pulls bring news or its table grows (a swarm forming), the next
    # pull comes this soon (None: one probe period). A simulator stretches the probe period to
    # what its box can probe, but not its pulls: their news is what a member learns anyway.
    forming_pull_s: float | None = None

    def __post_init__(self) -> None:
        positive = ("probe_interval_s", "ack_timeout_s", "suspicion_base_s", "gossip_interval_s",
                    "meta_interval_s", "sync_interval_s", "probe_timeout_s")
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.forming_pull_s is not None and not (isinstance(self.forming_pull_s, (int, float))
                                                    and math.isfinite(self.forming_pull_s) and self.forming_pull_s > 0):
            raise ValueError(f"forming_pull_s must be None or a positive number of seconds, "
                             f"got {self.forming_pull_s!r}")
        if self.suspicion_per_decade_s < 0 or self.suspicion_max_mult < 1:
            raise ValueError("need suspicion_per_decade_s >= 0 and suspicion_max_mult >= 1")
        for name in ("indirect_probes", "confirmations", "gossip_fanout", "gossip_burst"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.awareness_max, int) or self.awareness_max < 1:
            raise ValueError(f"awareness_max must be an int >= 1, got {self.awareness_max!r}")
        if not isinstance(self.retransmit_mult, int) or self.retransmit_mult < 1:
            raise ValueError(f"retransmit_mult must be an int >= 1, got {self.retransmit_mult!r}")
        if not isinstance(self.piggyback_bytes, int) or self.piggyback_bytes < 256:
            raise ValueError(f"piggyback_bytes must be an int >= 256, got {self.piggyback_bytes!r}")

    def suspicion_bounds(self, members: int) -> tuple[float, float]:
        """A suspicion's shortest and longest timeout in a swarm of `members`."""
        low = self.suspicion_base_s + self.suspicion_per_decade_s * math.log10(max(members, 1))
        return low, low * self.suspicion_max_mult

    def forming_pull(self) -> float:
        """The wait after a table pull that brought news: `forming_pull_s`, or a probe period."""
        return self.forming_pull_s or self.probe_interval_s

    def retransmit_limit(self, members: int) -> int:
        """How many times each member sends one update on: enough that it reaches every member
        with high probability (memberlist's rule), O(log n) per member."""
        return self.retransmit_mult * max(1, math.ceil(math.log10(members + 1)))

    def news_for_s(self, members: int) -> float:
        """How long a member passes one piece of news on: as long as its retransmit limit's sends
        would take at one message a period. Each member sends several messages a period, so
        news goes its limit's times well within this unless the queue is congested (a mass join:
        thousands of records queued at every member). News still waiting then is dropped unsent,
        for anti-entropy's table pulls to bring to whoever missed it, rather than ride on every
        message for hundreds of periods after the swarm formed, to receivers who hold it."""
        return self.retransmit_limit(members) * self.probe_interval_s

    def sync_interval(self, members: int) -> float:
        """Anti-entropy's period, longer in a larger swarm (memberlist's push-pull scale)."""
        if members <= 32:
            return self.sync_interval_s
        return self.sync_interval_s * (math.ceil(math.log2(members) - math.log2(32)) + 1)


class Suspicion:
    """One peer suspected at one incarnation `at`, by `first` and the members that confirm it.

    Lifeguard's timeout: it starts at `max_s` and falls, log-scaled, toward `min_s`, which it
    reaches at `expected` independent confirmations: a peer many members cannot reach is
    declared dead soon; one only a single (perhaps slow) member suspects gets the long timeout
    in which to refute."""

    __slots__ = ("at", "confirmed_by", "expected", "last_probe", "max_s", "min_s", "start")

    def __init__(self, at: tuple[int, int], first: str, start: float, min_s: float, max_s: float,
                 expected: int) -> None:
        self.at = at
        self.start = start
        self.min_s, self.max_s, self.expected = min_s, max_s, expected
        self.confirmed_by = {first}
        # when the holder probed the suspect itself once the timeout ran out (None: not yet)
        self.last_probe: float | None = None

    def confirm(self, member: str) -> bool:
        """A distinct member suspects the same incarnation: True if it shortened the timeout."""
        if member in self.confirmed_by or len(self.confirmed_by) > self.expected:
            return False
        self.confirmed_by.add(member)
        return True

    @property
    def timeout_s(self) -> float:
        if self.expected < 1:
            return self.min_s
        confirmations = len(self.confirmed_by) - 1
        fraction = math.log(confirmations + 1) / math.log(self.expected + 1)
        return max(self.min_s, self.max_s - (self.max_s - self.min_s) * fraction)

    def expires_at(self) -> float:
        return self.start + self.timeout_s

    def pardon(self, seconds: float) -> None:
        """This node could not run for `seconds`: the refutation may be waiting unread."""
        self.start += seconds


class Awareness:
    """Lifeguard's local health multiplier: a score from 0 (healthy) to `max_score - 1`, raised
    when this node misses what a healthy one would see (a probe it sent went unanswered while
    the members it asked for help did answer, a refutation it had to send, a nack that never
    came) and lowered by every probe that succeeds. Periods and timeouts are multiplied by
    score + 1."""

    def __init__(self, max_score: int) -> None:
        self.max_score = max_score
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(max(0, self.score + delta), self.max_score - 1)

    def scale(self, seconds: float) -> float:
        return seconds * (self.score + 1)


class ClaimLedger:
    """Which members' claims the accused keep refuting. A claim a peer refutes with its own
    signed beat was wrong; a member whose claims about the same peer were refuted
    `max_refuted` times (decayed with `halflife_s`) is no longer believed about that peer: its
    further claims about it are counted (`discounted`) and neither held nor passed on. Other
    members' claims still count, so a peer that really died is still found dead; a member can
    no longer keep another suspect (and steer traffic away from it) by accusing it over and
    over. Keyed by (claimant, accused), bounded by `max_pairs`; on an injected clock."""

    def __init__(self, max_refuted: float = 3.0, halflife_s: float = 60.0, max_pairs: int = 4096) -> None:
        self.max_refuted = max_refuted
        self.halflife_s = halflife_s
        self.max_pairs = max_pairs
        self.refutations = 0  # claims refuted, in all
        self.discounted = 0  # claims not believed, in all
        self._claimant: dict[str, str] = {}  # accused -> the member whose claim about it we hold
        self._refuted: dict[tuple[str, str], tuple[float, float]] = {}  # (claimant, accused) -> (count, at)

    def _count(self, pair: tuple[str, str], now: float) -> float:
        count, at = self._refuted.get(pair, (0.0, now))
        return count * 0.5 ** ((now - at) / self.halflife_s)

    def believed(self, claimant: str, accused: str, now: float) -> bool:
        """Whether a claim of `claimant`'s about `accused` may be held (counted if not)."""
        if (claimant, accused) not in self._refuted or self._count((claimant, accused), now) < self.max_refuted:
            return True
        self.discounted += 1
        return False

    def held(self, accused: str, claimant: str) -> None:
        """A claim of `claimant`'s about `accused` is held now."""
        self._claimant.pop(accused, None)
        self._claimant[accused] = claimant
        if len(self._claimant) > self.max_pairs:
            del self._claimant[next(iter(self._claimant))]

    def refuted(self, accused: str, now: float) -> str | None:
        """`accused` refuted the claim held against it: charge its claimant, and name it."""
        claimant = self._claimant.pop(accused, None)
        if claimant is None:
            return None
        pair = (claimant, accused)
        count = self._count(pair, now) + 1
        self._refuted.pop(pair, None)
        self._refuted[pair] = (count, now)
        if len(self._refuted) > self.max_pairs:
            del self._refuted[next(iter(self._refuted))]
        self.refutations += 1
        return claimant

    def status(self, now: float, top: int = 8) -> dict[str, Any]:
        """Totals, and the members most often refuted with the count (decayed) for each."""
        worst: dict[str, float] = {}
        for (claimant, accused) in list(self._refuted):
            worst[claimant] = worst.get(claimant, 0.0) + self._count((claimant, accused), now)
        ranked = sorted(worst.items(), key=lambda kv: -kv[1])[:top]
        return {"refuted": self.refutations, "discounted": self.discounted,
                "most_refuted": {c: round(n, 2) for c, n in ranked if n >= 0.05}}


class IdSet:
    """Ids with O(1) add, remove and random choice: the members a node may probe or gossip to.
    A node of a simulated swarm does this every period for each of thousands of peers, so
    nothing here walks the whole set. With `key`, each id's 64-bit key (`key(id)`) is kept in
    an array beside it, in the same order (`keys`): what the probe ring computes on without a
    walk of the ids in Python (`node.ring`)."""

    def __init__(self, key: Callable[[str], int] | None = None, ordered: bool = False,
                 code: Callable[[str], int] | None = None) -> None:
        self._ids: list[str] = []
        self._index: dict[str, int] = {}
        self.version = 0  # raised by every add and remove: what a cache of the set keys on
        self._key = key
        self._keys = np.empty(0 if key is None else 16, dtype=np.uint64)
        # with `ordered`, the ids also in sorted order, kept as they come and go (an insert into
        # a list of thousands of pointers is a short memmove): what table pages walk by id
        self._sorted: list[str] | None = [] if ordered else None
        # with `ordered` and `code`, each id's code (`node.have.prefix_code`) in that order too:
        # what a table pull's list of held peers is built from and matched against
        if code is not None and not ordered:
            raise ValueError("codes are kept in the ids' sorted order: code needs ordered")
        self._code = code
        self._codes = array.array("q")  # an insert is a memmove, as the ids' own list

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, peer_id: str) -> bool:
        return peer_id in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    @property
    def ids(self) -> list[str]:
        """The ids in the set's (arbitrary) order; the caller must not change the list."""
        return self._ids

    def keys(self) -> np.ndarray:
        """With `key`: each id's key, in the order of `ids` (a view, valid until the next change)."""
        return self._keys[:len(self._ids)]

    def in_order(self) -> list[str]:
        """With `ordered`: the ids sorted; the caller must not change the list."""
        if self._sorted is None:
            raise ValueError("this IdSet keeps no order")
        return self._sorted

    def codes_in_order(self) -> np.ndarray:
        """With `code`: each id's code, in the order of `in_order` (a copy: an array that
        lends its buffer cannot grow)."""
        if self._code is None:
            raise ValueError("this IdSet keeps no codes")
        return np.frombuffer(self._codes, dtype=np.int64).copy()

    def index(self, peer_id: str) -> int | None:
        """Where `peer_id` is in `ids` (None if not held)."""
        return self._index.get(peer_id)

    def add(self, peer_id: str) -> bool:
        if peer_id in self._index:
            return False
        at = self._index[peer_id] = len(self._ids)
        self._ids.append(peer_id)
        if self._key is not None:
            if at == len(self._keys):  # grows by an eighth, as a list does: few spare keys
                grown = np.empty(max(16, at + at // 8), dtype=np.uint64)
                grown[:at] = self._keys
                self._keys = grown
            self._keys[at] = self._key(peer_id)
        if self._sorted is not None:
            place = bisect.bisect_left(self._sorted, peer_id)
            self._sorted.insert(place, peer_id)
            if self._code is not None:
                self._codes.insert(place, self._code(peer_id))
        self.version += 1
        return True

    def remove(self, peer_id: str) -> bool:
        at = self._index.pop(peer_id, None)
        if at is None:
            return False
        self.version += 1
        last = self._ids.pop()
        if at < len(self._ids):
            self._ids[at] = last
            self._index[last] = at
            if self._key is not None:
                self._keys[at] = self._keys[len(self._ids)]
        if self._sorted is not None:
            place = bisect.bisect_left(self._sorted, peer_id)
            del self._sorted[place]
            if self._code is not None:
                del self._codes[place]
        return True

    def sample(self, rng: random.Random, k: int, but: tuple[str, ...] = ()) -> list[str]:
        """Up to `k` distinct random ids, none of `but`, in random order (a caller that takes
        the first few that suit it must not always get the same ones)."""
        n = len(self._ids)
        if n <= k + len(but):
            out = [i for i in self._ids if i not in but]
            rng.shuffle(out)
            return out[:k]
        out: list[str] = []
        while len(out) < k:
            pick = self._ids[rng.randrange(n)]
            if pick not in but and pick not in out:
                out.append(pick)
        return out


class ProbeOrder:
    """Whom to probe next: round-robin over a shuffled list of the members, reshuffled every
    pass. Random picks would leave a member unprobed for many periods now and then; this bounds
    the wait to one pass. A member that joins mid-pass is put at a random place in what is left
    of it, so it is probed this pass too."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._pass: list[str] = []
        self._next = 0

    def add(self, peer_id: str) -> None:
        left = len(self._pass) - self._next
        self._pass.insert(self._next + self._rng.randint(0, left), peer_id)

    def next(self, members: IdSet) -> str | None:
        """The next id of `members` to probe (one that left it since is skipped), or None."""
        for _ in range(2):
            while self._next < len(self._pass):
                peer_id = self._pass[self._next]
                self._next += 1
                if peer_id in members:
                    return peer_id
            self._pass = list(members)
            self._rng.shuffle(self._pass)
            self._next = 0
        return None


# What an update is to its queue (`Broadcasts`), most pressing first:
URGENT = 0  # claims (suspect, dead), refutations, leaves: a false death waits on these
NEWS = 1  # joins (records) and a member's own new meta: sent eagerly, in room claims cannot take
ROUTINE = 2  # beats passed on: whatever room is left
NEWS_SHARE = 3  # with news waiting, claims take at most (NEWS_SHARE - 1) / NEWS_SHARE of a message


class Broadcasts:
    """Updates waiting to be sent on, one per key (a newer update about the same peer replaces
    the older), by priority (`URGENT`, `NEWS`, `ROUTINE`), the least-sent first within one;
    each is dropped after `limit` sends. Claims go first, but while news (a join) waits they
    leave it a third of each message: a storm of suspicions does not stall a join, nor a mass
    join a refutation. Bounded: past `max_items`, the most-sent half of the least pressing is
    dropped; and news is dropped once it has waited its time (`expire_news`,
    `Liveness.news_for_s`), sent or not, so a mass join's records stop riding on every message
    soon after it ends."""

    def __init__(self, max_items: int = 1024) -> None:
        self.max_items = max_items
        self._items: dict[Any, list[Any]] = {}  # key -> [priority, sends, seq, key, update, nbytes]
        self._heaps: tuple[list[tuple[int, int, Any]], ...] = ([], [], [])  # per priority: (sends, seq, key)
        self._counts = [0, 0, 0]
        self._seq = itertools.count()
        self._news_ages: collections.deque[tuple[float, int, Any]] = collections.deque()  # (queued at, seq, key)
        self.taken = [0, 0, 0]  # bytes of updates taken to be sent, by priority, each send counted
        self.queued = [0, 0, 0]  # updates queued, by priority (one replacing another counts)
        self.expired = 0  # news dropped for its age before its `limit` sends

    def __len__(self) -> int:
        return len(self._items)

    @property
    def eager(self) -> int:
        """Urgent and news items queued: what the gossip fan-out sends on its own."""
        return self._counts[URGENT] + self._counts[NEWS]

    def count(self, priority: int) -> int:
        return self._counts[priority]

    def add(self, key: Any, update: list[Any], priority: int = ROUTINE, now: float | None = None) -> None:
        """Queue `update` under `key`; news is dated `now` (by default `time.monotonic()`) for
        `expire_news`."""
        if priority not in (URGENT, NEWS, ROUTINE):
            raise ValueError(f"priority must be URGENT, NEWS or ROUTINE, got {priority!r}")
        nbytes = len(msgpack.packb(update, use_bin_type=True))
        seq = -next(self._seq)  # newest first among equals
        self._drop(key)
        self._items[key] = [priority, 0, seq, key, update, nbytes]
        self._counts[priority] += 1
        self.queued[priority] += 1
        if priority == NEWS:
            ages = self._news_ages
            ages.append((time.monotonic() if now is None else now, seq, key))
            if len(ages) > 4 * self.max_items + 64:  # mostly news replaced or sent since: keep what is queued
                self._news_ages = collections.deque(entry for entry in ages if self._holds(entry[1], entry[2]))
        heap = self._heaps[priority]
        heapq.heappush(heap, (0, seq, key))
        if len(self._items) > self.max_items:  # shed the most-sent half, least pressing first (amortized O(1))
            ranked = sorted(self._items.values(), key=lambda item: (item[0], item[1], item[2]))
            for item in ranked[self.max_items // 2:]:
                self._drop(item[3])
        if len(heap) > 4 * self.max_items + 64:
            self._heaps[priority][:] = [(i[1], i[2], i[3]) for i in self._items.values() if i[0] == priority]
            heapq.heapify(self._heaps[priority])

    def _holds(self, seq: int, key: Any) -> bool:
        item = self._items.get(key)
        return item is not None and item[2] == seq and item[0] == NEWS

    def expire_news(self, before: float) -> None:
        """Drop the news queued before `before`, sent its `limit` times or not (oldest first,
        amortized O(1)), so a count of news waiting (`count`) counts only live news."""
        ages = self._news_ages
        while ages and ages[0][0] < before:
            _, seq, key = ages.popleft()
            if self._holds(seq, key):
                self._drop(key)
                self.expired += 1

    def _drop(self, key: Any) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self._counts[item[0]] -= 1

    def take(self, budget_bytes: int, limit: int, *, eager_only: bool = False) -> list[list[Any]]:
        """Updates to piggyback on one message, at most `budget_bytes` of them; each taken counts
        one send, and one sent `limit` times is dropped. `eager_only`: urgent and news only."""
        out: list[list[Any]] = []
        spent = 0
        for priority in ((URGENT, NEWS) if eager_only else (URGENT, NEWS, ROUTINE)):
            room = budget_bytes
            if priority == URGENT and self._counts[NEWS]:
                room = budget_bytes * (NEWS_SHARE - 1) // NEWS_SHARE
            spent = self._take_from(priority, room, limit, out, spent)
        return out

    def _take_from(self, priority: int, room: int, limit: int, out: list[list[Any]], spent: int) -> int:
        heap, items = self._heaps[priority], self._items
        again: list[tuple[int, int, Any]] = []
        while heap and len(out) < MAX_UPDATES:
            sends, seq, key = heap[0]
            item = items.get(key)
            if item is None or item[0] != priority or item[1] != sends or item[2] != seq:
                heapq.heappop(heap)  # replaced or dropped since
                continue
            if spent + item[5] > room:
                if spent == 0 and item[5] > room:
                    heapq.heappop(heap)  # never fits: drop it rather than block the queue
                    self._drop(key)
                    continue
                break
            heapq.heappop(heap)
            out.append(item[4])
            spent += item[5]
            self.taken[priority] += item[5]
            item[1] += 1
            if item[1] >= limit:
                self._drop(key)
            else:
                again.append((item[1], item[2], key))
        for entry in again:
            heapq.heappush(heap, entry)
        return spent
