"""What a codec says it can do (`lossless`, `zero_copy`) and the copy-free paths that rest on it:
`encode(t, copy=False)` lends `t` to the packet, `decode(p, copy=False)` reads the buffer in place."""
from __future__ import annotations

import pytest
import torch
from _compressors_support import ALL_SPECS, over_the_wire

from starling.compressors import Compressor, Packet, PacketError, decode, from_spec, registered_codecs
from starling.compressors.base import Encoded
from starling.compressors.registry import _CODECS, register

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that NaN equals NaN and -0.0 differs from 0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


@pytest.mark.parametrize("name", registered_codecs())
def test_every_registered_codec_states_both_flags(name: str) -> None:
    cls = _CODECS[name]
    assert isinstance(cls.stage_lossless, bool) and isinstance(cls.stage_zero_copy, bool)
    if cls.stage_zero_copy:  # its packet is its input's bytes: nothing lost, no payload to hand on
        assert cls.stage_lossless and not cls.takes_inner


def test_only_none_is_lossless_and_pipelines_follow_their_stages() -> None:
    assert [s for s in ALL_SPECS if from_spec(s).lossless] == ["none"]
    assert [s for s in ALL_SPECS if from_spec(s).zero_copy] == ["none"]
    # a lossy first stage makes the pipeline lossy whatever follows; "topk:F" alone sends raw values
    assert not from_spec("topk:0.5+none").lossless and not from_spec("topk:0.5").zero_copy


def test_a_codec_that_does_not_state_its_flags_is_not_registered() -> None:
    class Silent(Compressor):
        codec = "test-silent"

        def _encode(self, flat, shape, seed, name):
            return Encoded({})

        def _decode(self, h, buffers, payload, shape, dtype, device):
            return torch.zeros(0)

    with pytest.raises(TypeError, match="stage_lossless"):
        register(Silent)

    class LossyButLending(Silent):
        codec = "test-lending"
        stage_lossless = False
        stage_zero_copy = True

    with pytest.raises(TypeError, match="zero-copy stage must be lossless"):
        register(LossyButLending)
    assert "test-silent" not in registered_codecs() and "test-lending" not in registered_codecs()


@pytest.mark.parametrize("spec", [s for s in ALL_SPECS if from_spec(s).lossless])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_lossless_codec_round_trips_bit_exactly(spec: str, dtype: torch.dtype) -> None:
    c = from_spec(spec)
    x = torch.randn(3, 41, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    for copy in (True, False):
        y = c.decode(over_the_wire(c.encode(x, copy=copy)), copy=copy)
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(_bits(y), _bits(x))


def test_a_zero_copy_encode_lends_the_tensor_and_the_default_copies_it() -> None:
    c = from_spec("none")
    vector = torch.arange(12.0)
    lent = c.encode(vector[4:8], copy=False)
    assert _shares_memory(lent.buffers[0], vector)
    assert lent.buffers[0].data_ptr() == vector[4:8].data_ptr()
    own = c.encode(vector[4:8])
    assert not _shares_memory(own.buffers[0], vector)
    vector.fill_(-1.0)  # the lent packet carries later writes; the default one does not
    assert torch.equal(c.decode(lent), torch.full((4,), -1.0))
    assert torch.equal(c.decode(own), torch.arange(4.0, 8.0))
    # the wire sees the same bytes either way
    assert lent.header == own.header and lent.nbytes == own.nbytes


def test_copy_false_changes_nothing_for_a_codec_that_cannot_lend() -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(2))
    for spec in ("fp16", "int8", "topk:0.25"):
        c = from_spec(spec)
        packet = c.encode(x, copy=False)
        assert not any(_shares_memory(b, x) for b in packet.buffers)
        decoded = c.decode(packet, copy=False)
        assert not any(_shares_memory(decoded, b) for b in packet.buffers)
        assert torch.equal(decoded, c.decode(c.encode(x)))


def test_a_strided_tensor_lent_to_a_zero_copy_codec_is_made_contiguous() -> None:
    base = torch.arange(12.0)
    packet = from_spec("none").encode(base[::2], copy=False)
    assert not _shares_memory(packet.buffers[0], base)
    assert torch.equal(decode(packet), base[::2])


def test_a_view_decode_shares_memory_with_the_buffer() -> None:
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(3))
    packet = over_the_wire(from_spec("none").encode(x))  # read-only wire memory, as a peer receives it
    for view in (decode(packet, copy=False), from_spec("none").decode(packet, copy=False)):
        assert view.shape == x.shape and torch.equal(view, x)
        assert _shares_memory(view, packet.buffers[0])
    own = decode(packet)
    assert not _shares_memory(own, packet.buffers[0]) and torch.equal(own, x)


@pytest.mark.parametrize("header, buffers, field", [
    ({"codec": "none", "shape": [4], "dtype": "float32"}, (torch.zeros(12, dtype=torch.uint8),), "buffers[0]"),
    ({"codec": "none", "shape": [-4], "dtype": "float32"}, (torch.zeros(16, dtype=torch.uint8),), "shape"),
    ({"codec": "none", "shape": [True], "dtype": "float32"}, (torch.zeros(4, dtype=torch.uint8),), "shape"),
    ({"codec": "none", "shape": [4], "dtype": "int32"}, (torch.zeros(16, dtype=torch.uint8),), "dtype"),
    ({"codec": "none", "shape": [4]}, (torch.zeros(16, dtype=torch.uint8),), "dtype"),
    ({"codec": "none", "shape": [4], "dtype": "float32"}, (), "buffers"),
    ({"codec": "none", "shape": [4], "dtype": "float32", "inner": {}}, (torch.zeros(16, dtype=torch.uint8),),
     "inner"),
    ({"codec": "none", "shape": [2], "dtype": "float32"}, (torch.zeros(8, dtype=torch.uint8),) * 2, "buffers"),
])
def test_a_view_decode_checks_the_header_like_any_decode(header, buffers, field) -> None:
    packet = Packet(header, buffers)
    for decoder in (lambda p: decode(p, copy=False), lambda p: from_spec("none").decode(p, copy=False)):
        with pytest.raises(PacketError) as info:
            decoder(packet)
        assert info.value.field == field
