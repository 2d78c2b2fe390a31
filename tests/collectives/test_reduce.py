"""The sharded all-reduce: exact means, parts lent or copied, weights and shares, failures and
stalls of an owner, and the refusals of bad parts, each with its code and counted."""
from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import in_parallel, swarm, wait_until

from starling.collectives import ReduceTimeouts, ShardedReducer
from starling.collectives.accumulator import ShardGroup as _ShardGroup
from starling.node import Refusal, refusal_of


def part(t: int, members: tuple[str, ...], shard: int = 0) -> dict:
    return {"step": t, "shard": shard, "chunk": 0, "members": list(members), "packet": {}}

@pytest.mark.parametrize("compressor", ["none", "fp16"])
def test_chunked_rounds_give_the_exact_mean_and_identical_replicas(make_node, compressor):
    world, numel = 3, 50
    nodes = swarm(make_node, world)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.reduce", numel, compressor, chunk_numel=7) for n in nodes]
    vectors = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    mean = torch.stack(vectors).mean(0)
    results = in_parallel([lambda r=r: reducers[r].reduce(1, members, vectors[r]) for r in range(world)])
    assert all(res.synced and res.peers == world and not res.lost for res in results)
    tol = 0 if compressor == "none" else 2e-3
    torch.testing.assert_close(vectors[0], mean, rtol=tol, atol=tol + 1e-6)
    assert all(torch.equal(v, vectors[0]) for v in vectors[1:])

def test_a_blocking_reduce_sends_the_vector_in_place_and_start_sends_copies(make_node, monkeypatch):
    """reduce() lends its vector to the round (no copy of the parts with the lossless codec);
    start() copies, so that the caller may write the vector while the round runs."""
    import starling.collectives.reduce as reduce_module

    encoded = []
    real_encode = reduce_module.encode
    monkeypatch.setattr(reduce_module, "encode", lambda *a, **k: encoded.append(a[3]) or real_encode(*a, **k))
    a, b = swarm(make_node, 2)
    members = tuple(sorted(n.peer_id for n in (a, b)))
    ra, rb = (ShardedReducer(n, "test.lend", 20, chunk_numel=4) for n in (a, b))
    va, vb = torch.arange(20.0), torch.arange(20.0) * 3
    mean = (va + vb) / 2
    in_parallel([lambda: ra.reduce(1, members, va), lambda: rb.reduce(1, members, vb)])
    assert encoded == [] and torch.equal(va, mean) and torch.equal(vb, mean)

    va, vb = torch.arange(20.0), torch.arange(20.0) * 3
    pending = [ra.start(2, members, va), rb.start(2, members, vb)]
    assert len(encoded) == 2 * 3  # each peer's 3 chunks of the shard it does not own
    va.fill_(float("nan")), vb.fill_(float("nan"))  # the round has its own copies
    results = [p.wait() for p in pending]
    assert all(r.synced and r.peers == 2 for r in results)
    assert torch.equal(va, mean) and torch.equal(vb, mean)

