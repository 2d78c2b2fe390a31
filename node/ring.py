"""Whom a member probes once the swarm is larger than its socket cap: its fingers on a ring.

Below the cap a member probes everyone in round-robin order (`node.swim.ProbeOrder`), as SWIM
does. Past it, a probe to a member it holds no socket to opens a DEALER and its monitor and
closes another: at 1024 simulated peers with a cap of 20, almost every probe did, and a
formed swarm of 256 bare nodes spent 0.70x the CPU once its probes stopped doing so
(`benchmarks/membership.py`; 0.88x at 1024).

So past the cap a member probes only its fingers, and keeps their sockets open (pinned, see
`node.dealers.DealerCache.pin`). Every member has a place on a ring, a hash of its id and an
epoch. Its fingers are the members n/2, n/4, n/8... places ahead of it on the ring, down to
the next one: about log2(n) members. A member allowed fewer (`limit`, half its socket cap)
spreads them over those scales (`finger_steps`). Where members' views agree:

- every member is the finger of exactly as many members as it has fingers (the member n/2^j
  places behind it holds it as finger j), so every member is probed about once a period, as in
  SWIM, and watched by log2(n) others: its death is heard of at once (the DEALERs' socket
  monitors) by those members, and no member hears gossip from fewer;
- the fingers form a graph of diameter log2(n), so gossip sent to open sockets (fingers among
  them) spreads in O(log n) hops, not round the ring;
- a formed swarm's fingers stay as they are, so its probes open no socket. A join or a death
  moves, swarm-wide, about one finger per member (those whose finger spans its place).

Each finger's ring is redrawn every `epoch_s` seconds of wall time, finger `j` at its own
offset (`j / MAX_FINGERS` of an epoch), so a member opens one socket every `epoch_s /
MAX_FINGERS` seconds, not all at once: nobody picks which members probe it for longer than an
epoch by choosing its id, and the gossip graph keeps changing. Members whose clocks disagree by
a little only disagree about the fingers whose epoch is turning.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable

import numpy as np

MAX_FINGERS = 16  # fingers a member keeps at most: enough for 65,536 members
EPOCH_PERIODS = 256  # probe periods a finger's ring lasts (`ProbeRing.epoch_s`)
_POSITIONS_MAX = 1 << 16  # places kept by the process-wide cache (every node of a simulation shares it)
_positions: dict[int, dict[str, int]] = {}  # epoch -> peer id -> place
_positions_held = 0


def place(peer_id: str, epoch: int) -> int:
    """`peer_id`'s place on the ring of `epoch`: the same for every member that computes it."""
    global _positions_held
    of_epoch = _positions.get(epoch)
    if of_epoch is None:
        of_epoch = _positions[epoch] = {}
    at = of_epoch.get(peer_id)
    if at is None:
        if _positions_held >= _POSITIONS_MAX:
            _positions.clear()
            _positions_held = 0
            of_epoch = _positions[epoch] = {}
        digest = hashlib.blake2b(peer_id.encode(), digest_size=8, person=b"starling-ring",
                                 salt=epoch.to_bytes(8, "little", signed=True)).digest()
        at = of_epoch[peer_id] = int.from_bytes(digest, "little")
        _positions_held += 1
    return at


def ahead(members: list[str], own_id: str, epoch: int, steps: list[int]) -> list[str]:
    """The members `steps[i]` places ahead of `own_id` on the ring of `epoch` (`members` holds
    the others, each step in 1..len(members)). Selects by distance ahead, going round, without
    sorting the ring: a member's view changes with every join while a swarm forms, so its
    fingers are worked out again at nearly every probe (at 1024 members, 0.23 ms each time
    where sorting took 1.56 ms: `benchmarks/membership_costs.py`)."""
    known = _positions.get(epoch) or {}  # `place`'s cache read here: half the time of a call per member
    places = np.fromiter((known[p] if p in known else place(p, epoch) for p in members), dtype=np.uint64,
                         count=len(members))
    distance = places - np.uint64(place(own_id, epoch))  # wraps round: how far ahead, on a ring of 2^64
    kth = sorted({step - 1 for step in steps})
    order = np.argpartition(distance, kth)
    return [members[int(order[step - 1])] for step in steps]


