"""What a pull of the peer table costs the node that answers it: a stranger's hello gets at most
ten times its own bytes back, a member's pulls share a budget of bytes per second, and a
joiner still learns a big table, page by page (real CURVE sockets on loopback)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgpack
import pytest
import zmq
from conftest import raw_dealer, wait_until
from zmq.utils import z85

from starling.node import rpc
from starling.node.address import parse_address
from starling.node.admission import AdmissionConfig
from starling.node.client import query
from starling.node.hello import Hello
from starling.node.identity import Identity
from starling.node.loop import NetworkThread
from starling.node.membership import PeerRecord, TableLimits
from starling.node.node import Node, NodeConfig
from starling.node.swarm import ANNOUNCE, HELLO, SYNC, WANT
from starling.node.swim import Liveness
from starling.node.table_sync import HAVE_CHARS, MAX_HAVE
from starling.node.wire import ENVELOPE_BYTES, decode, encode, frame_nbytes

# slow suspicions: the made-up peers below answer no probe, and must stay in the table (alive or
# suspect) for the test
SLOW = Liveness(probe_interval_s=1.0, suspicion_base_s=120.0)


def config(**admission) -> NodeConfig:
    return NodeConfig(liveness=SLOW, request_timeout_s=5.0, admission=AdmissionConfig(**admission))


def fat_records(n: int) -> list[PeerRecord]:
    """Signed records of made-up peers, each with eight addresses (nothing listens there)."""
    return [PeerRecord.create(Identity.generate(), [f"tcp://127.0.{i % 250}.{j + 1}:{40000 + i}" for j in range(8)], 1)
            for i in range(n)]


def announce(member: Node, to: Node, records: list[PeerRecord]) -> None:
    for start in range(0, len(records), 200):
        member.run(member._asend_raw(to.peer_id, ANNOUNCE, [r.to_wire() for r in records[start:start + 200]]))


async def _raw_request(address: str, identity: Identity, topic: str, body) -> tuple[int, int, object]:
    """(request bytes, reply bytes, reply body) of one request from a stranger's DEALER."""
    target = parse_address(address)
    sock = NetworkThread.get().context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.curve_serverkey = z85.encode(target.curve_key)
        sock.curve_publickey, sock.curve_secretkey = identity.curve_public_z85, identity.curve_secret_z85
        sock.connect(target.endpoint)
        frames = encode(rpc.REQUEST_TOPIC, identity.peer_id, 0, rpc.request_body(topic, 1, body))
        await sock.send_multipart(frames)
        answer = await asyncio.wait_for(sock.recv_multipart(copy=False), 10)
        _, ok, result = rpc.parse_reply(decode(answer))
        assert ok, result
        return frame_nbytes(frames), frame_nbytes(answer), result
    finally:
        sock.close(0)


@pytest.fixture
def seeded():
    """A seed whose table (300 fat records, announced by a member: ~120 KB) is more than one
    page, and whose members may pull a page and then 100 KB/s."""
    seed = Node(config=config(member_pull_bytes_per_s=1e5, member_pull_burst_bytes=64 * 1024)).start("tcp://127.0.0.1:0")
    member = Node(config=config()).start("tcp://127.0.0.1:0", join=[seed.address])
    records = fat_records(300)
    announce(member, seed, records)
    assert wait_until(lambda: len(seed.live_peers()) == 301, timeout_s=30)
    yield seed, member, records
    member.close()
    seed.close()


def test_a_strangers_hello_gets_at_most_ten_times_its_bytes_and_a_joiner_pages_the_rest(seeded):
    seed, _, records = seeded
    stranger = Identity.generate()
    hello = Hello.ours(PeerRecord.create(stranger, ["tcp://127.0.0.1:9"], 1).to_wire()).to_wire()
    sent, got, body = NetworkThread.get().run(_raw_request(seed.address, stranger, HELLO, hello))
    assert got <= 10 * sent, (sent, got)
    assert isinstance(body["next"], str) and len(body["peers"]) < 301  # a first page only
    # a real joiner learns the whole table: the hello's page, then `$sync` pages as a member,
    # waiting out its pull budget between them
    joiner = Node(config=config()).start("tcp://127.0.0.1:0", join=[seed.address])
    try:
        assert {r.peer_id for r in records} <= set(joiner.live_peers())
    finally:
        joiner.close()


