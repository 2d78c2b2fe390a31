"""Chunked top-k and 2-bit values: packing round-trips at chunk edges and odd sizes,
the bits a message costs, error feedback that conserves mass, and malformed messages refused."""
from __future__ import annotations

import math

import pytest
import torch
from _compressors_support import over_the_wire

from starling.compressors import ChunkTopK, ErrorFeedback, NonFiniteError, Packet, PacketError, from_spec
from starling.compressors.chunked import chunk_counts


def _kept(x: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """The exact top-k of every chunk as a mask (ties broken apart by a random input)."""
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    for lo in range(0, x.numel(), chunk):
        part = x[lo:lo + chunk]
        mask[lo + torch.topk(part.abs(), min(k, part.numel())).indices] = True
    return mask


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 32, 33, 100, 4095, 4096, 4097, 3 * 4096 + 5])
@pytest.mark.parametrize("k,chunk", [(4, 16), (1, 2), (16, 16), (64, 4096), (5, 13)])
def test_raw_values_round_trip_at_chunk_edges_and_odd_sizes(n: int, k: int, chunk: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n * 31 + k))
    codec = from_spec(f"chunktopk:{k}/{chunk}")
    packet = over_the_wire(codec.encode(x))
    full, tail, k_tail = chunk_counts(n, k, chunk)
    count = full * k + k_tail
    width = max(1, (chunk - 1).bit_length())
    assert packet.buffers[0].numel() == (count * width + 7) // 8  # ceil(log2 C) bits per index
    y = codec.decode(packet)
    mask = _kept(x, k, chunk)
    assert torch.equal(y, torch.where(mask, x, torch.zeros_like(x)))


@pytest.mark.parametrize("n", [5, 64, 65, 1000, 4096 + 3])
@pytest.mark.parametrize("block", [1, 3, 8, 64])
def test_q2_keeps_signs_and_lands_on_the_two_magnitudes_of_each_block(n: int, block: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + block))
    codec = from_spec(f"q2:block={block}")
    packet = over_the_wire(codec.encode(x))
    assert packet.buffers[1].numel() == (2 * n + 7) // 8
    y = codec.decode(packet)
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    for lo in range(0, n, block):
        part, got = x[lo:lo + block].abs(), y[lo:lo + block].abs()
        lo_mag, hi_mag = part.min(), part.max()
        assert bool(((got == lo_mag) | (got == hi_mag)).all())
        # each value took the nearer magnitude
        assert bool(((got - part).abs() <= torch.minimum((part - lo_mag).abs(), (part - hi_mag).abs()) + 1e-6).all())


def test_sparseloco_message_is_about_a_quarter_bit_per_parameter() -> None:
    n = 64 * 4096
    codec = from_spec("chunktopk:64/4096+q2")
    packet = codec.encode(torch.randn(n))
    payload_bits = 8 * sum(b.numel() for b in packet.buffers)
    assert payload_bits / n == pytest.approx(64 / 4096 * (12 + 2) + 64 / 4096, rel=1e-3)
    assert codec.spec == "chunktopk:64/4096+q2" and isinstance(codec, ChunkTopK)
    y = codec.decode(over_the_wire(packet))
    assert int(y.count_nonzero()) == 64 * 64


@pytest.mark.parametrize("spec", ["chunktopk:64/4096+q2", "chunktopk:8/64+sign:block=8", "chunktopk:3/10"])
def test_error_feedback_conserves_mass(spec: str) -> None:
    """Over rounds, what was sent plus the residual equals the sum of the inputs."""
    feedback = ErrorFeedback(from_spec(spec))
    gen = torch.Generator().manual_seed(3)
    inputs, sent = torch.zeros(5000, dtype=torch.float64), torch.zeros(5000, dtype=torch.float64)
    for _ in range(6):
        x = torch.randn(5000, generator=gen)
        inputs += x.double()
        sent += feedback.decode(over_the_wire(feedback.encode(x, name="f0"))).double()
        residual = feedback.residual("f0")
        assert residual is not None
        assert torch.allclose(sent + residual.double(), inputs, atol=1e-5)
    state = feedback.state_dict()  # the residual is what a checkpoint keeps
    restored = ErrorFeedback(from_spec(spec))
    restored.load_state_dict(state)
    assert torch.equal(restored.residual("f0"), feedback.residual("f0"))


