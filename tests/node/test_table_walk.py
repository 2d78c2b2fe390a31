"""How a member comes to hold a table: a joiner pages the whole of it in ranges at once, and a
forming swarm pulls again soon after each pull that brought news, at its own pace rather than
its probe period's (real nodes on loopback TCP)."""
from __future__ import annotations

import math

import pytest
from conftest import wait_until

from starling.node.admission import AdmissionConfig
from starling.node.identity import Identity
from starling.node.membership import PeerRecord, PeerStatus
from starling.node.node import Node, NodeConfig
from starling.node.swarm import ANNOUNCE, SYNC
from starling.node.swim import Liveness
from starling.node.table_sync import MAX_PARALLEL_PAGES, PULL_PAGES, SUM_BYTES, id_fraction, parse_sync, split_ids
from starling.node.transport import TransportConfig
from starling.node.wire import WireError
from starling.runtime.simconfig import sim_liveness

# probes, gossip and suspicions far slower than the tests: what moves, moves by table pulls
QUIET = Liveness(probe_interval_s=30.0, gossip_interval_s=30.0, suspicion_base_s=120.0)


def fat_records(n: int) -> list[PeerRecord]:
    """Signed records of made-up peers, eight addresses each (nothing listens there)."""
    return [PeerRecord.create(Identity.generate(), [f"tcp://127.0.{i % 250}.{j + 1}:{40000 + i}" for j in range(8)], 1)
            for i in range(n)]


def test_the_ranges_of_a_walk_start_where_its_first_page_ended_and_rise():
    # a first page that spanned an eighth of the ids (up to "6") leaves seven pages: seven ranges
    starts = split_ids(None, "6", 16)
    assert starts[0] == "6" and starts == sorted(starts) and len(set(starts)) == len(starts)
    assert len(starts) == math.ceil((1 - id_fraction("6")) / id_fraction("6"))
    assert len(split_ids(None, "6", 4)) == 4  # never more ranges than asked
    assert split_ids("abc", "abd", MAX_PARALLEL_PAGES)[0] == "abd"
    # nothing left to split, or ids that are not base32 (a seed's made-up `next`): one range
    assert split_ids(None, "zzzz", 8) == ["zzzz"]
    assert split_ids("q", "p", 8) == ["p"]
    assert split_ids(None, "!!!!", 8)[0] == "!!!!"


def test_a_joiner_pages_a_big_table_in_ranges_at_once_and_learns_each_record_once():
    """A seed's table of 600 fat records is several pages: the joiner reads the first page,
    then the rest of them at once, and learns every record, none of them twice."""
    seed = Node(config=NodeConfig(liveness=QUIET)).start("tcp://127.0.0.1:0")
    helper = Node(config=NodeConfig(liveness=QUIET)).start("tcp://127.0.0.1:0", join=[seed.address])
    joiner = Node(config=NodeConfig(liveness=QUIET))
    try:
        records = fat_records(600)
        for start in range(0, len(records), 200):
            helper.run(helper._asend_raw(seed.peer_id, ANNOUNCE, [r.to_wire() for r in records[start:start + 200]]))
        assert wait_until(lambda: len(seed.live_peers()) == 601, timeout_s=30)
        outbox = joiner._swarm.tables.outbox
        request, in_flight, most = outbox.request, [0], [0]

        async def counted(peer_id, topic, *args, **kwargs):  # the joiner's own requests, as they go
            if topic != SYNC:
                return await request(peer_id, topic, *args, **kwargs)
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                return await request(peer_id, topic, *args, **kwargs)
            finally:
                in_flight[0] -= 1
        outbox.request = counted
        learned: list[str] = []
        joiner.on_peer_change(lambda change: learned.append(change.peer_id) if change.old is None else None)
        joiner.start("tcp://127.0.0.1:0", join=[seed.address])
        assert {r.peer_id for r in records} <= set(joiner.live_peers())
        assert most[0] > 1  # pages in flight at once, not one round trip a page
        assert len(learned) == len(set(learned))
        pages = joiner.stats.snapshot()["messages_sent_by_topic"].get(SYNC, 0)
        assert pages <= math.ceil(600 * records[0].wire_bytes / seed.config.admission.table_page_bytes) \
            + MAX_PARALLEL_PAGES + 1  # at most a page a range more than the table's bytes
    finally:
        joiner.close()
        helper.close()
        seed.close()


