"""Every codec: shapes, dtypes, wire size, the wire itself, errors within bounds."""
from __future__ import annotations

import math

import msgpack
import pytest
import torch
from _compressors_support import ALL_SPECS, over_the_wire, rel_err

from starling.compressors import Packet, decode, from_spec, registered_codecs

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (130,), (33, 40)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LOSSLESS = {"none"}


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_round_trip_shapes_and_dtypes(spec: str) -> None:
    c = from_spec(spec)
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for dtype in DTYPES:
            x = torch.randn(shape, generator=gen).to(dtype)
            packet = c.encode(x, seed=7, name="t")
            y = c.decode(packet)
            assert y.shape == x.shape and y.dtype == x.dtype, (spec, shape, dtype)
            assert torch.isfinite(y).all()
            if spec in LOSSLESS:
                assert torch.equal(y, x)
            for buf in packet.buffers:
                assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
            # the header is msgpack-able and nbytes is exact
            packed = msgpack.packb(packet.header, use_bin_type=True)
            assert packet.nbytes == len(packed) + sum(b.numel() for b in packet.buffers)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_strided_views_encode_like_their_values(spec: str) -> None:
    """Views with strides, including a lone element whose stride torch ignores when it calls
    the tensor contiguous, encode to the same packet as a contiguous copy."""
    base = torch.randn(40, generator=torch.Generator().manual_seed(3))
    for view in (base[::2], base[::2][1:2], base[5:6], base.view(5, 8)[:, 1], base[::2][3:3]):
        got = from_spec(spec).encode(view, seed=7, name="t")
        want = from_spec(spec).encode(view.clone(memory_format=torch.contiguous_format), seed=7, name="t")
        assert got.header == want.header, (spec, view.stride())
        assert all(torch.equal(g, w) for g, w in zip(got.buffers, want.buffers)), (spec, view.stride())


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_over_the_wire_decodes_identically(spec: str) -> None:
    c = from_spec(spec)
    x = torch.randn(33, 40, generator=torch.Generator().manual_seed(1))
    packet = c.encode(x, seed=3)
    wire = over_the_wire(packet)
    before = [bytes(b.numpy().tobytes()) for b in wire.buffers]
    y_local = c.decode(packet)
    y_wire = from_spec(spec).decode(wire)  # an independent instance, read-only buffers
    assert torch.equal(y_local, y_wire)
    assert torch.equal(decode(wire), y_wire)  # header-driven decoding needs no compressor
    assert [bytes(b.numpy().tobytes()) for b in wire.buffers] == before  # never written
    assert wire.nbytes == packet.nbytes


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4", "sign", "topk:0.2", "powersgd:2"])
def test_packet_does_not_alias_input(spec: str) -> None:
    c = from_spec(spec)
    x = torch.randn(40, 30)
    packet = c.encode(x)
    expected = c.decode(packet).clone()
    x.mul_(100.0)
    assert torch.equal(c.decode(packet), expected)


def test_lossless_and_cast_errors() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    assert torch.equal(from_spec("none").decode(from_spec("none").encode(x)), x)
    assert rel_err(from_spec("fp16").decode(from_spec("fp16").encode(x)), x) < 1e-3
    assert rel_err(from_spec("bf16").decode(from_spec("bf16").encode(x)), x) < 1e-2


@pytest.mark.parametrize(
    "spec,bound",
    [("int8", 0.01), ("int4", 0.15), ("fp4", 0.15), ("fp8", 0.05), ("fp8:e5m2", 0.08), ("fp4:e3m0", 0.25)],
)
def test_quantizer_error_on_gaussian(spec: str, bound: float) -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))
    c = from_spec(spec)
    assert rel_err(c.decode(c.encode(x)), x) < bound


@pytest.mark.parametrize(
    "spec,n,expected_codes",
    [("int8", 1000, 1000), ("int4", 1001, 501), ("fp4", 17, 9), ("sign", 1001, 126), ("fp8", 300, 300)],
)
def test_quantizer_buffer_sizes(spec: str, n: int, expected_codes: int) -> None:
    c = from_spec(spec)
    packet = c.encode(torch.randn(n))
    scales, codes = packet.buffers
    assert scales.numel() == 4 * math.ceil(n / c.block)
    assert codes.numel() == expected_codes
    assert packet.header["block"] == c.block


def test_ratios_are_what_the_formats_promise() -> None:
    n = 1 << 14
    x = torch.randn(n)
    raw = from_spec("none").encode(x).nbytes
    assert from_spec("fp16").encode(x).nbytes < raw / 2 + 100
    assert from_spec("int4").encode(x).nbytes < raw / 7
    assert from_spec("sign").encode(x).nbytes < raw / 27


def test_scaled_sign_matches_block_mean() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 0.5, -0.5, 4.0, -1.0])
    y = from_spec("sign:block=8").decode(from_spec("sign:block=8").encode(x))
    scale = x.abs().mean()
    assert torch.allclose(y, torch.where(x >= 0, scale, -scale))


def test_registered_codecs() -> None:
    names = set(registered_codecs())
    assert {"none", "fp16", "bf16", "int8", "int4", "fp4", "sign", "topk", "randomk", "powersgd",
            "countsketch", "gsketch"} <= names
    if hasattr(torch, "float8_e4m3fn"):
        assert "fp8" in names


def test_packet_to_device_and_validation() -> None:
    packet = from_spec("int8").encode(torch.randn(10))
    moved = packet.to("cpu")
    assert moved.header == packet.header and moved.nbytes == packet.nbytes
    assert isinstance(moved, Packet)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8")
@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4", "sign", "topk:0.3+int8", "powersgd:2"])
def test_float8_inputs(spec: str) -> None:
    x = torch.randn(12, 10).to(torch.float8_e4m3fn)
    c = from_spec(spec)
    packet = c.encode(x)
    y = c.decode(over_the_wire(packet))
    assert y.dtype == torch.float8_e4m3fn and y.shape == x.shape
    if spec == "none":
        assert packet.buffers[0].numel() == x.numel()  # one byte each, as sent
        assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
