from __future__ import annotations

import math
import warnings

import msgpack
import pytest
import torch
import zmq

from starling.node.wire import (
    ALLOWED_DTYPES,
    ENVELOPE_VERSION,
    Limits,
    Message,
    RejectReason,
    WireError,
    decode,
    encode,
    frame_nbytes,
)


def _header(frames) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def _with_header(frames, **changes) -> list:
    header = _header(frames)
    for key, value in changes.items():
        if value is _DELETE:
            del header[key]
        else:
            header[key] = value
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


_DELETE = object()


def _sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -100), min(info.max, 100) + 1, shape, dtype=dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()
    )


def test_enum_values():
    assert ENVELOPE_VERSION == 1
    assert RejectReason.MALFORMED == "malformed"
    assert RejectReason("unknown_peer") is RejectReason.UNKNOWN_PEER
    for name in ["BAD_SIGNATURE", "SPOOFED_SENDER", "UNKNOWN_TOPIC", "HANDLER_ERROR"]:
        assert getattr(RejectReason, name).value == name.lower()


def test_allowed_dtypes():
    for name in ["float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16",
                 "int32", "int64", "bool"]:  # fmt: skip
        assert ALLOWED_DTYPES[name] == getattr(torch, name)
    assert "float8_e4m3fn" in ALLOWED_DTYPES and "float8_e5m2" in ALLOWED_DTYPES
    assert "complex64" not in ALLOWED_DTYPES


def test_round_trip_header_fields():
    frames = encode("grad/0", "peer-a", 7, {"round": 3, "names": ["w"], "raw": b"\x00\xff"},
                    timestamp=123.5)  # fmt: skip
    assert len(frames) == 1
    message = decode(frames)
    assert isinstance(message, Message)
    assert message.topic == "grad/0"
    assert message.sender == "peer-a"
    assert message.seq == 7
    assert message.timestamp == 123.5
    assert message.body == {"round": 3, "names": ["w"], "raw": b"\x00\xff"}
    assert message.payload == ()
    assert message.nbytes == frame_nbytes(frames) == len(frames[0])


def test_default_timestamp_is_now():
    import time

    before = time.time()
    message = decode(encode("t", "s", 0))
    assert before - 1 <= message.timestamp <= time.time() + 1
    assert message.body is None


@pytest.mark.parametrize("name", sorted(ALLOWED_DTYPES))
def test_round_trip_each_dtype(name):
    dtype = ALLOWED_DTYPES[name]
    tensor = _sample(dtype)
    frames = encode("t", "s", 1, None, [tensor])
    assert _header(frames)["f"] == [["t", name, [3, 5]]]
    (out,) = decode(frames).payload
    assert _same(out, tensor)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0, 2), ()])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "int64", "bool", "uint8"])
def test_empty_and_zero_dim(shape, name):
    tensor = _sample(ALLOWED_DTYPES[name], shape)
    (out,) = decode(encode("t", "s", 1, None, [tensor])).payload
    assert out.shape == torch.Size(shape)
    assert _same(out, tensor)


def test_many_frames_mixed():
    payload = []
    for i in range(200):
        if i % 3 == 0:
            payload.append(bytes([i % 256]) * i)
        else:
            payload.append(torch.full((i % 7, 2), float(i)))
    message = decode(encode("t", "s", 1, {"n": len(payload)}, payload))
    assert len(message.payload) == len(payload)
    for sent, received in zip(payload, message.payload):
        if isinstance(sent, bytes):
            assert isinstance(received, memoryview)
            assert bytes(received) == sent
        else:
            assert torch.equal(received, sent)


def test_raw_bytes_frames():
    data = [b"", b"abc", bytearray(b"xyz"), memoryview(b"0123456789")[2:5]]
    frames = encode("t", "s", 1, None, data)
    assert _header(frames)["f"] == [["b", 0], ["b", 3], ["b", 3], ["b", 3]]
    payload = decode(frames).payload
    assert [bytes(p) for p in payload] == [b"", b"abc", b"xyz", b"234"]
    assert all(isinstance(p, memoryview) for p in payload)


def test_multidimensional_memoryview_is_flattened():
    view = memoryview(bytearray(range(12))).cast("B", (3, 4))
    (out,) = decode(encode("t", "s", 1, None, [view])).payload
    assert bytes(out) == bytes(range(12))


