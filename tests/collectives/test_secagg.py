"""Secure aggregation's arithmetic: masks that cancel in the owner's sum, parts that look
random alone, dropouts recovered with t surviving neighbours and refused with t - 1, and
tampered shares or wrong seeds caught."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from starling.collectives.secagg import (
    PRIME,
    IntegerCodec,
    MaskingMember,
    SecAggError,
    Share,
    Unmasker,
    combine_shares,
    graph_degree,
    neighbours,
    record_verifier,
    split_secret,
)
from starling.node.identity import Identity

ROUND = b"round-7/shard-0"


def swarm(n: int, degree: int, threshold: int, seed: int = 0, before_deal=None):
    """n members with real identities and seeded secrets; their adverts dealt and shares held."""
    rng = random.Random(seed)
    ids = {f"m{i:02d}": Identity.generate() for i in range(n)}
    verify = record_verifier({m: ident.verify_key for m, ident in ids.items()})
    members = {m: MaskingMember(m, tuple(ids), ROUND, threshold, degree, ident.sign,
                                random_bytes=lambda k, rng=rng: rng.randbytes(k)) for m, ident in ids.items()}
    if before_deal is not None:
        before_deal(members)
    for member in members.values():
        for share in member.deal():
            members[share.holder].hold(share, verify)
    adverts = {m: member.advert for m, member in members.items()}
    return members, adverts, verify


def parts(n: int, size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"m{i:02d}": torch.randn(size, generator=g) for i in range(n)}


def run_round(members, adverts, verify, xs, codec, sending, size, degree, threshold):
    owner = Unmasker(tuple(members), ROUND, threshold, degree, size)
    for m in sending:
        owner.receive(m, members[m].mask(codec.encode(xs[m]), adverts, verify))
    revealed = [s for m in owner.survivors() for s in members[m].reveal(owner.survivors())]
    return owner, owner.unmask(adverts, revealed, verify)


@pytest.mark.parametrize("codec", [IntegerCodec(), IntegerCodec(scale=256.0, clip=4.0, bits=16),
                                   IntegerCodec(scale=2.0, clip=3.0, bits=8)], ids=["32", "16", "8"])
def test_the_masked_sum_is_the_plain_sum_of_the_integer_parts(codec):
    n, size, degree, threshold = 10, 1000, 6, 3
    members, adverts, verify = swarm(n, degree, threshold)
    xs = parts(n, size)
    owner = Unmasker(tuple(members), ROUND, threshold, degree, size, bits=codec.bits)
    for m in members:
        owner.receive(m, members[m].mask(codec.encode(xs[m]), adverts, verify))
    total = owner.unmask(adverts, [s for m in owner.survivors() for s in members[m].reveal(owner.survivors())],
                         verify)
    assert total.dtype == codec.dtype and total.nbytes == size * codec.bits // 8
    plain = np.zeros(size, dtype=codec.dtype)
    for x in xs.values():
        plain = (plain + codec.encode(x)).astype(codec.dtype)
    assert np.array_equal(total, plain)
    assert codec.capacity() >= n  # the sum does not wrap: decoding gives the clipped, rounded sum
    clipped = sum(x.clamp(-codec.clip, codec.clip) for x in xs.values())
    assert torch.allclose(codec.decode_sum(total, n), clipped, atol=codec.max_error(n) + 1e-6)


def test_one_masked_part_alone_is_uniform_bytes():
    n, size, degree, threshold = 6, 1 << 18, 4, 2
    members, adverts, verify = swarm(n, degree, threshold, seed=3)
    zero = IntegerCodec().encode(torch.zeros(size))  # the most structured part there is
    masked = members["m00"].mask(zero, adverts, verify)
    counts = np.bincount(np.frombuffer(masked.tobytes(), dtype=np.uint8), minlength=256)
    expected = counts.sum() / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 400  # 255 degrees of freedom: p(chi2 > 400) < 1e-7 for uniform bytes (seeded: this run 2xx)
    assert len(set(zero.tolist())) == 1 and len(np.unique(masked)) > size * 0.99


@pytest.mark.parametrize("revealing", ["t", "t-1"])
def test_a_dropout_is_unmasked_with_t_of_its_neighbours_shares_and_the_round_dropped_with_t_minus_one(revealing):
    n, size, degree, threshold = 10, 64, 6, 3
    members, adverts, verify = swarm(n, degree, threshold, seed=5)
    xs, codec = parts(n, size, seed=2), IntegerCodec()
    gone = "m04"
    sending = [m for m in members if m != gone]
    owner = Unmasker(tuple(members), ROUND, threshold, degree, size)
    for m in sending:
        owner.receive(m, members[m].mask(codec.encode(xs[m]), adverts, verify))
    revealed = [s for m in owner.survivors() for s in members[m].reveal(owner.survivors())]
    keep = threshold if revealing == "t" else threshold - 1  # of its neighbours' shares of its mask key
    of_gone = [s for s in revealed if s.dealer == gone]
    assert len(of_gone) == degree and all(s.kind == "key" for s in of_gone)  # never its seed
    revealed = [s for s in revealed if s.dealer != gone] + of_gone[:keep]
    if revealing == "t-1":
        with pytest.raises(SecAggError, match="round is dropped"):
            owner.unmask(adverts, revealed, verify)
        return
    total = owner.unmask(adverts, revealed, verify)
    plain = np.zeros(size, dtype=np.uint32)
    for m in sending:
        plain = (plain + codec.encode(xs[m])).astype(np.uint32)
    assert np.array_equal(total, plain)  # exactly the survivors' sum


def test_two_of_sixteen_dropped_mid_round_leave_the_survivors_sum():
    n, size = 16, 256
    degree = graph_degree(n)
    threshold = degree // 2 + 1
    members, adverts, verify = swarm(n, degree, threshold, seed=11)
    xs, codec = parts(n, size, seed=3), IntegerCodec()
    sending = [m for m in members if m not in ("m03", "m11")]
    _, total = run_round(members, adverts, verify, xs, codec, sending, size, degree, threshold)
    assert torch.allclose(codec.decode_sum(total, len(sending)), sum(xs[m] for m in sending),
                          atol=codec.max_error(len(sending)))


def test_a_tampered_share_is_detected_counted_and_the_rest_still_unmask():
    n, size, degree, threshold = 8, 32, 6, 2
    members, adverts, verify = swarm(n, degree, threshold, seed=7)
    xs, codec = parts(n, size, seed=4), IntegerCodec()
    owner = Unmasker(tuple(members), ROUND, threshold, degree, size)
    for m in members:
        owner.receive(m, members[m].mask(codec.encode(xs[m]), adverts, verify))
    revealed = [s for m in owner.survivors() for s in members[m].reveal(owner.survivors())]
    bad = revealed[0]
    revealed[0] = Share(bad.dealer, bad.holder, bad.kind, bad.x, (bad.y + 1) % PRIME, bad.signature)
    total = owner.unmask(adverts, revealed, verify)  # every seed still has >= t honest shares here
    assert owner.rejected == 1
    plain = np.zeros(size, dtype=np.uint32)
    for x in xs.values():
        plain = (plain + codec.encode(x)).astype(np.uint32)
    assert np.array_equal(total, plain)
    with pytest.raises(SecAggError, match="not signed"):  # a holder checks what it is dealt the same way
        members[bad.holder].hold(revealed[0], verify)


def test_shares_of_a_seed_other_than_the_committed_one_break_the_commitment():
    n, size, degree, threshold = 6, 16, 4, 2

    def cheat(members):
        members["m01"]._seed = bytes(32)  # it committed to one seed and deals shares of another

    members, adverts, verify = swarm(n, degree, threshold, seed=9, before_deal=cheat)
    xs, codec = parts(n, size, seed=5), IntegerCodec()
    owner = Unmasker(tuple(members), ROUND, threshold, degree, size)
    for m in members:
        owner.receive(m, members[m].mask(codec.encode(xs[m]), adverts, verify))
    revealed = [s for m in owner.survivors() for s in members[m].reveal(owner.survivors())]
    with pytest.raises(SecAggError, match="m01's seed rebuilt from its shares breaks its commitment"):
        owner.unmask(adverts, revealed, verify)
    assert owner.rejected == 1


def test_parts_that_do_not_fit_are_refused_and_counted():
    owner = Unmasker(("a", "b"), ROUND, 1, 1, 4)
    with pytest.raises(SecAggError, match="uint32 of 4"):
        owner.receive("a", np.zeros(5, dtype=np.uint32))
    with pytest.raises(SecAggError, match="not a member"):
        owner.receive("z", np.zeros(4, dtype=np.uint32))
    assert owner.rejected == 2 and owner.survivors() == ()
    with pytest.raises(SecAggError, match="NaN"):
        IntegerCodec().encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="bits must be one of"):
        IntegerCodec(bits=12)


def test_shamir_needs_threshold_shares_and_the_graph_is_sparse_and_symmetric():
    shares = split_secret(123456789, 3, [1, 2, 3, 4, 5])
    assert combine_shares({x: shares[x] for x in (2, 4, 5)}, 3) == 123456789
    with pytest.raises(SecAggError):
        combine_shares({x: shares[x] for x in (1, 2)}, 3)
    members = [f"p{i:04d}" for i in range(1000)]
    k = graph_degree(len(members))
    graph = neighbours(members, k, b"seed")
    assert 20 <= k <= 40 and all(len(v) == k for v in graph.values())
    assert all(m in graph[o] for m, v in graph.items() for o in v)
    codec = IntegerCodec(scale=2.0**16, clip=8.0)
    assert codec.capacity() == 4095 and codec.max_error(16) == 16 * 0.5 / 2**16
    assert IntegerCodec(scale=2.0, clip=3.5, bits=8).capacity() == 18  # 4-bit values of up to 18 members
