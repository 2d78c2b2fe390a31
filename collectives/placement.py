"""Who owns which values of a round: the shards and chunks of a sharded all-reduce over a
member list, and their owners.

    owners = the members others can dial, in member order (all members when none can be)
    shards = P contiguous slices of the vector, P = |owners| (fewer: min_shard_numel, max_owners;
             at least 2 unless max_owners says 1)
    shard i's owners = owners[i]; with fewer shards than owners, the first P of an order drawn
                       from the term (every OWNER_TERM_ROUNDS rounds) and the member list; with
                       replication r, r consecutive owners of an order drawn every round

Every peer computes the same placement from the same member list and round, so it is never
sent. The draw is seeded by the term and the member list's digest: a member cannot grind a
key that makes it an owner term after term (in id order the lowest ids would own every round of
a large swarm, and carry all of its averaging), or that sits next to its accomplice's, since the
order changes with every term and every list (a join or a death draws afresh).
"""
from __future__ import annotations

from collections.abc import Callable, Collection

from starling.collectives.compact import view_digest
from starling.collectives.layout import chunk_layout
from starling.common.hashing import derive_seed, peer_hash

Shard = tuple[tuple[tuple[int, int], ...], tuple[str, ...]]  # (chunk bounds, owners)
_KEEP_PLACEMENTS = 16  # placements cached: each costs a look at every member (and a hash each, replicated)
# Drawn owners (one a shard) serve this many rounds of one member list before the next draw; replicated
# owners, whose members compare their answers, are drawn every round (`voting.py`). A member's part
# goes to its owner on a socket, and past the socket cap a socket to a new owner is opened (and
# another closed) at both ends: owners drawn afresh every round were 2,048 such opens a round at
# 1024 simulated peers, and a round took 25-30% longer than with owners kept for eight.
OWNER_TERM_ROUNDS = 8
_KEEP_ORDERS = 64  # drawn orders cached, for every placement of this process together
_ORDERS: dict[tuple[int, tuple[str, ...]], tuple[str, ...]] = {}


def drawn_order(seed: int, owners: tuple[str, ...]) -> tuple[str, ...]:
    """`owners` in the order `seed` draws. Kept for the whole process: a draw over 1024 members
    is a hash each, a few ms, and every member of a simulated box draws the same order for a
    round (128 of them in a worker, for every reducer, took an eighth of its CPU)."""
    key = (seed, owners)
    order = _ORDERS.get(key)
    if order is None:
        order = tuple(sorted(owners, key=lambda m: derive_seed(seed, peer_hash(m))))
        _ORDERS[key] = order
        for old in list(_ORDERS)[:-_KEEP_ORDERS]:  # any thread may draw
            _ORDERS.pop(old, None)
    return order


