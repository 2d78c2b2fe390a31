"""The compressor seam: ``Packet``, ``PacketError`` and the abstract ``Compressor``.

A packet is a small msgpack-able header plus raw uint8 buffers that the wire sends as
frames. Every codec is a thin subclass of ``Compressor`` with two methods, ``_encode`` and
``_decode``. Codecs that reduce a tensor to a smaller float tensor (top-k values, low-rank
factors, a sketch) hand that "payload" to a next stage (``inner``), which is how
``"topk:0.01+int8"`` composes; without a next stage the payload travels raw.

Decoding reads every parameter from the header (never from the decoder's own settings) and
checks it against the buffers; any disagreement raises ``PacketError`` naming the field.
Decoding never writes into its input buffers (they may be read-only wire memory).

Every codec states two facts about itself, so that callers branch on what a codec can do and
never on its name: ``lossless`` (decoding gives back the input bit for bit) and ``zero_copy``
(the packet can carry the input's own memory, and a decode can read the wire buffer in
place). ``encode(t, copy=False)`` and ``decode(p, copy=False)`` use the second where the codec
has it; by default a packet never shares memory with its input, nor a decoded tensor with
its packet.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import torch

from starling.common.hashing import check_seed

from . import registry, rng

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        FLOAT_DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in FLOAT_DTYPES.items()}
_FP8_INPUTS = frozenset(v for k, v in FLOAT_DTYPES.items() if k.startswith("float8"))


def chunk_elems(device: torch.device, cpu: int) -> int:
    """Elements per chunk of a chunked loop: cache-sized on CPU, large on accelerators
    (where every op is a kernel launch and memory is plentiful)."""
    return cpu if device.type == "cpu" else max(cpu, 1 << 24)

# Header keys owned by the base class; codec fields must not reuse them.
_RESERVED = frozenset({"codec", "shape", "dtype", "inner"})


class PacketError(ValueError):
    """A packet whose header and buffers disagree; ``field`` names the culprit."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"bad packet field {field!r}: {reason}")
        self.field = field
        self.reason = reason


class NonFiniteError(ValueError):
    """The tensor to encode holds NaN or Inf and the codec cannot represent it."""


@dataclass(frozen=True, eq=False)
class Packet:
    """An encoded tensor: ``header`` (msgpack-able) and raw uint8 ``buffers``."""

    header: dict[str, Any]
    buffers: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.header, dict):
            raise PacketError("header", f"must be a dict, got {type(self.header).__name__}")
        buffers = tuple(self.buffers)
        for i, buf in enumerate(buffers):
            if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
                raise PacketError(f"buffers[{i}]", "must be a 1-D torch.uint8 tensor")
            if not buf.is_contiguous():
                raise PacketError(f"buffers[{i}]", "must be contiguous")
        object.__setattr__(self, "buffers", buffers)

    @property
    def header_nbytes(self) -> int:
        return len(msgpack.packb(self.header, use_bin_type=True))

    @property
    def nbytes(self) -> int:
        """Exact size on the wire: packed header plus every buffer's bytes."""
        return self.header_nbytes + sum(b.numel() for b in self.buffers)

    def to(self, device: torch.device | str) -> Packet:
        return Packet(self.header, tuple(b.to(device) for b in self.buffers))


@dataclass(frozen=True)
class Param:
    """One spec parameter of a codec, e.g. ``block`` in ``"int8:block=128"``."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    positional: bool = False
    fmt: Callable[[Any], str] = str
    required: bool = False


@dataclass(frozen=True)
class Encoded:
    """What a codec's ``_encode`` returns: header fields, own buffers, payload for ``inner``."""

    fields: dict[str, Any]
    buffers: tuple[torch.Tensor, ...] = ()
    payload: torch.Tensor | None = None


