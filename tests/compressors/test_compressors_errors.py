"""Bad input: packets whose header and buffers disagree, bad specs, non-finite tensors."""
from __future__ import annotations

import copy

import pytest
import torch

from starling.compressors import ErrorFeedback, NonFiniteError, Packet, PacketError, decode, from_spec


def _tamper(packet: Packet, header_edit=None, buffers=None) -> Packet:
    header = copy.deepcopy(packet.header)
    if header_edit:
        header_edit(header)
    return Packet(header, packet.buffers if buffers is None else tuple(buffers))


def _set(key, value, where=None):
    def edit(h):
        (h if where is None else h[where])[key] = value

    return edit


def _expect(packet: Packet, field: str, spec: str | None = None) -> PacketError:
    decoder = from_spec(spec) if spec else None
    with pytest.raises(PacketError) as info:
        decoder.decode(packet) if decoder else decode(packet)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)
    return info.value


X = torch.randn(300, generator=torch.Generator().manual_seed(0))


def test_wrong_and_unknown_codec() -> None:
    p = from_spec("int8").encode(X)
    _expect(p, "codec", "int4")  # a decoder refuses another codec's packet
    _expect(_tamper(p, _set("codec", "zstd")), "codec")
    _expect(_tamper(p, _set("codec", 5)), "codec")


@pytest.mark.parametrize("spec", ["none", "fp16", "int8", "int4", "fp4", "sign", "topk:0.1"])
def test_truncated_or_missing_buffers(spec: str) -> None:
    p = from_spec(spec).encode(X)
    last = len(p.buffers) - 1
    short = list(p.buffers)
    short[last] = short[last][:-1]
    err = _expect(_tamper(p, buffers=short), _field_of(spec, last))
    assert "bytes" in err.reason
    with pytest.raises(PacketError) as info:
        decode(_tamper(p, buffers=p.buffers[:-1]))
    assert "buffers" in info.value.field
    with pytest.raises(PacketError) as info:
        decode(_tamper(p, buffers=list(p.buffers) + [torch.zeros(3, dtype=torch.uint8)]))
    assert info.value.field == "buffers"


def _field_of(spec: str, index: int) -> str:
    if spec.startswith("topk"):
        return "inner.buffers[0]"
    if spec in ("none", "fp16"):
        return "buffers[0]"
    return ("scales", "codes")[index]


@pytest.mark.parametrize(
    "edit,field",
    [
        (_set("shape", [301]), "codes"),
        (_set("shape", "300"), "shape"),
        (_set("shape", [-1]), "shape"),
        (_set("dtype", "int32"), "dtype"),
        (_set("block", 7), "block"),
        (_set("block", "256"), "block"),
        (lambda h: h.pop("block"), "block"),
    ],
)
def test_bad_header_fields(edit, field: str) -> None:
    _expect(_tamper(from_spec("int8").encode(X), edit), field)


def test_nan_and_negative_scales() -> None:
    p = from_spec("int8:block=8").encode(X)
    for bad in (float("nan"), float("inf"), -1.0):
        scales = p.buffers[0].view(torch.float32).clone()
        scales[3] = bad
        _expect(_tamper(p, buffers=[scales.view(torch.uint8), p.buffers[1]]), "scales")


def test_bad_fp_format() -> None:
    _expect(_tamper(from_spec("fp4").encode(X), _set("format", "e1m2")), "format")


