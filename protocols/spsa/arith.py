"""The arithmetic of `spsa`: exact in-place perturbation, directions regenerated from seeds,
the one-byte quantizer of projected gradients, and parameter digests.

Exact perturbation. In float32, fl(fl(fl(x + d) - 2d) + d) is not x in general: each add rounds,
and x + d cannot even hold x's low bits when |d| > |x|. So the map x -> x + d must lose nothing,
and we make it so by keeping every trained tensor on a power-of-two grid (24-bit fixed point):

    M(T)    = max |T| + eps * zmax                 # the largest value a perturbation can reach
    G(T)    = 2^(e - 22)  where M(T) < 2^e         # so |T +- d| < 4 M <= 2^24 G: all exact
    T       = G * round(T / G)                     # snapped once, and when G grows
    d       = G * round(eps * z / G)               # perturbation on the same grid
    update  = G * round(lr * sum_j c_j z_j / G)    # and so is every update

A sum of multiples of G below 2^24 G is exact in float32, so +d, -2d, +d returns every bit, on
any IEEE device, and an update is exact too. G is a pure function of the tensor's values, so a
peer that loads the same values derives the same grid. The price: a tensor keeps 22-23
significant bits relative to its largest entry (a tiny entry next to a large one is resolved to
2^-22 of the large one), and an update smaller than G/2 rounds to zero (G is about 2.4e-7 for a
tensor whose largest entry is near 1). Only float32 tensors are trained.

One byte per projected gradient. A code c in [-127, 127] (-128 is reserved, hence malformed):

    c = 0                 g = 0
    c = +-k, 1 <= k <= 127   g = +-S * 2^((k - 64) / 8)           S = 2^scale_log2

i.e. sign plus log-magnitude in steps of 2^(1/8) over S/234 .. 234 S. Rounding to the nearest
step in the log domain gives |g^ - g| <= (2^(1/16) - 1) |g| (4.43%) for S 2^-7.9375 <= |g| <=
S 2^7.9375; below that, g^ = 0 and |g^ - g| = |g| < S 2^-7.9375; above, codes saturate at
+-127 (g^ = +-234 S, never larger than |g|). The sign is always kept. S costs no bytes: every
peer derives it from the codes already decoded (`ScaleTracker`), so it follows |g|.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from starling.common import peer_hash
from starling.compressors import rng

CODE_RESERVED = -128
LEVELS_PER_OCTAVE = 8
CODE_BIAS = 64
MAX_CODE = 127
REL_ERROR = 2.0 ** (1.0 / 16.0) - 1.0  # the quantizer's relative error bound inside its range
UNDERFLOW_LOG2 = -(CODE_BIAS - 0.5) / LEVELS_PER_OCTAVE  # log2(|g| / S) below which g^ = 0
SATURATE_LOG2 = (MAX_CODE - CODE_BIAS) / LEVELS_PER_OCTAVE  # log2 of the largest |g^| / S
# 2^(j/8) for j = 0..7, written out so that decoding never depends on a platform's pow().
_OCTAVE_STEPS = tuple(float.fromhex(h) for h in (
    "0x1.0000000000000p+0", "0x1.172b83c7d517bp+0", "0x1.306fe0a31b715p+0", "0x1.4bfdad5362a27p+0",
    "0x1.6a09e667f3bcdp+0", "0x1.8ace5422aa0dbp+0", "0x1.ae89f995ad3adp+0", "0x1.d5818dcfba487p+0"))
_SQRT_HALF = float.fromhex("0x1.6a09e667f3bcdp-1")
_MANTISSA_BITS = 24  # float32
_GRID_SHIFT = _MANTISSA_BITS - 2  # G = 2^(e - 22): two bits of headroom above max|T| + eps zmax
Z_MAX = {"rademacher": 1.0, "normal": 6.0}  # the counter RNG's normals stop near 5.8 sigma
NO_DIGEST = -1


# ---------------------------------------------------------------------------- one byte
def encode_g(g: float, scale_log2: int) -> int:
    """The code of a projected gradient (0 for 0, NaN or inf: such a step moves nothing)."""
    if g == 0.0 or not math.isfinite(g):
        return 0
    level = round(LEVELS_PER_OCTAVE * (math.log2(abs(g)) - scale_log2)) + CODE_BIAS
    k = min(max(level, 0), MAX_CODE)
    return k if g > 0 else -k


def decode_code(code: int, scale_log2: int) -> float:
    """The value of a code; exact (a table entry times a power of two), same on every machine."""
    if not -MAX_CODE <= code <= MAX_CODE:
        raise ValueError(f"code {code} outside [-{MAX_CODE}, {MAX_CODE}]")
    if code == 0:
        return 0.0
    octave, step = divmod(abs(code) - CODE_BIAS, LEVELS_PER_OCTAVE)
    value = math.ldexp(_OCTAVE_STEPS[step], octave + scale_log2)
    return value if code > 0 else -value


def codes_from_bytes(data: bytes) -> list[int]:
    """Signed codes from wire bytes; ValueError for the reserved -128."""
    codes = [b - 256 if b > 127 else b for b in data]
    if CODE_RESERVED in codes:
        raise ValueError(f"code {CODE_RESERVED} is reserved")
    return codes


def codes_to_bytes(codes: Sequence[int]) -> bytes:
    return bytes(c & 0xFF for c in codes)


def round_log2(x: float) -> int:
    """round(log2(x)) for x > 0, exactly (frexp, no libm)."""
    mantissa, exponent = math.frexp(x)  # x = m 2^e, 0.5 <= m < 1
    return exponent if mantissa >= _SQRT_HALF else exponent - 1


@dataclass
class ScaleTracker:
    """S = 2^scale_log2, centred on a running mean of |g^| that every peer computes alike."""

    scale_log2: int
    mean_abs: float
    decay: float = 0.9

    @classmethod
    def start(cls, g_scale: float) -> ScaleTracker:
        log2 = round_log2(g_scale)
        return cls(log2, math.ldexp(1.0, log2))

    def update(self, values: Sequence[float]) -> None:
        """After a step: fold in the step's decoded values (Python floats: IEEE double ops)."""
        if not values:
            return
        mean = sum(abs(v) for v in values) / len(values)
        # All-zero codes (|g| under the range) pull S down; a floor keeps it a normal number.
        self.mean_abs = max(self.decay * self.mean_abs + (1.0 - self.decay) * mean, 1e-30)
        self.scale_log2 = round_log2(self.mean_abs)


