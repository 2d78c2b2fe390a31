"""Peer table and signed records: pure logic on an injected clock, no sockets."""
from __future__ import annotations

from dataclasses import replace

import pytest

from starling.node.have import Have
from starling.node.identity import Identity
from starling.node.membership import (
    LIVE_SHIFT,
    PeerRecord,
    PeerStatus,
    PeerTable,
    TableFull,
    TableLimits,
    finite_meta,
    live_incarnation,
    parse_beat,
    sign_beat,
)
from starling.node.swim import Liveness
from starling.node.wire import RejectReason, WireError


@pytest.fixture
def ids() -> list[Identity]:
    return [Identity.generate() for _ in range(3)]


def test_record_round_trip_and_signature(ids):
    rec = PeerRecord.create(ids[0], ["tcp://127.0.0.1:5000"], incarnation=7)
    assert rec.is_valid()
    back = PeerRecord.from_wire(rec.to_wire())
    assert back == rec


def test_relayed_record_with_altered_address_is_rejected(ids):
    rec = PeerRecord.create(ids[0], ["tcp://127.0.0.1:5000"], incarnation=7)
    forged = replace(rec, addresses=("tcp://10.6.6.6:5000",))
    with pytest.raises(WireError) as err:
        PeerRecord.from_wire(forged.to_wire())
    assert err.value.reason is RejectReason.BAD_SIGNATURE


def test_a_record_decoded_twice_is_one_shared_object(ids):
    """Every table in a process holds the same instance of a record (a simulation holds n^2
    references to n records); an unverifiable one is never handed out, a newer one is distinct."""
    import msgpack

    rec = PeerRecord.create(ids[0], ["tcp://127.0.0.1:5000"], incarnation=3)
    wire = msgpack.packb(rec.to_wire(), use_bin_type=True)
    first = PeerRecord.from_wire(msgpack.unpackb(wire, raw=False))
    again = PeerRecord.from_wire(msgpack.unpackb(wire, raw=False))
    assert again is first and again == rec
    newer = PeerRecord.from_wire(PeerRecord.create(ids[0], ["tcp://127.0.0.1:5000"], incarnation=4).to_wire())
    assert newer is not first and newer.incarnation == 4
    assert PeerRecord.from_wire(rec.to_wire(), verify=False) is first  # known and verified: shared
    forged = replace(rec, addresses=("tcp://10.6.6.6:5000",)).to_wire()
    unchecked = PeerRecord.from_wire(forged, verify=False)  # parsed, not checked: not shared
    assert PeerRecord.from_wire(forged, verify=False) is not unchecked
    with pytest.raises(WireError):
        PeerRecord.from_wire(forged)
    with pytest.raises(WireError):
        unchecked.verified()


def test_a_field_equal_to_a_shared_records_but_of_another_type_is_still_refused(ids):
    """A record the process verified is taken as its shared instance before any check; a wire
    record that only compares equal to it (1.0 == 1, 1 == True, a tuple of addresses) must not
    slip through that way."""
    rec = PeerRecord.create(ids[0], ["tcp://127.0.0.1:5000"], incarnation=1)
    shared = PeerRecord.from_wire(rec.to_wire())
    wire = rec.to_wire()
    assert PeerRecord.from_wire([*wire[:3], tuple(wire[3]), *wire[4:]]) is shared  # msgpack packs both as arrays
    for at, value in ((4, 1.0), (4, True), (6, 0)):
        odd = list(wire)
        odd[at] = value
        with pytest.raises(WireError) as err:
            PeerRecord.from_wire(odd)
        assert err.value.reason is RejectReason.BAD_FIELD, (at, value)
    with pytest.raises(WireError):  # an unhashable field is named by the checks, not a TypeError
        PeerRecord.from_wire([*wire[:3], [["tcp://127.0.0.1:5000"]], *wire[4:]])


def test_record_signed_by_another_key_is_rejected(ids):
    rec = PeerRecord.create(ids[0], ["tcp://127.0.0.1:5000"], incarnation=1)
    # an attacker re-signs the victim's id with its own key
    forged = replace(rec, signature=ids[1].sign(rec.signed_bytes()))
    with pytest.raises(WireError):
        PeerRecord.from_wire(forged.to_wire())