def _pull_past_every_refusal(seed: Node, member: Node, topic: str, check=lambda body: None) -> None:
    """`member` asks `seed` for `topic` as fast as answers come for 2 s, past every refusal:
    it is answered while its pull budget lasts, then turned down, and what it was sent fits
    the budget (a turned-down pull costs a short answer, the size of the ask)."""
    admission = seed.config.admission
    start, busy, pages = time.monotonic(), 0, 0
    while time.monotonic() - start < 2.0:
        try:
            check(member.request(seed.peer_id, topic, None, timeout_s=0.2).body)
            pages += 1
        except rpc.BusyError:
            busy += 1
        except rpc.RequestTimeout:  # deep in debt: no longer answered at all
            pass
    elapsed = time.monotonic() - start
    sent = _bytes_sent_to(seed, member.peer_id, topic)
    asked = seed.stats.snapshot()["bytes_received"][member.peer_id][topic]
    assert busy > 0 and pages > 0
    assert sent <= (admission.member_pull_burst_bytes + admission.member_pull_bytes_per_s * elapsed
                    + admission.table_page_bytes + 2 * asked), (sent, asked, elapsed)


def test_a_members_table_pulls_are_held_to_its_byte_rate(seeded):
    seed, member, _ = seeded
    _pull_past_every_refusal(seed, member, SYNC)


def test_a_members_status_pulls_are_paged_and_share_its_pull_budget(seeded):
    """A member's `$status` is the table in pages, each charged to the member's pull budget
    with its `$sync` and `$want` pulls: a member asking again and again gets no more than that
    budget's bytes (a whole table per ask would be 2.26 MB for 61 bytes at 4096 peers)."""
    seed, member, _ = seeded

    def one_page(body) -> None:
        assert len(body["peers"]) < 301 and isinstance(body["next"], str)  # one page, and where to go on

    _pull_past_every_refusal(seed, member, "$status", one_page)


def test_a_member_reads_a_paged_status_to_its_end(seeded):
    seed, member, _ = seeded
    status = query(seed.address, identity=member.identity, timeout_s=10)
    assert len(status["peers"]) == 301 and len({p["id"] for p in status["peers"]}) == 301
    assert status["id"] == seed.peer_id and "next" not in status
    with pytest.raises(rpc.BadRequestError):  # paging is for members; an id must be one
        member.request(seed.peer_id, "$status", {"after": 7})


def test_a_member_whose_pull_budget_is_spent_still_reads_its_status_once_it_refills(seeded):
    """The member's own table pulls can spend its budget just before it asks for the status
    (a forming member pulls every second): the first page turned down as busy is waited out,
    as the later ones are."""
    seed, member, _ = seeded
    busy = 0
    while busy == 0:  # the budget spent: the seed turns a page down
        try:
            member.request(seed.peer_id, SYNC, None, timeout_s=2)
        except rpc.BusyError:
            busy += 1
    status = query(seed.address, identity=member.identity, timeout_s=10)
    assert len(status["peers"]) == 301 and "next" not in status


def test_wants_share_the_pull_budget(seeded):
    seed, member, records = seeded
    admission = seed.config.admission
    ids = [r.peer_id for r in records[:256]]
    start = time.monotonic()
    for _ in range(40):  # 40 x 256 fat records wanted: ~4 MB if all were answered
        member.run(member._asend_raw(seed.peer_id, WANT, ids))
    assert wait_until(lambda: seed.stats.snapshot()["rejected"].get("rate_limited", 0) > 0, timeout_s=20)
    time.sleep(0.5)  # the announces already spawned finish
    allowed = admission.member_pull_burst_bytes + admission.member_pull_bytes_per_s * (time.monotonic() - start)
    assert _bytes_sent_to(seed, member.peer_id, ANNOUNCE) <= allowed + 40 * ENVELOPE_BYTES


def test_a_sync_page_is_held_to_its_size_and_goes_on_from_its_cursor(seeded):
    seed, member, records = seeded
    seen: list[str] = []
    after = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            reply = member.request(seed.peer_id, SYNC, None if after is None else {"after": after}).body
        except rpc.BusyError:  # the next page waits for the member's budget to refill
            time.sleep(0.1)
            continue
        assert len(msgpack.packb(reply["peers"])) <= seed.config.admission.table_page_bytes
        seen += [r[0] for r in reply["peers"]]
        if reply["next"] is None:
            break
        after = reply["next"]
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    assert {r.peer_id for r in records} <= set(seen)


