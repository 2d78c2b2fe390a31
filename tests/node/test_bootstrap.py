"""Bootstrap: several join addresses in turn with backoff, DNS names and IPv6 literals, and
a swarm split in two that heals when its halves learn of each other again."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from conftest import TEST_LIVENESS, wait_until

from starling.node.address import PeerAddress, parse_address
from starling.node.identity import Identity
from starling.node.node import JoinError, Node, NodeConfig

CONFIG = NodeConfig(liveness=TEST_LIVENESS, request_timeout_s=5.0, join_timeout_s=1.0, join_backoff_s=0.2,
                    rejoin_interval_s=0.5)


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(listen: str = "tcp://127.0.0.1:0", join: list[str] | None = None, config: NodeConfig = CONFIG,
             identity: Identity | None = None) -> Node:
        node = Node(identity, config=config)
        made.append(node)
        return node.start(listen, join or [])

    yield make
    for node in made:
        node.close()


def _free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_join_addresses_are_tried_in_turn(nodes):
    seed = nodes()
    dead = f"tcp://127.0.0.1:{_free_port()}#{seed.address.split('#')[1]}"  # nobody listens there
    joiner = nodes(join=[dead, seed.address])
    assert joiner.live_peers() == [seed.peer_id]


def test_a_join_waits_with_backoff_for_a_seed_that_comes_up(nodes):
    identity = Identity.generate()
    port = _free_port()
    address = str(PeerAddress(f"tcp://127.0.0.1:{port}", identity.curve_public))
    late = threading.Timer(1.0, lambda: nodes(f"tcp://127.0.0.1:{port}", identity=identity))
    late.start()
    t0 = time.monotonic()
    joiner = nodes(join=[address], config=NodeConfig(liveness=TEST_LIVENESS, join_timeout_s=0.5, join_deadline_s=30,
                                                     join_backoff_s=0.2))
    late.join()
    assert time.monotonic() - t0 >= 0.9
    assert wait_until(lambda: len(joiner.live_peers()) == 1)


def test_a_join_gives_up_at_its_deadline_and_names_every_address():
    addresses = [str(PeerAddress(f"tcp://127.0.0.1:{_free_port()}", Identity.generate().curve_public))
                 for _ in range(2)]
    node = Node(config=NodeConfig(liveness=TEST_LIVENESS, join_timeout_s=0.2, join_deadline_s=1.5,
                                  join_backoff_s=0.1))
    t0 = time.monotonic()
    with pytest.raises(JoinError, match=r"could not join the swarm within 1.5 s \(\d+ hellos in \d+ rounds\)") as err:
        node.start("tcp://127.0.0.1:0", addresses)
    # bounded by the deadline (less the last hello's patience, 0.2 s), not by rounds or backoff
    assert 1.5 - 0.2 <= time.monotonic() - t0 < 10
    assert all(address in str(err.value) for address in addresses)
    assert len(str(err.value).splitlines()) == 1


def test_join_by_dns_name(nodes):
    seed = nodes()
    endpoint, key = seed.address.split("#")
    joiner = nodes(join=[f"tcp://localhost:{endpoint.rsplit(':', 1)[1]}#{key}"])
    assert joiner.live_peers() == [seed.peer_id]


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_join_by_ipv6_literal(nodes):
    seed = nodes("tcp://[::1]:0")
    assert seed.address.startswith("tcp://[::1]:")
    joiner = nodes("tcp://[::1]:0", join=[seed.address])
    assert joiner.live_peers() == [seed.peer_id]
    assert wait_until(lambda: seed.live_peers() == [joiner.peer_id])


def test_a_split_swarm_heals_when_its_halves_meet_again(nodes):
    seed_identity = Identity.generate()
    port = _free_port()
    seed = nodes(f"tcp://127.0.0.1:{port}", identity=seed_identity)
    a = nodes(join=[seed.address])
    b = nodes(join=[seed.address])
    assert wait_until(lambda: len(a.live_peers()) == 2 and len(b.live_peers()) == 2)
    seed.close()  # the seed crashes and comes back with an empty table: a swarm of its own...
    assert wait_until(lambda: a.live_peers() == [b.peer_id] and b.live_peers() == [a.peer_id], timeout_s=15)
    seed2 = nodes(f"tcp://127.0.0.1:{port}", identity=seed_identity)
    d = nodes(join=[seed2.address])  # ...that another peer joins: two halves, {a, b} and {seed, d}
    # (a or b may have said hello to the seed again already, while d joined: the heal began)
    assert seed2.peer_id in d.live_peers()
    everyone = {a.peer_id, b.peer_id, seed2.peer_id, d.peer_id}
    # a and b hello their join address again: each half learns the other's table
    for node in (a, b, seed2, d):
        assert wait_until(lambda node=node: set(node.live_peers()) == everyone - {node.peer_id}, timeout_s=20)


def test_a_join_address_is_alive_while_a_live_peer_answers_to_it(nodes):
    """The rejoin check: a join address is alive while a live peer has its key (or, for an
    address without a key, its endpoint); the peer last found there is looked up first, and
    once it is gone the address is lost, until another live peer answers to it."""
    seed = nodes()
    member = nodes(join=[seed.address])
    assert wait_until(lambda: seed.peer_id in member.live_peers())
    keyed = member._bootstrap.seeds[0]
    assert keyed.curve_key is not None
    bare = PeerAddress(keyed.endpoint)

    async def alive(address: PeerAddress) -> bool:
        return member._bootstrap.seed_alive(address)

    assert member.run(alive(keyed), 5) and member.run(alive(bare), 5)
    assert member.run(alive(keyed), 5)  # the second time through the peer it remembered
    assert member.run(alive(PeerAddress(parse_address(member.address).endpoint)), 5)  # its own address
    assert not member.run(alive(PeerAddress("tcp://127.0.0.1:9", keyed.curve_key[::-1])), 5)
    seed.close()
    assert wait_until(lambda: seed.peer_id not in member.live_peers(), 15)
    assert not member.run(alive(keyed), 5) and not member.run(alive(bare), 5)