def test_topk_index_and_count_errors() -> None:
    p = from_spec("topk:0.05").encode(X)
    _expect(_tamper(p, _set("k", 10_000)), "k")
    _expect(_tamper(p, _set("k", p.header["k"] - 1)), "inner.shape")
    _expect(_tamper(p, _set("index", "zigzag")), "index")
    _expect(_tamper(p, lambda h: h.pop("inner")), "inner")
    _expect(_tamper(p, _set("shape", [5], where="inner")), "inner.buffers[0]")
    _expect(_tamper(p, buffers=[p.buffers[0][:-1], p.buffers[1]]), "indices")
    # indices past the end of a (claimed) smaller tensor with the same index width
    big = from_spec("topk:0.05").encode(torch.arange(1000.0))
    assert big.header["index"] == "bits"
    _expect(_tamper(big, _set("shape", [600])), "indices")
    # a bitmap with one bit too many
    bitmap = from_spec("topk:0.9").encode(X)
    assert bitmap.header["index"] == "bitmap"
    bits = bitmap.buffers[0].clone()
    zero = int((X.abs() <= X.abs().sort().values[29]).nonzero()[0])  # a position not kept
    bits[zero // 8] |= 1 << (zero % 8)
    _expect(_tamper(bitmap, buffers=[bits, bitmap.buffers[1]]), "indices")


def test_seeded_and_lowrank_header_errors() -> None:
    p = from_spec("randomk:0.1").encode(X, seed=3)
    _expect(_tamper(p, _set("seed", "abc")), "seed")
    _expect(_tamper(p, _set("k", 31)), "inner.shape")
    s = from_spec("countsketch:3x8").encode(X, seed=3)
    _expect(_tamper(s, _set("rows", 4)), "inner.shape")
    g = from_spec("gsketch:8,kind=srht").encode(X, seed=3)
    _expect(_tamper(g, _set("kind", "fft")), "kind")
    m = from_spec("powersgd:2").encode(torch.randn(20, 30))
    _expect(_tamper(m, _set("rows", 21)), "rows")
    _expect(_tamper(m, _set("mode", "svd")), "mode")
    _expect(_tamper(m, _set("rank", 3)), "inner.shape")


def test_packet_construction_checks_buffers() -> None:
    with pytest.raises(PacketError) as info:
        Packet({"codec": "none"}, (torch.zeros(4, dtype=torch.float32),))
    assert info.value.field == "buffers[0]"
    with pytest.raises(PacketError):
        Packet(["not", "a", "dict"], ())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        from_spec("int8").decode("not a packet")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec", ["int8", "int4", "fp4", "fp8", "sign", "topk:0.01", "topk:0.5", "powersgd:2", "countsketch:3x8", "gsketch:8"]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(spec: str, bad: float) -> None:
    x = torch.randn(20, 30)
    x[7, 3] = bad
    with pytest.raises(NonFiniteError):
        from_spec(spec).encode(x)


def test_non_finite_topk_large_tensor() -> None:
    x = torch.randn(1 << 17)
    x[12345] = float("nan")
    with pytest.raises(NonFiniteError):
        from_spec("topk:0.001").encode(x)


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
def test_casts_pass_non_finite_through(spec: str) -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    y = from_spec(spec).decode(from_spec(spec).encode(x))
    assert torch.isnan(y[1]) and y[2] == float("inf") and y[3] == -float("inf")


def test_error_feedback_state_unchanged_on_error() -> None:
    ef = ErrorFeedback(from_spec("int8"))
    ef.encode(torch.randn(10), name="w")
    before = ef.residual("w").clone()
    bad = torch.randn(10)
    bad[0] = float("nan")
    with pytest.raises(NonFiniteError):
        ef.encode(bad, name="w")
    assert torch.equal(ef.residual("w"), before)
    with pytest.raises(ValueError, match="shape"):
        ef.encode(torch.randn(11), name="w")
    assert torch.equal(ef.residual("w"), before)


def test_encode_rejects_non_float() -> None:
    with pytest.raises(TypeError):
        from_spec("int8").encode(torch.arange(10))
    with pytest.raises(ValueError):
        from_spec("randomk:0.1").encode(torch.randn(10), seed=1 << 70)


@pytest.mark.parametrize(
    "spec,words",
    [
        ("", "non-empty"),
        ("zstd", "unknown codec"),
        ("topk", "needs a fraction"),
        ("topk:0", "fraction"),
        ("topk:1.5", "fraction"),
        ("topk:abc", "fraction"),
        ("int8+topk:0.1", "cannot be followed"),
        ("int8:block=12", "block"),
        ("int8:blocksize=16", "no parameter"),
        ("int8:16,block=16", "given twice"),
        ("sign:stochastic=true", "no parameter"),
        ("fp4:e5m3", "format"),
        ("countsketch:5", "ROWSxCOLS"),
        ("powersgd:0", "rank"),
        ("gsketch:16,kind=fft", "kind"),
        ("topk:0.1+", "empty stage"),
        ("int8:block=16,,", "empty argument"),
        ("int8:stochastic=perhaps", "boolean"),
    ],
)
def test_bad_specs(spec: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        from_spec(spec)
    assert words in str(info.value)