def test_non_contiguous_and_grad_tensors():
    base = torch.randn(4, 6, requires_grad=True)
    transposed = base.t()
    strided = base[:, ::2]
    payload = decode(encode("t", "s", 1, None, [transposed, strided])).payload
    assert torch.equal(payload[0], transposed.detach())
    assert torch.equal(payload[1], strided.detach())


def test_conj_and_neg_views_are_resolved():
    tensor = torch.randn(5)
    neg = torch._neg_view(tensor)
    (out,) = decode(encode("t", "s", 1, None, [neg])).payload
    assert torch.equal(out, -tensor)


def test_tensor_frame_is_zero_copy_on_send():
    tensor = torch.arange(16, dtype=torch.float32)
    frames = encode("t", "s", 1, None, [tensor])
    assert isinstance(frames[1], memoryview)
    tensor[0] = 42.0  # the frame views the tensor's memory
    assert decode(frames).payload[0][0].item() == 42.0


def test_decode_is_zero_copy_for_aligned_frames():
    data = bytearray(torch.arange(1024, dtype=torch.float32).numpy().tobytes())
    frames = encode("t", "s", 1, None, [torch.zeros(1024)])
    frames[1] = data
    (out,) = decode(frames).payload
    data[0:4] = torch.tensor([7.0]).numpy().tobytes()
    assert out.data_ptr() == torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert out[0].item() == 7.0


def test_unaligned_frame_is_decoded_correctly():
    tensor = torch.arange(10, dtype=torch.float64)
    buffer = bytearray(1) + bytearray(tensor.numpy().tobytes())
    frames = encode("t", "s", 1, None, [tensor])
    frames[1] = memoryview(buffer)[1:]
    (out,) = decode(frames).payload
    assert torch.equal(out, tensor)


def test_no_warning_for_read_only_frames():
    frames = [bytes(f) for f in encode("t", "s", 1, None, [torch.ones(4)])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode(frames)


def test_zmq_frames_round_trip():
    context = zmq.Context()
    a = context.socket(zmq.PAIR)
    b = context.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-test")
        b.connect("inproc://wire-test")
        tensors = [torch.randn(64, 64), torch.randn(3).to(torch.bfloat16), torch.empty(0)]
        a.send_multipart(encode("t", "s", 9, {"k": 1}, [*tensors, b"raw"]), copy=False)
        received = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in received)
        message = decode(received)
        assert message.seq == 9 and message.body == {"k": 1}
        for sent, got in zip(tensors, message.payload):
            assert _same(got, sent)
        assert bytes(message.payload[-1]) == b"raw"
        assert message.nbytes == frame_nbytes(received)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        context.term()


# -- encode refuses what decode would reject -------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(topic="", sender="s", seq=0),
        dict(topic="x" * 257, sender="s", seq=0),
        dict(topic="t", sender="s" * 129, seq=0),
        dict(topic="t", sender="s", seq=-1),
        dict(topic="t", sender="s", seq=2**63),
        dict(topic="t", sender="s", seq=True),
        dict(topic="t", sender="s", seq=0, timestamp=math.nan),
        dict(topic="t", sender="s", seq=0, timestamp=math.inf),
        dict(topic="t", sender="s", seq=0, payload=[torch.zeros(2, dtype=torch.complex64)]),
        dict(topic="t", sender="s", seq=0, payload=[torch.zeros(2).to_sparse()]),
    ],
)
def test_encode_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        encode(**kwargs)


def test_encode_rejects_unserializable_body_and_payload():
    with pytest.raises(TypeError):
        encode("t", "s", 0, {"x": object()})
    with pytest.raises(TypeError):
        encode("t", "s", 0, None, ["a string"])  # type: ignore[list-item]


# -- decode rejects malformed input with the right reason --------------------------------------


def _valid() -> list:
    return encode("t", "s", 1, {"a": 1}, [torch.ones(2, 3), b"abcd"], timestamp=1.0)


def _reason(frames, limits: Limits = Limits()) -> RejectReason:
    with pytest.raises(WireError) as info:
        decode(frames, limits)
    assert isinstance(info.value, ValueError)
    assert str(info.value)
    return info.value.reason


def test_valid_sample_decodes():
    assert decode(_valid()).topic == "t"


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"\xc1"],  # never-used msgpack byte
        [b"\x92\x01"],  # truncated array
        [msgpack.packb({"v": 1}) + b"extra"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb("just a string")],
        [msgpack.packb({1: 2})],  # non-str map key
        [msgpack.packb({"v": 1, "t": msgpack.ExtType(5, b"x")})],
        [b"\xa3\xff\xfe\xfd"],  # invalid utf-8 str
        ["not bytes"],
        [12345],
        b"a single buffer",
    ],
)
def test_malformed(frames):
    assert _reason(frames) == RejectReason.MALFORMED


