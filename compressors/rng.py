"""Counter-based random numbers that are bit-identical on every device.

Every number is a pure function of ``(seed, stream, index)``: a SplitMix64 finaliser applied
to ``key(seed, stream) + index * GOLDEN``. Only int64 ops (add, multiply with wrap-around,
shift, and, xor) build the bits, so CPU and CUDA give the same bits; chunks generated with an
``offset`` are exactly the matching slice of one long draw.

Floats are built from those bits with IEEE-exact steps only (int to float of 24-bit
integers, multiplication by powers of two). ``normal`` uses Box-Muller with its own
logarithm, sine and cosine made of add, multiply, divide and sqrt, each a separate torch
op and each correctly rounded in IEEE arithmetic, so normals are bit-identical across
devices too. The square root is taken in float64 and rounded to float32: torch's CUDA
float32 sqrt is not correctly rounded (one ulp off on about 0.6% of values on an H200).
Resolution: uniforms carry 24 random bits (8 for bfloat16, 11 for float16); normals are
truncated at about 5.8 standard deviations (radius from 24-bit uniforms).

Streams keep the kinds apart: ``uniform(s, n)`` and ``normal(s, n)`` are independent.
"""
from __future__ import annotations

import math

import torch

# One seed derivation for every room; its SplitMix64 mixing and seed check are this RNG's too.
from starling.common.hashing import check_seed as _check_seed
from starling.common.hashing import derive_seed
from starling.common.hashing import mix64 as _mix64_int

