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
from collections.abc import Callable, Collection, Iterable

import numpy as np

MAX_FINGERS = 16  # fingers a member keeps at most: enough for 65,536 members
EPOCH_PERIODS = 256  # probe periods a finger's ring lasts (`ProbeRing.epoch_s`)
_CACHE_MAX = 1 << 16  # ids whose keys the process keeps (every node of a simulation shares them)
_id_keys: dict[str, int] = {}  # peer id -> its key
_epoch_keys: dict[int, tuple[np.uint64, np.uint64]] = {}
_MULTIPLIERS = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))  # MurmurHash3's finalizer
_SHIFT = np.uint64(33)


def id_key(peer_id: str) -> int:
    """`peer_id`'s 64-bit key, a hash of the id: where its places on every ring come from."""
    key = _id_keys.get(peer_id)
    if key is None:
        if len(_id_keys) >= _CACHE_MAX:
            _id_keys.clear()
        digest = hashlib.blake2b(peer_id.encode(), digest_size=8, person=b"starling-ring").digest()
        key = _id_keys[peer_id] = int.from_bytes(digest, "little")
    return key


def _keys_of(epoch: int) -> tuple[np.uint64, np.uint64]:
    keys = _epoch_keys.get(epoch)
    if keys is None:
        if len(_epoch_keys) >= 4 * MAX_FINGERS:
            _epoch_keys.clear()
        digest = hashlib.blake2b(epoch.to_bytes(8, "little", signed=True), digest_size=16,
                                 person=b"starling-epoch").digest()
        keys = _epoch_keys[epoch] = (np.uint64(int.from_bytes(digest[:8], "little")),
                                     np.uint64(int.from_bytes(digest[8:], "little")))
    return keys


def _mix(x: np.ndarray) -> None:
    """A bijection of 64-bit words in which every bit of the input moves every bit of the
    output (`x` in place; uint64 arithmetic wraps)."""
    for multiplier in _MULTIPLIERS:
        x ^= x >> _SHIFT
        x *= multiplier
    x ^= x >> _SHIFT


def places(keys: np.ndarray, epoch: int) -> np.ndarray:
    """The places on the ring of `epoch` of the members whose `id_key`s are `keys`: the same
    for every member that computes them. The id's key, the epoch's two keys and two rounds of
    mixing: each epoch's ring is a fresh shuffle of the same keys, so a member that ground
    keys until its id landed where it wanted on one ring has no better odds on the next. Done
    on a whole array at once: a member's view changes with every join while a swarm forms, and
    its fingers are worked out again at nearly every probe, over thousands of members."""
    first, second = _keys_of(epoch)
    x = keys ^ first
    _mix(x)
    x ^= second
    _mix(x)
    return x


def place(peer_id: str, epoch: int) -> int:
    """`peer_id`'s place on the ring of `epoch` (`places` for one member)."""
    return int(places(np.array([id_key(peer_id)], dtype=np.uint64), epoch)[0])


def ahead(keys: np.ndarray, own_key: int, epoch: int, steps: list[int]) -> list[int]:
    """Where in `keys` (the `id_key`s of the other members) are the members `steps[i]` places
    ahead of the member whose key is `own_key`, on the ring of `epoch` (each step in
    1..len(keys)). Selects by distance ahead, going round, without sorting the ring."""
    own = places(np.array([own_key], dtype=np.uint64), epoch)[0]
    distance = places(keys, epoch) - own  # wraps round: how far ahead, on a ring of 2^64
    kth = sorted({step - 1 for step in steps})
    order = np.argpartition(distance, kth)
    return [int(order[step - 1]) for step in steps]


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

    def fingers(self, members: Iterable[str], version: int, limit: int, keys: np.ndarray | None = None,
                skip: Collection[int] = ()) -> list[str]:
        """Up to `limit` fingers among `members`, the successor first, then from the farthest
        in: the same list while `version` (of the members) and the epochs stay the same. With
        `keys` (`id_key` of each of `members`, a list then, in its order; `node.swim.IdSet`
        keeps them) nothing walks the members in Python, and `skip` holds the places in
        `members` of those that cannot be probed; without, this member may be among them."""
        limit = max(1, min(limit, MAX_FINGERS))
        epochs = self.epochs(limit, self._clock())
        key = (version, limit, *epochs)
        if key == self._key:
            return self._fingers
        if keys is None:
            ids = [p for p in members if p != self.own_id]
            keys = np.fromiter((id_key(p) for p in ids), dtype=np.uint64, count=len(ids))
        else:
            ids = members if isinstance(members, list) else list(members)
            if skip:
                kept = np.ones(len(ids), dtype=bool)
                kept[list(skip)] = False
                at = np.flatnonzero(kept)
                ids, keys = [ids[int(i)] for i in at], keys[at]
        fingers: list[str] = []
        if ids:
            n = len(ids) + 1
            own_key = id_key(self.own_id)
            wanted = [(epoch, step) for epoch, step in zip(epochs, finger_steps(n, limit))]
            found: dict[tuple[int, int], str] = {}
            for epoch in dict.fromkeys(e for e, _ in wanted):
                steps = [step for e, step in wanted if e == epoch]
                found.update(zip(((epoch, step) for step in steps),
                                 (ids[i] for i in ahead(keys, own_key, epoch, steps))))
            for at_step in wanted:
                peer = found[at_step]
                if peer not in fingers:
                    fingers.append(peer)
        self._key, self._fingers = key, fingers
        self.rebuilt += 1
        return fingers

    def next(self, members: Iterable[str], version: int, limit: int, keys: np.ndarray | None = None,
             skip: Collection[int] = ()) -> str | None:
        """The next finger to probe, round-robin, or None if there is no other member."""
        fingers = self.fingers(members, version, limit, keys, skip)
        if not fingers:
            return None
        self._next = (self._next + 1) % len(fingers)
        return fingers[self._next]
