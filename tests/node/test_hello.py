"""Versions at hello: each side says its package version, the wire versions it speaks and its
capabilities; a peer out of range is refused in one line naming both sides and what to
upgrade, counted, and nothing about it is kept. A release-0.1.x hello (a 3-item list) and a
0.1.x seed's refusal of ours read the same way."""
from __future__ import annotations

import threading

import msgpack
import pytest
import zmq
from conftest import TEST_LIVENESS, raw_dealer, wait_until

from starling.node import IncompatibleVersionError, JoinError, Node, NodeConfig, rpc
from starling.node.hello import LEGACY, LEGACY_HELLO_REFUSAL, Hello, PeerVersions, mismatch_text
from starling.node.identity import Identity
from starling.node.membership import PeerRecord
from starling.node.swarm import ANNOUNCE, HELLO
from starling.node.version import CAPABILITIES, PACKAGE_VERSION, WIRE_RANGE, describe
from starling.node.wire import ENVELOPE_VERSION, RejectReason, WireError, decode, encode

MINE = PeerVersions.local()
FUTURE = PeerVersions("9.0.0", (9, 9), ("teleport",))
CONFIG = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0, join_timeout_s=2.0, join_deadline_s=5.0)


# ---------------------------------------------------------------------------- the messages
def test_this_build_says_its_versions_in_one_place():
    assert MINE == PeerVersions(PACKAGE_VERSION, WIRE_RANGE, CAPABILITIES)
    assert WIRE_RANGE[0] <= WIRE_RANGE[1] and "relay" in CAPABILITIES
    assert describe().startswith(f"starling {PACKAGE_VERSION} (wire ")


def test_ranges_meet_where_they_share_a_version_and_the_line_names_the_side_to_upgrade():
    assert PeerVersions("0.2.0", (2, 2)).meets(PeerVersions("0.3.0", (2, 3)))
    assert not PeerVersions("0.2.0", (2, 2)).meets(PeerVersions("0.4.0", (3, 4)))
    assert mismatch_text(PeerVersions("0.2.0", (2, 2)), LEGACY) == \
        "the seed runs starling 0.2.0 (wire 2); the joiner runs starling 0.1.x (wire 1): upgrade the joiner"
    assert mismatch_text(LEGACY, PeerVersions("0.2.0", (2, 2))) == \
        "the seed runs starling 0.1.x (wire 1); the joiner runs starling 0.2.0 (wire 2): upgrade the seed"
    assert mismatch_text(PeerVersions("0.2.0", (2, 2)), PeerVersions("0.5.0", (4, 5))).endswith(
        "the joiner runs starling 0.5.0 (wire 4-5): upgrade the seed")


def test_a_hello_is_a_map_that_later_releases_may_extend_and_a_list_is_release_0_1():
    record = PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:9"], 1).to_wire()
    wire = Hello.ours(record, {"protocol": "gossip"}, True, turned_away=1).to_wire()
    assert set(wire) == {"record", "config", "table", "version", "turned_away"}
    later = {**wire, "version": {**FUTURE.to_wire(), "compression": "zstd"}, "room": 4}  # keys it does not know
    hello = Hello.from_wire(later)
    assert hello.versions == FUTURE and hello.turned_away == 1 and not hello.legacy
    old = Hello.from_wire([record, None, True])
    assert old.legacy and old.versions == LEGACY and old.want_table


@pytest.mark.parametrize("body", [
    "x", None, [1, 2], {"record": None, "config": None, "table": True},  # no version
    {"record": None, "config": None, "table": "yes", "version": MINE.to_wire()},
    {"record": None, "config": [1], "table": True, "version": MINE.to_wire()},
    {"record": None, "config": None, "table": True, "version": MINE.to_wire(), "turned_away": -1},
    {"record": None, "config": None, "table": True, "version": {"package": "0.2.0", "wire": [3, 2]}},
    {"record": None, "config": None, "table": True, "version": {"package": "0.2.0", "wire": [True, 2]}},
    {"record": None, "config": None, "table": True, "version": {"package": "a b\n", "wire": [2, 2]}},
    {"record": None, "config": None, "table": True, "version": {"package": "0.2.0", "wire": [2, 2],
                                                                 "capabilities": ["x" * 33]}},
])
def test_a_malformed_hello_is_a_bad_field(body):
    with pytest.raises(WireError) as info:
        Hello.from_wire(body)
    assert info.value.reason is RejectReason.BAD_FIELD