def test_bad_version():
    assert _reason(_with_header(_valid(), v=2)) == RejectReason.BAD_VERSION
    assert _reason(_with_header(_valid(), v=0)) == RejectReason.BAD_VERSION


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(v=_DELETE), "v"),
        (dict(v="1"), "v"),
        (dict(v=True), "v"),
        (dict(t=_DELETE), "t"),
        (dict(b=_DELETE), "b"),
        (dict(extra=1), "extra"),
        (dict(t=""), "t"),
        (dict(t="x" * 257), "t"),
        (dict(t=5), "t"),
        (dict(t=b"bytes"), "t"),
        (dict(s="x" * 129), "s"),
        (dict(s=None), "s"),
        (dict(n=-1), "n"),
        (dict(n=2**63), "n"),
        (dict(n=1.0), "n"),
        (dict(n=False), "n"),
        (dict(ts="now"), "ts"),
        (dict(ts=math.nan), "ts"),
        (dict(ts=-math.inf), "ts"),
        (dict(ts=None), "ts"),
        (dict(f="nope"), "f"),
        (dict(f={"a": 1}), "f"),
    ],
)
def test_bad_field(changes, field):
    with pytest.raises(WireError) as info:
        decode(_with_header(_valid(), **changes))
    assert info.value.reason == RejectReason.BAD_FIELD
    assert info.value.field == field
    assert repr(field) in str(info.value)


def test_timestamp_may_be_an_int():
    assert decode(_with_header(_valid(), ts=5)).timestamp == 5.0


@pytest.mark.parametrize(
    "descriptor",
    [
        "t",
        [],
        ["x", 4],
        ["b"],
        ["b", 4, 4],
        ["b", "4"],
        ["b", -1],
        ["b", True],
        ["t", "float32"],
        ["t", "float32", [1], 0],
    ],
)
def test_bad_descriptor(descriptor):
    frames = _valid()
    header = _header(frames)
    header["f"][1] = descriptor
    with pytest.raises(WireError) as info:
        decode(_with_header(frames, f=header["f"]))
    assert info.value.reason == RejectReason.BAD_FIELD
    assert info.value.field == "f[1]"


def test_frame_count_mismatch():
    frames = _valid()
    assert _reason(frames[:-1]) == RejectReason.FRAME_MISMATCH
    assert _reason([*frames, b"more"]) == RejectReason.FRAME_MISMATCH


def test_frame_length_mismatch():
    frames = _valid()
    assert _reason([frames[0], bytes(frames[1])[:-1], frames[2]]) == RejectReason.FRAME_MISMATCH
    assert _reason([frames[0], bytes(frames[1]) + b"\x00", frames[2]]) == RejectReason.FRAME_MISMATCH
    assert _reason([frames[0], frames[1], b"abc"]) == RejectReason.FRAME_MISMATCH
    swapped = [frames[0], frames[2], frames[1]]
    assert _reason(swapped) == RejectReason.FRAME_MISMATCH


@pytest.mark.parametrize("dtype", ["complex64", "float", "object", "", 5, None, ["float32"],
                                   "float8_e4m3fnuz", "quint8"])  # fmt: skip
def test_bad_dtype(dtype):
    frames = _valid()
    header = _header(frames)
    header["f"][0] = ["t", dtype, [2, 3]]
    assert _reason(_with_header(frames, f=header["f"])) == RejectReason.BAD_DTYPE


@pytest.mark.parametrize("shape", [[-1, -6], [2, "3"], [2.0, 3], [True, 6], "2x3", 6, None,
                                   [1] * 9 + [6]])  # fmt: skip
def test_bad_shape(shape):
    frames = _valid()
    header = _header(frames)
    header["f"][0] = ["t", "float32", shape]
    assert _reason(_with_header(frames, f=header["f"])) == RejectReason.BAD_SHAPE


def test_max_ndim_limit_is_configurable():
    frames = encode("t", "s", 1, None, [torch.zeros([1] * 5)])
    assert decode(frames).payload[0].ndim == 5
    assert _reason(frames, Limits(max_ndim=4)) == RejectReason.BAD_SHAPE