@pytest.mark.parametrize("raw", [None, [], [1, 2, 3, 4, 5, 6], ["x", b"a", b"b", [], 1, b"c"], "record"])
def test_malformed_records_raise_typed_errors(raw):
    with pytest.raises(WireError) as err:
        PeerRecord.from_wire(raw)
    assert err.value.reason is RejectReason.BAD_FIELD


def test_claims_make_a_peer_suspect_then_dead_and_a_newer_liveness_incarnation_refutes(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    rec = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 1)
    assert table.upsert(rec, now=0.0).new is PeerStatus.ALIVE
    assert ids[1].peer_id in table.live_ids
    held, change = table.claim(PeerStatus.SUSPECT, rec.peer_id, 1, 0)
    assert held and (change.old, change.new) == (PeerStatus.ALIVE, PeerStatus.SUSPECT)
    assert table.claim(PeerStatus.SUSPECT, rec.peer_id, 1, 0) == (False, None)  # a confirmation: the caller counts it
    assert table.seen(rec.peer_id, 1.0) is None  # a claimed suspicion waits for a refutation
    assert table.claim(PeerStatus.DEAD, rec.peer_id, 1, 0)[1].new is PeerStatus.DEAD
    assert ids[1].peer_id not in table.live_ids
    # a beat of the same liveness incarnation (a meta change) does not refute; a higher one does
    assert table.heartbeat(sign_beat(ids[1], 1, 5, {}), now=2.0) is None
    assert table.get(rec.peer_id).status is PeerStatus.DEAD
    assert table.heartbeat(sign_beat(ids[1], 1, (1 << LIVE_SHIFT) | 6, {}), now=3.0).new is PeerStatus.ALIVE
    assert live_incarnation(table.get(rec.peer_id).beat) == 1 and ids[1].peer_id in table.live_ids
    # a stale claim (about the liveness incarnation it refuted) no longer holds
    assert table.claim(PeerStatus.SUSPECT, rec.peer_id, 1, 0) == (False, None)
    assert table.claim(PeerStatus.DEAD, rec.peer_id, 0, 1) == (False, None)  # nor one about an older record
    assert table.live_at(rec.peer_id) == (1, 1)


def test_a_dropped_connection_is_suspicion_a_message_clears_and_a_dead_peer_that_talks_revives(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    rec = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 1)
    table.upsert(rec, now=0.0)
    assert table.suspect(rec.peer_id).new is PeerStatus.SUSPECT  # this node's own evidence, no claim
    assert table.seen(rec.peer_id, 1.0).new is PeerStatus.ALIVE
    table.suspect(rec.peer_id)
    assert table.declare_dead(rec.peer_id, silent_since=0.5) is None  # heard from at 1.0
    assert table.declare_dead(rec.peer_id, silent_since=1.5).new is PeerStatus.DEAD
    assert table.seen(rec.peer_id, 2.0).new is PeerStatus.ALIVE  # it talks to us: alive here
    table.suspect(rec.peer_id)  # suspect on our own evidence, then a member claims it: held, no new status
    assert table.claim(PeerStatus.SUSPECT, rec.peer_id, 1, 0) == (True, None)
    assert table.seen(rec.peer_id, 3.0) is None  # now only a refutation clears it


def test_leave_is_final_until_a_new_incarnation(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    rec = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 5)
    table.upsert(rec, 0.0)
    assert table.left(rec.peer_id, 5).new is PeerStatus.LEFT
    assert table.seen(rec.peer_id, 1.0) is None  # stale traffic cannot resurrect it
    assert table.upsert(rec, 1.0) is None  # nor can a relay of the old record
    assert table.live() == []
    newer = PeerRecord.create(ids[1], ["tcp://127.0.0.1:2"], 6)
    assert table.upsert(newer, 2.0).new is PeerStatus.ALIVE


def test_older_incarnation_does_not_replace_newer(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    new = PeerRecord.create(ids[1], ["tcp://127.0.0.1:2"], 9)
    old = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 3)
    table.upsert(new, 0.0)
    table.upsert(old, 1.0)
    assert table.get(new.peer_id).record == new