__all__ = [
    "bits64",
    "derive_seed",
    "normal",
    "rademacher",
    "randint",
    "sample_indices",
    "uniform",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB

# Stream tags: one per kind of number, so that kinds drawn from one seed are independent.
_STREAM_BITS = 0x5354_0001
_STREAM_UNIFORM = 0x5354_0002
_STREAM_NORMAL = 0x5354_0003
_STREAM_SIGN = 0x5354_0004
_STREAM_INT = 0x5354_0005
_STREAM_INDEX = 0x5354_0006

# Words hashed per chunk: keeps every temporary inside the CPU caches.
_CHUNK_WORDS = 1 << 16


def _signed(value: int) -> int:
    """Reinterpret an unsigned 64-bit integer as torch's signed int64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _key(seed: int, stream: int) -> int:
    return _mix64_int(_mix64_int(_check_seed(seed)) ^ _mix64_int(stream))


_M30 = (1 << 34) - 1
_M27 = (1 << 37) - 1
_M31 = (1 << 33) - 1
_S_GOLDEN = _signed(_GOLDEN)
_S_C1 = _signed(_C1)
_S_C2 = _signed(_C2)


def _chunk(device: torch.device) -> int:
    # rng may not import base (base imports rng), hence its own copy of the rule.
    return _CHUNK_WORDS if device.type == "cpu" else max(_CHUNK_WORDS, 1 << 22)


def _hash_counters(key: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """SplitMix64 of ``key + (start + i) * GOLDEN`` for i in [0, count): int64 words."""
    out = torch.empty(count, dtype=torch.int64, device=device)
    k = _signed(key)
    step = _chunk(device)
    for lo in range(0, count, step):
        hi = min(count, lo + step)
        z = torch.arange(start + lo, start + hi, dtype=torch.int64, device=device)
        z.mul_(_S_GOLDEN).add_(k)
        # Logical right shifts are arithmetic shifts with the sign-extended bits masked off.
        z.bitwise_xor_(z.bitwise_right_shift(30).bitwise_and_(_M30)).mul_(_S_C1)
        z.bitwise_xor_(z.bitwise_right_shift(27).bitwise_and_(_M27)).mul_(_S_C2)
        z.bitwise_xor_(z.bitwise_right_shift(31).bitwise_and_(_M31))
        out[lo:hi] = z
    return out


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def _check_count(n: int, offset: int) -> None:
    if n < 0 or offset < 0:
        raise ValueError(f"count and offset must be >= 0, got n={n}, offset={offset}")


def bits64(seed: int, n: int, device: torch.device | str | None = None, *, offset: int = 0) -> torch.Tensor:
    """``n`` raw 64-bit words (int64) at stream positions ``offset .. offset + n - 1``."""
    _check_count(n, offset)
    return _hash_counters(_key(seed, _STREAM_BITS), offset, n, _device(device))


def _fields24(key: int, n: int, offset: int, device: torch.device) -> torch.Tensor:
    """24-bit integers (int64), two per hashed word, at positions ``offset .. offset+n-1``."""
    first = offset // 2
    words = _hash_counters(key, first, (offset + n + 1) // 2 - first, device)
    fields = torch.stack(
        (words.bitwise_right_shift(40).bitwise_and_(0xFFFFFF), words.bitwise_right_shift(16).bitwise_and_(0xFFFFFF)),
        dim=1,
    ).view(-1)
    start = offset - 2 * first
    return fields[start : start + n]


_UNIFORM_BITS = {torch.bfloat16: 8, torch.float16: 11}


def uniform(
    seed: int,
    n: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    offset: int = 0,
) -> torch.Tensor:
    """Uniform numbers in [0, 1), exactly representable in ``dtype`` (never 1.0)."""
    _check_count(n, offset)
    fields = _fields24(_key(seed, _STREAM_UNIFORM), n, offset, _device(device))
    bits = _UNIFORM_BITS.get(dtype, 24)
    if bits < 24:
        fields = fields.bitwise_right_shift(24 - bits)
    return fields.to(torch.float32).mul_(2.0**-bits).to(dtype)


# Box-Muller ingredients, all from +, -, *, / and sqrt (see module docstring).
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
_HALF_PI = math.pi / 2
_SIN_COEF = (-1 / 6, 1 / 120, -1 / 5040, 1 / 362880, -1 / 39916800)
_COS_COEF = (-1 / 2, 1 / 24, -1 / 720, 1 / 40320, -1 / 3628800, 1 / 479001600)
_LOG_COEF = (1 / 3, 1 / 5, 1 / 7, 1 / 9)


def _poly(w: torch.Tensor, coefs: tuple[float, ...]) -> torch.Tensor:
    """1 + c0 w + c1 w^2 + ... by Horner's rule, one torch op per step (no fused ops)."""
    acc = torch.full_like(w, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc.mul_(w).add_(c)
    return acc.mul_(w).add_(1.0)


def _neg_two_log(v: torch.Tensor) -> torch.Tensor:
    """-2 ln(v) for v in (0, 1] (float32), using frexp and the atanh series."""
    m, e = torch.frexp(v)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = e.to(torch.float32).sub_(small.to(torch.float32))
    t = (m - 1.0).div_(m + 1.0)  # |t| <= 0.172: the series converges fast
    ln_m = _poly(t * t, _LOG_COEF).mul_(t).mul_(2.0)
    return e.mul_(_LN2).add_(ln_m).mul_(-2.0)


def _normal_pairs(key: int, first_pair: int, pairs: int, device: torch.device) -> torch.Tensor:
    """(pairs, 2) float32 standard normals; pair j is a pure function of (key, first_pair + j)."""
    out = torch.empty(pairs, 2, dtype=torch.float32, device=device)
    step = _chunk(device)
    for lo in range(0, pairs, step):
        hi = min(pairs, lo + step)
        words = _hash_counters(key, first_pair + lo, hi - lo, device)
        # 24 bits for the radius, 22 for the angle inside a quarter turn, 2 sign bits.
        radius_bits = words.bitwise_right_shift(40).bitwise_and_(0xFFFFFF)
        angle_bits = words.bitwise_right_shift(2).bitwise_and_(0x3FFFFF)
        signs = words.bitwise_and(3)
        v = radius_bits.to(torch.float32).mul_(-(2.0**-24)).add_(1.0)  # (0, 1], exact
        # sqrt in float64, rounded once to float32: that is the correctly rounded float32 sqrt
        # (53 >= 2 * 24 + 2 bits), where CUDA's float32 sqrt was seen off by one ulp
        r = _neg_two_log(v).double().sqrt_().float()
        theta = angle_bits.to(torch.float32).add_(0.5).mul_(2.0**-22).mul_(_HALF_PI)
        w = theta * theta
        sin = _poly(w, _SIN_COEF).mul_(theta)
        cos = _poly(w, _COS_COEF)
        # Independent reflections of a uniform quarter-turn angle give a uniform full turn.
        sx = signs.bitwise_and(1).to(torch.float32).mul_(-2.0).add_(1.0)
        sy = signs.bitwise_right_shift(1).to(torch.float32).mul_(-2.0).add_(1.0)
        out[lo:hi, 0] = cos.mul_(r).mul_(sx)
        out[lo:hi, 1] = sin.mul_(r).mul_(sy)
    return out


def normal(
    seed: int,
    n: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    offset: int = 0,
) -> torch.Tensor:
    """Standard normal numbers at stream positions ``offset .. offset + n - 1``.

    Computed in float32 and rounded once to ``dtype``; any chunking by ``offset`` gives the
    same numbers as one call.
    """
    _check_count(n, offset)
    first = offset // 2
    pairs = _normal_pairs(_key(seed, _STREAM_NORMAL), first, (offset + n + 1) // 2 - first, _device(device))
    start = offset - 2 * first
    flat = pairs.view(-1)[start : start + n]
    return flat.to(dtype) if dtype != torch.float32 or start or flat.numel() != pairs.numel() else flat


def rademacher(
    seed: int,
    n: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    offset: int = 0,
) -> torch.Tensor:
    """Random signs (+1 / -1) at stream positions ``offset .. offset + n - 1``."""
    _check_count(n, offset)
    first = offset // 64
    words = _hash_counters(_key(seed, _STREAM_SIGN), first, (offset + n + 63) // 64 - first, _device(device))
    shifts = torch.arange(64, dtype=torch.int64, device=words.device)
    bits = words.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)
    start = offset - 64 * first
    return bits[start : start + n].to(dtype).mul_(-2).add_(1)


def _randint_from_words(words: torch.Tensor, high: torch.Tensor | int) -> torch.Tensor:
    """Map 64-bit words to [0, high) by multiply-shift on their top 32 bits (high < 2**31)."""
    top = words.bitwise_right_shift(32).bitwise_and_(0xFFFFFFFF)
    return top.mul_(high).bitwise_right_shift_(32)


def randint(
    seed: int,
    n: int,
    high: int,
    device: torch.device | str | None = None,
    *,
    offset: int = 0,
) -> torch.Tensor:
    """Integers in [0, high) (int64). Bias below 2**-32 * high relative per value."""
    _check_count(n, offset)
    if not 0 < high <= 1 << 62:
        raise ValueError(f"high must be in [1, 2**62], got {high}")
    words = _hash_counters(_key(seed, _STREAM_INT), offset, n, _device(device))
    if high < 1 << 31:
        return _randint_from_words(words, high)
    # Wide ranges: 53-bit fractions in float64 (exact IEEE ops on every device).
    frac = words.bitwise_right_shift(11).bitwise_and_((1 << 53) - 1).to(torch.float64).mul_(2.0**-53)
    return frac.mul_(float(high)).floor_().to(torch.int64).clamp_(max=high - 1)


def sample_indices(seed: int, k: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``k`` distinct sorted indices in [0, n), without a permutation.

    Stratified sampling: [0, n) is cut into ``k`` strata of near-equal length and one index
    is drawn uniformly in each, so each index is kept with probability about k / n.
    """
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    dev = _device(device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    if k == n:
        return torch.arange(n, dtype=torch.int64, device=dev)
    i = torch.arange(k + 1, dtype=torch.int64, device=dev)
    if k * n < 1 << 62:
        bounds = i.mul_(n).div_(k, rounding_mode="floor")
    else:  # floor(i * n / k) without overflow
        q, r = divmod(n, k)
        bounds = i * q + (i * r).div_(k, rounding_mode="floor")
    lo, length = bounds[:-1], bounds[1:] - bounds[:-1]
    words = _hash_counters(_key(seed, _STREAM_INDEX), 0, k, dev)
    if n // k + 1 < 1 << 31:
        return lo + _randint_from_words(words, length)
    frac = words.bitwise_right_shift(11).bitwise_and_((1 << 53) - 1).to(torch.float64).mul_(2.0**-53)
    return lo + frac.mul_(length.to(torch.float64)).floor_().to(torch.int64)