def test_a_forming_member_pulls_at_its_own_pace_not_its_probe_periods():
    """Probes and gossip every 30 s: records its seed learns after the join reach the member
    only by its table pulls. They are more pages than one pull reads, and the pull that
    brought the first of them brings the next one `forming_pull_s` later, not a period later.
    (The records are of clients, which the member cannot dial: it pulls from the seed.)"""
    small_pages = AdmissionConfig(table_page_bytes=16 * 1024)
    seed = Node(config=NodeConfig(liveness=QUIET, admission=small_pages)).start("tcp://127.0.0.1:0")
    fast = Liveness(probe_interval_s=30.0, gossip_interval_s=30.0, suspicion_base_s=120.0, forming_pull_s=0.5)
    member = Node(config=NodeConfig(liveness=fast)).start("tcp://127.0.0.1:0", join=[seed.address])
    try:
        records = [PeerRecord.create(Identity.generate(), [], 1) for _ in range(600)]
        assert len(records) * records[0].wire_bytes > PULL_PAGES * small_pages.table_page_bytes
        seed.add_records([r.to_wire() for r in records])
        assert wait_until(lambda: {r.peer_id for r in records} <= set(member.live_peers()), timeout_s=15)
        assert member._swarm.tables.pulls.get("news", 0) >= 2
    finally:
        member.close()
        seed.close()


def test_a_member_whose_loop_runs_behind_pulls_less_often_not_at_its_forming_pace():
    """Two swarms forming on one box: a loop that ran behind while a pull was out doubles the
    wait for the next one toward the probe period, rather than queue a pull a second behind
    the work already waiting."""
    seed = Node(config=NodeConfig(liveness=QUIET)).start("tcp://127.0.0.1:0")
    fast = Liveness(probe_interval_s=30.0, gossip_interval_s=30.0, suspicion_base_s=120.0, forming_pull_s=0.5)
    member = Node(config=NodeConfig(liveness=fast))
    member._swarm.loop_lag = lambda since: 2.0  # as `LoopLag.worst_since` says of a loop 2 s behind
    member.start("tcp://127.0.0.1:0", join=[seed.address])
    try:
        tables = member._swarm.tables
        waits = []
        for _ in range(2):  # each batch of news is pulled, and each such pull doubles the wait
            seed.add_records([PeerRecord.create(Identity.generate(), [], 1).to_wire() for _ in range(5)])
            news = tables.pulls.get("news", 0)
            assert wait_until(lambda news=news: tables.pulls.get("news", 0) > news, timeout_s=20)
            waits.append(member.run(_quiet(tables), timeout_s=5))
        assert waits == sorted(waits) and waits[-1] > fast.forming_pull_s
        assert waits[-1] <= fast.probe_interval_s
    finally:
        member.close()
        seed.close()


def _sync_bytes(node: Node) -> int:
    return sum(per.get(SYNC, 0) for per in node.stats.snapshot()["bytes_sent"].values())


def test_a_settled_member_asks_whether_it_holds_the_same_peers_before_it_pages():
    """A pull after one that brought nothing first asks whether the member holds the same
    peers alive (a 16-byte sum, where the list of held peers is 6 bytes a peer), and pages only
    when it does not: news still comes on the pull after the seed's table changed."""
    seed = Node(config=NodeConfig(liveness=QUIET)).start("tcp://127.0.0.1:0")
    member = Node(config=NodeConfig(liveness=QUIET)).start("tcp://127.0.0.1:0", join=[seed.address])
    try:
        tables = member._swarm.tables
        seed.add_records([PeerRecord.create(Identity.generate(), [], 1).to_wire() for _ in range(300)])

        def pull() -> tuple[int, int]:
            before = _sync_bytes(member)
            learned = member.run(tables.anti_entropy(0.5, 60.0), timeout_s=10)
            return learned, _sync_bytes(member) - before

        assert pull()[0] == 300 and tables.pulls == {"news": 1}
        learned, listed = pull()  # nothing new, found by naming all 301 peers held
        assert learned == 0 and tables.pulls.get("none") == 1 and listed > 301 * 6
        learned, summed = pull()
        assert learned == 0 and tables.pulls.get("same") == 1
        assert summed < 100 < listed  # the sum and its envelope, not a list of the table
        assert pull()[0] == 0 and tables.pulls["same"] == 2
        late = [PeerRecord.create(Identity.generate(), [], 1) for _ in range(5)]
        seed.add_records([r.to_wire() for r in late])
        learned, _ = pull()  # the sums differ: the pull pages as before
        assert learned == 5 and tables.pulls["news"] == 2 and {r.peer_id for r in late} <= set(member.live_peers())
        for node in (member, seed):  # each ask and answer was well formed
            assert "bad_field" not in node.stats.snapshot()["rejected"]
    finally:
        member.close()
        seed.close()


