"""Sparsifiers: ``topk:FRACTION`` and ``randomk:FRACTION``.

Both send the chosen values as a payload for the next stage (``topk:0.01+int8``), raw in
the input dtype when there is none. Top-k also sends its indices, packed with exactly
``ceil(log2(numel))`` bits each, or as a bitmap of ``numel`` bits when that is smaller.
Random-k sends no indices: both sides draw them from the seed in the header.

Top-k follows Deep Gradient Compression: the threshold comes from a strided sample (whole
runs of values, so the sample reads few cache lines), one pass collects the values above
it, and if more than k pass, an exact top-k among those candidates trims them, so the
result is then exactly the top-k. A severe undershoot (a sample that misjudged the
tensor) lowers the threshold once, and if still short falls back to an exact top-k. So
the values sent are the exact top-k, except that zeros are never sent (a tensor with fewer
than k non-zeros sends them all). The count sent is in the header.

Non-finite input: top-k raises ``NonFiniteError`` (every chunk's maximum is checked);
random-k raises only if a value it sends is not finite.
"""
from __future__ import annotations

import logging
import math

import torch

from . import rng
from .base import Compressor, Encoded, Header, NonFiniteError, PacketError, Param, chunk_elems, fresh_seed
from .packing import pack_bits, pack_uints, unpack_bits, unpack_uints
from .registry import register

log = logging.getLogger(__name__)

_EXACT_BELOW = 1 << 16  # small tensors: a plain torch.topk is cheap and exact
_SAMPLE_HITS = 512  # expected sample values above the threshold (sets the sample size)
_SAMPLE_RUN = 256  # contiguous values per sample run
_MARGIN = 1.25  # aim the threshold at this many times k, then trim exactly
_PASS_CHUNK = 1 << 22


def _parse_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {value}")
    return value


def _count(fraction: float, n: int) -> int:
    return 0 if n == 0 else min(n, max(1, math.ceil(fraction * n)))


def index_width(n: int) -> int:
    return max(1, (n - 1).bit_length())


def _next_prime(m: int) -> int:
    def is_prime(v: int) -> bool:
        return v >= 2 and all(v % d for d in range(2, math.isqrt(v) + 1))

    while not is_prime(m):
        m += 1
    return m


def pack_indices(idx: torch.Tensor, n: int) -> tuple[str, torch.Tensor]:
    """Sorted distinct indices as fixed-width bits or a bitmap, whichever is smaller."""
    k = idx.numel()
    if (n + 7) // 8 < (k * index_width(n) + 7) // 8:
        mask = torch.zeros(n, dtype=torch.uint8, device=idx.device)
        mask[idx] = 1
        return "bitmap", pack_bits(mask)
    return "bits", pack_uints(idx, index_width(n))


