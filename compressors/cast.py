"""Codecs that only change the number format: ``none`` (raw), ``fp16``, ``bf16``.

Non-finite values pass through unchanged (IEEE casts); ``fp16`` turns magnitudes above
65504 into +-Inf, ``bf16`` keeps the float32 range.
"""
from __future__ import annotations

import math

import torch

from .base import Compressor, Encoded, Header, as_bytes, register, view_as


class _Cast(Compressor):
    """Send the tensor in ``wire_dtype``; ``None`` means the input's own dtype."""

    n_buffers = 1
    wire_dtype: torch.dtype | None = None

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], seed: int | None, name: str | None) -> Encoded:
        target = self.wire_dtype or flat.dtype
        # A copy even when the dtype matches: the packet must not alias the caller's tensor.
        wire = flat.to(target, copy=True) if flat.is_contiguous() else flat.contiguous().to(target)
        return Encoded({}, (as_bytes(wire),))

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        (buf,) = buffers
        target = self.wire_dtype or dtype
        numel = math.prod(shape)
        Header.expect_len(buf, numel * target.itemsize, h.path + "buffers[0]")
        return view_as(buf, target).to(device=device, dtype=dtype, copy=True)


@register
class Raw(_Cast):
    """``none``: the tensor's bytes as they are."""

    codec = "none"
    keeps_fp8 = True


@register
class Float16(_Cast):
    codec = "fp16"
    wire_dtype = torch.float16


@register
class BFloat16(_Cast):
    codec = "bf16"
    wire_dtype = torch.bfloat16
