"""What a reducer leaves off the wire (collectives/compact.py): packet headers both ends can
rebuild, and contributor lists as bitmasks over the round's members."""
from __future__ import annotations

import pytest
import torch
from conftest import in_parallel, swarm, wait_until

from starling.collectives import ShardedReducer
from starling.collectives.compact import HeaderTemplates, contributor_mask, contributors_of, view_digest
from starling.compressors import from_spec
from starling.node import Refusal, refusal_of

SPARSE = "chunktopk:64/4096+q2"


@pytest.mark.parametrize("spec", ["none", "int4", "sign:block=64", SPARSE, "powersgd:2"])
def test_a_header_that_depends_only_on_the_length_is_left_out_and_rebuilt(spec: str) -> None:
    codec, templates = from_spec(spec), HeaderTemplates(from_spec(spec))
    for numel in (6912, 4097, 3):
        header = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(numel))).header
        assert templates.outgoing(header, numel) is None
        assert HeaderTemplates(from_spec(spec)).incoming(None, numel) == header  # the receiver's own
        assert templates.outgoing(header, numel + 1) == header  # another length: another template


def test_a_seeded_codec_has_no_template_and_its_headers_travel_whole() -> None:
    codec = from_spec("randomk:0.01")
    templates = HeaderTemplates(codec)
    header = codec.encode(torch.randn(5000)).header
    assert templates.template(5000) is None and templates.outgoing(header, 5000) == header
    with pytest.raises(ValueError, match="no header template"):
        templates.incoming(None, 5000)


@pytest.mark.parametrize("n", [1, 4, 8, 9, 17, 1024])
def test_contributor_masks_round_trip(n: int) -> None:
    members = tuple(f"peer{k:04d}" for k in range(n))
    some = members[::3]
    mask = contributor_mask(members, some)
    assert len(mask) == (n + 7) // 8
    assert contributors_of(members, mask) == some
    assert contributors_of(members, contributor_mask(members, members)) == members


@pytest.mark.parametrize("mask", [b"", b"\x01\x00", b"\x10", None, [1], "\x01"])
def test_a_mask_that_does_not_fit_the_members_is_refused(mask: object) -> None:
    members = ("a", "b", "c")  # one byte, bits 3..7 unused
    with pytest.raises(ValueError, match="contributor mask"):
        contributors_of(members, mask)


def _round_bytes(nodes, topic: str) -> int:
    members = tuple(sorted(n.peer_id for n in nodes))
    numel = len(nodes) * 6912
    reducers = [ShardedReducer(n, topic, numel, SPARSE) for n in nodes]
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(len(nodes))]
    results = in_parallel([lambda r=r: reducers[r].reduce(0, members, vectors[r]) for r in range(len(nodes))])
    assert all(r.synced and r.peers == len(nodes) for r in results)
    assert all(torch.equal(v, vectors[0]) for v in vectors[1:])  # bit-identical averages either way
    return sum(n.stats.total_sent(topic) for n in nodes)


def test_a_round_leaves_the_packet_headers_off_the_wire(make_node, monkeypatch) -> None:
    """Three real nodes average a sparse vector: 12 messages (each peer's 2 parts and 2
    averages). With templates each goes without its ~100-byte packet header; the payloads
    are the same, so the round is at least 12 x 90 bytes smaller."""
    nodes = swarm(make_node, 3)
    compact = _round_bytes(nodes, "test.compact")
    monkeypatch.setattr(HeaderTemplates, "template", lambda self, numel: None)
    whole = _round_bytes(nodes, "test.whole")
    assert whole - compact >= 12 * 90, (whole, compact)


def test_an_owner_refuses_a_left_out_header_it_cannot_rebuild(make_node) -> None:
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    spec = "randomk:0.25"
    ra, rb = (ShardedReducer(n, "test.notemplate", 40, spec) for n in (a, b))
    owner, other = (a, b) if members[0] == a.peer_id else (b, a)
    packet = from_spec(spec).encode(torch.arange(1.0, 21.0))
    body = {"step": 0, "shard": 0, "chunk": 0, "members": list(members), "packet": None}
    reply = other.request(owner.peer_id, "test.notemplate", body, [bytes(x.numpy()) for x in packet.buffers]).body
    assert refusal_of(reply) is Refusal.BAD_PART and "no header template" in reply["reason"]
    assert owner.stats.rejected["test.notemplate.bad_part"] == 1
    va, vb = torch.arange(40.0), torch.arange(40.0)  # and round 0 still runs with both real parts
    results = in_parallel([lambda: ra.reduce(0, members, va), lambda: rb.reduce(0, members, vb)])
    assert all(r.synced and r.peers == 2 for r in results)
    assert torch.equal(va, vb)


