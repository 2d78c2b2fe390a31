"""Counter RNG: pinned streams, seeds, offsets, distributions."""
from __future__ import annotations

import math

import pytest
import torch

from starling.compressors import rng

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def test_bits_match_a_pure_python_splitmix() -> None:
    key = rng._key(99, rng._STREAM_BITS)
    expected = [_signed(rng._mix64_int((key + i * _GOLDEN) & _MASK)) for i in range(1000, 1010)]
    assert rng.bits64(99, 10, offset=1000).tolist() == expected


def test_pinned_streams() -> None:
    # Changing any of these silently desynchronizes peers running different versions.
    assert rng.bits64(0, 4).tolist() == [
        4925818967363055168, -1674679019551287357, 7203738325271002123, -2929542128942870561]
    assert rng.bits64(123456789, 3, offset=10**12).tolist() == [
        1623987028410276156, 2247082526621550792, 1179201580691918631]
    assert rng.normal(0, 6).view(torch.int32).tolist() == [
        -1084342720, 1058012993, 1067097131, -1096571951, -1095425649, 1061832520]
    assert rng.randint(0, 5, 1000).tolist() == [538, 949, 332, 479, 489]
    assert rng.sample_indices(0, 5, 100).tolist() == [0, 39, 51, 72, 86]
    assert rng.derive_seed(0, 1, 2) == 9056455758235018220


KINDS = {
    "bits64": lambda s, n, o: rng.bits64(s, n, offset=o),
    "uniform": lambda s, n, o: rng.uniform(s, n, offset=o),
    "normal": lambda s, n, o: rng.normal(s, n, offset=o),
    "rademacher": lambda s, n, o: rng.rademacher(s, n, offset=o),
    "randint": lambda s, n, o: rng.randint(s, n, 1000, offset=o),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_same_seed_same_numbers_other_seed_other_numbers(kind: str) -> None:
    draw = KINDS[kind]
    a, b, c = draw(5, 4096, 0), draw(5, 4096, 0), draw(6, 4096, 0)
    assert torch.equal(a, b)
    assert float((a != c).float().mean()) > 0.4


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_chunks_by_offset_equal_one_draw(kind: str) -> None:
    draw = KINDS[kind]
    whole = draw(17, 1001, 3)
    parts = torch.cat([draw(17, 1, 3), draw(17, 64, 4), draw(17, 335, 68), draw(17, 601, 403)])
    assert torch.equal(whole, parts)


def test_streams_of_one_seed_are_independent() -> None:
    u = rng.uniform(3, 10_000)
    z = rng.normal(3, 10_000)
    assert abs(float(torch.corrcoef(torch.stack((u, z)))[0, 1])) < 0.05


def test_uniform_range_and_resolution() -> None:
    u = rng.uniform(1, 50_000)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    for dtype, bits in ((torch.bfloat16, 8), (torch.float16, 11), (torch.float64, 24)):
        v = rng.uniform(1, 10_000, dtype=dtype)
        assert v.dtype == dtype and float(v.max()) < 1.0
        assert torch.equal(v.double() * 2**bits, (v.double() * 2**bits).floor())


def test_normal_moments_and_reference() -> None:
    z = rng.normal(2, 400_000).double()
    assert abs(float(z.mean())) < 0.01
    assert abs(float(z.std()) - 1.0) < 0.01
    assert abs(float((z**4).mean()) - 3.0) < 0.06
    assert float(z.abs().max()) < 6.0
    # Box-Muller in float64 from the same bits: the hand-made log / sin / cos are accurate
    words = rng._hash_counters(rng._key(2, rng._STREAM_NORMAL), 0, 5000, torch.device("cpu"))
    r = torch.sqrt(-2 * torch.log(1 - ((words >> 40) & 0xFFFFFF).double() * 2**-24))
    theta = (((words >> 2) & 0x3FFFFF).double() + 0.5) * 2**-22 * math.pi / 2
    sx, sy = 1 - 2 * (words & 1).double(), 1 - 2 * ((words >> 1) & 1).double()
    ref = torch.stack((r * torch.cos(theta) * sx, r * torch.sin(theta) * sy), 1).view(-1)
    assert float((z[:10_000] - ref).abs().max()) < 2e-6


def test_normal_in_other_dtypes_is_one_rounding() -> None:
    base = rng.normal(4, 3000)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(rng.normal(4, 3000, dtype=dtype), base.to(dtype))


def test_rademacher_and_randint() -> None:
    s = rng.rademacher(5, 30_000)
    assert set(s.unique().tolist()) == {-1.0, 1.0} and abs(float(s.mean())) < 0.03
    r = rng.randint(5, 30_000, 10)
    counts = torch.bincount(r, minlength=10).double()
    assert int(r.min()) == 0 and int(r.max()) == 9
    assert float(((counts - 3000) ** 2 / 3000).sum()) < 40  # chi2, 9 dof
    wide = rng.randint(5, 1000, 1 << 40)
    assert int(wide.min()) >= 0 and int(wide.max()) < 1 << 40 and int(wide.max()) > 1 << 39


@pytest.mark.parametrize("k,n", [(0, 10), (10, 10), (1, 1), (7, 100), (1000, 1001), (300, 1 << 20)])
def test_sample_indices(k: int, n: int) -> None:
    idx = rng.sample_indices(8, k, n)
    assert idx.numel() == k
    if k:
        assert int(idx.min()) >= 0 and int(idx.max()) < n
        assert bool((idx[1:] > idx[:-1]).all())


def test_sample_indices_inclusion_is_uniform() -> None:
    hits = torch.zeros(100)
    for seed in range(2000):
        hits[rng.sample_indices(seed, 7, 100)] += 1
    assert float(hits.min()) > 0.07 * 2000 * 0.7 and float(hits.max()) < 0.07 * 2000 * 1.3


def test_seed_validation() -> None:
    assert torch.equal(rng.bits64(-1, 3), rng.bits64((1 << 64) - 1, 3))
    with pytest.raises(TypeError):
        rng.bits64(True, 3)
    with pytest.raises(TypeError):
        rng.uniform(1.5, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        rng.bits64(1 << 64, 3)
    with pytest.raises(ValueError):
        rng.normal(0, -1)
    assert rng.derive_seed(1, 2) != rng.derive_seed(1, 3) != rng.derive_seed(2, 2)
