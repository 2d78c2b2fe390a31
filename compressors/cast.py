"""Codecs that only change the number format: ``none`` (raw), ``fp16``, ``bf16``.

Non-finite values pass through unchanged (IEEE casts); ``fp16`` turns magnitudes above
65504 into +-Inf, ``bf16`` keeps the float32 range.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch

from .base import Compressor, Encoded, Header, as_bytes, view_as
from .registry import register


@register
class Raw(Compressor):
    """``none``: the tensor's bytes as they are, in its own dtype (float8 included).

    The only lossless and zero-copy codec: ``_encode`` sends its input's memory and
    ``_decode`` reads the buffer in place; the base class copies around both unless the
    caller lends the tensor (``encode(copy=False)``) or takes a view (``decode(copy=False)``).
    """

    codec = "none"
    n_buffers = 1
    keeps_fp8 = True
    stage_lossless = True
    stage_zero_copy = True

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], seed: int | None, name: str | None) -> Encoded:
        return Encoded({}, (as_bytes(flat.contiguous()),))

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        (buf,) = buffers
        Header.expect_len(buf, math.prod(shape) * dtype.itemsize, h.path + "buffers[0]")
        return view_as(buf, dtype).to(device)


class _Cast(Compressor):
    """Send the tensor in ``wire_dtype`` (a cast rounds: lossy for float32 input)."""

    n_buffers = 1
    wire_dtype: ClassVar[torch.dtype]
    stage_lossless = stage_zero_copy = False

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], seed: int | None, name: str | None) -> Encoded:
        # A copy even when the dtype matches: the packet must not alias the caller's tensor.
        wire = flat.to(self.wire_dtype, copy=True) if flat.is_contiguous() else flat.contiguous().to(self.wire_dtype)
        return Encoded({}, (as_bytes(wire),))

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        (buf,) = buffers
        Header.expect_len(buf, math.prod(shape) * self.wire_dtype.itemsize, h.path + "buffers[0]")
        return view_as(buf, self.wire_dtype).to(device=device, dtype=dtype, copy=True)


@register
class Float16(_Cast):
    codec = "fp16"
    wire_dtype = torch.float16


@register
class BFloat16(_Cast):
    codec = "bf16"
    wire_dtype = torch.bfloat16