def test_own_record_is_ignored_and_forget_bounds_the_table(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    assert table.upsert(PeerRecord.create(ids[0], ["inproc://x"], 1), 0.0) is None
    table.upsert(PeerRecord.create(ids[1], ["inproc://y"], 1), 0.0)
    table.claim(PeerStatus.DEAD, ids[1].peer_id, 1, 0)
    assert table.forget(older_than_s=10.0, now=6.0) == []
    assert table.forget(older_than_s=10.0, now=20.0) == [ids[1].peer_id]
    assert table.all() == []


def test_liveness_validation():
    with pytest.raises(ValueError, match="probe_interval_s"):
        Liveness(probe_interval_s=0.0)
    with pytest.raises(ValueError, match="indirect_probes"):
        Liveness(indirect_probes=-1)
    with pytest.raises(ValueError, match="piggyback_bytes"):
        Liveness(piggyback_bytes=10)


def test_relayed_beats_refresh_only_when_newer(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    rec = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 4)
    table.upsert(rec, now=0.0)
    assert table.heartbeat(sign_beat(ids[1], 4, 7, {"round": 2}), now=2.0) is None  # news, still alive
    info = table.get(rec.peer_id)
    assert (info.beat, info.last_seen, info.meta) == (7, 2.0, {"round": 2})
    # a slow relay of an older beat, or one of another incarnation, refreshes nothing
    assert table.heartbeat(sign_beat(ids[1], 4, 7, {"round": 1}), now=2.5) is None
    assert table.heartbeat(sign_beat(ids[1], 3, 99, {}), now=2.5) is None
    assert (info.last_seen, info.meta) == (2.0, {"round": 2})
    table.suspect(rec.peer_id)
    assert table.heartbeat(sign_beat(ids[1], 4, 8, {}), now=5.5).new is PeerStatus.ALIVE
    assert info.signed_beat == sign_beat(ids[1], 4, 8, {})  # relayed exactly as signed
    # a restart (newer incarnation) counts its beats from zero again
    table.upsert(PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 5), now=6.0)
    assert table.get(rec.peer_id).beat == -1 and table.get(rec.peer_id).signed_beat is None
    table.left(rec.peer_id, 5)
    assert table.heartbeat(sign_beat(ids[1], 5, 1, {}), now=7.0) is None  # gone is gone


@pytest.mark.parametrize("forge", ["other key", "counter", "meta", "incarnation"])
def test_a_beat_not_signed_by_its_peer_is_refused_and_changes_nothing(ids, forge):
    table = PeerTable(ids[0].peer_id, Liveness())
    table.upsert(PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 4), now=0.0)
    table.heartbeat(sign_beat(ids[1], 4, 7, {"$via": "honest"}), now=1.0)
    table.claim(PeerStatus.SUSPECT, ids[1].peer_id, 4, 0)
    if forge == "other key":  # a member signs a beat for another peer with its own key
        entry = sign_beat(ids[2], 4, 10**12, {"$via": "attacker"})
        entry[0] = ids[1].peer_id
    else:
        entry = sign_beat(ids[1], 4, 8, {"$via": "honest"})
        if forge == "counter":
            entry[2] = 10**12
        elif forge == "meta":
            entry[3] = {"$via": "attacker"}
        else:
            entry[1], entry[2] = 4, 9  # a signature of another beat
            entry[4] = sign_beat(ids[1], 5, 9, {"$via": "honest"})[4]
    with pytest.raises(WireError) as err:
        table.heartbeat(parse_beat(entry), now=5.5)
    assert err.value.reason is RejectReason.BAD_SIGNATURE
    info = table.get(ids[1].peer_id)
    assert (info.status, info.beat, info.meta, info.last_seen) == (PeerStatus.SUSPECT, 7, {"$via": "honest"}, 1.0)


def test_is_news_tells_new_beats_from_old_and_unknown_peers(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    known = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 4)
    table.upsert(known, now=0.0)
    table.heartbeat(sign_beat(ids[1], 4, 10, {}), now=0.0)
    stranger = Identity.generate()
    assert table.is_news(sign_beat(ids[0], 1, 5, {})) is False  # our own
    assert table.is_news(sign_beat(ids[1], 4, 10, {})) is False
    assert table.is_news(sign_beat(ids[1], 4, 11, {})) is True
    assert table.is_news(sign_beat(stranger, 1, 0, {})) is None  # never heard of: ask for its record
    assert table.is_news(sign_beat(ids[1], 9, 0, {})) is None  # a newer incarnation than we hold
    assert table.get(known.peer_id).beat == 10  # asking applies nothing


SIG = bytes(64)