class Header:
    """Typed, validated access to one stage's header; errors name ``path + key``."""

    def __init__(self, header: Any, path: str) -> None:
        if not isinstance(header, dict):
            raise PacketError(path.rstrip(".") or "header", "must be a dict")
        self.raw = header
        self.path = path

    def error(self, key: str, reason: str) -> PacketError:
        return PacketError(self.path + key, reason)

    def get(self, key: str) -> Any:
        if key not in self.raw:
            raise self.error(key, "missing")
        return self.raw[key]

    def int(self, key: str, lo: int = 0, hi: int | None = None) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an int, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            raise self.error(key, f"{value} outside [{lo}, {hi if hi is not None else 'inf'}]")
        return value

    def float(self, key: str) -> float:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(key, f"must be a finite number, got {value!r}")
        return float(value)

    def str(self, key: str, choices: Sequence[str] | None = None) -> str:
        value = self.get(key)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            allowed = f" (one of {', '.join(choices)})" if choices is not None else ""
            raise self.error(key, f"bad value {value!r}{allowed}")
        return value

    def bool(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise self.error(key, f"must be a bool, got {value!r}")
        return value

    def seed(self, key: str = "seed") -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < (1 << 64):
            raise self.error(key, f"must be a 64-bit int, got {value!r}")
        return value

    def shape(self) -> tuple[int, ...]:
        value = self.get("shape")
        if not isinstance(value, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
        ):
            raise self.error("shape", f"must be a list of non-negative ints, got {value!r}")
        if len(value) > 64:
            raise self.error("shape", "more than 64 dimensions")
        return tuple(value)

    def dtype(self) -> torch.dtype:
        name = self.get("dtype")
        if name not in FLOAT_DTYPES:
            raise self.error("dtype", f"unknown dtype {name!r}")
        return FLOAT_DTYPES[name]

    @staticmethod
    def expect_len(buf: torch.Tensor, nbytes: int, field: str) -> None:
        if buf.numel() != nbytes:
            raise PacketError(field, f"has {buf.numel()} bytes, header implies {nbytes}")


def view_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 buffer as ``dtype`` without writing to it (copies if misaligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size > 1 and buf.numel() and buf.data_ptr() % size:
        buf = buf.clone()
    return buf.view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous uint8 view of a contiguous tensor."""
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # torch calls a lone element contiguous whatever its stride
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def fresh_seed() -> int:
    """A seed from torch's default generator, so ``torch.manual_seed`` makes runs repeatable."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def codec_class(name: Any, field: str = "codec") -> type[Compressor]:
    """The codec a header names (PacketError if none of that name is registered)."""
    cls = registry.lookup(name)
    if cls is None:
        raise PacketError(field, f"unknown codec {name!r}")
    return cls


class Compressor(ABC):
    """Encode a float tensor to a ``Packet`` and back. Stateless unless a subclass says so."""

    codec: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    n_buffers: ClassVar[int] = 0
    takes_inner: ClassVar[bool] = False  # hands a float payload to a next stage
    seeded: ClassVar[bool] = False  # the seed travels in the header
    keeps_fp8: ClassVar[bool] = False  # handles float8 input itself (others see float32)
    # What one stage can do; every codec states both (``register`` checks), and a pipeline's
    # ``lossless`` and ``zero_copy`` follow from its stages'.
    stage_lossless: ClassVar[bool]  # this stage gives back its input bit for bit
    # This stage's ``_encode`` puts its input's memory in the packet and its ``_decode`` returns
    # a view of its buffer: the base class copies around both unless the caller says ``copy=False``.
    stage_zero_copy: ClassVar[bool]

    def __init__(self, inner: Compressor | None = None) -> None:
        if inner is not None and not self.takes_inner:
            raise ValueError(f"codec {self.codec!r} cannot be followed by another stage")
        self.inner = inner

    # --- naming ---------------------------------------------------------------------------

    @property
    def spec(self) -> str:
        """Canonical spec string; ``from_spec(c.spec)`` builds an equivalent compressor."""
        parts = []
        for i, p in enumerate(self.params):
            value = getattr(self, p.name)
            if i == 0 and p.positional and (p.required or value != p.default):
                parts.append(p.fmt(value))
            elif value != p.default:
                parts.append(f"{p.name}={p.fmt(value)}")
        own = self.codec + (":" + ",".join(parts) if parts else "")
        return own + ("+" + self.inner.spec if self.inner is not None else "")

    @classmethod
    def from_args(
        cls, positional: Sequence[str], keyword: dict[str, str], inner: Compressor | None = None
    ) -> Compressor:
        """Build from parsed spec arguments (strings); raises ValueError naming the problem."""
        if len(positional) > len(cls.params):
            raise ValueError(f"{cls.codec} takes at most {len(cls.params)} arguments, got {len(positional)}")
        known = {p.name: p for p in cls.params}
        raw: dict[str, str] = {}
        for p, text in zip(cls.params, positional):
            raw[p.name] = text
        for key, text in keyword.items():
            if key not in known:
                allowed = ", ".join(known) or "none"
                raise ValueError(f"{cls.codec} has no parameter {key!r} (parameters: {allowed})")
            if key in raw:
                raise ValueError(f"{cls.codec}: parameter {key!r} given twice")
            raw[key] = text
        kwargs: dict[str, Any] = {}
        for p in cls.params:
            if p.name in raw:
                try:
                    kwargs[p.name] = p.parse(raw[p.name])
                except ValueError as exc:
                    raise ValueError(f"{cls.codec}: bad {p.name} {raw[p.name]!r}: {exc}") from None
            elif p.required:
                raise ValueError(f"{cls.codec} needs a {p.name}, e.g. {cls.codec}:{p.fmt(p.default)}")
        if inner is not None and not cls.takes_inner:
            raise ValueError(f"{cls.codec} cannot be followed by another stage ('+'); only "
                             f"{', '.join(registry.stage_takers())} can")
        return cls(**kwargs, inner=inner)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    # --- what the codec can do ------------------------------------------------------------

    @property
    def lossless(self) -> bool:
        """Whether ``decode(encode(t))`` equals ``t`` bit for bit (shape and dtype too), for
        every float tensor: no error feedback is needed, nothing is approximated."""
        return self.stage_lossless and (self.inner is None or self.inner.lossless)

    @property
    def zero_copy(self) -> bool:
        """Whether ``encode(t, copy=False)`` can put ``t``'s own memory in the packet (for a
        contiguous ``t``), and ``decode(p, copy=False)`` return a view of ``p``'s buffer."""
        return self.stage_zero_copy and (self.inner is None or self.inner.zero_copy)

    # --- public API -----------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor, seed: int | None = None, name: str | None = None, *,
               copy: bool = True) -> Packet:
        """Encode ``tensor``; ``seed`` feeds seeded codecs and travels in the header.

        ``copy=False`` lends ``tensor`` to the packet: a ``zero_copy`` codec then sends its
        memory as it is, and the caller must not write ``tensor`` while the packet is in use.
        Other codecs make their own buffers either way."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"{self.codec}: expected a floating-point tensor, got {tensor.dtype}")
        if seed is not None:
            check_seed(seed)  # the one seed check (common.hashing): TypeError, or ValueError past 64 bits
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        flat = tensor.detach().reshape(-1)
        if tensor.dtype in _FP8_INPUTS and not self.keeps_fp8:  # few ops support float8
            flat = flat.to(torch.float32)
        header, buffers = self._encode_stage(flat, tuple(tensor.shape), seed, name, copy)
        header["dtype"] = DTYPE_NAMES[tensor.dtype]
        return Packet(header, tuple(buffers))

    def decode(self, packet: Packet, device: torch.device | str | None = None, *, copy: bool = True) -> torch.Tensor:
        """Rebuild the tensor (its shape and dtype) from ``packet`` on ``device``.

        ``copy=False`` lets a ``zero_copy`` codec return a view of the packet's buffer (read
        only: it may be wire memory), after checking the header as any decode does. Whether
        the result shares memory with the packet is then up to the codec and the buffer's
        alignment; other codecs build a new tensor either way."""
        if not isinstance(packet, Packet):
            raise TypeError(f"expected a Packet, got {type(packet).__name__}")
        buffers = packet.buffers
        if device is not None:
            buffers = tuple(b.to(device) for b in buffers)
            dev = torch.device(device)
        else:
            dev = buffers[0].device if buffers else torch.device("cpu")
        flat, shape, used = self._decode_stage(packet.header, buffers, 0, "", dev, copy)
        if used != len(buffers):
            raise PacketError("buffers", f"{len(buffers)} buffers, header accounts for {used}")
        return flat.view(shape)

    def reset(self) -> None:
        """Forget any per-name state (warm starts)."""
        if self.inner is not None:
            self.inner.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()} if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None and "inner" in state:
            self.inner.load_state_dict(state["inner"])

    # --- what subclasses write ------------------------------------------------------------

    @abstractmethod
    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], seed: int | None, name: str | None) -> Encoded:
        """Encode a 1-D view of the input; ``shape`` is the caller's original shape."""

    @abstractmethod
    def _decode(
        self,
        h: Header,
        buffers: tuple[torch.Tensor, ...],
        payload: torch.Tensor | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Return the flat decoded tensor (``prod(shape)`` elements of ``dtype``)."""

    # --- plumbing -------------------------------------------------------------------------

    def _encode_stage(
        self, flat: torch.Tensor, shape: tuple[int, ...], seed: int | None, name: str | None, copy: bool = True
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if copy and self.stage_zero_copy:  # the packet gets the copy's memory, never the caller's
            flat = flat.clone(memory_format=torch.contiguous_format)
        enc = self._encode(flat, shape, seed, name)
        clash = _RESERVED.intersection(enc.fields)
        if clash:
            raise AssertionError(f"{self.codec} uses reserved header keys {sorted(clash)}")
        header: dict[str, Any] = {"codec": self.codec, "shape": list(shape), "dtype": DTYPE_NAMES[flat.dtype]}
        header.update(enc.fields)
        buffers = list(enc.buffers)
        if self.takes_inner:
            assert enc.payload is not None, f"{self.codec} produced no payload"
            payload = enc.payload.reshape(-1)
            inner = self.inner if self.inner is not None else codec_class("none")()
            inner_seed = None if seed is None else rng.derive_seed(seed, 1)
            inner_header, inner_buffers = inner._encode_stage(payload, (payload.numel(),), inner_seed, name)
            header["inner"] = inner_header
            buffers += inner_buffers
        return header, buffers

    def _decode_stage(
        self, header: Any, buffers: tuple[torch.Tensor, ...], start: int, path: str, device: torch.device,
        copy: bool = True,
    ) -> tuple[torch.Tensor, tuple[int, ...], int]:
        h = Header(header, path)
        codec = h.get("codec")
        if codec != self.codec:
            raise h.error("codec", f"got {codec!r}, this decoder is {self.codec!r}")
        shape = h.shape()
        dtype = h.dtype()
        wire_dtype = torch.float32 if dtype in _FP8_INPUTS and not self.keeps_fp8 else dtype
        end = start + self.n_buffers
        if len(buffers) < end:
            raise PacketError(path + "buffers",
                              f"{self.codec} needs {self.n_buffers} buffers, {len(buffers) - start} left")
        payload = None
        if self.takes_inner:
            inner_header = h.get("inner")
            if not isinstance(inner_header, dict):
                raise h.error("inner", "must be a dict")
            inner_cls = codec_class(inner_header.get("codec"), path + "inner.codec")
            payload, _, end = inner_cls()._decode_stage(inner_header, buffers, end, path + "inner.", device)
        elif "inner" in header:
            raise h.error("inner", f"{self.codec} takes no next stage")
        flat = self._decode(h, buffers[start : start + self.n_buffers], payload, shape, wire_dtype, device)
        if copy and self.stage_zero_copy:  # a view of the buffer: the caller asked for its own tensor
            flat = flat.clone()
        assert flat.numel() == math.prod(shape) and flat.dtype == wire_dtype, self.codec
        return flat.to(dtype), shape, end


def decode(packet: Packet, device: torch.device | str | None = None, *, copy: bool = True) -> torch.Tensor:
    """Decode any packet by the codec its header names (no compressor needed); ``copy`` as
    in ``Compressor.decode``."""
    if not isinstance(packet, Packet):
        raise TypeError(f"expected a Packet, got {type(packet).__name__}")
    return codec_class(packet.header.get("codec"))().decode(packet, device, copy=copy)