def test_huge_shape_is_a_mismatch_not_an_allocation():
    frames = _valid()
    header = _header(frames)
    header["f"][0] = ["t", "float32", [2**40, 2**40, 2**40]]
    assert _reason(_with_header(frames, f=header["f"])) == RejectReason.FRAME_MISMATCH


def test_bool_frame_with_invalid_bytes():
    frames = encode("t", "s", 1, None, [torch.ones(4, dtype=torch.bool)])
    frames[1] = b"\x00\x01\x02\x01"
    assert _reason(frames) == RejectReason.MALFORMED


def test_oversize_header():
    frames = encode("t", "s", 1, "x" * 2000)
    assert _reason(frames, Limits(max_header_bytes=1000)) == RejectReason.OVERSIZE


def _nested(depth: int, leaf: object = 0) -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _header_with_body(body: object) -> list:
    header = {"v": ENVELOPE_VERSION, "t": "t", "s": "s", "n": 1, "ts": 1.0, "b": body, "f": []}
    return [msgpack.packb(header, use_bin_type=True)]


def test_a_body_nested_deeper_than_the_limit_is_rejected_without_recursion():
    limit = Limits().max_depth
    assert decode(_header_with_body(_nested(limit - 1))).body == _nested(limit - 1)  # the header map is 1
    assert _reason(_header_with_body(_nested(limit))) == RejectReason.TOO_DEEP
    assert _reason(_header_with_body(_nested(990))) == RejectReason.TOO_DEEP  # a config nested 990 deep
    assert _reason(_header_with_body(_nested(5)), Limits(max_depth=4)) == RejectReason.TOO_DEEP


def test_a_body_too_deep_for_the_receiver_is_not_sent():
    with pytest.raises(TypeError, match="nest deeper"):
        encode("t", "s", 1, _nested(Limits().max_depth))


def test_oversize_message():
    frames = encode("t", "s", 1, None, [torch.zeros(1000)])
    assert decode(frames, Limits(max_message_bytes=5000)).payload[0].numel() == 1000
    assert _reason(frames, Limits(max_message_bytes=3000)) == RejectReason.OVERSIZE


def test_too_many_frames():
    frames = encode("t", "s", 1, None, [b"x"] * 11)
    assert len(decode(frames, Limits(max_frames=11)).payload) == 11
    assert _reason(frames, Limits(max_frames=10)) == RejectReason.TOO_MANY_FRAMES


def test_deeply_nested_body_is_malformed_not_a_crash():
    header = b"\x91" * 100_000 + b"\x00"
    assert _reason([header]) == RejectReason.MALFORMED


def test_huge_declared_lengths_are_bounded():
    # a str32 / array32 / map32 header that claims 4 GiB but carries a few bytes
    for prefix in (b"\xdb", b"\xdd", b"\xdf", b"\xc6"):
        assert _reason([prefix + b"\xff\xff\xff\xff" + b"ab"]) == RejectReason.MALFORMED


def test_wire_error_message_names_the_field():
    with pytest.raises(WireError, match="'n'"):
        decode(_with_header(_valid(), n=-5))


def test_encode_rejects_bodies_the_receiver_would_reject():
    with pytest.raises(TypeError, match="rejected"):
        encode("t", "s", 0, {1: "int key"})
    with pytest.raises(TypeError, match="rejected"):
        encode("t", "s", 0, msgpack.ExtType(3, b"x"))


# A process that only talks to nodes (`node status`, `node watch`, `keygen`) never loads torch;
# the first tensor frame it reads loads it and decodes as in any other process.
WITHOUT_TORCH = """
import struct, sys
import msgpack
import starling.cli.main, starling.node.client
from starling.node.wire import decode, encode
assert "torch" not in sys.modules, "the CLI loaded torch"
message = decode(encode("x", "me", 1, {"a": 1}, [b"raw"]))
assert bytes(message.payload[0]) == b"raw" and "torch" not in sys.modules, "a bytes frame loaded torch"
header = {"v": 1, "t": "x", "s": "me", "n": 2, "ts": 0.0, "b": None, "f": [["t", "float32", [2]]]}
message = decode([msgpack.packb(header, use_bin_type=True), struct.pack("<2f", 1.0, 2.0)])
assert "torch" in sys.modules and message.payload[0].tolist() == [1.0, 2.0], message
print("ok")
"""


@pytest.mark.slow
def test_a_process_that_only_talks_to_nodes_never_loads_torch():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
