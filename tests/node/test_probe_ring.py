"""Past the socket cap a member probes its fingers on a ring, whose sockets stay open
(`node.ring`): every member is still probed and watched, a probe opens no socket, and gossip
over the fingers reaches everyone in a few hops."""
from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
from conftest import DEATH_SEEN_WITHIN_S, TEST_LIVENESS, statuses, wait_until

from starling.node.node import NodeConfig
from starling.node.ring import MAX_FINGERS, ProbeRing, finger_steps, id_key, place, places
from starling.node.rpc import Reply
from starling.node.swim import URGENT, IdSet
from starling.node.transport import TransportConfig
from starling.node.updates import SUSPECT, Claim

IDS = [f"peer-{i:04d}" for i in range(512)]
EPOCH_S = 100.0


def fingers_of(ids, now=1000.0, limit=10, version=1):
    clock = [now]
    rings = {p: ProbeRing(p, EPOCH_S, lambda: clock[0]) for p in ids}
    return {p: r.fingers(ids, version, limit) for p, r in rings.items()}, rings, clock


def hops(fingers, source):
    """Hops from `source` to every member over the finger graph."""
    seen, frontier = {source: 0}, [source]
    for at in frontier:
        for nxt in fingers[at]:
            if nxt not in seen:
                seen[nxt] = seen[at] + 1
                frontier.append(nxt)
    return seen


def test_every_member_is_the_finger_of_as_many_members_as_it_has_fingers():
    fingers, _, _ = fingers_of(IDS)
    watched = Counter(f for fs in fingers.values() for f in fs)
    assert set(watched) == set(IDS)  # nobody is left unprobed (and unwatched)
    assert all(p not in fs for p, fs in fingers.items())
    assert all(len(fs) == 9 for fs in fingers.values())  # 256, 128, ..., 2 places ahead, and the next
    assert set(watched.values()) == {9}  # probed by, watched by and gossiped to from as many


def test_the_fingers_reach_everyone_in_a_few_hops():
    fingers, _, _ = fingers_of(IDS)
    for source in IDS[:5]:
        reached = hops(fingers, source)
        assert len(reached) == len(IDS)
        assert max(reached.values()) <= 2 * 9  # O(log n), not round the ring (n / fingers)


def test_a_formed_swarm_keeps_its_fingers_and_a_join_moves_about_one_each():
    fingers, rings, _ = fingers_of(IDS)
    assert all(r.fingers(IDS, 1, 10) is fingers[p] for p, r in rings.items())  # nothing changed: no new socket
    assert all(r.rebuilt == 1 for r in rings.values())
    joined = {p: r.fingers([*IDS, "joiner"], 2, 10) for p, r in rings.items()}
    moved = sum(len(set(fingers[p]) - set(joined[p])) for p in IDS)
    assert moved <= 2 * len(IDS), moved
    assert sum(fs.count("joiner") for fs in joined.values()) >= 9  # and it is probed at once
    few = {p: r.fingers(IDS, 3, 3) for p, r in rings.items()}
    # the next member, and two spread over the scales (64 and 8 places ahead), not the farthest two
    assert all(few[p][0] == fingers[p][0] and set(few[p]) <= set(fingers[p]) for p in IDS)
    assert set(Counter(f for fs in few.values() for f in fs).values()) == {3}


@pytest.mark.parametrize("limit", [3, 5, 7])
def test_fewer_fingers_than_scales_still_reach_everyone_in_a_few_hops(limit):
    """A member at a socket cap of 10 keeps 5 fingers: spread over the scales, each hop closes a
    constant share of the distance left. The first scales alone (n/2 to n/16, then the next
    member) left 1024 members 67 hops apart."""
    ids = [f"peer-{i:04d}" for i in range(1024)]
    fingers, _, _ = fingers_of(ids, limit=limit)
    assert all(len(fs) == limit for fs in fingers.values())
    assert set(Counter(f for fs in fingers.values() for f in fs).values()) == {limit}  # each probed alike
    bound = {3: 32, 5: 16, 7: 14}[limit]  # 10 hops with all 10 fingers
    for source in ids[:3]:
        reached = hops(fingers, source)
        assert len(reached) == len(ids) and max(reached.values()) <= bound, (limit, max(reached.values()))