# ---------------------------------------------------------------------------- directions
def peer_key(peer_id: str) -> int:
    """A peer's 63-bit key: its seed component and its name in records."""
    return peer_hash(peer_id, digest="blake2b", byteorder="little", bits=63)


def direction_seed(swarm_seed: int, step: int, sample: int, key: int | None) -> int:
    """z's seed: (swarm seed, step, sample) in shared mode, plus the peer key in per-peer mode."""
    if key is None:
        return rng.derive_seed(swarm_seed, step, sample)
    return rng.derive_seed(swarm_seed, key, step, sample)


def direction(seed: int, offset: int, n: int, distribution: str, device: torch.device) -> torch.Tensor:
    """z[offset : offset + n] of the direction seeded by `seed` (float32)."""
    if distribution == "rademacher":
        return rng.rademacher(seed, n, device, offset=offset)
    return rng.normal(seed, n, device, offset=offset)


# ---------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class _Segment:
    tensor: int  # index into ParamSpace.params
    lo: int  # range within the flattened tensor
    hi: int
    at: int  # where that range starts within the chunk


class ParamSpace:
    """The trained parameters as one stream of `numel` values, visited in chunks of
    `chunk_numel` so that a direction is regenerated (never stored) with O(chunk) memory."""

    def __init__(self, model: nn.Module, param_filter: str, chunk_numel: int, eps: float, z_max: float) -> None:
        pattern = re.compile(param_filter) if param_filter else None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad
                 and (pattern is None or pattern.search(n))]
        if not named:
            raise ValueError(f"no trainable parameter matches param_filter {param_filter!r}")
        bad = [(n, p.dtype) for n, p in named if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"spsa trains float32 parameters only; {bad[0][0]} is {bad[0][1]} "
                             "(cast the model with .float() or narrow param_filter)")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.numel = sum(p.numel() for p in self.params)
        self.device = self.params[0].device
        self.reach = eps * z_max
        self.eps = eps
        self.grids = [0.0] * len(self.params)
        self._chunks = list(self._plan(chunk_numel))

    def _plan(self, chunk_numel: int) -> Iterator[tuple[int, int, list[_Segment]]]:
        lo, segments, filled = 0, [], 0
        for i, p in enumerate(self.params):
            pos, n = 0, p.numel()
            while pos < n:
                take = min(n - pos, chunk_numel - filled)
                segments.append(_Segment(i, pos, pos + take, filled))
                pos, filled = pos + take, filled + take
                if filled == chunk_numel:
                    yield lo, filled, segments
                    lo, segments, filled = lo + filled, [], 0
        if filled:
            yield lo, filled, segments

    def _view(self, seg: _Segment) -> torch.Tensor:
        return self.params[seg.tensor].detach().view(-1)[seg.lo:seg.hi]

    # ---------------------------------------------------------------- grid
    @torch.no_grad()
    def snap(self) -> None:
        """Give each tensor the grid its values call for, rounding onto it where it grew.

        The result is a pure function of the values (values on a grid lie on every finer one),
        so a peer that loads a snapped tensor derives the same grid and changes nothing. Negative
        zeros are made positive: an exact sum that returns to zero is +0."""
        for i, p in enumerate(self.params):
            grid = self._grid_for(p)
            if grid > self.grids[i] and not self._on_grid(p, grid):
                p.detach().div_(grid).round_().mul_(grid)
                lifted = self._grid_for(p)  # rounding up may carry max|T| past a power of two
                if lifted > grid:
                    grid = lifted
                    p.detach().div_(grid).round_().mul_(grid)
            p.detach().add_(0.0)  # -0.0 (also from rounding) becomes +0.0, as x + d - 2d + d gives
            self.grids[i] = grid

    def _grid_for(self, p: torch.Tensor) -> float:
        low, high = torch.aminmax(p.detach()) if p.numel() else (torch.zeros(()), torch.zeros(()))
        max_abs = max(-float(low), float(high))  # no |T| temporary: memory stays O(chunk)
        _, exponent = math.frexp(max_abs + self.reach)  # M < 2^exponent
        return math.ldexp(1.0, exponent - _GRID_SHIFT)

    @staticmethod
    def _on_grid(p: torch.Tensor, grid: float) -> bool:
        scaled = p.detach() / grid
        return bool(torch.equal(scaled, scaled.round()))

    # ---------------------------------------------------------------- perturb and update
    @torch.no_grad()
    def perturb(self, seed: int, distribution: str, factor: int) -> None:
        """theta += factor * d(z(seed)), exactly (factor +1 or -2)."""
        for lo, n, segments in self._chunks:
            z = direction(seed, lo, n, distribution, self.device)
            for seg in segments:
                grid = self.grids[seg.tensor]
                steps = z[seg.at:seg.at + seg.hi - seg.lo].mul(self.eps / grid).round_()
                self._view(seg).add_(steps, alpha=factor * grid)  # integer * power of two: exact

    @torch.no_grad()
    def update(self, terms: Sequence[tuple[int, float]], distribution: str) -> None:
        """theta += sum_j coef_j z(seed_j), snapped to each tensor's grid once per chunk.

        Terms are summed in the given order, one rounding per multiply and per add (no fused
        multiply-add), so every IEEE device gets the same bits."""
        if not terms:
            return
        for lo, n, segments in self._chunks:
            acc: torch.Tensor | None = None
            for seed, coef in terms:
                z = direction(seed, lo, n, distribution, self.device).mul_(coef)
                acc = z if acc is None else acc.add_(z)
            assert acc is not None
            for seg in segments:
                grid = self.grids[seg.tensor]
                delta = acc[seg.at:seg.at + seg.hi - seg.lo].div(grid).round_().mul_(grid)
                self._view(seg).add_(delta)
        self.snap()

    # ---------------------------------------------------------------- state
    @torch.no_grad()
    def digest(self) -> int:
        """A 63-bit digest of the trained parameters' bits."""
        h = hashlib.blake2b(digest_size=8)
        for p in self.params:
            h.update(p.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy())
        return int.from_bytes(h.digest(), "little") >> 1

    @torch.no_grad()
    def read(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.params])

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        if flat.dtype != torch.float32 or flat.numel() != self.numel:
            raise ValueError(f"expected {self.numel} float32 values, got {flat.numel()} {flat.dtype}")
        pos = 0
        for p in self.params:
            p.detach().copy_(flat[pos:pos + p.numel()].view_as(p))
            pos += p.numel()
        self.grids = [0.0] * len(self.params)
        self.snap()
