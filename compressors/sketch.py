"""Linear sketches for the sketching protocol: ``countsketch:ROWSxCOLS`` and ``gsketch:SIZE``.

Both draw their random maps from the counter RNG keyed by the seed in the header, so a
receiver rebuilds them exactly, on any device. Both are linear: sketches of several peers
made with the same seed can be summed before unsketching (``sketch`` / ``unsketch`` are
public for that). ``decode`` returns the unsketched estimate in the input's shape and dtype.

- count sketch: row r hashes value i to bucket h_r(i) with sign s_r(i). Unsketch estimates
  each value as the median over rows of s_r(i) * S[r, h_r(i)]; with ``heavy=K`` only the K
  largest estimates (the heavy hitters, as in FetchSGD) are kept. ``transpose`` is the
  linear, unbiased estimate R^T S / ROWS (the mean over rows). ``hash=mix`` (default) hashes
  every value; ``hash=shift`` cuts the input into blocks of COLS values and maps block j to
  the buckets by a random cyclic shift a_j with one random sign s_j (bucket (k + a_j) mod
  COLS for the k-th value of the block): two values of different blocks collide with
  probability 1 / COLS and random relative sign, as in a count sketch, but only one word is
  hashed per block, so sketching and unsketching are a few memory passes.
- ``gsketch``: y = R x with R (SIZE x n) Gaussian with variance 1 / SIZE (``kind=gauss``,
  columns generated chunk by chunk, O(SIZE * n) work), or a subsampled randomized Hadamard
  transform (``kind=srht``, O(n log n)); unsketch is R^T y, unbiased: E[R^T R] = I.

The sketch (float32) is the payload for a next stage. Non-finite input raises
``NonFiniteError``. ``sketch_rows`` sketches each row of a matrix with the same map (per-sample
gradients), in one pass over the map.
"""
from __future__ import annotations

import math

import torch

from . import rng
from .base import Compressor, Encoded, Header, NonFiniteError, PacketError, Param, fresh_seed
from .registry import register

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


def _parse_hash(text: str) -> str:
    if text not in ("mix", "shift"):
        raise ValueError(f"hash must be mix or shift, got {text!r}")
    return text


_SHIFT_STREAM = 0x5348_4946  # derive_seed part that keeps block shifts apart from the mix hashes


def _check_finite(table: torch.Tensor, codec: str) -> None:
    if table.numel() and not bool(torch.isfinite(table).all()):
        raise NonFiniteError(f"{codec}: input holds NaN or Inf")


