"""The wire envelope: one ZeroMQ multipart message ``[header, *frames]`` per message.

The header is a msgpack map ``{"v", "t", "s", "n", "ts", "b", "f"}``: envelope version (the
framing's, `node.version`; what topics and bodies mean is the wire version a hello names), topic, sender,
sequence number, timestamp, body (any msgpack value) and one descriptor per frame that
follows, ``["t", dtype, shape]`` for a tensor or ``["b", nbytes]`` for raw bytes. Tensors are
never copied into msgpack: each is its own frame, sent zero-copy and received as a view over
the frame's memory.

`decode` treats its input as hostile: it checks every field, every size against `Limits`
(the header, which carries the body, is at most `max_header_bytes`; lists and maps nest at
most `max_depth` deep, so nothing that reads a body later, `json.dumps` included, can hit
Python's recursion limit), and raises only `WireError`, whose `reason` the node counts.

torch is imported when the first tensor is framed or read, not with this module: a process
that only talks to nodes (`starling node status`, `node watch`, `keygen`) never loads it.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import TYPE_CHECKING, Any

import msgpack
import numpy
import zmq

from starling.node.version import ENVELOPE_VERSION

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALLOWED_DTYPES",  # noqa: F822 (built on first read: the module's __getattr__)
    "ENVELOPE_BYTES",
    "ENVELOPE_VERSION",
    "HEADER_KEYS",
    "MAX_SENDER_CHARS",
    "MAX_TOPIC_CHARS",
    "Limits",
    "Message",
    "RejectReason",
    "WireError",
    "decode",
    "encode",
    "frame_nbytes",
]

HEADER_KEYS = frozenset({"v", "t", "s", "n", "ts", "b", "f"})
MAX_TOPIC_CHARS = 256
MAX_SENDER_CHARS = 128
_MAX_SEQ = 1 << 63


class RejectReason(str, Enum):
    """Why an incoming message was dropped; the node counts drops by these values."""

    # raised by wire.decode
    MALFORMED = "malformed"
    BAD_VERSION = "bad_version"
    BAD_FIELD = "bad_field"
    FRAME_MISMATCH = "frame_mismatch"
    BAD_DTYPE = "bad_dtype"
    BAD_SHAPE = "bad_shape"
    OVERSIZE = "oversize"
    TOO_MANY_FRAMES = "too_many_frames"
    TOO_DEEP = "too_deep"
    # raised by the node
    UNKNOWN_PEER = "unknown_peer"
    BAD_SIGNATURE = "bad_signature"
    SPOOFED_SENDER = "spoofed_sender"
    UNKNOWN_TOPIC = "unknown_topic"
    HANDLER_ERROR = "handler_error"
    NOT_ALLOWED = "not_allowed"  # a peer record whose key is not on the node's allowlist
    BUSY = "busy"  # past a cap on work in flight (node.admission); a request is answered with BUSY
    RATE_LIMITED = "rate_limited"  # a stranger's connection over its rate, dropped unread
    NO_ROUTE = "no_route"  # a relay asked to forward to a peer it cannot reach, or by a node that is no relay
    RELAY_TAMPERED = "relay_tampered"  # a relayed message whose seal does not open (altered on the way)
    REPLAYED = "replayed"  # a relayed message delivered before
    TABLE_FULL = "table_full"  # a relayed record refused: the peer table, or its relayer's share of it, is full
    REACH_ELSEWHERE = "reach_elsewhere"  # a dial-back asked for addresses not at the asker's own IP
    BANNED = "banned"  # from a member this node banned (node.trust)
    INCOMPATIBLE = "incompatible"  # a hello from a peer that speaks no wire version this node speaks


# The bytes of a message around its body (version, topic, sender, sequence, request id, frame
# descriptors): what an answer costs before its body, when a node holds answers to a budget.
ENVELOPE_BYTES = 160


class WireError(ValueError):
    """A message that cannot be accepted; `reason` is what the node counts."""

    def __init__(self, reason: RejectReason, message: str, field: str | None = None) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.field = field


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 1 << 20
    max_frames: int = 1024
    max_message_bytes: int = 1 << 30  # sum of all frames, header included
    max_ndim: int = 8
    max_depth: int = 32  # lists and maps inside one another, the header map counted as 1


@cache
def _allowed_dtypes() -> dict[str, torch.dtype]:
    """The dtypes a tensor frame may carry, by their names on the wire (torch imported here)."""
    import torch

    names = [
        "float32", "float16", "bfloat16", "float64",
        "int8", "uint8", "int16", "int32", "int64", "bool",
        "float8_e4m3fn", "float8_e5m2",
    ]  # fmt: skip
    return {name: getattr(torch, name) for name in names if hasattr(torch, name)}


@cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _allowed_dtypes().items()}


def __getattr__(name: str) -> Any:
    """`ALLOWED_DTYPES`, the wire's dtypes by name, built (importing torch) when first read."""
    if name == "ALLOWED_DTYPES":
        return _allowed_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Message:
    topic: str
    sender: str
    seq: int
    timestamp: float
    body: Any
    # tensors for "t" frames (views over the received memory: treat as read-only),
    # memoryviews for "b" frames
    payload: tuple[torch.Tensor | memoryview, ...]
    nbytes: int  # all frames, header included


