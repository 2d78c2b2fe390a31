"""Linear sketches for the sketching protocol: ``countsketch:ROWSxCOLS`` and ``gsketch:SIZE``.

Both draw their random maps from the counter RNG keyed by the seed in the header, so a
receiver rebuilds them exactly, on any device. Both are linear: sketches of several peers
made with the same seed can be summed before unsketching (``sketch`` / ``unsketch`` are
public for that). ``decode`` returns the unsketched estimate in the input's shape and dtype.

- count sketch: row r hashes value i to bucket h_r(i) with sign s_r(i). Unsketch estimates
  each value as the median over rows of s_r(i) * S[r, h_r(i)]; with ``heavy=K`` only the K
  largest estimates (the heavy hitters, as in FetchSGD) are kept.
- ``gsketch``: y = R x with R (SIZE x n) Gaussian with variance 1 / SIZE (``kind=gauss``,
  columns generated chunk by chunk, O(SIZE * n) work), or a subsampled randomized Hadamard
  transform (``kind=srht``, O(n log n)); unsketch is R^T y, unbiased: E[R^T R] = I.

The sketch (float32) is the payload for a next stage. Non-finite input raises
``NonFiniteError``.
"""
from __future__ import annotations

import math

import torch

from . import rng
from .base import Compressor, Encoded, Header, NonFiniteError, PacketError, Param, fresh_seed, register

_CHUNK = 1 << 20  # values hashed (count sketch) or matrix entries generated (gsketch) at once


def _parse_rows_cols(text: str | tuple[int, int]) -> tuple[int, int]:
    if isinstance(text, tuple):
        rows, cols = text
    else:
        parts = text.lower().split("x")
        if len(parts) != 2:
            raise ValueError(f"expected ROWSxCOLS, e.g. 5x10000, got {text!r}")
        rows, cols = int(parts[0]), int(parts[1])
    if not (1 <= rows <= 64 and 1 <= cols < 1 << 31):
        raise ValueError(f"need 1 <= rows <= 64 and 1 <= cols < 2**31, got {rows}x{cols}")
    return rows, cols


def _parse_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _check_finite(table: torch.Tensor, codec: str) -> None:
    if table.numel() and not bool(torch.isfinite(table).all()):
        raise NonFiniteError(f"{codec}: input holds NaN or Inf")


