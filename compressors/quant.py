"""Blockwise absmax quantizers: ``int8``, ``int4``, ``fp4``, ``fp8`` and scaled ``sign``.

The flat tensor is cut into blocks of ``block`` values (the last block may be shorter); each
block gets one float32 scale and each value a code. Buffers: ``scales`` (float32 bytes) and
``codes``; 4-bit codes pack two per byte (element ``2i`` in the high nibble), signs eight per
byte (element ``i`` in bit ``i % 8``).

Work runs over chunks of whole blocks small enough to stay in the CPU caches, so each value
is read from memory once; the same torch code runs on CUDA.

Stochastic rounding (``stochastic=true``) rounds up with probability equal to the distance
from the lower code, which makes the decoded value unbiased. Its noise comes from the
counter RNG keyed by the encode ``seed`` (a fresh one when ``None``); the seed is not sent,
the receiver does not need it.

Non-finite input raises ``NonFiniteError`` (found through the block scales, at no extra
cost), and no packet is produced.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from starling.common import parse_bool

from . import rng
from .base import (
    Compressor,
    Encoded,
    Header,
    NonFiniteError,
    Param,
    as_bytes,
    chunk_elems,
    fresh_seed,
    view_as,
)
from .fused import Fused
from .registry import register

_CHUNK_ELEMS = 1 << 20  # 4 MiB of float32 per chunk: few ops, temporaries near the caches
_F32_MAX = torch.finfo(torch.float32).max


def _absmax(x: torch.Tensor, top: float) -> torch.Tensor:
    """Per-row max |x| of a (blocks, block) tensor, at least 2 * top / float32 max.

    The floor keeps ``top / absmax`` finite: blocks of tiny values (below ~1e-36 for int8)
    get a fixed step instead of an overflowing one; all-zero blocks stay exactly zero.
    (amax and amin beat aminmax on CPU.)
    """
    absmax = torch.maximum(torch.amax(x, dim=1), torch.amin(x, dim=1).neg_())
    return absmax.clamp_(min=2.0 * top / _F32_MAX)


def _parse_block(text: str) -> int:
    block = int(text)
    if block < 8 or block % 8 or block > 1 << 24:
        raise ValueError(f"block must be a multiple of 8 in [8, 2**24], got {block}")
    return block


def _fmt_bool(value: bool) -> str:
    return "true" if value else "false"


class _BlockQuantizer(Compressor):
    """Shared chunk loop; subclasses quantize and dequantize one chunk of whole blocks."""

    n_buffers = 2
    stage_lossless = stage_zero_copy = False  # codes of 1 to 8 bits round every value
    bits: ClassVar[int]
    fused: ClassVar[bool] = False  # has ``_codes_fused``: one compiled kernel on accelerators
    default_block: ClassVar[int] = 256
    has_stochastic: ClassVar[bool] = True

    def __init__(self, block: int | None = None, stochastic: bool = False, inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.block = _parse_block(str(self.default_block if block is None else block))
        if stochastic and not self.has_stochastic:
            raise ValueError(f"{self.codec} has no stochastic rounding")
        self.stochastic = bool(stochastic)

    # Subclass hooks -----------------------------------------------------------------------

    def _fields(self) -> dict[str, Any]:
        return {}

    def _check_fields(self, h: Header) -> None:
        """Validate codec-specific header fields before decoding."""

    def _quantize(self, x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, work: torch.Tensor,
                  noise: torch.Tensor | None, count: int) -> None:
        """Quantize ``x`` (blocks, block) float32 into ``scales`` and the ``codes`` bytes.

        ``count`` is the number of real values per block (less than the width only for the
        zero-padded last block).
        """
        raise NotImplementedError

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        """Fill ``out`` (blocks, block) float32 from a chunk's code bytes and scales."""
        raise NotImplementedError

    @classmethod
    def code_bytes(cls, n: int) -> int:
        return (n * cls.bits + 7) // 8

    # Encode ------------------------------------------------------------------------------

    def _codes_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block scales (float32) and code bytes (uint8) of ``x`` (blocks, block), any float dtype,
        rounded to nearest, in one kernel (``fused.Fused``): the accelerator path of codecs whose
        ``fused`` is set. The same bytes as ``_quantize``."""
        raise NotImplementedError

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], seed: int | None, name: str | None) -> Encoded:
        block, device = self.block, flat.device
        full = flat.numel() // block
        noise_seed = (fresh_seed() if seed is None else seed) if self.stochastic else None
        # Stochastic rounding stays on the loop: compiled for CUDA, ``x * inv + noise`` came out
        # different from the CPU's in a few codes in a million (one rounding where eager has two).
        if self.fused and noise_seed is None and device.type not in Fused.eager_devices and full:
            scales, codes = self._encode_whole(flat, full)
        else:
            scales, codes = self._encode_chunks(flat, full, noise_seed)
        if scales.numel() and not bool(torch.isfinite(scales).all()):
            raise NonFiniteError(f"{self.codec}: input holds NaN or Inf (or exceeds float32 range)")
        fields = {"block": block}
        fields.update(self._fields())
        return Encoded(fields, (as_bytes(scales), codes))

    def _encode_whole(self, flat: torch.Tensor, full: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and codes of every block, the full ones in one fused kernel (accelerators)."""
        n, block = flat.numel(), self.block
        scales, codes = self._codes_fused(flat[: full * block].view(full, block))
        if n > full * block:
            tail_scale, tail_codes = self._encode_tail(flat, full, None)
            scales = torch.cat((scales, tail_scale))
            codes = torch.cat((codes, tail_codes[: self.code_bytes(n) - codes.numel()]))
        return scales, codes

    def _encode_chunks(self, flat: torch.Tensor, full: int,
                       noise_seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and codes of every block, the full ones chunk by chunk in place (the CPU's path)."""
        n, block, device = flat.numel(), self.block, flat.device
        scales = torch.empty(full + (1 if n > full * block else 0), dtype=torch.float32, device=device)
        codes = torch.empty(self.code_bytes(n), dtype=torch.uint8, device=device)
        per_chunk = max(8, chunk_elems(device, _CHUNK_ELEMS) // block // 8 * 8)  # keeps chunk starts byte-aligned
        work = torch.empty(min(per_chunk, max(full, 1)) * block, dtype=torch.float32, device=device)
        for b0 in range(0, full, per_chunk):
            b1 = min(full, b0 + per_chunk)
            x = flat[b0 * block : b1 * block].view(b1 - b0, block).to(torch.float32)
            noise = None if noise_seed is None else rng.uniform(noise_seed, x.numel(), device, offset=b0 * block)
            byte0 = b0 * block * self.bits // 8
            byte1 = b1 * block * self.bits // 8
            self._quantize(x, scales[b0:b1], codes[byte0:byte1], work[: x.numel()].view_as(x), noise, block)
        if n > full * block:
            tail_scale, tail_codes = self._encode_tail(flat, full, noise_seed)
            scales[full:] = tail_scale
            byte0 = full * block * self.bits // 8
            codes[byte0:] = tail_codes[: codes.numel() - byte0]
        return scales, codes

    def _encode_tail(self, flat: torch.Tensor, full: int,
                     noise_seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The last, short block, zero-padded to whole bytes: its scale and its codes."""
        device, tail = flat.device, flat.numel() - full * self.block
        width = (tail + 7) // 8 * 8
        x = torch.zeros(1, width, dtype=torch.float32, device=device)
        x[0, :tail] = flat[full * self.block :]
        noise = None
        if noise_seed is not None:
            noise = torch.zeros(width, dtype=torch.float32, device=device)
            noise[:tail] = rng.uniform(noise_seed, tail, device, offset=full * self.block)
        scale = torch.empty(1, dtype=torch.float32, device=device)
        tail_codes = torch.empty(self.code_bytes(width), dtype=torch.uint8, device=device)
        self._quantize(x, scale, tail_codes, torch.empty_like(x), noise, tail)
        return scale, tail_codes

    # Decode ------------------------------------------------------------------------------

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        scale_buf, code_buf = buffers
        block = h.int("block", 8, 1 << 24)
        if block % 8:
            raise h.error("block", f"must be a multiple of 8, got {block}")
        self._check_fields(h)
        n = math.prod(shape)
        full = n // block
        tail = n - full * block
        nblocks = full + (1 if tail else 0)
        Header.expect_len(scale_buf, 4 * nblocks, h.path + "scales")
        Header.expect_len(code_buf, self.code_bytes(n), h.path + "codes")
        scales = view_as(scale_buf, torch.float32)
        if nblocks and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise h.error("scales", "NaN, Inf or negative scale")
        out = torch.empty(n, dtype=dtype, device=device)
        per_chunk = max(8, chunk_elems(device, _CHUNK_ELEMS) // block // 8 * 8)
        # float32 output is written in place; other dtypes go through a float32 scratch chunk
        scratch = None if dtype == torch.float32 else torch.empty(min(per_chunk, full) * block, device=device)
        for b0 in range(0, full, per_chunk):
            b1 = min(full, b0 + per_chunk)
            byte0 = b0 * block * self.bits // 8
            byte1 = b1 * block * self.bits // 8
            target = out[b0 * block : b1 * block].view(b1 - b0, block)
            values = target if scratch is None else scratch[: target.numel()].view_as(target)
            self._dequantize(code_buf[byte0:byte1], scales[b0:b1], values, h)
            if scratch is not None:
                target.copy_(values)
        if tail:
            width = (tail + 7) // 8 * 8
            byte0 = full * block * self.bits // 8
            tail_codes = torch.zeros(self.code_bytes(width), dtype=torch.uint8, device=device)
            tail_codes[: code_buf.numel() - byte0] = code_buf[byte0:]
            values = torch.empty(1, width, dtype=torch.float32, device=device)
            self._dequantize(tail_codes, scales[full:], values, h)
            out[full * block :] = values.view(-1)[:tail]
        return out


class _Integer(_BlockQuantizer):
    """Symmetric uniform codes in [-qmax, qmax]; scale = absmax / qmax."""

    qmax: ClassVar[int]

    def _scaled(
        self, x: torch.Tensor, scales: torch.Tensor, work: torch.Tensor, noise: torch.Tensor | None
    ) -> torch.Tensor:
        """``work`` <- x / scale rounded to an integer code (nearest, or stochastically)."""
        absmax = _absmax(x, self.qmax)
        torch.mul(absmax, 1.0 / self.qmax, out=scales)
        inv = absmax.reciprocal_().mul_(self.qmax).unsqueeze(1)
        torch.mul(x, inv, out=work)
        if noise is None:
            return work.round_()
        return work.add_(noise.view_as(work)).floor_().clamp_(-self.qmax, self.qmax)



def _one_over(absmax: torch.Tensor) -> torch.Tensor:
    """``absmax.reciprocal()`` as eager torch rounds it. Compiled for CUDA, ``reciprocal`` (and
    ``1.0 / t``, which torch turns into it) is Triton's approximate one, while a division is
    rounded exactly (``fused``); one ulp off moves a value across a rounding boundary now and then."""
    return torch.ones_like(absmax).div(absmax)


def _pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The even and the odd values of each block, as float32 (blocks, block / 2): the high and
    low nibbles of a packed byte. Computing on the halves keeps a 4-bit codec one kernel: its
    output has the reduction's shape, so the compiler fuses the block max with the packing."""
    pairs = x.to(torch.float32).view(x.shape[0], -1, 2)
    return pairs[..., 0], pairs[..., 1]


def _pairs_absmax(even: torch.Tensor, odd: torch.Tensor, top: float) -> torch.Tensor:
    """``_absmax`` of the blocks whose halves these are (a maximum is exact in any order)."""
    absmax = torch.maximum(torch.maximum(even, odd).amax(1), torch.minimum(even, odd).amin(1).neg())
    return absmax.clamp(min=2.0 * top / _F32_MAX)


@Fused
def _int8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.to(torch.float32)
    absmax = _absmax(x, 127)
    q = torch.mul(x, _one_over(absmax).mul(127).unsqueeze(1)).round().to(torch.int8)
    return absmax * (1.0 / 127), q.view(torch.uint8).view(-1)


@Fused
def _int4_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    even, odd = _pairs(x)
    absmax = _pairs_absmax(even, odd, 7)
    inv = _one_over(absmax).mul(7).unsqueeze(1)
    high = torch.mul(even, inv).round().to(torch.int8).view(torch.uint8).bitwise_and(0x0F)  # two's complement
    low = torch.mul(odd, inv).round().to(torch.int8).view(torch.uint8).bitwise_and(0x0F)
    return absmax * (1.0 / 7), high.bitwise_left_shift(4).bitwise_or(low).view(-1)


@register
class Int8(_Integer):
    codec = "int8"
    bits = 8
    qmax = 127
    default_block = 256
    params = (Param("block", _parse_block, 256), Param("stochastic", parse_bool, False, fmt=_fmt_bool))
    fused = True

    def _codes_fused(self, x):
        return _int8_codes(x)

    def _quantize(self, x, scales, codes, work, noise, count) -> None:
        y = self._scaled(x, scales, work, noise)
        codes.view(torch.int8).view(x.shape).copy_(y)

    def _dequantize(self, codes, scales, out, h) -> None:
        torch.mul(codes.view(torch.int8).view(out.shape), scales.unsqueeze(1), out=out)


@register
class Int4(_Integer):
    """Codes -7..7 as 4-bit two's complement, two per byte (element 2i in the high nibble)."""

    codec = "int4"
    bits = 4
    qmax = 7
    default_block = 64
    params = (Param("block", _parse_block, 64), Param("stochastic", parse_bool, False, fmt=_fmt_bool))
    fused = True

    def _codes_fused(self, x):
        return _int4_codes(x)

    def _quantize(self, x, scales, codes, work, noise, count) -> None:
        y = self._scaled(x, scales, work, noise)
        q = torch.empty(x.shape, dtype=torch.int8, device=x.device).copy_(y)
        # Little-endian int16 view: low byte = element 2i, high byte = element 2i+1.
        pairs = q.view(-1).view(torch.int16)
        packed = pairs.bitwise_left_shift(4).bitwise_and_(0xF0)
        packed.bitwise_or_(pairs.bitwise_right_shift(8).bitwise_and_(0x0F))
        codes.copy_(packed)  # int16 -> uint8 keeps the low byte

    def _dequantize(self, codes, scales, out, h) -> None:
        blocks, block = out.shape
        pairs = out.view(blocks, block // 2, 2)
        s = scales.unsqueeze(1)
        high = codes.view(torch.int8).bitwise_right_shift(4)  # arithmetic: sign-extends the nibble
        torch.mul(high.view(blocks, -1), s, out=pairs[..., 0])
        low = codes.bitwise_left_shift(4).view(torch.int8).bitwise_right_shift_(4)
        torch.mul(low.view(blocks, -1), s, out=pairs[..., 1])


def _pack_nibbles(mag_and_sign: torch.Tensor, out: torch.Tensor) -> None:
    flat = mag_and_sign.reshape(-1)
    torch.bitwise_left_shift(flat[0::2], 4, out=out)
    out.bitwise_or_(flat[1::2])


def _unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return torch.stack((codes.bitwise_right_shift(4), codes.bitwise_and(15)), dim=1).view(-1)


_FP4_FORMATS = ("e2m1", "e3m0")
# Magnitudes of the 8 codes of each format, as multiples of the block's absmax.
_FP4_GRID = {
    "e2m1": [v / 6.0 for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)],
    "e3m0": [0.0] + [2.0 ** (c - 7) for c in range(1, 8)],
}


def _parse_fp4_format(text: str) -> str:
    if text not in _FP4_FORMATS:
        raise ValueError(f"fp4 format must be one of {', '.join(_FP4_FORMATS)}, got {text!r}")
    return text


@register
class FP4(_BlockQuantizer):
    """4-bit floats: sign bit plus E2M1 (0, .5, 1, 1.5, 2, 3, 4, 6) or E3M0 (0 and 2**-6..1).

    Scale maps the block's absmax to the format's largest magnitude. E3M0 is the format of
    Streaming DiLoCo's pseudo-gradient exchange.
    """

    codec = "fp4"
    bits = 4
    default_block = 64
    fused = True
    params = (
        Param("format", _parse_fp4_format, "e2m1", positional=True),
        Param("block", _parse_block, 64),
        Param("stochastic", parse_bool, False, fmt=_fmt_bool),
    )

    def __init__(self, format: str = "e2m1", block: int | None = None, stochastic: bool = False,
                 inner: Compressor | None = None) -> None:
        super().__init__(block, stochastic, inner)
        self.format = _parse_fp4_format(format)

    def _fields(self) -> dict[str, Any]:
        return {"format": self.format}

    def _check_fields(self, h: Header) -> None:
        h.str("format", _FP4_FORMATS)

    def _codes_fused(self, x):
        return (_fp4_e2m1_codes if self.format == "e2m1" else _fp4_e3m0_codes)(x)

    def _quantize(self, x, scales, codes, work, noise, count) -> None:
        absmax = _absmax(x, 1.0)
        scales.copy_(absmax)  # scale = absmax: magnitudes are stored relative to it
        inv = absmax.reciprocal_().unsqueeze(1)
        a = torch.mul(x, inv, out=work).abs_()  # in [0, 1]
        mag = self._e2m1(a, noise) if self.format == "e2m1" else self._e3m0(a, noise)
        mag.bitwise_or_((x < 0).to(torch.uint8).bitwise_left_shift_(3))
        _pack_nibbles(mag, codes.view(-1))

    @staticmethod
    def _e2m1(a: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        # On the 0..6 scale the grid has step 0.5 below 2, 1 below 4, 2 up to 6; in units of
        # the local step the code is round(a / step) + offset (offset 0, 2, 4).
        a = a.mul_(6.0)
        ge2 = (a >= 2.0).to(torch.float32)
        ge4 = (a >= 4.0).to(torch.float32)
        step_inv = ge2.mul(-1.0).add_(2.0).sub_(ge4.mul(0.5))  # 2, 1, 0.5
        units = a.mul_(step_inv)
        units = units.round_() if noise is None else units.add_(noise.view_as(units)).floor_()
        return units.add_(ge2.add_(ge4).mul_(2.0)).clamp_(0, 7).to(torch.uint8)

    @staticmethod
    def _e3m0(a: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        # a = m * 2**e with m in [0.5, 1): neighbours 2**(e-1) (code e+6) and 2**e (code e+7).
        m, e = torch.frexp(a)
        e = e.to(torch.float32).add_(6.0)
        tiny = a < 2.0**-6
        if noise is None:
            code = e.add_((m >= 0.75).to(torch.float32))
            below = (a >= 2.0**-7).to(torch.float32)  # nearest of 0 and 2**-6
        else:
            u = noise.view_as(a)
            code = e.add_((u < m.mul(2.0).sub_(1.0)).to(torch.float32))
            below = (u < a.mul(64.0)).to(torch.float32)
        return torch.where(tiny, below, code).clamp_(0, 7).to(torch.uint8)

    def _dequantize(self, codes, scales, out, h) -> None:
        fmt = h.str("format", _FP4_FORMATS)
        grid = torch.tensor(_FP4_GRID[fmt], dtype=torch.float32, device=codes.device)
        lut = torch.cat((grid, -grid))
        nibbles = _unpack_nibbles(codes)
        torch.mul(lut[nibbles.to(torch.int64)].view(out.shape), scales.unsqueeze(1), out=out)


def _fp4_codes(x: torch.Tensor, magnitude) -> tuple[torch.Tensor, torch.Tensor]:
    """``FP4._quantize``'s arithmetic as a function: the block absmax and the packed nibbles."""
    even, odd = _pairs(x)
    absmax = _pairs_absmax(even, odd, 1.0)
    inv = _one_over(absmax).unsqueeze(1)

    def nibble(half: torch.Tensor) -> torch.Tensor:
        mag = magnitude(torch.mul(half, inv).abs(), None)
        return mag.bitwise_or((half < 0).to(torch.uint8).bitwise_left_shift(3))

    return absmax, nibble(even).bitwise_left_shift(4).bitwise_or(nibble(odd)).view(-1)


@Fused
def _fp4_e2m1_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp4_codes(x, FP4._e2m1)


@Fused
def _fp4_e3m0_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp4_codes(x, FP4._e3m0)


_FP8_FORMATS: dict[str, torch.dtype] = {}
if hasattr(torch, "float8_e4m3fn"):
    _FP8_FORMATS["e4m3"] = torch.float8_e4m3fn
if hasattr(torch, "float8_e5m2"):
    _FP8_FORMATS["e5m2"] = torch.float8_e5m2


def _parse_fp8_format(text: str) -> str:
    if text not in _FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {', '.join(_FP8_FORMATS) or '(none in this torch)'}, got {text!r}")
    return text


class FP8(_BlockQuantizer):
    """8-bit floats (torch's e4m3fn or e5m2), each block scaled so its absmax is the format max.

    Plain casts would flush typical gradient magnitudes to zero; the block scale avoids it.
    Rounding is torch's round-to-nearest-even cast; no stochastic rounding.
    """

    codec = "fp8"
    bits = 8
    default_block = 256
    has_stochastic = False
    fused = True
    params = (Param("format", _parse_fp8_format, "e4m3", positional=True), Param("block", _parse_block, 256))

    def __init__(self, format: str = "e4m3", block: int | None = None, inner: Compressor | None = None) -> None:
        super().__init__(block, False, inner)
        self.format = _parse_fp8_format(format)

    def _fields(self) -> dict[str, Any]:
        return {"format": self.format}

    def _check_fields(self, h: Header) -> None:
        h.str("format", tuple(_FP8_FORMATS))

    def _codes_fused(self, x):
        return _fp8_codes(x, _FP8_FORMATS[self.format])

    def _quantize(self, x, scales, codes, work, noise, count) -> None:
        dtype = _FP8_FORMATS[self.format]
        fmax = torch.finfo(dtype).max
        absmax = _absmax(x, fmax)
        torch.mul(absmax, 1.0 / fmax, out=scales)
        inv = absmax.reciprocal_().mul_(fmax).unsqueeze(1)
        y = torch.mul(x, inv, out=work).clamp_(-fmax, fmax)
        codes.view(dtype).view(x.shape).copy_(y)

    def _dequantize(self, codes, scales, out, h) -> None:
        dtype = _FP8_FORMATS[h.str("format", tuple(_FP8_FORMATS))]
        out.copy_(codes.view(dtype).view(out.shape)).mul_(scales.unsqueeze(1))


@Fused
def _fp8_codes(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``FP8._quantize``'s arithmetic as a function: float32 scales and the fp8 code bytes."""
    x = x.to(torch.float32)
    fmax = torch.finfo(dtype).max
    absmax = _absmax(x, fmax)
    y = torch.mul(x, _one_over(absmax).mul(fmax).unsqueeze(1)).clamp(-fmax, fmax)
    return absmax * (1.0 / fmax), y.to(dtype).view(torch.uint8).view(-1)


if _FP8_FORMATS:
    register(FP8)


@register
class Sign(_BlockQuantizer):
    """Scaled sign (EF-SignSGD): one bit per value, scale = mean |x| of the block.

    Zero encodes as +scale. Biased by design: use it under ``ErrorFeedback``.
    """

    codec = "sign"
    bits = 1
    default_block = 256
    has_stochastic = False
    params = (Param("block", _parse_block, 256),)

    def __init__(self, block: int | None = None, inner: Compressor | None = None) -> None:
        super().__init__(block, False, inner)

    def _quantize(self, x, scales, codes, work, noise, count) -> None:
        # Summed in float64, rounded once: a float32 sum's rounding depends on the reduction
        # order, which differs between CPU and CUDA, and the two must write the same bytes.
        scales.copy_(torch.abs(x, out=work).sum(dim=1, dtype=torch.float64).div_(count))
        positive = torch.ge(x, 0.0).view(-1)
        words = positive.view(torch.uint8).view(torch.int64)
        # Each int64 holds eight 0/1 bytes; the multiply gathers them into the top byte.
        codes.copy_(words.mul(0x0102040810204080).bitwise_right_shift_(56).bitwise_and_(0xFF))

    def _dequantize(self, codes, scales, out, h) -> None:
        words = codes.to(torch.int64).mul_(0x0101010101010101).bitwise_and_(0x8040201008040201 - (1 << 64))
        positive = words.view(torch.uint8).view(out.shape) != 0
        s = scales.unsqueeze(1)
        torch.where(positive, s, s.neg(), out=out)