# -- encode -----------------------------------------------------------------------------


def encode(
    topic: str,
    sender: str,
    seq: int,
    body: Any = None,
    payload: Sequence[torch.Tensor | bytes | bytearray | memoryview] = (),
    *,
    timestamp: float | None = None,
    check_body: bool = True,
) -> list[bytes | memoryview]:
    """Build the frames of one message; tensors go out as zero-copy frames.

    Raises ValueError/TypeError for arguments that `decode` would reject, so nothing
    unreadable is ever sent.
    """
    _check_topic(topic, ValueError)
    _check_sender(sender, ValueError)
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < _MAX_SEQ:
        raise ValueError(f"seq must be an int in [0, 2**63), got {seq!r}")
    ts = time.time() if timestamp is None else timestamp
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError(f"timestamp must be a finite number, got {ts!r}")

    frames: list[bytes | memoryview] = []
    descriptors: list[list[Any]] = []
    torch = sys.modules.get("torch")  # a process that never imported it holds no tensor
    for index, item in enumerate(payload):
        if torch is not None and isinstance(item, torch.Tensor):
            descriptor, frame = _tensor_frame(item, index)
        elif isinstance(item, (bytes, bytearray, memoryview)):
            frame = _bytes_frame(item)
            descriptor = ["b", frame.nbytes if isinstance(frame, memoryview) else len(frame)]
        else:
            raise TypeError(
                f"payload[{index}] must be a torch.Tensor or bytes-like, got {type(item).__name__}"
            )
        descriptors.append(descriptor)
        frames.append(frame)

    header = {"v": ENVELOPE_VERSION, "t": topic, "s": sender, "n": seq, "ts": ts, "b": body,
              "f": descriptors}  # fmt: skip
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"body is not msgpack-serializable: {exc}") from None
    if not check_body:  # a body this node built in a shape the receiver checks anyway (pings)
        return [packed, *frames]
    try:  # map keys must be str/bytes, extension types are refused on receipt, and so is depth
        _check_depth(msgpack.unpackb(packed, raw=False, strict_map_key=True, ext_hook=_reject_ext),
                     Limits.max_depth)
    except (WireError, ValueError) as exc:
        raise TypeError(f"body would be rejected by the receiver: {exc}") from None
    return [packed, *frames]


def _tensor_frame(tensor: torch.Tensor, index: int) -> tuple[list[Any], memoryview]:
    import torch

    name = _dtype_names().get(tensor.dtype)
    if name is None:
        raise ValueError(f"payload[{index}] has dtype {tensor.dtype}, which the wire does not carry")
    if tensor.layout != torch.strided:
        raise ValueError(f"payload[{index}] has layout {tensor.layout}; only dense tensors travel")
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.resolve_conj().resolve_neg().contiguous()
    raw = flat.reshape(-1).view(torch.uint8).numpy()
    return ["t", name, list(tensor.shape)], memoryview(raw)


def _bytes_frame(item: bytes | bytearray | memoryview) -> bytes | memoryview:
    if isinstance(item, bytes):
        return item
    view = memoryview(item)
    if not view.c_contiguous:
        return view.tobytes()
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


# -- decode -----------------------------------------------------------------------------


def frame_nbytes(frames: Sequence[bytes | memoryview | zmq.Frame]) -> int:
    """Total bytes of a multipart message."""
    return sum(_as_view(frame, index).nbytes for index, frame in enumerate(frames))


def fitting(items: Iterable[Any], budget: float) -> tuple[list[Any], int]:
    """The first of `items` whose msgpack bytes fit in `budget` together (an answer held to
    what its asker may get), and those bytes."""
    out: list[Any] = []
    nbytes = 0
    for item in items:
        size = len(msgpack.packb(item, use_bin_type=True))
        if nbytes + size > budget:
            break
        out.append(item)
        nbytes += size
    return out, nbytes


def decode(frames: Sequence[bytes | memoryview | zmq.Frame], limits: Limits = Limits()) -> Message:
    """Validate and decode one message; raises WireError and nothing else."""
    try:
        return _decode(frames, limits)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(RejectReason.MALFORMED, f"undecodable message ({exc!r})") from None