@register
class CountSketch(Compressor):
    codec = "countsketch"
    stage_lossless = stage_zero_copy = False
    takes_inner = True
    seeded = True
    params = (
        Param("size", _parse_rows_cols, (5, 10000), positional=True, required=True, fmt=lambda rc: f"{rc[0]}x{rc[1]}"),
        Param("heavy", _parse_count, 0),
        Param("hash", _parse_hash, "mix"),
    )

    def __init__(self, size: tuple[int, int] | str = (5, 10000), heavy: int = 0, hash: str = "mix",
                 inner: Compressor | None = None) -> None:
        super().__init__(inner)
        self.size = _parse_rows_cols(size)
        self.heavy = _parse_count(str(heavy))
        self.hash = _parse_hash(hash)

    @staticmethod
    def _hashes(
        seed: int, row: int, cols: int, lo: int, count: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        words = rng.bits64(rng.derive_seed(seed, row), count, device, offset=lo)
        bucket = words.bitwise_right_shift(32).bitwise_and_(0xFFFFFFFF).mul_(cols).bitwise_right_shift_(32)
        sign = words.bitwise_and_(1).to(torch.float32).mul_(-2.0).add_(1.0)
        return bucket, sign

    @staticmethod
    def _block_maps(seed: int, row: int, cols: int, numel: int) -> tuple[list[int], list[float]]:
        """``hash=shift``: each block's cyclic shift and sign (one hashed word per block)."""
        blocks = -(-numel // cols)
        words = rng.bits64(rng.derive_seed(seed, row, _SHIFT_STREAM), blocks)
        shifts = words.bitwise_right_shift(32).bitwise_and_(0xFFFFFFFF).mul_(cols).bitwise_right_shift_(32)
        signs = words.bitwise_and_(1).to(torch.float32).mul_(-2.0).add_(1.0)
        return shifts.tolist(), signs.tolist()

    @staticmethod
    def _segments(cols: int, numel: int, shifts: list[int], lo: int, hi: int):
        """``hash=shift``: (block, bucket start, value start, length) runs covering [lo, hi)."""
        for j in range(lo // cols, -(-hi // cols)):
            start, stop = max(lo, j * cols), min(hi, (j + 1) * cols, numel)
            bucket = (start - j * cols + shifts[j]) % cols
            while start < stop:  # at most two runs: up to the last bucket, then from bucket 0
                run = min(stop - start, cols - bucket)
                yield j, bucket, start, run
                start, bucket = start + run, 0

    def sketch(self, tensor: torch.Tensor, seed: int) -> torch.Tensor:
        """The (rows, cols) float32 count sketch of ``tensor`` (flattened)."""
        return self.sketch_rows(tensor.detach().reshape(1, -1), seed)[0]

    def sketch_rows(self, matrix: torch.Tensor, seed: int) -> torch.Tensor:
        """(B, rows, cols): the count sketch of each row of a (B, n) matrix, one map for all."""
        rows, cols = self.size
        batch, numel = matrix.shape
        table = torch.zeros(batch, rows, cols, dtype=torch.float32, device=matrix.device)
        for r in range(rows):
            if self.hash == "shift":
                shifts, signs = self._block_maps(seed, r, cols, numel)
            for lo in range(0, numel, _CHUNK):
                x = matrix[:, lo : lo + _CHUNK].to(torch.float32)
                if self.hash == "shift":
                    for j, bucket, start, run in self._segments(cols, numel, shifts, lo, lo + x.shape[1]):
                        table[:, r, bucket : bucket + run].add_(x[:, start - lo : start - lo + run], alpha=signs[j])
                else:
                    bucket, sign = self._hashes(seed, r, cols, lo, x.shape[1], matrix.device)
                    table[:, r].index_add_(1, bucket, x * sign)
        return table

    def _row_estimates(self, table: torch.Tensor, numel: int, seed: int, lo: int, count: int,
                       est: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, count): each row's estimate s_r(i) * S[r, h_r(i)] of values lo .. lo+count-1."""
        rows, cols = table.shape
        if est is None:
            est = torch.empty(rows, count, dtype=torch.float32, device=table.device)
        for r in range(rows):
            if self.hash == "shift":
                shifts, signs = self._block_maps(seed, r, cols, numel)
                for j, bucket, start, run in self._segments(cols, numel, shifts, lo, lo + count):
                    torch.mul(table[r, bucket : bucket + run], signs[j], out=est[r, start - lo : start - lo + run])
            else:
                bucket, sign = self._hashes(seed, r, cols, lo, count, table.device)
                torch.mul(table[r][bucket], sign, out=est[r])
        return est

    def unsketch(self, table: torch.Tensor, numel: int, seed: int, heavy: int = 0) -> torch.Tensor:
        """Median-of-rows estimate of the ``numel`` values; keep the ``heavy`` largest if > 0."""
        rows = table.shape[0]
        out = torch.empty(numel, dtype=torch.float32, device=table.device)
        if rows == 1:  # the only row's estimate is the median: written in place
            self._row_estimates(table, numel, seed, 0, numel, out.view(1, numel))
        buffers = None  # reused across chunks: fresh pages cost more than the sort on some hosts
        for lo in range(0, numel if rows > 1 else 0, _CHUNK):
            count = min(_CHUNK, numel - lo)
            if buffers is None or buffers[0].shape[1] != count:
                buffers = tuple(torch.empty(rows, count, dtype=dt, device=table.device)
                                for dt in (torch.float32, torch.float32, torch.int64))
            est, ordered, order = buffers
            self._row_estimates(table, numel, seed, lo, count, est)
            torch.sort(est, dim=0, out=(ordered, order))
            mid = ordered[rows // 2]
            out[lo : lo + count] = mid if rows % 2 else mid.add_(ordered[rows // 2 - 1]).mul_(0.5)
        if 0 < heavy < numel:
            keep = torch.topk(out.abs(), heavy, sorted=False).indices
            sparse = torch.zeros_like(out)
            sparse[keep] = out[keep]
            out = sparse
        return out

    def transpose(self, table: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
        """R^T S / rows: the mean of the rows' estimates, linear and unbiased."""
        rows = table.shape[0]
        if rows == 1:
            return self.unsketch(table, numel, seed)
        out = torch.empty(numel, dtype=torch.float32, device=table.device)
        for lo in range(0, numel, _CHUNK):
            count = min(_CHUNK, numel - lo)
            torch.mean(self._row_estimates(table, numel, seed, lo, count), dim=0, out=out[lo : lo + count])
        return out

    def _encode(self, flat, shape, seed, name) -> Encoded:
        seed = fresh_seed() if seed is None else seed
        table = self.sketch(flat, seed)
        _check_finite(table, self.codec)
        rows, cols = self.size
        fields = {"rows": rows, "cols": cols, "seed": seed, "heavy": self.heavy}
        if self.hash != "mix":  # headers of the default hash stay as they were
            fields["hash"] = self.hash
        return Encoded(fields, (), table)

    def _decode(self, h: Header, buffers, payload, shape, dtype, device) -> torch.Tensor:
        rows, cols = h.int("rows", 1, 64), h.int("cols", 1, (1 << 31) - 1)
        seed, heavy = h.seed(), h.int("heavy", 0)
        if payload.numel() != rows * cols:
            raise PacketError(h.path + "inner.shape", f"{payload.numel()} values for a {rows}x{cols} sketch")
        hashing = h.str("hash", ("mix", "shift")) if "hash" in h.raw else "mix"
        codec = self if hashing == self.hash else CountSketch((rows, cols), heavy, hashing)
        table = payload.to(device=device, dtype=torch.float32).view(rows, cols)
        return codec.unsketch(table, math.prod(shape), seed, heavy).to(dtype)


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
    """Unnormalized Walsh-Hadamard transform of a power-of-two length vector (or of each
    row of a (B, p) matrix).

    H_p is the Kronecker product of small Hadamard matrices; each step multiplies the last
    axis by one of them and rotates the axes, so every axis is done once (a few GEMMs
    instead of log2(p) memory-bound butterfly passes).
    """
    batch = z.shape[0] if z.dim() == 2 else 1
    p = z.shape[-1]
    levels = p.bit_length() - 1
    x = z.reshape(batch, p)
    while levels > 0:
        step = min(levels, 6)
        m = 1 << step
        x = (x.reshape(batch, -1, m) @ _hadamard(m, z.device)).transpose(1, 2).reshape(batch, p)
        levels -= step
    return x if z.dim() == 2 else x.reshape(p)


@register
class GaussianSketch(Compressor):
    codec = "gsketch"
    stage_lossless = stage_zero_copy = False
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
        return self.sketch_rows(tensor.detach().reshape(1, -1), seed, kind, size)[0]

    def sketch_rows(self, matrix: torch.Tensor, seed: int, kind: str | None = None,
                    size: int | None = None) -> torch.Tensor:
        """(B, size): the sketch of each row of a (B, n) matrix with one R for all rows."""
        x = matrix.detach().to(torch.float32)
        batch, numel = x.shape
        kind = kind or self.kind
        size = size or self.sketch_size(numel)
        if kind == "srht":
            p = self._padded(numel)
            z = torch.zeros(batch, p, dtype=torch.float32, device=x.device)
            z[:, :numel] = x * rng.rademacher(rng.derive_seed(seed, 1), numel, x.device)
            rows = rng.sample_indices(rng.derive_seed(seed, 2), size, p, x.device)
            return _fwht(z)[:, rows].mul_(1.0 / math.sqrt(size))
        y = torch.zeros(batch, size, dtype=torch.float32, device=x.device)
        step = max(1, _CHUNK // size)
        for c0 in range(0, numel, step):
            chunk = x[:, c0 : c0 + step]
            r = rng.normal(seed, size * chunk.shape[1], x.device, offset=c0 * size).view(chunk.shape[1], size)
            y.add_(chunk @ r)
        return y.mul_(1.0 / math.sqrt(size))

    def matrix(self, numel: int, seed: int) -> torch.Tensor:
        """R itself, dense (size, numel), for ``kind=gauss``: R x equals ``sketch(x)`` (analysis,
        attacks, and callers that apply one R many times)."""
        if self.kind != "gauss":
            raise ValueError("matrix() is for kind=gauss; SRHT is applied by transform")
        return rng.normal(seed, self.size * numel).view(numel, self.size).T.mul(1.0 / math.sqrt(self.size))

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
