"""Who owns a round's shards when there are fewer shards than members: drawn each term of
rounds from the term and the member list (replicated owners every round), the same on every
member, so no id owns every round."""
from __future__ import annotations

from collections import Counter

from starling.collectives.placement import OWNER_TERM_ROUNDS, Placement


def _members(n: int) -> tuple[str, ...]:
    return tuple(sorted(f"m{i:04d}" for i in range(n)))


def test_owners_are_drawn_each_term_not_the_lowest_ids():
    members = _members(1000)
    placement = Placement(1000, 1 << 16, max_owners=4)
    starts = [k * OWNER_TERM_ROUNDS for k in range(50)]
    owners = [placement.owner_set(members, t) for t in starts]
    assert all(len(o) == 4 for o in owners)
    assert owners.count(set(members[:4])) == 0  # the lowest ids own no term
    counts = Counter(m for o in owners for m in o)
    assert max(counts.values()) <= 3 and len(counts) >= 150  # 200 seats spread over many members
    # a term's owners own each of its rounds (their sockets stay open from round to round)
    assert all(placement.owner_set(members, t + k) == owners[0] for t in starts[:1] for k in range(OWNER_TERM_ROUNDS))
    # every member computes the same: a fresh placement, the same list in another tuple
    again = Placement(1000, 1 << 16, max_owners=4)
    assert all(again.owner_set(tuple(list(members)), t) == o for t, o in zip(starts, owners))
    # another member list (a join, a death) draws afresh
    assert placement.owner_set(members[1:], starts[7]) != owners[7]


def test_replicated_owners_are_drawn_every_round():
    members = _members(100)
    placement = Placement(100, 1 << 16, max_owners=4, replication=2)
    rounds = [placement.owner_set(members, t) for t in range(OWNER_TERM_ROUNDS)]
    assert len({frozenset(o) for o in rounds}) > 1


def test_a_swarm_with_a_shard_for_every_member_keeps_member_order():
    members = _members(6)
    placement = Placement(600, 1 << 16, max_owners=48)
    assert [owners for _, owners in placement.shards(members, 3)] == [(m,) for m in members]


def test_only_reachable_members_are_drawn():
    members = _members(100)
    reachable = set(members[::2])
    placement = Placement(100, 1 << 16, max_owners=4, reachable=lambda m: m in reachable)
    assert all(placement.owner_set(members, t) <= reachable for t in range(30))


def test_a_small_vector_has_two_owners_so_none_sends_to_itself_alone():
    """`min_shard_numel` leaves 1,000 values one shard, but a member that owned a round's only
    shard would send no part to anyone, and, fallen behind, never hear the refusal that says
    which round the others are in: two shards, two owners, wherever two members can own."""
    members = _members(1024)
    placement = Placement(1000, 1 << 16, min_shard_numel=512, max_owners=48)
    assert all(len(placement.shards(members, t)) == 2 and len(placement.owner_set(members, t)) == 2
               for t in range(20))
    assert len(Placement(1000, 1 << 16, min_shard_numel=256).shards(members, 0)) == 3  # the floor, not more
    assert len(Placement(1000, 1 << 16, min_shard_numel=512, max_owners=1).shards(members, 0)) == 1  # asked for
    assert len(Placement(1000, 1 << 16, min_shard_numel=512).shards(members[:1], 0)) == 1  # one member
    assert len(Placement(1, 1 << 16, min_shard_numel=512).shards(members, 0)) == 1  # one value
    only = set(members[5:6])  # one member others can dial owns it all
    assert Placement(1000, 1 << 16, min_shard_numel=512, reachable=lambda m: m in only).owner_set(members, 0) == only


def test_the_members_said_unreachable_all_at_once_own_nothing_as_when_asked_one_by_one():
    members = _members(40)
    clients = set(members[::7])
    one_by_one = Placement(1000, 1 << 16, max_owners=4, reachable=lambda m: m not in clients)
    at_once = Placement(1000, 1 << 16, max_owners=4, unreachable=lambda: tuple(clients))
    assert at_once.owners(members) == one_by_one.owners(members) == tuple(m for m in members if m not in clients)
    for t in range(0, 3 * OWNER_TERM_ROUNDS, OWNER_TERM_ROUNDS):
        assert at_once.shards(members, t) == one_by_one.shards(members, t)
    assert Placement(1000, 1 << 16, unreachable=tuple).owners(members) == members  # every member listens
    assert Placement(1000, 1 << 16, unreachable=lambda: members).owners(members) == members  # none does: all own