def _decode(frames: Sequence[bytes | memoryview | zmq.Frame], limits: Limits) -> Message:
    if isinstance(frames, (bytes, bytearray, memoryview, str)):
        raise WireError(RejectReason.MALFORMED, "expected a sequence of frames, got one buffer")
    try:
        count = len(frames)
    except TypeError:
        raise WireError(RejectReason.MALFORMED, "expected a sequence of frames") from None
    if count == 0:
        raise WireError(RejectReason.MALFORMED, "empty message: no header frame")
    if count - 1 > limits.max_frames:
        raise WireError(
            RejectReason.TOO_MANY_FRAMES,
            f"{count - 1} payload frames exceed the limit of {limits.max_frames}",
            "f",
        )
    views = [_as_view(frame, index) for index, frame in enumerate(frames)]
    header_view, data_views = views[0], views[1:]
    header_len = header_view.nbytes
    if header_len > limits.max_header_bytes:
        raise WireError(
            RejectReason.OVERSIZE,
            f"header of {header_len} bytes exceeds the limit of {limits.max_header_bytes}",
        )
    total = sum(view.nbytes for view in views)
    if total > limits.max_message_bytes:
        raise WireError(
            RejectReason.OVERSIZE,
            f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}",
        )

    header = _unpack_header(header_view)
    _check_depth(header, limits.max_depth)
    topic, sender, seq, ts, body, descriptors = _check_header(header, len(data_views))
    payload = tuple(
        _decode_frame(descriptor, view, index, limits)
        for index, (descriptor, view) in enumerate(zip(descriptors, data_views))
    )
    # Interned: a node keeps senders and topics as keys of its tables and counters, and a
    # string decoded per message would be held once per node (n^2 copies in a simulation).
    # Interned strings go when nothing refers to them, so strangers cannot grow the table.
    return Message(topic=sys.intern(topic), sender=sys.intern(sender), seq=seq, timestamp=ts, body=body,
                   payload=payload, nbytes=total)  # fmt: skip


def _as_view(frame: Any, index: int) -> memoryview:
    if isinstance(frame, zmq.Frame):
        view = frame.buffer
    elif isinstance(frame, (bytes, bytearray, memoryview)):
        view = memoryview(frame)
    else:
        raise WireError(
            RejectReason.MALFORMED, f"frame {index} is a {type(frame).__name__}, not bytes-like"
        )
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise WireError(RejectReason.MALFORMED, f"frame {index} is not contiguous memory")
        view = view.cast("B")
    return view


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(RejectReason.MALFORMED, f"msgpack extension type {code} is not allowed", "b")


def _unpack_header(view: memoryview) -> Any:
    bound = max(view.nbytes, 1)  # no string, array or map can be longer than the header
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_bin_len=bound,
            max_str_len=bound,
            max_array_len=bound,
            max_map_len=bound,
            max_ext_len=bound,
        )
    except WireError:
        raise
    except Exception as exc:
        raise WireError(RejectReason.MALFORMED, f"header is not valid msgpack ({exc!r})") from None


def _check_depth(value: Any, max_depth: int) -> None:
    """Raise TOO_DEEP if lists and maps nest deeper than `max_depth` (without recursing).

    One level at a time, each in one comprehension: every ping carries a digest of up to
    MAX_DIGEST entries, and a walk that pushed and popped each container cost more than the
    rest of a ping's handling in a swarm of hundreds of nodes in one process."""
    level = [value] if type(value) is list or type(value) is dict else []
    depth = 1
    while level:
        if depth > max_depth:
            raise WireError(RejectReason.TOO_DEEP, f"lists and maps nest deeper than {max_depth}", "b")
        level = [child for item in level for child in (item.values() if type(item) is dict else item)
                 if type(child) is list or type(child) is dict]
        depth += 1


def _check_topic(topic: Any, error: type[Exception]) -> None:
    if not isinstance(topic, str) or not topic or len(topic) > MAX_TOPIC_CHARS:
        message = f"topic must be a non-empty str of at most {MAX_TOPIC_CHARS} chars, got {_brief(topic)}"
        raise _make_error(error, message, "t")


def _check_sender(sender: Any, error: type[Exception]) -> None:
    if not isinstance(sender, str) or len(sender) > MAX_SENDER_CHARS:
        message = f"sender must be a str of at most {MAX_SENDER_CHARS} chars, got {_brief(sender)}"
        raise _make_error(error, message, "s")


def _make_error(error: type[Exception], message: str, field: str) -> Exception:
    if error is WireError:
        return WireError(RejectReason.BAD_FIELD, f"field {field!r}: {message}", field)
    return error(message)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad_field(field: str, message: str) -> WireError:
    return WireError(RejectReason.BAD_FIELD, f"field {field!r}: {message}", field)