@pytest.mark.parametrize("body", [
    None, [], "beat", ["id", 1, 2, {}], ["", 1, 2, {}, SIG], ["x" * 65, 1, 2, {}, SIG],
    ["id", -1, 2, {}, SIG], ["id", 1, 2**63, {}, SIG], ["id", True, 2, {}, SIG], ["id", 1, 2.0, {}, SIG],
    ["id", 1, 2, [], SIG], ["id", 1, 2, {}, b"short"], ["id", 1, 2, {}, "sig"],
])
def test_malformed_beats_raise_typed_errors(body):
    with pytest.raises(WireError) as err:
        parse_beat(body)
    assert err.value.reason is RejectReason.BAD_FIELD


@pytest.mark.parametrize("meta", [[], {"x": float("nan")}, {1: 2}, {"x": [1]}, {f"k{i}": i for i in range(40)}])
def test_bad_heartbeat_meta_is_refused(meta):
    with pytest.raises(WireError):
        finite_meta(meta)


def test_a_member_vouches_for_at_most_its_share_of_the_table_even_once_its_peers_talk(ids):
    """A relayed record counts against its relayer for as long as it is held: throwaway
    identities that each send one message on their own connection do not free their relayer's
    share (else about 8,250 keys fill a node's 8192 slots), and neither do the peers they relay
    on in turn."""
    member = ids[1].peer_id
    table = PeerTable(ids[0].peer_id, Liveness(), TableLimits(max_peers=100, max_sponsored_per_member=3))
    keys = [Identity.generate() for _ in range(5)]
    made_up = [PeerRecord.create(key, ["tcp://127.0.0.1:1"], 1) for key in keys]
    for record in made_up[:3]:
        table.upsert(record, now=0.0, told_by=member)
    with pytest.raises(TableFull):
        table.upsert(made_up[3], now=0.0, told_by=member)
    assert made_up[3].peer_id not in table and table.sponsored(member) == 3
    table.heartbeat(sign_beat(keys[0], 1, 1, {}), now=1.0)  # a relayed beat
    table.seen(made_up[0].peer_id, now=1.0)  # heard on its own connection: still on the member's word
    assert table.sponsored(member) == 3 and table.get(made_up[0].peer_id).told_by is None
    with pytest.raises(TableFull):
        table.upsert(made_up[3], now=1.0, told_by=member)
    with pytest.raises(TableFull):  # relayed on by a peer the member brought: the member's share too
        table.upsert(made_up[4], now=1.0, told_by=made_up[0].peer_id)
    table.upsert(made_up[3], now=1.0)  # the peer itself greets us: nobody's share
    assert made_up[3].peer_id in table and table.sponsored(member) == 3


def test_a_full_table_of_one_addresses_greeters_takes_a_greeter_from_another_address(ids):
    """Keys that greet a node themselves count in the group of the address they came from: a
    full table gives up the newest of the biggest group, so a joiner from another address gets
    in, and one from the address that fills the table does not."""
    table = PeerTable(ids[0].peer_id, Liveness(), TableLimits(max_peers=4, max_sponsored_per_member=4))

    def greeter() -> PeerRecord:
        return PeerRecord.create(Identity.generate(), [], 1)

    sybils = [greeter() for _ in range(3)]
    for record in sybils:
        table.upsert(record, now=0.0, origin="ip:127.0.0.2")
    honest = greeter()
    table.upsert(honest, now=0.0, origin="ip:127.0.0.1")
    with pytest.raises(TableFull):  # full, and its own address holds the most
        table.upsert(greeter(), now=0.0, origin="ip:127.0.0.2")
    joiner = greeter()
    table.upsert(joiner, now=0.0, origin="ip:10.0.0.7")
    assert joiner.peer_id in table and honest.peer_id in table and len(table.all()) == 4
    assert table.evicted == [sybils[2].peer_id]  # the newest of the biggest group
    # a relayed record is in nobody's address group: the origin is for greeters only
    relayed = PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:1"], 1)
    table.upsert(relayed, now=0.0, told_by=honest.peer_id, origin="ip:127.0.0.2")
    assert table.get(relayed.peer_id).origin is None and table.get(relayed.peer_id).sponsor == honest.peer_id