def test_a_sync_ask_with_a_sum_names_nothing_else_and_its_sum_is_its_size():
    assert parse_sync({"sum": b"s" * SUM_BYTES})[3] == b"s" * SUM_BYTES
    assert parse_sync({"sum": b"s" * SUM_BYTES, "me": ["record"]})[2] == ["record"]
    assert parse_sync({"have": b"abcdef"})[3] is None
    for bad in ({"sum": b"s" * (SUM_BYTES - 1)}, {"sum": "s" * SUM_BYTES}, {"sum": b"s" * SUM_BYTES, "have": b""},
                {"sum": b"s" * SUM_BYTES, "after": "x"}, {"sum": None}):
        with pytest.raises(WireError, match="sync"):
            parse_sync(bad)


async def _quiet(tables) -> float:
    return tables._quiet_s


def test_forming_pull_s_is_a_positive_time_or_none():
    for bad in (0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match="forming_pull_s"):
            Liveness(forming_pull_s=bad)
    assert Liveness().forming_pull_s is None


@pytest.mark.parametrize("swarm", [64, 128, 1024, 4096])
def test_a_simulated_swarm_pulls_faster_than_it_probes_once_its_period_is_stretched(swarm):
    liveness = sim_liveness(swarm, swarm)
    soon = liveness.forming_pull()
    assert soon <= liveness.probe_interval_s
    assert soon >= 1.0 or liveness.forming_pull_s is None  # the box's pulls stay bounded
    if swarm >= 1024:
        assert soon < liveness.probe_interval_s


def test_a_member_past_its_socket_cap_whose_open_members_are_all_suspect_still_finds_one_to_ask():
    """On a box too loaded to answer probes in time, the members a node holds a socket to are
    the ones it probed, and it may suspect them all. Its table pulls and indirect probes then
    ask live members it holds no socket to, rather than nobody: a pull with nobody to ask
    learns nothing and backs off, and an indirect probe with nobody to ask suspects its target
    on one node's word."""
    seed = Node(config=NodeConfig(liveness=QUIET)).start("tcp://127.0.0.1:0")
    others = [Node(config=NodeConfig(liveness=QUIET)).start("tcp://127.0.0.1:0", join=[seed.address])
              for _ in range(4)]
    capped = NodeConfig(liveness=QUIET, transport=TransportConfig(max_open_dealers=2))
    member = Node(config=capped).start("tcp://127.0.0.1:0", join=[seed.address])
    try:
        everyone = {seed.peer_id, *(o.peer_id for o in others)}
        assert wait_until(lambda: everyone <= set(member.live_peers()), timeout_s=15)
        swarm = member._swarm
        transport = swarm.outbox.transport

        async def suspect_the_open_ones_then_draw() -> tuple[list[str], list[str], list[str]]:
            # in one turn of the node's loop: no beat comes in between to clear a suspicion
            opened = transport.sample_open(swarm._rng, 100)
            for peer_id in opened:
                swarm.table.suspect(peer_id)
            asked = swarm._helpers(8)
            return opened, asked, [swarm.table.get(p).status for p in asked]

        opened, asked, statuses = member.run(suspect_the_open_ones_then_draw())
        assert opened and len(opened) < len(everyone)  # past the cap: some are open, not all
        assert len(everyone) > transport.dealer_cap
        assert asked and not set(asked) & set(opened)
        assert all(status is PeerStatus.ALIVE for status in statuses)
        member.run(swarm.tables.anti_entropy(0.5, 60.0), timeout_s=10)
        assert "no_helper" not in swarm.tables.pulls, swarm.tables.pulls
    finally:
        for node in (member, *others, seed):
            node.close()