def unpack_indices(h: Header, buf: torch.Tensor, k: int, n: int) -> torch.Tensor:
    fmt = h.str("index", ("bits", "bitmap"))
    field = h.path + "indices"
    if fmt == "bitmap":
        Header.expect_len(buf, (n + 7) // 8, field)
        idx = unpack_bits(buf, n).nonzero().view(-1)
        if idx.numel() != k:
            raise PacketError(field, f"bitmap has {idx.numel()} bits set, header says k={k}")
        return idx
    width = index_width(n)
    Header.expect_len(buf, (k * width + 7) // 8, field)
    idx = unpack_uints(buf, k, width)
    if k and (int(idx.max()) >= n or (k > 1 and not bool((idx[1:] > idx[:-1]).all()))):
        raise PacketError(field, f"indices must be increasing and below {n}")
    return idx


def _scatter(n: int, idx: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.zeros(n, dtype=dtype, device=device)
    out[idx.to(device)] = values.to(device=device, dtype=dtype)
    return out


@register
class TopK(Compressor):
    """Keep the ``fraction`` of values largest in magnitude."""

    codec = "topk"
    stage_lossless = stage_zero_copy = False
    n_buffers = 1
    takes_inner = True
    params = (Param("fraction", _parse_fraction, 0.01, positional=True, required=True),)

    def __init__(self, fraction: float = 0.01, inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.fraction = _parse_fraction(str(fraction))

    def _encode(self, flat, shape, seed, name) -> Encoded:
        n = flat.numel()
        idx = self.select(flat, _count(self.fraction, n))
        values = flat[idx]
        if values.numel() and not bool(torch.isfinite(values).all()):
            raise NonFiniteError("topk: input holds NaN or Inf")
        fmt, buf = pack_indices(idx, n)
        return Encoded({"k": idx.numel(), "index": fmt}, (buf,), values)

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Sorted indices of (at most) the ``k`` largest magnitudes of a 1-D tensor."""
        n = flat.numel()
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=flat.device)
        if n <= _EXACT_BELOW or k * 4 >= n:
            if not bool(torch.isfinite(flat).all()):
                raise NonFiniteError("topk: input holds NaN or Inf")
            return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
        sample = self._sample(flat, k)
        rank = min(sample.numel(), max(1, math.ceil(_MARGIN * k * sample.numel() / n)))
        threshold = float(torch.topk(sample, rank, sorted=False).values.min())
        idx = self._above(flat, threshold)
        # Short of k with a positive threshold: the sample misjudged the tensor. (A zero
        # threshold means fewer than k non-zeros, and those are all in ``idx``.)
        if idx.numel() < k and threshold > 0:
            log.debug("topk: %d of %d above the sampled threshold; lowering it", idx.numel(), k)
            threshold = float(torch.topk(sample, min(sample.numel(), rank * 8), sorted=False).values.min())
            idx = self._above(flat, threshold)
            if idx.numel() < k and threshold > 0:  # laid out against the sample: pay for exactness
                log.debug("topk: still short (%d of %d); exact top-k", idx.numel(), k)
                return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
        if idx.numel() > k:
            keep = torch.topk(flat[idx].abs(), k, sorted=False).indices
            idx = idx[keep].sort().values
        return idx

    @staticmethod
    def _sample(flat: torch.Tensor, k: int) -> torch.Tensor:
        """|values| from evenly strided runs covering about _SAMPLE_HITS * n / k values."""
        n = flat.numel()
        runs = n // _SAMPLE_RUN
        want_runs = max(1, math.ceil(_SAMPLE_HITS * n / k / _SAMPLE_RUN))
        if runs <= want_runs:
            return flat.abs().float()
        stride = _next_prime(runs // want_runs)  # a prime stride rarely aligns with a layout
        blocks = flat[: runs * _SAMPLE_RUN].view(runs, _SAMPLE_RUN)[::stride]
        return blocks.abs().float().reshape(-1)

    @staticmethod
    def _above(flat: torch.Tensor, threshold: float) -> torch.Tensor:
        """Indices with |x| >= threshold (> 0 for a zero threshold), chunk by chunk."""
        n = flat.numel()
        strict = threshold <= 0.0
        step = chunk_elems(flat.device, _PASS_CHUNK)
        work = torch.empty(min(n, step), dtype=flat.dtype, device=flat.device)
        mask = torch.empty(min(n, step), dtype=torch.bool, device=flat.device)
        parts, peaks = [], []
        for lo in range(0, n, step):
            x = flat[lo : lo + step]
            a = torch.abs(x, out=work[: x.numel()])
            peaks.append(a.max())
            m = (torch.gt if strict else torch.ge)(a, threshold, out=mask[: x.numel()])
            parts.append(m.nonzero().view(-1).add_(lo))
        if not bool(torch.isfinite(torch.stack(peaks)).all()):
            raise NonFiniteError("topk: input holds NaN or Inf")
        return torch.cat(parts)

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        n = math.prod(shape)
        k = h.int("k", 0, n)
        if payload.numel() != k:
            raise PacketError(h.path + "inner.shape", f"{payload.numel()} values for k={k}")
        idx = unpack_indices(h, buffers[0], k, n)
        return _scatter(n, idx, payload, dtype, device)


@register
class RandomK(Compressor):
    """Keep a random ``fraction`` of values; indices come from the seed, only values travel.

    Indices are stratified (one uniform pick in each of k equal strata), so they are
    distinct and sorted without a permutation. Values are not rescaled by n / k: pair it
    with ``ErrorFeedback``, or rescale yourself for an unbiased estimate.
    """

    codec = "randomk"
    stage_lossless = stage_zero_copy = False
    takes_inner = True
    seeded = True
    params = (Param("fraction", _parse_fraction, 0.01, positional=True, required=True),)

    def __init__(self, fraction: float = 0.01, inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.fraction = _parse_fraction(str(fraction))

    def _encode(self, flat, shape, seed, name) -> Encoded:
        n = flat.numel()
        k = _count(self.fraction, n)
        seed = fresh_seed() if seed is None else seed
        values = flat[rng.sample_indices(seed, k, n, flat.device)]
        if values.numel() and not bool(torch.isfinite(values).all()):
            raise NonFiniteError("randomk: a selected value is NaN or Inf")
        return Encoded({"k": k, "seed": seed}, (), values)

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        n = math.prod(shape)
        k = h.int("k", 0, n)
        seed = h.seed()
        if payload.numel() != k:
            raise PacketError(h.path + "inner.shape", f"{payload.numel()} values for k={k}")
        return _scatter(n, rng.sample_indices(seed, k, n, device), payload, dtype, device)