def test_a_full_table_drops_the_dead_then_the_biggest_sponsors_newest_records(ids):
    table = PeerTable(ids[0].peer_id, Liveness(), TableLimits(max_peers=4, max_sponsored_per_member=4))
    flooder, honest = ids[1].peer_id, ids[2].peer_id
    heard = PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:1"], 1)
    table.upsert(heard, now=0.0)  # first-hand
    fakes = [PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:1"], 1) for _ in range(3)]
    for record in fakes:
        table.upsert(record, now=0.0, told_by=flooder)
    # full: a record the flooder relays is refused, one another member relays takes a flooder's place
    with pytest.raises(TableFull):
        table.upsert(PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:1"], 1), now=0.0, told_by=flooder)
    other = PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:1"], 1)
    table.upsert(other, now=0.0, told_by=honest)
    assert other.peer_id in table and heard.peer_id in table and table.sponsored(flooder) == 2
    assert fakes[2].peer_id not in table  # its newest went: the oldest are the established
    assert table.evicted == [fakes[2].peer_id]
    # a dead entry goes before anyone's record
    table.seen(heard.peer_id, now=0.0)
    for info in table.all():  # all claimed dead
        table.claim(PeerStatus.DEAD, info.peer_id, info.record.incarnation, 0)
    table.seen(other.peer_id, now=10.0)
    newcomer = PeerRecord.create(Identity.generate(), ["tcp://127.0.0.1:1"], 1)
    table.upsert(newcomer, now=10.0)
    assert newcomer.peer_id in table and other.peer_id in table and len(table.all()) == 4



def test_a_forgotten_death_leaves_a_tombstone_that_brings_the_dead_entry_back_for_a_relayed_record(ids):
    table = PeerTable(ids[0].peer_id, Liveness(), TableLimits(max_peers=4, max_sponsored_per_member=4))
    rec = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 3)
    table.upsert(rec, 0.0)
    table.heartbeat(parse_beat(sign_beat(ids[1], 3, 5 << LIVE_SHIFT, {})), 0.0)
    proof = object()  # the signed death claim, as the caller checked it
    held, change = table.claim(PeerStatus.DEAD, rec.peer_id, 3, 6, proof=proof)
    assert held and change.new is PeerStatus.DEAD
    assert table.get(rec.peer_id).proof is proof
    assert table.proofs(Have.of([rec.peer_id])) == [proof]
    assert table.proofs(Have.of(["zzzzzz"])) == []
    assert table.forget(10.0, now=20.0, tombstones_s=100.0) == [rec.peer_id]
    assert rec.peer_id not in table and table.proofs(Have.of([rec.peer_id])) == [proof]

    # a member that missed the death relays the record: the dead entry comes back, as it was
    assert table.upsert(rec, 30.0, told_by=ids[2].peer_id) is None
    assert table.restored(rec.peer_id, None)
    info = table.get(rec.peer_id)
    assert (info.status, info.proof, info.claim_at, info.beat) == (PeerStatus.DEAD, proof, 6, 5 << LIVE_SHIFT)
    assert table.live() == [] and rec.peer_id not in table.tombstones
    older = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 2)
    assert table.forget(10.0, now=50.0, tombstones_s=100.0) == [rec.peer_id]
    assert table.upsert(older, 51.0, told_by=ids[2].peer_id) is None and rec.peer_id not in table
    # a beat of a later liveness incarnation (its refutation) revives the restored entry
    assert table.upsert(rec, 52.0, told_by=ids[2].peer_id) is None
    assert table.heartbeat(parse_beat(sign_beat(ids[1], 3, 7 << LIVE_SHIFT, {})), 53.0).new is PeerStatus.ALIVE
    assert table.get(rec.peer_id).proof is None and table.proofs(Have.of([rec.peer_id])) == []