def test_the_ring_turns_one_finger_at_a_time():
    fingers, rings, clock = fingers_of(IDS)
    start, steps = dict(fingers), []
    for _ in range(MAX_FINGERS):  # an epoch, a sixteenth at a time: finger j's ring turns in step j
        clock[0] += EPOCH_S / MAX_FINGERS
        turned = {p: r.fingers(IDS, 1, 10) for p, r in rings.items()}
        steps.append(sum(len(set(fingers[p]) - set(turned[p])) for p in IDS))
        fingers = turned
        assert set(Counter(f for fs in turned.values() for f in fs)) == set(IDS)  # everyone still probed
    assert max(steps) <= 2 * len(IDS), steps  # about one new socket each at a time, not all of them at once
    kept = sum(len(set(start[p]) & set(fingers[p])) for p in IDS)
    assert kept <= len(IDS), kept  # after an epoch nearly all are new: nobody keeps its watchers for good


def test_fingers_are_the_members_n_over_2_to_the_j_places_ahead_on_the_sorted_ring():
    """The ring is never sorted (`node.ring.ahead`): the fingers match a sort done here, for
    sizes from two members up, at limits and times where fingers' epochs differ."""
    for n in (2, 3, 5, 17, 100, 513):
        ids = IDS[:n] if n <= len(IDS) else [f"x-{i}" for i in range(n)]
        for now, limit in ((1000.0, 10), (1037.5, 16), (5.0, 1)):
            ring = ProbeRing(ids[0], EPOCH_S, lambda now=now: now)
            epochs = ring.epochs(min(limit, MAX_FINGERS), now)
            want: list[str] = []
            for j in range(min(limit, n.bit_length())):
                order = sorted(ids, key=lambda p, e=epochs[j]: place(p, e))
                peer = order[(order.index(ids[0]) + (1 if j == 0 else max(1, n >> j))) % n]
                if peer != ids[0] and peer not in want:
                    want.append(peer)
            assert ring.fingers(ids, 1, limit) == want, (n, now, limit)


def test_a_ring_refuses_a_nonpositive_epoch_and_is_empty_alone():
    with pytest.raises(ValueError):
        ProbeRing("a", 0.0, time.time)
    ring = ProbeRing("a", 10.0, time.time)
    assert ring.fingers(["a"], 1, 4) == [] and ring.next(["a"], 1, 4) is None


def _opened(nodes, topic):
    return sum(n.stats.snapshot()["sockets_opened_by_topic"].get(topic, 0) for n in nodes)


@pytest.mark.slow
def test_past_the_cap_probes_open_no_sockets_and_a_crash_is_still_seen_by_all(make_node):
    """Sixteen members, each capped at four sockets: every probe round-robin over the others
    would open a socket (and its monitor) three times in four. Probing the fingers opens none
    once they are open, and a member that crashes is still known dead by everyone."""
    config = NodeConfig(liveness=TEST_LIVENESS, transport=TransportConfig(max_open_dealers=4))
    nodes = [make_node("tcp", config=config)]
    nodes += [make_node("tcp", join=[nodes[0].address], config=config) for _ in range(15)]
    assert wait_until(lambda: all(len(n.live_peers()) == 15 for n in nodes), timeout_s=60)
    periods = 15
    # each has worked out its fingers on the view it holds now and probed them, so their
    # sockets are open
    assert wait_until(lambda: all(n._swarm._ring.view == n._swarm.table.live_ids.version and len(n._swarm._pinned) == 2
                                  and all(n._transport.is_open(p) for p in n._swarm._pinned) for n in nodes),
                      timeout_s=60)
    before = _opened(nodes, "$probe")
    time.sleep(periods * TEST_LIVENESS.probe_interval_s)
    opened = _opened(nodes, "$probe") - before
    assert opened <= len(nodes), opened  # round-robin over everyone: about 16 * 15 * 3/4 = 180
    pinned = [n._swarm._pinned for n in nodes]
    # half the cap; one where a finger's ring turned in the sleep and its new finger is the other one
    assert all(1 <= len(p) <= 2 for p in pinned), pinned
    # open, or opened by the probe it gets within two periods where its ring has just turned
    assert wait_until(lambda: all(n._transport.is_open(p) for n in nodes for p in n._swarm._pinned), timeout_s=10)
    for n in nodes:
        n.on("echo", lambda m: Reply(m.body))
    busy = nodes[0]
    for other in nodes[1:]:  # a protocol's sends to everyone: each opens a socket and closes an idle one
        assert busy.request(other.peer_id, "echo", 1).body == 1
    assert all(busy._transport.is_open(p) for p in busy._swarm._pinned)  # but never a finger's
    victim = nodes.pop(7)
    victim.close()  # no leave: its connections drop, as for a SIGKILL
    assert wait_until(lambda: all(statuses(n).get(victim.peer_id) == "dead" for n in nodes),
                      timeout_s=DEATH_SEEN_WITHIN_S)


