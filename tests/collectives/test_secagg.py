"""Secure aggregation's arithmetic: the ring encoding and its capacity, pseudorandom streams
that seek, Shamir's threshold, and SecAgg+'s sparse, symmetric graph."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from starling.collectives.secagg import (
    IntegerCodec,
    SecAggError,
    add,
    combine_shares,
    graph_degree,
    neighbours,
    prg,
    split_secret,
    sub,
)


@pytest.mark.parametrize("codec", [IntegerCodec(), IntegerCodec(scale=2.0, clip=3.5, bits=8)],
                         ids=["ring32", "ring8"])
def test_ring_sums_decode_to_the_plain_sum_within_the_rounding(codec):
    g = torch.Generator().manual_seed(0)
    members = min(10, codec.capacity())
    xs = [torch.randn(500, generator=g).clamp(-codec.clip, codec.clip) for _ in range(members)]
    total = np.zeros(500, dtype=codec.dtype)
    for x in xs:
        total = add(total, codec.encode(x))
    decoded = codec.decode_sum(total, members)
    assert float((decoded - torch.stack(xs).sum(0)).abs().max()) <= codec.max_error(members) + 1e-6


def test_masks_cancel_in_the_ring_and_streams_seek():
    seed, rid = b"s" * 32, b"round"
    whole = prg(seed, 1000, rid)
    assert np.array_equal(whole[333:633], prg(seed, 300, rid, offset=333))
    part = IntegerCodec().encode(torch.linspace(-1, 1, 1000))
    masked = add(part.copy(), whole)
    assert not np.array_equal(masked, part)
    assert np.array_equal(sub(masked, whole), part)


def test_codec_refuses_non_finite_parts_overflow_and_bad_rings():
    with pytest.raises(SecAggError, match="NaN"):
        IntegerCodec().encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="bits must be one of"):
        IntegerCodec(bits=12)
    codec = IntegerCodec(scale=2.0**16, clip=8.0)
    with pytest.raises(SecAggError, match="overflow"):
        codec.decode_sum(np.zeros(3, dtype=np.uint32), codec.capacity() + 1)


def test_shamir_needs_threshold_shares_and_the_graph_is_sparse_and_symmetric():
    shares = split_secret(123456789, 3, [1, 2, 3, 4, 5])
    assert combine_shares({x: shares[x] for x in (2, 4, 5)}, 3) == 123456789
    with pytest.raises(SecAggError):
        combine_shares({x: shares[x] for x in (1, 2)}, 3)
    two = {x: shares[x] for x in (1, 2)}  # t - 1 shares: every secret fits them equally
    assert combine_shares({**two, 3: (shares[3] + 1)}, 3) != 123456789
    members = [f"p{i:04d}" for i in range(1000)]
    k = graph_degree(len(members))
    graph = neighbours(members, k, b"seed")
    assert 20 <= k <= 40 and all(len(v) == k for v in graph.values())
    assert all(m in graph[o] for m, v in graph.items() for o in v)
    codec = IntegerCodec(scale=2.0**16, clip=8.0)
    assert codec.capacity() == 4095 and codec.max_error(16) == 16 * 0.5 / 2**16
    assert IntegerCodec(scale=2.0, clip=3.5, bits=8).capacity() == 18  # 4-bit values of up to 18 members