@register
class CountSketch(Compressor):
    codec = "countsketch"
    takes_inner = True
    seeded = True
    params = (
        Param("size", _parse_rows_cols, (5, 10000), positional=True, required=True, fmt=lambda rc: f"{rc[0]}x{rc[1]}"),
        Param("heavy", _parse_count, 0),
    )

    def __init__(self, size: tuple[int, int] | str = (5, 10000), heavy: int = 0, inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.size = _parse_rows_cols(size)
        self.heavy = _parse_count(str(heavy))

    @staticmethod
    def _hashes(seed: int, row: int, cols: int, lo: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        words = rng.bits64(rng.derive_seed(seed, row), count, device, offset=lo)
        bucket = words.bitwise_right_shift(32).bitwise_and_(0xFFFFFFFF).mul_(cols).bitwise_right_shift_(32)
        sign = words.bitwise_and_(1).to(torch.float32).mul_(-2.0).add_(1.0)
        return bucket, sign

    def sketch(self, tensor: torch.Tensor, seed: int) -> torch.Tensor:
        """The (rows, cols) float32 count sketch of ``tensor`` (flattened)."""
        rows, cols = self.size
        flat = tensor.detach().reshape(-1)
        table = torch.zeros(rows, cols, dtype=torch.float32, device=flat.device)
        for lo in range(0, flat.numel(), _CHUNK):
            x = flat[lo : lo + _CHUNK].to(torch.float32)
            for r in range(rows):
                bucket, sign = self._hashes(seed, r, cols, lo, x.numel(), flat.device)
                table[r].index_add_(0, bucket, sign.mul_(x))
        return table

    def unsketch(self, table: torch.Tensor, numel: int, seed: int, heavy: int = 0) -> torch.Tensor:
        """Median-of-rows estimate of the ``numel`` values; keep the ``heavy`` largest if > 0."""
        rows, cols = table.shape
        out = torch.empty(numel, dtype=torch.float32, device=table.device)
        for lo in range(0, numel, _CHUNK):
            count = min(_CHUNK, numel - lo)
            est = torch.empty(rows, count, dtype=torch.float32, device=table.device)
            for r in range(rows):
                bucket, sign = self._hashes(seed, r, cols, lo, count, table.device)
                torch.mul(table[r][bucket], sign, out=est[r])
            ordered = est.sort(dim=0).values
            mid = ordered[rows // 2]
            out[lo : lo + count] = mid if rows % 2 else mid.add_(ordered[rows // 2 - 1]).mul_(0.5)
        if 0 < heavy < numel:
            keep = torch.topk(out.abs(), heavy, sorted=False).indices
            sparse = torch.zeros_like(out)
            sparse[keep] = out[keep]
            out = sparse
        return out

    def _encode(self, flat, shape, seed, name) -> Encoded:
        seed = fresh_seed() if seed is None else seed
        table = self.sketch(flat, seed)
        _check_finite(table, self.codec)
        rows, cols = self.size
        return Encoded({"rows": rows, "cols": cols, "seed": seed, "heavy": self.heavy}, (), table)

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        rows, cols = h.int("rows", 1, 64), h.int("cols", 1, (1 << 31) - 1)
        seed, heavy = h.seed(), h.int("heavy", 0)
        if payload.numel() != rows * cols:
            raise PacketError(h.path + "inner.shape", f"{payload.numel()} values for a {rows}x{cols} sketch")
        table = payload.to(device=device, dtype=torch.float32).view(rows, cols)
        return self.unsketch(table, math.prod(shape), seed, heavy).to(dtype)


def _parse_size(text: str) -> int:
    value = int(text)
    if not 1 <= value < 1 << 31:
        raise ValueError(f"size must be in [1, 2**31), got {value}")
    return value


def _parse_kind(text: str) -> str:
    if text not in ("gauss", "srht"):
        raise ValueError(f"kind must be gauss or srht, got {text!r}")
    return text


def _hadamard(m: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < m:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def _fwht(z: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of a power-of-two length vector.

    H_p is the Kronecker product of small Hadamard matrices; each step multiplies the last
    axis by one of them and rotates the axes, so every axis is done once (a few GEMMs
    instead of log2(p) memory-bound butterfly passes).
    """
    p = z.numel()
    levels = p.bit_length() - 1
    x = z
    while levels > 0:
        step = min(levels, 6)
        m = 1 << step
        x = (x.view(-1, m) @ _hadamard(m, z.device)).T.reshape(-1)
        levels -= step
    return x


@register
class GaussianSketch(Compressor):
    codec = "gsketch"
    takes_inner = True
    seeded = True
    params = (Param("size", _parse_size, 1024, positional=True, required=True), Param("kind", _parse_kind, "gauss"))

    def __init__(self, size: int = 1024, kind: str = "gauss", inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.size = _parse_size(str(size))
        self.kind = _parse_kind(kind)

    @staticmethod
    def _padded(numel: int) -> int:
        return 1 << max(0, (numel - 1).bit_length())

    def sketch_size(self, numel: int) -> int:
        """SRHT cannot sample more rows than the padded length; Gaussian has no limit."""
        return min(self.size, self._padded(numel)) if self.kind == "srht" else self.size

    def sketch(self, tensor: torch.Tensor, seed: int, kind: str | None = None, size: int | None = None) -> torch.Tensor:
        """The float32 sketch y = R x of ``tensor`` (flattened)."""
        flat = tensor.detach().reshape(-1).to(torch.float32)
        kind = kind or self.kind
        size = size or self.sketch_size(flat.numel())
        if kind == "srht":
            p = self._padded(flat.numel())
            z = torch.zeros(p, dtype=torch.float32, device=flat.device)
            z[: flat.numel()] = flat * rng.rademacher(rng.derive_seed(seed, 1), flat.numel(), flat.device)
            rows = rng.sample_indices(rng.derive_seed(seed, 2), size, p, flat.device)
            return _fwht(z)[rows].mul_(1.0 / math.sqrt(size))
        y = torch.zeros(size, dtype=torch.float32, device=flat.device)
        step = max(1, _CHUNK // size)
        for c0 in range(0, flat.numel(), step):
            x = flat[c0 : c0 + step]
            r = rng.normal(seed, size * x.numel(), flat.device, offset=c0 * size).view(x.numel(), size)
            y.add_(r.T @ x)
        return y.mul_(1.0 / math.sqrt(size))

    def unsketch(self, y: torch.Tensor, numel: int, seed: int, kind: str | None = None) -> torch.Tensor:
        """R^T y: an unbiased float32 estimate of the ``numel`` sketched values."""
        kind = kind or self.kind
        size = y.numel()
        y = y.to(torch.float32)
        if kind == "srht":
            p = self._padded(numel)
            z = torch.zeros(p, dtype=torch.float32, device=y.device)
            z[rng.sample_indices(rng.derive_seed(seed, 2), size, p, y.device)] = y * (1.0 / math.sqrt(size))
            return _fwht(z)[:numel].mul_(rng.rademacher(rng.derive_seed(seed, 1), numel, y.device))
        out = torch.empty(numel, dtype=torch.float32, device=y.device)
        step = max(1, _CHUNK // size)
        for c0 in range(0, numel, step):
            count = min(step, numel - c0)
            r = rng.normal(seed, size * count, y.device, offset=c0 * size).view(count, size)
            torch.mv(r, y, out=out[c0 : c0 + count])
        return out.mul_(1.0 / math.sqrt(size))

    def _encode(self, flat, shape, seed, name) -> Encoded:
        seed = fresh_seed() if seed is None else seed
        y = self.sketch(flat, seed)
        _check_finite(y, self.codec)
        return Encoded({"size": y.numel(), "kind": self.kind, "seed": seed}, (), y)

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        kind = h.str("kind", ("gauss", "srht"))
        seed = h.seed()
        n = math.prod(shape)
        size = h.int("size", 1, (1 << 31) - 1 if kind == "gauss" else self._padded(n))
        if payload.numel() != size:
            raise PacketError(h.path + "inner.shape", f"{payload.numel()} values for a sketch of size {size}")
        return self.unsketch(payload.to(device), n, seed, kind).to(dtype)