def test_a_sync_ask_naming_the_peers_it_holds_gets_only_the_others(seeded):
    """Anti-entropy asks for what the helper holds and it lacks: a page of news, not of records
    it has (a forming swarm pulls every period, and pages from a random point were mostly
    known)."""
    seed, member, records = seeded
    held = records[:250]
    have = "".join(r.peer_id[:HAVE_CHARS] for r in held).encode()
    # The member's own anti-entropy pulls from the seed in the background (past its socket cap,
    # from members it holds a socket to, the seed among them), and one just before ours leaves
    # less of its pull budget than our page, or none: ask again once the budget refilled.
    budget = seed._swarm.tables.pull_bucket(member.peer_id, time.monotonic())
    body = None
    for _ in range(5):
        assert wait_until(lambda: budget.available(time.monotonic()) >= budget.burst, timeout_s=10)
        try:
            body = member.request(seed.peer_id, SYNC, {"have": have}).body
        except rpc.BusyError:
            continue
        if body["next"] is None:
            break
    assert body is not None, "every ask was refused as over the pull budget"
    got = {raw[0] for raw in body["peers"]}
    assert body["next"] is None and not got & {r.peer_id for r in held}
    assert {r.peer_id for r in records[250:]} <= got and member.peer_id in got


@pytest.mark.parametrize("body", [{"after": 5}, {"from": "x"}, ["x"], {"after": "x" * 65}, {},
                                  {"have": b"abcde"}, {"have": "abcdef"}, {"have": b"\xff" * 6},
                                  {"have": b"a" * 6 * (MAX_HAVE + 1)}])
def test_a_malformed_sync_is_refused(seeded, body):
    seed, member, _ = seeded
    with pytest.raises(rpc.BadRequestError):
        member.request(seed.peer_id, SYNC, body)


def _bytes_sent_to(node: Node, peer: str, topic: str) -> int:
    return node.stats.snapshot()["bytes_sent"].get(peer, {}).get(topic, 0)


def test_a_strangers_status_costs_at_most_ten_times_its_bytes_and_the_client_pads_for_more(seeded):
    seed, _, records = seeded
    stranger = Identity.generate()
    sent, got, body = NetworkThread.get().run(_raw_request(seed.address, stranger, "$status", None))
    assert got <= 10 * sent and set(body) == {"pad_to"}  # 301 peers do not fit in 10x a bare request
    sent, got, body = NetworkThread.get().run(_raw_request(seed.address, stranger, "$status",
                                                           {"pad": bytes(body["pad_to"])}))
    assert got <= 10 * sent and len(body["peers"]) == 301
    assert len(query(seed.address, timeout_s=10)["peers"]) == 301  # what `starling node status` does


def test_a_member_cannot_fill_the_table_with_made_up_peers_and_joiners_still_join():
    limits = TableLimits(max_peers=64, max_sponsored_per_member=32)
    seed = Node(config=replace(config(), table=limits)).start("tcp://127.0.0.1:0")
    flooder = Node(config=config()).start("tcp://127.0.0.1:0", join=[seed.address])
    try:
        announce(flooder, seed, fat_records(100))
        assert wait_until(lambda: seed.stats.snapshot()["rejected"].get("table_full", 0) >= 100 - 32)
        assert len(seed.live_peers()) == 1 + 32  # the flooder, and its share of made-up peers
        joiners = [Node(config=config()).start("tcp://127.0.0.1:0", join=[seed.address]) for _ in range(3)]
        try:
            for joiner in joiners:
                assert wait_until(lambda j=joiner: j.peer_id in seed.live_peers())
                assert seed.peer_id in joiner.live_peers()
            assert seed.fault is None and not seed.closed
        finally:
            for joiner in joiners:
                joiner.close()
    finally:
        flooder.close()
        seed.close()