def _check_header(header: Any, frame_count: int) -> tuple[str, str, int, float, Any, list[Any]]:
    if not isinstance(header, dict):
        raise WireError(RejectReason.MALFORMED, f"header is a {type(header).__name__}, not a map")
    # The version is checked first: another version may use other keys.
    if "v" not in header:
        raise _bad_field("v", "missing version")
    version = header["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise _bad_field("v", f"version must be an int, got {_brief(version)}")
    if version != ENVELOPE_VERSION:
        raise WireError(
            RejectReason.BAD_VERSION, f"envelope version {version}, expected {ENVELOPE_VERSION}", "v"
        )
    keys = set(header)
    if keys != HEADER_KEYS:
        missing = sorted(HEADER_KEYS - keys)
        extra = sorted(map(str, keys - HEADER_KEYS))
        field = missing[0] if missing else extra[0]
        raise _bad_field(field, f"header keys wrong (missing {missing}, unexpected {extra})")

    topic, sender, seq, ts = header["t"], header["s"], header["n"], header["ts"]
    _check_topic(topic, WireError)
    _check_sender(sender, WireError)
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < _MAX_SEQ:
        raise _bad_field("n", f"seq must be an int in [0, 2**63), got {_brief(seq)}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise _bad_field("ts", f"timestamp must be a finite number, got {_brief(ts)}")
    descriptors = header["f"]
    if not isinstance(descriptors, list):
        raise _bad_field("f", f"frame descriptors must be a list, got {type(descriptors).__name__}")
    if len(descriptors) != frame_count:
        raise WireError(
            RejectReason.FRAME_MISMATCH,
            f"header describes {len(descriptors)} frames but {frame_count} follow",
            "f",
        )
    return topic, sender, seq, float(ts), header["b"], descriptors


def _decode_frame(
    descriptor: Any, view: memoryview, index: int, limits: Limits
) -> torch.Tensor | memoryview:
    field = f"f[{index}]"
    if not isinstance(descriptor, list) or not descriptor:
        raise _bad_field(field, f"descriptor must be a non-empty list, got {_brief(descriptor)}")
    kind = descriptor[0]
    if kind == "b":
        if len(descriptor) != 2:
            raise _bad_field(field, "a bytes descriptor is ['b', nbytes]")
        nbytes = descriptor[1]
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise _bad_field(field, f"nbytes must be a non-negative int, got {_brief(nbytes)}")
        if nbytes != view.nbytes:
            raise WireError(
                RejectReason.FRAME_MISMATCH,
                f"{field}: header says {nbytes} bytes, frame has {view.nbytes}",
                field,
            )
        return view
    if kind != "t":
        raise _bad_field(field, f"descriptor kind must be 't' or 'b', got {_brief(kind)}")
    if len(descriptor) != 3:
        raise _bad_field(field, "a tensor descriptor is ['t', dtype, shape]")
    dtype_name, shape = descriptor[1], descriptor[2]
    dtype = _allowed_dtypes().get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise WireError(
            RejectReason.BAD_DTYPE, f"{field}: dtype {_brief(dtype_name)} is not allowed", field
        )
    if not isinstance(shape, list) or len(shape) > limits.max_ndim:
        raise WireError(
            RejectReason.BAD_SHAPE,
            f"{field}: shape must be a list of at most {limits.max_ndim} dims, got {_brief(shape)}",
            field,
        )
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise WireError(
                RejectReason.BAD_SHAPE,
                f"{field}: shape dims must be non-negative ints, got {_brief(shape)}",
                field,
            )
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if expected != view.nbytes:
        raise WireError(
            RejectReason.FRAME_MISMATCH,
            f"{field}: shape {shape} of {dtype_name} needs {expected} bytes, frame has {view.nbytes}",
            field,
        )
    return _tensor_view(view, dtype, shape, field)


def _tensor_view(view: memoryview, dtype: torch.dtype, shape: list[int], field: str) -> torch.Tensor:
    import torch

    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    if dtype == torch.bool and int(numpy.frombuffer(view, dtype=numpy.uint8).max()) > 1:
        raise WireError(RejectReason.MALFORMED, f"{field}: bool tensor holds bytes other than 0/1", field)
    with warnings.catch_warnings():
        # Frames are read-only memory; the Message contract says to treat tensors as such.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        # frombuffer straight to the dtype: a later .view(dtype) is ~100x slower here.
        tensor = torch.frombuffer(view, dtype=dtype)
    if tensor.data_ptr() % tensor.element_size():
        # ZeroMQ hands out 8-byte aligned frames, enough for every allowed dtype, so this
        # copy only happens for odd-offset buffers; copying on the network thread is what
        # a zero-copy receive path must avoid.
        tensor = tensor.clone()
    return tensor.reshape(shape)