def test_an_owner_asks_for_a_member_list_it_does_not_know_and_refuses_what_is_no_digest(make_node) -> None:
    a, b, c = swarm(make_node, 3)
    subset = tuple(sorted((a.peer_id, b.peer_id)))  # not the owner's view of 3, and never used here
    ra, rb = (ShardedReducer(n, "test.views", 40) for n in (a, b))
    owner, other = (a, b) if subset[0] == a.peer_id else (b, a)
    body = {"step": 0, "shard": 0, "chunk": 0, "view": view_digest(subset), "packet": None}
    reply = other.request(owner.peer_id, "test.views", body, [bytes(20 * 4)]).body
    assert refusal_of(reply) is Refusal.UNKNOWN_VIEW and "send it whole" in reply["reason"]
    assert not owner.stats.rejected  # not bad input: views change
    reply = other.request(owner.peer_id, "test.views", {**body, "view": b"short"}, [bytes(20 * 4)]).body
    assert refusal_of(reply) is Refusal.MALFORMED and owner.stats.rejected["test.views.malformed"] == 1
    va, vb = torch.arange(40.0), torch.arange(40.0) + 1  # nothing changed: the round runs on both parts
    results = in_parallel([lambda: ra.reduce(0, subset, va), lambda: rb.reduce(0, subset, vb)])
    assert all(r.synced and r.peers == 2 for r in results) and torch.equal(va, vb)


def test_a_part_whose_view_the_owner_never_saw_goes_again_with_the_whole_list(make_node) -> None:
    """The sender names a 2-member list the owner (in a swarm of 3) has not used: the owner
    answers unknown_view, the part goes again with the list, opens the owner's group, and the
    round ends with both peers' parts averaged."""
    a, b, c = swarm(make_node, 3)
    subset = tuple(sorted((a.peer_id, b.peer_id)))
    reducers = {n.peer_id: ShardedReducer(n, "test.retry", 40) for n in (a, b)}
    owner_id, other_id = subset[0], subset[1]
    v_owner, v_other = torch.zeros(40), torch.full((40,), 2.0)
    pending = reducers[other_id].start(0, subset, v_other)
    # the owner's group for shard 0 opens only from the sender's full list (its digest was unknown)
    assert wait_until(lambda: bool(reducers[owner_id]._groups), timeout_s=20)
    done = reducers[owner_id].start(0, subset, v_owner).wait()
    other_done = pending.wait()
    assert done.synced and other_done.synced and done.peers == other_done.peers == 2
    assert torch.equal(v_owner, v_other) and torch.equal(v_owner, torch.ones(40))


def test_known_views_stay_bounded_in_lists_and_in_member_ids() -> None:
    """A member may send long member lists; what an owner remembers of them stays bounded, and
    the newest list is always there."""
    from starling.collectives import compact

    views = compact.KnownViews()
    lists = [tuple(f"{k:05d}{j:011d}" for j in range(4)) for k in range(compact._VIEWS_KEPT + 10)]
    for members in lists:
        views.add(members)
    assert len(views._lists) == compact._VIEWS_KEPT
    assert views.resolve(view_digest(lists[0]), lambda: ()) is None  # the oldest went first
    assert views.resolve(view_digest(lists[-1]), lambda: ()) == lists[-1]
    long = tuple(f"{j:016d}" for j in range(compact._VIEW_IDS_KEPT // 2 + 1))
    views.add(long)
    views.add(tuple(reversed(long)))  # another list of as many ids: the first long one goes
    assert views._ids <= compact._VIEW_IDS_KEPT
    assert views.resolve(view_digest(long), lambda: ()) is None
    assert views.resolve(view_digest(tuple(reversed(long))), lambda: ()) == tuple(reversed(long))


def test_a_statement_packs_its_fields_in_canonical_form_flat_lists_as_they_are() -> None:
    """What members sign and check: maps with sorted keys, at any depth, and lists of ids
    (taken as they are, in one pass) packed as the same arrays as lists built item by item."""
    import msgpack

    from starling.node.trust import _DOMAIN, statement

    ids = tuple(f"peer{k:04d}" for k in range(1024))
    nested = [1, {"b": [1, 2.5], "a": (3, "x", None, True, b"\x00")}]
    expected = msgpack.packb([_DOMAIN, "avg", list(ids), [1, [["a", [3, "x", None, True, b"\x00"]], ["b", [1, 2.5]]]],
                              [[["k", "v"]]]], use_bin_type=True)
    assert statement("avg", ids, nested, [{"k": "v"}]) == expected
    assert statement("avg", list(ids), nested, [{"k": "v"}]) == expected


def test_a_rounds_view_is_the_sorted_live_peers_with_this_node_in_its_place() -> None:
    from types import SimpleNamespace

    from starling.collectives.events import membership

    live = ["b", "d", "f"]
    for me, view in (("a", "abdf"), ("c", "bcdf"), ("g", "bdfg"), ("d", "bdf")):
        node = SimpleNamespace(peer_id=me, live_peers=lambda: list(live))
        assert membership(node) == tuple(view), me
    assert membership(SimpleNamespace(peer_id="a", live_peers=list)) == ("a",)