def test_identities_that_talk_stay_on_their_relayers_word_and_a_full_table_still_takes_a_joiner():
    """One attacker's throwaway identities each send the node one message on their own
    connection. They stay on their relayer's word, so a second batch is refused (were they freed
    by talking, one member could fill the table and every hello after would be refused
    `table_full`); and a table full of two members' shares makes room for a joiner that greets
    it, dropping the newest of the biggest share."""
    share = 16
    limits = TableLimits(max_peers=2 * (share + 1), max_sponsored_per_member=share)
    seed = Node(config=replace(config(), table=limits)).start("tcp://127.0.0.1:0")
    flooders = [Node(config=config()).start("tcp://127.0.0.1:0", join=[seed.address]) for _ in range(2)]
    socks = []
    joiner = None
    try:
        for flooder in flooders:
            keys = [Identity.generate() for _ in range(share)]
            announce(flooder, seed, [PeerRecord.create(k, ["tcp://127.0.0.1:9"], time.time_ns()) for k in keys])
            assert wait_until(lambda ks=keys: all(k.peer_id in seed.live_peers() for k in ks))
            for key in keys:  # each says one word on a connection of its own: heard first-hand
                sock = raw_dealer(seed.address, key)
                sock.send_multipart(encode("$gossip", key.peer_id, 0, {"u": []}))
                socks.append(sock)
            assert wait_until(lambda ks=keys: all(seed._table.get(k.peer_id).told_by is None for k in ks))
            refused = seed.stats.snapshot()["rejected"].get("table_full", 0)
            announce(flooder, seed, fat_records(share))  # a second batch, on the same word
            assert wait_until(lambda r=refused: seed.stats.snapshot()["rejected"].get("table_full", 0) >= r + share)
        assert len(seed.live_peers()) == limits.max_peers  # full: two members and their shares
        joiner = Node(config=config()).start("tcp://127.0.0.1:0", join=[seed.address])
        assert wait_until(lambda: joiner.peer_id in seed.live_peers()) and seed.peer_id in joiner.live_peers()
        assert len(seed.live_peers()) <= limits.max_peers and seed._table.sponsored(flooders[1].peer_id) <= share
    finally:
        for sock in socks:
            sock.close()
        for node in [*flooders, *([joiner] if joiner else [])]:
            node.close()
        seed.close()



def _greet_from(address: str, seed: Node, key: Identity) -> zmq.Socket:
    """A raw client connection from `address` (a loopback alias) whose key says hello itself."""
    target = parse_address(seed.address)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.curve_serverkey = z85.encode(target.curve_key)
    sock.curve_publickey, sock.curve_secretkey = key.curve_public_z85, key.curve_secret_z85
    host, port = target.endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock.connect(f"tcp://{address}:0;{host}:{port}")
    hello = Hello.ours(PeerRecord.create(key, [], time.time_ns()).to_wire(), None, False).to_wire()
    sock.send_multipart(encode(rpc.REQUEST_TOPIC, key.peer_id, 0, [HELLO, 1, hello]))
    return sock


def test_a_table_full_of_keys_greeting_from_one_address_still_takes_a_joiner_from_another():
    """One attacker's keys each say hello themselves, from 127.0.0.2, until the table is full.
    They count in that address's group, so the honest joiner (from 127.0.0.1) takes the newest
    one's place; one more key from 127.0.0.2 is turned away busy, with members to try."""
    limits = TableLimits(max_peers=24, max_sponsored_per_member=12)
    seed = Node(config=replace(config(), table=limits)).start("tcp://127.0.0.1:0")
    socks: list[zmq.Socket] = []
    joiner = None
    try:
        keys = [Identity.generate() for _ in range(limits.max_peers + 8)]
        for key in keys:
            socks.append(_greet_from("127.0.0.2", seed, key))
        assert wait_until(lambda: len(seed._table.all()) == limits.max_peers)
        origins = {seed._table.get(k.peer_id).origin for k in keys if k.peer_id in seed._table}
        assert origins == {"ip:127.0.0.2"}
        joiner = Node(config=config()).start("tcp://127.0.0.1:0", join=[seed.address])
        assert wait_until(lambda: joiner.peer_id in seed.live_peers()) and seed.peer_id in joiner.live_peers()
        assert len(seed._table.all()) <= limits.max_peers
        assert seed._table.get(joiner.peer_id).origin == "ip:127.0.0.1"
        # another key from the address that fills the table is turned away busy, and (once the
        # seed's list of members to name is rebuilt, within a second) named the joiner to try
        answers = []

        def turned_away_to_the_joiner() -> bool:
            late = Identity.generate()
            sock = _greet_from("127.0.0.2", seed, late)
            socks.append(sock)
            assert sock.poll(5000) and late.peer_id not in seed._table
            body = decode(sock.recv_multipart()).body
            answers.append(body)
            assert body[1] is False and body[2]["code"] == rpc.ErrorCode.BUSY.value, body
            named = [r[0] for r in (body[2].get("data") or {}).get("members", [])]
            return joiner.peer_id in named

        assert wait_until(turned_away_to_the_joiner, timeout_s=5, interval_s=0.2), answers[-1]
    finally:
        for sock in socks:
            sock.close()
        if joiner is not None:
            joiner.close()
        seed.close()