# ---------------------------------------------------------------------------- the seed's side
def _ask(address: str, body, identity: Identity | None = None) -> tuple[bool, object, int, int]:
    """One hello from a hand-driven stranger: (ok, body, request bytes, answer bytes)."""
    identity = identity or Identity.generate()
    sock = raw_dealer(address, identity)
    try:
        frames = encode(rpc.REQUEST_TOPIC, identity.peer_id, 0, rpc.request_body(HELLO, 1, body))
        sock.send_multipart(frames)
        assert sock.poll(10_000), "no answer"
        answer = sock.recv_multipart()
        _, ok, reply = rpc.parse_reply(decode(answer))
        return ok, reply, sum(len(f) for f in frames), sum(len(f) for f in answer)
    finally:
        sock.close()


@pytest.fixture
def seed():
    # CURVE: a plaintext node of another test process could hello this one on a reused port
    node = Node(config=CONFIG).start("tcp://127.0.0.1:0", swarm_config={"protocol": "gossip"})
    member = Node(config=CONFIG).start("tcp://127.0.0.1:0", [node.address])
    yield node
    member.close()
    node.close()


def _state(node: Node) -> tuple:
    """The table, the config, and the joiners announced to members."""
    announced = sum(topics.get(ANNOUNCE, 0) for topics in node.stats.snapshot()["bytes_sent"].values())
    return sorted(p.id for p in node.peers), node.swarm_config, announced


@pytest.mark.parametrize("versions", [FUTURE, PeerVersions("0.1.5", (1, 1))], ids=["newer", "older"])
def test_a_hello_from_a_wire_this_peer_does_not_speak_is_refused_naming_both_and_changes_nothing(seed, versions):
    joiner = Identity.generate()
    record = PeerRecord.create(joiner, ["tcp://127.0.0.1:9"], 1).to_wire()
    before = _state(seed)
    ok, error, _, _ = _ask(seed.address, Hello(record, {"protocol": "gossip"}, True, versions).to_wire(), joiner)
    assert not ok and error.code is rpc.ErrorCode.INCOMPATIBLE
    assert error.message == mismatch_text(MINE, versions)
    assert f"starling {MINE.package}" in error.message and f"starling {versions.package}" in error.message
    assert error.message.endswith("upgrade the seed" if versions is FUTURE else "upgrade the joiner")
    assert _state(seed) == before  # not learned, nobody told, no config taken
    assert seed.status_of(joiner.peer_id) is None
    assert seed.stats.snapshot()["rejected"]["incompatible"] == 1


def test_a_release_0_1_hello_is_refused_with_the_code_its_joiner_stops_on(seed):
    """A 0.1.x joiner knows no `incompatible` code; on a config conflict it stops at once and
    prints the text, so that is what it gets."""
    joiner = Identity.generate()
    before = _state(seed)
    ok, error, _, _ = _ask(seed.address, [PeerRecord.create(joiner, [], 1).to_wire(), None, True], joiner)
    assert not ok and error.code is rpc.ErrorCode.CONFIG_CONFLICT
    assert error.message == (f"the seed runs starling {MINE.package} (wire {WIRE_RANGE[1]}); the joiner runs "
                             "starling 0.1.x (wire 1): upgrade the joiner")
    assert _state(seed) == before and seed.status_of(joiner.peer_id) is None
    assert seed.stats.snapshot()["rejected"]["incompatible"] == 1


def test_a_seed_answers_with_its_versions(seed):
    joiner = Identity.generate()
    before = _state(seed)
    ok, body, sent, got = _ask(seed.address, Hello.ours(PeerRecord.create(joiner, [], 1).to_wire()).to_wire(), joiner)
    assert ok and PeerVersions.from_wire(body["version"]) == MINE
    assert wait_until(lambda: _state(seed)[2] > before[2])  # taken: announced to the member (what a refusal is not)
    assert seed.status_of(joiner.peer_id) is not None
    assert got <= seed.config.admission.stranger_reply_factor * sent
    assert seed.status()["version"] == MINE.to_wire()