@pytest.mark.slow
def test_past_the_cap_news_goes_to_every_finger_at_once(make_node):
    """Past the cap, a burst's random targets are among the few members a node holds a socket
    to, so a member could miss a death whose senders all picked others (it then kept the dead
    peer alive, and handed it back to the swarm once the others had forgotten it). A burst
    now sends the news to each of the node's fingers as well as to its random targets."""
    config = NodeConfig(liveness=TEST_LIVENESS, transport=TransportConfig(max_open_dealers=10))
    nodes = [make_node("tcp", config=config)]
    nodes += [make_node("tcp", join=[nodes[0].address], config=config) for _ in range(19)]
    assert wait_until(lambda: all(len(n.live_peers()) == 19 for n in nodes), timeout_s=60)
    node = nodes[0]
    swarm = node._swarm
    # fingers 1, 10, 5 and 2 places ahead (and 1 again on a ring of another epoch), each probed
    # since, so its socket is open (news is not what opens a finger's socket)
    assert wait_until(lambda: swarm._ring.view == swarm.table.live_ids.version and len(swarm._pinned) >= 4
                      and all(node._transport.is_open(p) for p in swarm._pinned), timeout_s=60)
    fingers = set(swarm._pinned)
    accused = next(n.peer_id for n in nodes[1:] if n.peer_id not in fingers)
    sent_to: list[str] = []

    async def burst() -> None:
        claim = Claim.sign(swarm.local.identity, SUSPECT, accused, *swarm.table.live_at(accused))
        swarm.broadcasts.add(claim.key, claim.to_wire(), URGENT)
        real = swarm._send_quietly

        def spy(peer_id, topic, body):
            sent_to.append(peer_id)
            return real(peer_id, topic, body)

        swarm._send_quietly = spy
        try:
            await swarm._burst()
        finally:
            del swarm._send_quietly

    node.run(burst())
    assert fingers <= set(sent_to), (fingers, sent_to)  # 5 random picks of 10 open sockets hold 4 given ones 1 time in 42


def test_the_ring_keys_kept_beside_the_live_ids_give_the_fingers_a_walk_and_a_sort_give():
    """A member's table keeps its live ids' ring keys in an array (`node.swim.IdSet`): the
    fingers worked out on it are those of a walk of the ids and of a sorted ring, at sizes where
    fewer fingers than scales are spread over them, and members that cannot be probed are left out."""
    for n, now, limit in ((600, 1000.0, 4), (1100, 1037.5, 5), (40, 5.0, 16)):
        ids = [f"m-{i}" for i in range(n)]
        own, others = ids[0], ids[1:]
        live = IdSet(id_key)
        for p in reversed(others):  # in an order of its own, as a table's
            live.add(p)
        ring = ProbeRing(own, EPOCH_S, lambda now=now: now)
        keyed = ring.fingers(live.ids, 1, limit, live.keys())
        assert ProbeRing(own, EPOCH_S, lambda now=now: now).fingers(ids, 1, limit) == keyed
        epochs = ring.epochs(min(limit, MAX_FINGERS), now)
        want: list[str] = []
        for epoch, step in zip(epochs, finger_steps(n, limit)):
            order = sorted(ids, key=lambda p, e=epoch: place(p, e))
            peer = order[(order.index(own) + step) % n]
            if peer not in want:
                want.append(peer)
        assert keyed == want, (n, now, limit)
        skip = [live.index(p) for p in keyed[:2]]
        without = ProbeRing(own, EPOCH_S, lambda now=now: now).fingers(live.ids, 1, limit, live.keys(), skip)
        assert not set(keyed[:2]) & set(without)
        rest = [p for p in ids if p not in keyed[:2]]
        assert without == ProbeRing(own, EPOCH_S, lambda now=now: now).fingers(rest, 1, limit)


def test_a_place_on_the_ring_is_the_same_one_at_a_time_and_in_an_array_and_spread_evenly():
    ids = [f"peer-{i}" for i in range(4000)]
    keys = np.array([id_key(p) for p in ids], dtype=np.uint64)
    for epoch in (0, 1, -3, 2**40):
        at = places(keys, epoch)
        assert [int(x) for x in at[:50]] == [place(p, epoch) for p in ids[:50]]
        counts = np.bincount((at >> np.uint64(60)).astype(np.int64), minlength=16)  # 16 arcs of the ring
        assert counts.min() > 4000 / 16 * 0.75 and counts.max() < 4000 / 16 * 1.25
    # each epoch's ring is a new shuffle: where a member is on one says nothing of the next
    first, second = places(keys, 7).astype(np.float64), places(keys, 8).astype(np.float64)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.1