def finger_steps(n: int, limit: int) -> list[int]:
    """How many places ahead each finger is, on a ring of `n` members, for up to `limit` of them:
    the next member, then n/2, n/4, ..., one a scale (log2(n) fingers). Fewer than that are
    spread over the scales, the farthest first: n/4, n/16, n/64, n/256 and the next for
    5 of 1024's 10 (a member at a cap of 10 keeps 5). Each hop then closes a constant share of
    the distance left, so the graph's diameter stays O(log n) hops: 15 for 5 fingers of 1024,
    where the first five scales (n/2 to n/16, then one place at a time) took 67."""
    levels = n.bit_length()  # n >> (levels - 1) == 1: the scales from n/2 to the next member
    count = min(limit, levels)  # ProbeRing asks for at least one
    if count == levels:
        return [1, *(max(1, n >> j) for j in range(1, count))]
    shifts = [round(j * (levels - 1) / count) for j in range(1, count)]
    return [1, *(max(1, n >> shift) for shift in shifts)]


class ProbeRing:
    """One member's fingers, and whom it probes next among them (round-robin)."""

    def __init__(self, own_id: str, epoch_s: float, clock: Callable[[], float]) -> None:
        if epoch_s <= 0:
            raise ValueError(f"epoch_s must be positive, got {epoch_s}")
        self.own_id = own_id
        self.epoch_s = epoch_s
        self._clock = clock  # wall time: every member's epochs turn together
        self._key: tuple[object, ...] = ()
        self._fingers: list[str] = []  # as last worked out
        self._next = 0
        self.rebuilt = 0  # over the member's life: how often its fingers were worked out afresh

    @property
    def current(self) -> list[str]:
        """The fingers as the last call worked them out."""
        return self._fingers

    @property
    def view(self) -> object:
        """The version of the members the fingers were worked out on (None before the first)."""
        return self._key[0] if self._key else None

    def epochs(self, count: int, now: float) -> list[int]:
        """The epoch of each of the first `count` fingers at wall time `now`."""
        return [math.floor(now / self.epoch_s + j / MAX_FINGERS) for j in range(count)]

    def fingers(self, members: Iterable[str], version: int, limit: int) -> list[str]:
        """Up to `limit` fingers among `members` (this member not among them), the successor
        first, then from the farthest in: the same list while `version` (of the members) and
        the epochs stay the same."""
        limit = max(1, min(limit, MAX_FINGERS))
        epochs = self.epochs(limit, self._clock())
        key = (version, limit, *epochs)
        if key == self._key:
            return self._fingers
        ids = [p for p in members if p != self.own_id]
        fingers: list[str] = []
        if ids:
            n = len(ids) + 1
            wanted = [(epoch, step) for epoch, step in zip(epochs, finger_steps(n, limit))]
            found: dict[tuple[int, int], str] = {}
            for epoch in dict.fromkeys(e for e, _ in wanted):
                steps = [step for e, step in wanted if e == epoch]
                found.update(zip(((epoch, step) for step in steps), ahead(ids, self.own_id, epoch, steps)))
            for at in wanted:
                peer = found[at]
                if peer not in fingers:
                    fingers.append(peer)
        self._key, self._fingers = key, fingers
        self.rebuilt += 1
        return fingers

    def next(self, members: Iterable[str], version: int, limit: int) -> str | None:
        """The next finger to probe, round-robin, or None if there is no other member."""
        fingers = self.fingers(members, version, limit)
        if not fingers:
            return None
        self._next = (self._next + 1) % len(fingers)
        return fingers[self._next]
