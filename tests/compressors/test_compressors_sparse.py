"""Top-k (sampled threshold), random-k (seeded indices) and index packing."""
from __future__ import annotations

import math

import pytest
import torch
from _compressors_support import over_the_wire

from starling.compressors import TopK, from_spec
from starling.compressors.sparse import index_width


def _exact_topk(x: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("n,fraction", [(200_003, 0.001), (80_000, 0.2)])
def test_sampled_topk_is_exact_on_gaussian(n: int, fraction: float) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    c = from_spec(f"topk:{fraction}")
    packet = c.encode(x)
    k = math.ceil(fraction * n)
    assert packet.header["k"] == k
    y = c.decode(packet)
    assert set(y.nonzero().view(-1).tolist()) == _exact_topk(x, k)
    assert torch.equal(y[y != 0], x[y != 0])


def test_topk_mass_on_structured_tensor() -> None:
    # columns of very different scales: a strided sample could line up with one of them
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(256, 512, generator=gen) * torch.logspace(-3, 1, 512)).reshape(-1)
    k = math.ceil(0.001 * x.numel())
    idx = TopK(0.001).select(x, k)
    assert idx.numel() <= k
    exact = torch.topk(x.abs(), k).values.pow(2).sum()
    assert float(x[idx].pow(2).sum() / exact) >= 0.9


def test_topk_zero_and_ties() -> None:
    c = from_spec("topk:0.01")
    z = torch.zeros(70_000)
    packet = c.encode(z)
    assert packet.header["k"] == 0 and torch.equal(c.decode(packet), z)
    ones = torch.ones(70_000)
    assert c.decode(c.encode(ones)).count_nonzero() == 700


@pytest.mark.parametrize("n,k", [(1, 1), (255, 3), (256, 3), (257, 200), (70_000, 700), (1 << 17, 5)])
def test_index_packing_width_and_bitmap(n: int, k: int) -> None:
    x = torch.zeros(n)
    x[torch.randperm(n)[:k]] = torch.randn(k).abs() + 1
    packet = from_spec(f"topk:{k / n}").encode(x)
    idx_bytes = packet.buffers[0].numel()
    assert idx_bytes == min((n + 7) // 8, (packet.header["k"] * index_width(n) + 7) // 8)
    assert packet.header["index"] == ("bitmap" if idx_bytes == (n + 7) // 8 and idx_bytes < (
        packet.header["k"] * index_width(n) + 7) // 8 else "bits")
    assert torch.equal(from_spec("topk:0.5").decode(over_the_wire(packet)), x)


def test_topk_values_then_int8() -> None:
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(1))
    plain, quant = from_spec("topk:0.01"), from_spec("topk:0.01+int8")
    p1, p2 = plain.encode(x), quant.encode(x)
    assert p2.nbytes < p1.nbytes
    y1, y2 = plain.decode(p1), quant.decode(p2)
    assert torch.equal(y1 != 0, y2 != 0)
    assert float((y1 - y2).norm() / y1.norm()) < 0.01


def test_randomk_indices_from_seed() -> None:
    x = torch.randn(10_000)
    a, b = from_spec("randomk:0.01"), from_spec("randomk:0.01")
    pa, pb = a.encode(x, seed=42), b.encode(x, seed=42)
    assert pa.header == pb.header and len(pa.buffers) == 1  # only the values travel
    assert torch.equal(pa.buffers[0], pb.buffers[0])
    assert pa.buffers[0].numel() == 100 * 4
    ya = b.decode(pa)
    kept = ya.nonzero().view(-1)
    assert kept.numel() == 100 and torch.equal(ya[kept], x[kept])
    other = a.decode(a.encode(x, seed=43))
    assert not torch.equal(other.nonzero().view(-1), kept)


def test_randomk_fresh_seed_is_recorded() -> None:
    c = from_spec("randomk:0.1")
    x = torch.randn(1000)
    packet = c.encode(x)
    assert isinstance(packet.header["seed"], int)
    assert torch.equal(c.decode(packet), from_spec("randomk:0.1").decode(over_the_wire(packet)))


def test_topk_tensor_laid_out_against_the_sample() -> None:
    # Put the large values exactly in the runs the strided sample reads (white-box): the
    # sampled threshold then undershoots badly, and the codec must still return the top-k.
    from starling.compressors import sparse

    n, fraction = 1 << 18, 0.01
    k = math.ceil(fraction * n)
    runs = n // sparse._SAMPLE_RUN
    want = max(1, math.ceil(sparse._SAMPLE_HITS * n / k / sparse._SAMPLE_RUN))
    stride = sparse._next_prime(runs // want)
    assert stride > 1  # the sample really is a subset
    x = torch.randn(n, generator=torch.Generator().manual_seed(9)) * 0.01
    view = x[: runs * sparse._SAMPLE_RUN].view(runs, sparse._SAMPLE_RUN)
    view[::stride] = torch.randn(view[::stride].shape, generator=torch.Generator().manual_seed(10)) * 100
    assert view[::stride].numel() > k  # the true top-k lies entirely inside the sample
    y = from_spec(f"topk:{fraction}").decode(from_spec(f"topk:{fraction}").encode(x))
    assert set(y.nonzero().view(-1).tolist()) == _exact_topk(x, k)


def _reference_pack(values: list[int], width: int) -> bytes:
    """The documented layout, one bit at a time: bit b of value i is bit (i*width+b) % 8 of
    byte (i*width+b) // 8."""
    out = bytearray((len(values) * width + 7) // 8)
    for i, value in enumerate(values):
        for b in range(width):
            if value >> b & 1:
                out[(i * width + b) // 8] |= 1 << ((i * width + b) % 8)
    return bytes(out)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 7, 8, 12, 17])
@pytest.mark.parametrize("k", [1, 3, 8, 9, 1000])
def test_uint_packing_keeps_its_bit_layout_for_every_width(width: int, k: int) -> None:
    from starling.compressors.packing import pack_uints, unpack_uints

    gen = torch.Generator().manual_seed(width * 1000 + k)
    values = torch.randint(0, 1 << width, (k,), generator=gen, dtype=torch.int64)
    packed = pack_uints(values, width)
    assert bytes(packed.tolist()) == _reference_pack(values.tolist(), width)
    for chunk in (None, 8):  # a chunked loop (widths that do not divide a byte) gives the same
        assert torch.equal(unpack_uints(packed, k, width, chunk=chunk), values)
        assert torch.equal(pack_uints(values, width, chunk=chunk), packed)