def test_a_tombstone_gives_way_to_the_peer_itself_or_a_new_life_and_expires(ids):
    table = PeerTable(ids[0].peer_id, Liveness())
    rec = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 3)
    table.upsert(rec, 0.0)
    table.claim(PeerStatus.DEAD, rec.peer_id, 3, 0, proof="claim")
    table.forget(10.0, now=20.0, tombstones_s=100.0)
    assert table.upsert(rec, 21.0).new is PeerStatus.ALIVE  # the dead peer greets us itself
    assert rec.peer_id not in table.tombstones
    table.claim(PeerStatus.DEAD, rec.peer_id, 3, 0, proof="claim")
    table.forget(10.0, now=40.0, tombstones_s=100.0)
    newer = PeerRecord.create(ids[1], ["tcp://127.0.0.1:2"], 4)
    assert table.upsert(newer, 41.0, told_by=ids[2].peer_id).new is PeerStatus.ALIVE  # it restarted
    table.claim(PeerStatus.DEAD, rec.peer_id, 4, 0, proof="claim")
    table.forget(10.0, now=60.0, tombstones_s=100.0)
    assert table.forget(10.0, now=159.0, tombstones_s=100.0) == [] and rec.peer_id in table.tombstones
    table.forget(10.0, now=161.0, tombstones_s=100.0)
    assert table.tombstones == {}
    assert table.upsert(newer, 162.0, told_by=ids[2].peer_id).new is PeerStatus.ALIVE  # long forgotten


def test_a_departed_peer_stays_gone_past_its_entry_and_tombstones_are_bounded(ids):
    table = PeerTable(ids[0].peer_id, Liveness(), TableLimits(max_peers=2, max_sponsored_per_member=2))
    rec = PeerRecord.create(ids[1], ["tcp://127.0.0.1:1"], 5)
    table.upsert(rec, 0.0)
    assert table.left(rec.peer_id, 5, proof="leave").new is PeerStatus.LEFT
    table.forget(10.0, now=20.0, tombstones_s=100.0)
    assert table.upsert(rec, 21.0) is None  # its own old record, even first-hand: a leave is final
    assert table.get(rec.peer_id).status is PeerStatus.LEFT and table.live() == []
    others = [Identity.generate() for _ in range(3)]
    for i, other in enumerate(others):
        r = PeerRecord.create(other, ["tcp://127.0.0.1:3"], 1)
        table.upsert(r, 30.0 + i)
        table.claim(PeerStatus.DEAD, r.peer_id, 1, 0, proof=i)
        table.forget(0.0, now=31.0 + i, tombstones_s=100.0)
    assert len(table.tombstones) == 2  # the oldest went
    assert [t.proof for t in table.tombstones.values()] == [1, 2]


def test_a_records_wire_form_is_made_once_packs_as_to_wire_and_cannot_change():
    import msgpack

    record = PeerRecord.create(Identity.generate(), ["tcp://10.0.0.1:5555"], 3, relay=True)
    packed = msgpack.packb(record.to_wire(), use_bin_type=True)
    assert record.wire is record.wire and isinstance(record.wire, tuple)
    assert msgpack.packb(record.wire, use_bin_type=True) == packed and record.wire_bytes == len(packed)
    assert PeerRecord.from_wire(msgpack.unpackb(packed)) == record
    assert replace(record, incarnation=4).wire[4] == 4  # a new record makes its own


def test_a_records_curve_key_is_encoded_once_as_curve_names_a_connections_key():
    from zmq.utils import z85

    identity = Identity.generate()
    record = PeerRecord.create(identity, ["tcp://10.0.0.1:5555"], 1)
    assert record.curve_z85 == z85.encode(identity.curve_public).decode()
    assert record.curve_z85 is record.curve_z85


def test_the_table_knows_which_of_its_peers_give_no_address_as_records_come_and_go(ids):
    """Past the socket cap a member probes its fingers, worked out over every live peer but the
    ones with no address it cannot reach: the table names those, so nothing walks it to find them."""
    table = PeerTable(ids[0].peer_id, Liveness())
    client = PeerRecord.create(ids[1], [], 1)
    server = PeerRecord.create(ids[2], ["tcp://127.0.0.1:1"], 1)
    table.upsert(client, now=0.0)
    table.upsert(server, now=0.0)
    assert set(table.unaddressed) == {ids[1].peer_id}
    table.upsert(PeerRecord.create(ids[1], ["tcp://127.0.0.1:2"], 2), now=1.0)  # it listens now
    assert table.unaddressed == {}
    table.upsert(PeerRecord.create(ids[2], [], 2), now=1.0)  # and this one stopped listening
    assert set(table.unaddressed) == {ids[2].peer_id}
    table.suspect(ids[2].peer_id)
    table.declare_dead(ids[2].peer_id, silent_since=5.0)
    assert table.forget(older_than_s=1.0, now=10.0) == [ids[2].peer_id]
    assert table.unaddressed == {}