class Placement:
    """The shards of one vector of `numel` values. Every peer of a swarm must use the same
    `chunk_numel`, `min_shard_numel`, `max_owners` and `replication`; `reachable(peer)` says
    whether others can dial a peer (from its signed record, the same everywhere)."""

    def __init__(self, numel: int, chunk_numel: int, min_shard_numel: int = 1, max_owners: int = 0,
                 replication: int = 1, reachable: Callable[[str], bool] = lambda _: True,
                 unreachable: Callable[[], Collection[str]] | None = None) -> None:
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        if min_shard_numel < 1:
            raise ValueError(f"min_shard_numel must be >= 1, got {min_shard_numel}")
        if max_owners < 0:
            raise ValueError(f"max_owners must be >= 0, got {max_owners}")
        self.numel, self.chunk_numel = numel, chunk_numel
        # Above 1: shards of at least this many values, owned by members drawn each round. A
        # small vector over many peers (a 4096-value sketch over 1024 peers) otherwise cuts
        # into P shards of a few values each: P^2 requests a round, a million at 1024 peers.
        self.min_shard_numel = min_shard_numel
        # Above 0: at most this many shards (owned by members drawn each round). A member's part to an
        # owner holds a socket until the owner's group closes, so a round with more owners than
        # a node keeps sockets open (TransportConfig.max_open_dealers) cannot send all its parts
        # at once, and the parts that found no socket are lost to the round.
        self.max_owners = max_owners
        self.replication = replication
        self._reachable = reachable
        # the members `reachable` says no to, all at once (`Node.unreachable_peers`): where every
        # member listens, the owners of a round are its members with no look at each of them,
        # which at 1024 members was a sixth of a simulated box's CPU in all-reduce rounds
        self._unreachable = unreachable
        self._cache: dict[tuple[int, tuple[str, ...]], list[Shard]] = {}

    def owners(self, members: tuple[str, ...]) -> tuple[str, ...]:
        """Who owns shards: the members others can dial, in member order. A client (behind
        NAT) only sends parts, and its answers come back down the connections it opened, so no
        shard's traffic is relayed. If no member is reachable, all own shards and relays carry
        their parts."""
        if self._unreachable is not None:
            unreachable = self._unreachable()
            if not unreachable:
                return members
            gone = set(unreachable)
            owners = tuple(m for m in members if m not in gone)
        else:
            owners = tuple(m for m in members if self._reachable(m))
        return owners or members

    def shards(self, members: tuple[str, ...], t: int) -> list[Shard]:
        """(chunks, owners) of each shard of round t over `members`: computed once per round and
        list, then kept (an owner asks for every part it takes, a member several times a round:
        computing it each time, at 1024 members, is a million reachability looks per owner per round), so a
        record that changes in the middle of a round does not move its shards either."""
        key = (t, members)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        owners = self.owners(members)
        layout = self.layout(len(owners))
        r = min(self.replication, len(owners))
        if r <= 1 and len(layout) == len(owners):  # every owner owns a shard, in member order
            shards = [(chunks, (owner,)) for chunks, owner in zip(layout, owners)]
        else:
            term = t if r > 1 else t // OWNER_TERM_ROUNDS  # replicated owners: every round (`voting.py`)
            order = drawn_order(derive_seed("reduce.owners", term, int.from_bytes(view_digest(members)[:8], "little")),
                                owners)
            shards = [(chunks, tuple(order[(i + k) % len(order)] for k in range(r)))
                      for i, chunks in enumerate(layout)]
        self._cache[key] = shards
        for old in list(self._cache)[:-_KEEP_PLACEMENTS]:  # the training and network threads both ask
            self._cache.pop(old, None)
        return shards

    def owner_set(self, members: tuple[str, ...], t: int) -> set[str]:
        return {o for _, owners in self.shards(members, t) for o in owners}

    def groups(self, members: tuple[str, ...], t: int) -> list[tuple[int, int, tuple[str, ...]]]:
        """Every chunk of round t as (shard, chunk, its owners)."""
        return [(i, c, owners) for i, (chunks, owners) in enumerate(self.shards(members, t))
                for c in range(len(chunks))]

    def bounds(self, members: tuple[str, ...], t: int) -> list[tuple[int, int]]:
        """Every chunk's [lo, hi), shard by shard, chunk by chunk."""
        return [b for chunks, _ in self.shards(members, t) for b in chunks]

    def layout(self, owners: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Shard by shard, the chunks of a round with `owners` owners (fewer shards than owners
        where min_shard_numel or max_owners cap them, but two where two can own)."""
        shards = owners if self.min_shard_numel <= 1 else max(1, min(owners, self.numel // self.min_shard_numel))
        # At least two where two members can own (max_owners may still say one): a member that
        # owned a round's only shard would send no part to anyone else, and, fallen behind,
        # would never hear the refusal that tells it which round the others are in.
        shards = max(shards, min(2, owners, self.numel))
        if self.max_owners:
            shards = min(shards, self.max_owners)
        return chunk_layout(self.numel, shards, self.chunk_numel)