def test_a_strided_vector_is_averaged_and_a_wrong_shape_is_refused(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted(n.peer_id for n in (a, b)))
    ra, rb = (ShardedReducer(n, "test.shape", 6, chunk_numel=2) for n in (a, b))
    with pytest.raises(ValueError, match="1-D float32 vector of 6 values"):
        ra.reduce(1, members, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1-D float32 vector of 6 values"):
        ra.reduce(1, members, torch.zeros(6, dtype=torch.float64))
    base_a, base_b = torch.arange(12.0), torch.arange(12.0) * 3
    va, vb = base_a[::2], base_b[::2]  # every other value: not contiguous, so not lent
    in_parallel([lambda: ra.reduce(1, members, va), lambda: rb.reduce(1, members, vb)])
    assert torch.equal(va, torch.arange(0.0, 12.0, 2) * 2) and torch.equal(vb, va)
    assert torch.equal(base_a[1::2], torch.arange(1.0, 12.0, 2))  # the values between are untouched

def test_weights_follow_tokens_and_shares_sum_to_one(make_node):
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.w", 6) for n in nodes]
    vectors = [torch.full((6,), float(r + 1)) for r in range(3)]
    tokens = [10.0, 30.0, 60.0]
    results = in_parallel([lambda r=r: _reduce_weighted(reducers[r], members, vectors[r], tokens[r])
                           for r in range(3)])
    expected = sum(v * w for v, w in zip(vectors, tokens)) / sum(tokens)
    ids = [n.peer_id for n in nodes]
    for average, result in results:
        torch.testing.assert_close(average, expected)
        shares = dict(result.shares)
        assert math.isclose(sum(shares.values()), 1.0, rel_tol=0, abs_tol=1e-12)
        assert [round(shares[i], 12) for i in ids] == [round(w / sum(tokens), 12) for w in tokens]
    assert all(torch.equal(results[0][0], a) for a, _ in results)  # one average for everyone

    # equal weights: the plain average, bit for bit, and no shares on the wire
    plain = in_parallel([lambda r=r: _reduce_weighted(reducers[r], members, vectors[r], None, t=1) for r in range(3)])
    equal = in_parallel([lambda r=r: _reduce_weighted(reducers[r], members, vectors[r], 7.0, t=2) for r in range(3)])
    for (p, _), (e, result) in zip(plain, equal):
        assert torch.equal(p, e) and result.shares == ()

def _reduce_weighted(reducer, members, vector, weight, t=0):
    average = vector.clone()
    result = reducer.start(t, members, average, weight=weight).wait()
    return average, result

def test_a_peer_left_out_of_one_chunk_is_lost_but_not_absent(make_node):
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.part", 9, chunk_numel=2) for n in nodes]
    vectors = [torch.full((9,), 1.0), torch.full((9,), 3.0), torch.full((9,), 5.0)]
    vectors[2][0] = float("nan")  # one chunk of the third peer is refused; the rest of it counts
    results = in_parallel([lambda r=r: reducers[r].reduce(1, members, vectors[r]) for r in range(3)])
    assert results[0].lost == results[1].lost == (nodes[2].peer_id,)
    assert results[0].absent == results[1].absent == ()


def test_a_peer_with_non_finite_values_is_left_out_and_counted(make_node):
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    reducers = [ShardedReducer(n, "test.nan", 9, chunk_numel=2) for n in nodes]
    vectors = [torch.full((9,), 1.0), torch.full((9,), 3.0), torch.full((9,), 5.0)]
    vectors[2][1:] = float("nan")  # a NaN in every chunk of the third peer (chunks of 1 or 2 values)
    results = in_parallel([lambda r=r: reducers[r].reduce(1, members, vectors[r]) for r in range(3)])
    assert torch.equal(vectors[0], torch.full((9,), 2.0)) and torch.equal(vectors[1], vectors[0])
    assert results[0].lost == results[1].lost == (nodes[2].peer_id,)
    assert results[0].absent == results[1].absent == (nodes[2].peer_id,)  # nothing of it counted anywhere
    # the third peer's chunks were refused everywhere, by itself as owner too: it keeps its values
    assert not results[2].synced and torch.isnan(vectors[2][1:]).all()
    rejected = sum(n.stats.rejected.get("test.nan.not_finite", 0) for n in nodes)
    assert rejected >= 3  # each owner refused the NaN peer's chunks, and counted them

@pytest.mark.parametrize("values", ["nan", "finite"])
def test_a_late_part_gets_its_groups_average_only_when_it_is_finite(make_node, values):
    """Parts that come after their groups closed get the average the group's contributors
    got, as its signed answer, unless they are not finite: a member whose values went bad
    takes no average, on time or late. (Late is common for such a member: once an average of
    its own chunk comes back without it, its other owners stop waiting for it.)"""
    nodes = swarm(make_node, 3)
    members = tuple(sorted(n.peer_id for n in nodes))
    timeouts = ReduceTimeouts(round_timeout_s=1.0, reply_grace_s=1.0)
    reducers = [ShardedReducer(n, "test.late", 9, chunk_numel=2, timeouts=timeouts) for n in nodes]
    vectors = [torch.full((9,), 1.0), torch.full((9,), 3.0), torch.full((9,), 5.0)]
    if values == "nan":
        vectors[2][1:] = float("nan")
    on_time = in_parallel([lambda r=r: reducers[r].reduce(1, members, vectors[r]) for r in range(2)])
    assert all(r.lost == (nodes[2].peer_id,) for r in on_time)  # every group closed without the third
    assert torch.equal(vectors[0], torch.full((9,), 2.0)) and torch.equal(vectors[1], vectors[0])
    late = reducers[2].reduce(1, members, vectors[2])
    not_finite = sum(n.stats.rejected.get("test.late.not_finite", 0) for n in nodes)
    if values == "nan":
        assert not late.synced and torch.isnan(vectors[2][1:]).all() and vectors[2][0] == 5.0
        assert not_finite >= 3  # each owner refused it, the third one itself too
    else:
        assert late.synced and torch.equal(vectors[2], vectors[0]) and not_finite == 0


def test_an_owner_that_fails_to_average_answers_at_once(make_node, monkeypatch):
    """A failure while averaging a chunk refuses that chunk to every contributor; nothing
    waits for the round timeout (30 s here)."""
    def broken(self):
        raise RuntimeError("no memory for the sum")

    monkeypatch.setattr(_ShardGroup, "sum", broken)
    a, b = swarm(make_node, 2)
    members = tuple(sorted(n.peer_id for n in (a, b)))
    ra, rb = (ShardedReducer(n, "test.broken", 8) for n in (a, b))
    va, vb = torch.ones(8), torch.full((8,), 3.0)
    start = time.monotonic()
    results = in_parallel([lambda: ra.reduce(1, members, va), lambda: rb.reduce(1, members, vb)])
    assert time.monotonic() - start < 10
    assert all(not r.synced and r.lost for r in results)
    assert torch.equal(va, torch.ones(8)) and torch.equal(vb, torch.full((8,), 3.0))  # local values kept

@pytest.mark.timeout(60)
def test_a_stall_of_the_network_thread_does_not_close_a_round_without_its_parts(make_node):
    """The round's timers count the loop's awake time: when the process stalls past the round
    timeout, the parts that arrived meanwhile are read before anyone gives up on them."""
    timeout_s, stall_s = 2.0, 4.0  # the stall is twice the timeout, within its wall bound (3x)
    a, b = swarm(make_node, 2)
    members = tuple(sorted(n.peer_id for n in (a, b)))
    timeouts = ReduceTimeouts(round_timeout_s=timeout_s, reply_grace_s=1.0)
    ra, rb = (ShardedReducer(n, "test.stall", 10, timeouts=timeouts) for n in (a, b))
    va, vb = torch.arange(10.0), torch.arange(10.0) * 3
    mean = (va + vb) / 2
    pending_a = ra.start(1, members, va)
    # a's own shard is open, and so is b's (a's part reached it): both timers run
    assert wait_until(lambda: len(ra._groups) == 1 and len(rb._groups) == 1)

    async def stall() -> None:
        time.sleep(stall_s)  # blocks the network thread that both nodes share

    stalled = a.submit(stall())
    pending_b = rb.start(1, members, vb)  # b's round is queued behind the stall
    results = [pending_a.wait(), pending_b.wait()]
    stalled.result(timeout=1)
    assert all(r.synced and r.peers == 2 and not r.lost for r in results), results
    assert torch.equal(va, mean) and torch.equal(vb, mean)

def test_a_reducer_refuses_malformed_misrouted_and_late_parts_with_their_codes(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    ra, rb = ShardedReducer(a, "test.codes", 4), ShardedReducer(b, "test.codes", 4)
    owner, other = (a, b) if members[0] == a.peer_id else (b, a)

    reply = other.request(owner.peer_id, "test.codes", {"step": "x"}).body
    assert refusal_of(reply) is Refusal.MALFORMED and reply["reason"].startswith("malformed: ")
    reply = other.request(owner.peer_id, "test.codes", part(1, members, shard=1)).body
    assert refusal_of(reply) is Refusal.NOT_OWNER
    assert owner.stats.rejected["test.codes.malformed"] == 1 and owner.stats.rejected["test.codes.not_owner"] == 1

    in_parallel([lambda: ra.reduce(2, members, torch.ones(4)), lambda: rb.reduce(2, members, torch.ones(4))])
    reply = other.request(owner.peer_id, "test.codes", part(1, members)).body
    assert refusal_of(reply) is Refusal.LATE and reply["step"] == 2  # the owner's round rides along

def test_a_closed_reducer_refuses_as_closed(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    owner, other = (a, b) if members[0] == a.peer_id else (b, a)
    ShardedReducer(owner, "test.closed", 4, is_open=lambda: False)
    reply = other.request(owner.peer_id, "test.closed", part(1, members)).body
    assert reply["ok"] is False and refusal_of(reply) is Refusal.CLOSED

def test_a_part_with_a_nan_or_negative_weight_is_refused_counted_and_changes_nothing(make_node):
    a, b = swarm(make_node, 2)
    members = tuple(sorted((a.peer_id, b.peer_id)))
    owner, other = (a, b) if members[0] == a.peer_id else (b, a)
    reducer = ShardedReducer(owner, "test.bad", 4)
    for weight in (float("nan"), -1.0, "heavy"):
        body = {"step": 0, "shard": 0, "chunk": 0, "members": list(members), "packet": {}, "weight": weight}
        reply = other.request(owner.peer_id, "test.bad", body).body
        assert refusal_of(reply) is Refusal.MALFORMED and "weight" in reply["reason"]
    assert owner.stats.rejected["test.bad.malformed"] == 3
    assert not reducer._groups and not reducer._closed
    with pytest.raises(ValueError, match="weight"):
        ShardedReducer(other, "test.bad", 4).start(0, members, torch.ones(4), weight=float("inf"))
