"""Hostile input: every input either decodes or raises WireError, never anything else."""

from __future__ import annotations

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from starling.node.wire import ALLOWED_DTYPES, Limits, Message, WireError, decode, encode

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
    database=None,
)
SMALL_LIMITS = Limits(max_header_bytes=4096, max_frames=16, max_message_bytes=1 << 16, max_ndim=4)


def _decodes_or_rejects(frames, limits: Limits = Limits()) -> Message | None:
    try:
        message = decode(frames, limits)
    except WireError as exc:
        assert exc.reason is not None
        return None
    # anything accepted is fully usable
    for item in message.payload:
        if isinstance(item, torch.Tensor):
            item.sum() if item.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) else item.float()
        else:
            bytes(item)
    return message


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=8,
)  # fmt: skip


@st.composite
def valid_messages(draw) -> list:
    payload = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            payload.append(draw(st.binary(max_size=32)))
        else:
            name = draw(st.sampled_from(sorted(ALLOWED_DTYPES)))
            shape = draw(st.lists(st.integers(0, 4), max_size=3))
            tensor = torch.zeros(shape, dtype=torch.uint8).to(ALLOWED_DTYPES[name])
            payload.append(tensor)
    topic = draw(st.text(min_size=1, max_size=10))
    sender = draw(st.text(max_size=10))
    seq = draw(st.integers(0, 2**63 - 1))
    body = draw(st.none() | st.integers(0, 9)
                | st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**64 - 1), max_size=2))  # msgpack's range
    frames = encode(topic, sender, seq, body, payload, timestamp=draw(st.floats(-1e9, 1e9)))
    return [bytes(frame) for frame in frames]


@FUZZ
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_random_bytes(frames):
    _decodes_or_rejects(frames)
    _decodes_or_rejects(frames, SMALL_LIMITS)


@FUZZ
@given(msgpack_values, st.lists(st.binary(max_size=16), max_size=3))
def test_random_msgpack_headers(header, rest):
    _decodes_or_rejects([msgpack.packb(header, use_bin_type=True), *rest])


header_values = st.one_of(
    msgpack_values,
    st.lists(st.sampled_from(["t", "b", "float32", "bool", "bfloat16", "x"]) | st.integers(-2, 2**64 - 1)
             | st.lists(st.integers(-2, 10), max_size=10), max_size=4),
)  # fmt: skip


@FUZZ
@given(
    valid_messages(),
    st.sampled_from(["v", "t", "s", "n", "ts", "b", "f", "x"]),
    header_values,
)
def test_changed_header_values(frames, key, value):
    header = msgpack.unpackb(frames[0], raw=False)
    header[key] = value
    _decodes_or_rejects([msgpack.packb(header, use_bin_type=True), *frames[1:]])


@FUZZ
@given(valid_messages(), st.integers(0, 10), header_values)
def test_changed_descriptors(frames, index, value):
    header = msgpack.unpackb(frames[0], raw=False)
    if header["f"]:
        descriptor = header["f"][index % len(header["f"])]
        descriptor[index % len(descriptor)] = value
    else:
        header["f"] = [value]
    _decodes_or_rejects([msgpack.packb(header, use_bin_type=True), *frames[1:]])


@FUZZ
@given(valid_messages(), st.data())
def test_mutated_frames(frames, data):
    assert _decodes_or_rejects(frames) is not None  # the unmutated message is valid
    frames = list(frames)
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "truncate", "extend", "swap", "drop", "dup"]))
        index = data.draw(st.integers(0, len(frames) - 1)) if frames else 0
        if action == "flip" and frames and frames[index]:
            frame = bytearray(frames[index])
            position = data.draw(st.integers(0, len(frame) - 1))
            frame[position] ^= data.draw(st.integers(1, 255))
            frames[index] = bytes(frame)
        elif action == "truncate" and frames:
            cut = data.draw(st.integers(0, len(frames[index])))
            frames[index] = frames[index][:cut]
        elif action == "extend" and frames:
            frames[index] = frames[index] + data.draw(st.binary(min_size=1, max_size=8))
        elif action == "swap" and len(frames) > 1:
            other = data.draw(st.integers(0, len(frames) - 1))
            frames[index], frames[other] = frames[other], frames[index]
        elif action == "drop" and frames:
            del frames[index]
        elif action == "dup" and frames:
            frames.insert(index, frames[index])
    _decodes_or_rejects(frames)
    _decodes_or_rejects([memoryview(f) for f in frames], SMALL_LIMITS)


@FUZZ
@given(valid_messages())
def test_valid_messages_round_trip(frames):
    message = _decodes_or_rejects(frames)
    assert message is not None
    again = encode(message.topic, message.sender, message.seq, message.body, message.payload,
                   timestamp=message.timestamp)  # fmt: skip
    assert [bytes(f) for f in again] == frames