def test_decaying_feedback_is_sparselocos_accumulator() -> None:
    """decay b < 1: what was sent plus the residual is the b-discounted sum of the inputs
    (e <- b e + x; send C(e); e <- e - C(e)), and b = 1 is plain error feedback."""
    decay = 0.9
    feedback = ErrorFeedback(from_spec("chunktopk:64/4096+q2"), decay=decay)
    gen = torch.Generator().manual_seed(4)
    discounted = torch.zeros(5000, dtype=torch.float64)
    sent_discounted = torch.zeros(5000, dtype=torch.float64)
    for _ in range(6):
        x = torch.randn(5000, generator=gen)
        discounted = decay * discounted + x.double()
        sent = feedback.decode(over_the_wire(feedback.encode(x, name="f0"))).double()
        sent_discounted = decay * sent_discounted + sent
        residual = feedback.residual("f0")
        assert residual is not None
        assert torch.allclose(sent_discounted + residual.double(), discounted, atol=1e-5)
    assert ErrorFeedback(from_spec("int4")).decay == 1.0


@pytest.mark.parametrize("decay", [0.0, -0.5, 1.5, float("nan"), True, "0.9"])
def test_bad_feedback_decay_is_refused(decay: object) -> None:
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(from_spec("int4"), decay=decay)  # type: ignore[arg-type]


def _tampered(packet: Packet, *, header: dict | None = None, buffers: tuple | None = None) -> Packet:
    return Packet(header if header is not None else packet.header, buffers if buffers is not None else packet.buffers)


def _indices(values: list[int], width: int = 4) -> torch.Tensor:
    from starling.compressors.packing import pack_uints

    return pack_uints(torch.tensor(values, dtype=torch.int64), width)


def test_malformed_messages_are_refused_naming_the_field() -> None:
    codec = from_spec("chunktopk:2/16")
    x = torch.arange(32.0)
    good = codec.encode(x)
    assert torch.equal(codec.decode(good), torch.where(x % 16 >= 14, x, torch.zeros_like(x)))
    values = good.buffers[1:]
    cases = {"duplicated": _indices([14, 14, 14, 15]), "out of order": _indices([15, 14, 14, 15])}
    with pytest.raises(PacketError, match="indices"):  # one index too many bits: lengths disagree
        codec.decode(_tampered(good, buffers=(_indices([14, 15, 14, 31], width=5), *values)))
    ten = from_spec("chunktopk:2/10")  # 4-bit indices can name 10..15, past a chunk of 10
    packet = ten.encode(torch.arange(20.0))
    with pytest.raises(PacketError, match="out of its chunk"):
        ten.decode(_tampered(packet, buffers=(_indices([8, 12, 8, 9]), *packet.buffers[1:])))
    for name in ("duplicated", "out of order"):
        with pytest.raises(PacketError, match="increasing"):
            codec.decode(_tampered(good, buffers=(cases[name], *values)))
    short = from_spec("chunktopk:2/16").encode(torch.arange(20.0))  # a last chunk of 4 values
    tail_out = _indices([14, 15, 1, 7])  # 7 is past the last chunk's 4 values
    with pytest.raises(PacketError, match="out of its chunk"):
        codec.decode(_tampered(short, buffers=(tail_out, *short.buffers[1:])))
    # counts that do not match the lengths: a header k the buffers do not hold
    with pytest.raises(PacketError):
        codec.decode(_tampered(good, header={**good.header, "k": 3}))
    with pytest.raises(PacketError, match="values"):
        codec.decode(_tampered(good, header={**good.header, "inner": {**good.header["inner"], "shape": [3]}},
                               buffers=(good.buffers[0], good.buffers[1][:12])))


def test_nan_scales_and_bad_q2_buffers_are_refused() -> None:
    codec = from_spec("chunktopk:8/64+q2:block=8")
    packet = codec.encode(torch.randn(200))
    scales = packet.buffers[1].clone()
    scales.view(torch.float32)[0] = math.nan
    with pytest.raises(PacketError, match="scales"):
        codec.decode(_tampered(packet, buffers=(packet.buffers[0], scales, packet.buffers[2])))
    swapped = packet.buffers[1].clone()
    pairs = swapped.view(torch.float32).view(-1, 2)
    pairs[0] = torch.tensor([2.0, 1.0])  # lower magnitude above the upper
    with pytest.raises(PacketError, match="scales"):
        codec.decode(_tampered(packet, buffers=(packet.buffers[0], swapped, packet.buffers[2])))
    with pytest.raises(PacketError, match="codes"):
        codec.decode(_tampered(packet, buffers=(*packet.buffers[:2], packet.buffers[2][:-1])))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_raises(bad: float) -> None:
    x = torch.randn(300)
    x[77] = bad
    for spec in ("chunktopk:4/64", "chunktopk:4/64+q2", "q2"):
        with pytest.raises(NonFiniteError):
            from_spec(spec).encode(x)


@pytest.mark.parametrize("spec", ["chunktopk", "chunktopk:64", "chunktopk:0/16", "chunktopk:17/16",
                                  "chunktopk:1/1", "q2:block=0", "q2+int8"])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="bad compressor spec"):
        from_spec(spec)