# ---------------------------------------------------------------------------- the joiner's side
class _FakeSeed:
    """A ROUTER that answers every hello with the reply (ok, body) of its choosing."""

    def __init__(self, ok: bool, body: object) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.ok, self.body, self.hellos = ok, body, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._answer, daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            route, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            topic, rid, body = rpc.parse_request(msg)
            self.hellos.append(body)
            header = {"v": ENVELOPE_VERSION, "t": "$rep", "s": "fake", "n": 0, "ts": 0.0,
                      "b": [rid, self.ok, self.body], "f": []}
            self.sock.send_multipart([route, msgpack.packb(header, use_bin_type=True)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        self.sock.close()


@pytest.fixture
def fake_seed():
    made: list[_FakeSeed] = []

    def make(ok: bool, body: object) -> _FakeSeed:
        made.append(_FakeSeed(ok, body))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def test_a_joiner_refused_by_a_release_0_1_seed_says_the_seed_speaks_an_older_wire(fake_seed):
    """What a 0.1.x seed answers our hello (its only check of a hello's shape)."""
    old = fake_seed(False, {"code": "bad_request", "message": f"bad_field: {LEGACY_HELLO_REFUSAL}", "reason": None})
    node = Node(config=CONFIG)
    try:
        with pytest.raises(IncompatibleVersionError) as info:
            node.start("tcp://127.0.0.1:0", [old.address], security="plaintext")
    finally:
        node.close()
    assert str(info.value) == (f"{old.address}: the seed runs starling 0.1.x (wire 1); the joiner runs starling "
                               f"{MINE.package} (wire {WIRE_RANGE[1]}): upgrade the seed")
    assert len(old.hellos) == 1  # at once, not again and again until the deadline
    assert old.hellos[0]["version"] == MINE.to_wire()


def test_a_joiner_told_incompatible_stops_at_once_with_the_seeds_line(fake_seed):
    line = mismatch_text(FUTURE, MINE)
    seed = fake_seed(False, {"code": "incompatible", "message": line, "reason": None})
    node = Node(config=CONFIG)
    try:
        with pytest.raises(IncompatibleVersionError, match="upgrade the joiner") as info:
            node.start("tcp://127.0.0.1:0", [seed.address], security="plaintext")
    finally:
        node.close()
    assert str(info.value) == f"{seed.address}: {line}" and len(seed.hellos) == 1


def test_a_joiner_refuses_an_answer_from_a_wire_it_does_not_speak_and_takes_nothing_from_it(fake_seed):
    other = Identity.generate()
    record = PeerRecord.create(other, ["tcp://127.0.0.1:9"], 1).to_wire()
    seed = fake_seed(True, {"record": record, "config": {"protocol": "evil"}, "peers": [record], "next": None,
                            "version": FUTURE.to_wire()})
    node = Node(config=CONFIG)
    try:
        with pytest.raises(IncompatibleVersionError, match="upgrade the joiner"):
            node.start("tcp://127.0.0.1:0", [seed.address], security="plaintext")
        assert node.swarm_config is None and node.status_of(other.peer_id) is None
    finally:
        node.close()


def test_an_answer_without_versions_is_from_release_0_1(fake_seed):
    record = PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:9"], 1).to_wire()
    seed = fake_seed(True, {"record": record, "config": None, "peers": [], "next": None})
    node = Node(config=CONFIG)
    try:
        with pytest.raises(JoinError, match=r"runs starling 0\.1\.x \(wire 1\).*upgrade the seed"):
            node.start("tcp://127.0.0.1:0", [seed.address], security="plaintext")
    finally:
        node.close()


def test_two_nodes_of_this_build_join_and_know_each_others_versions():
    a = Node(config=CONFIG).start("tcp://127.0.0.1:0")
    b = Node(config=CONFIG)
    try:
        b.start("tcp://127.0.0.1:0", [a.address])
        assert b.live_peers() == [a.peer_id]
        assert a.stats.snapshot()["rejected"].get("incompatible", 0) == 0
    finally:
        b.close()
        a.close()
