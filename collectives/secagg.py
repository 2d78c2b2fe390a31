"""Secure aggregation's arithmetic (Bonawitz et al. 2017, with SecAgg+'s sparse graph, Bell et
al. 2020), with no sockets: the fixed-point ring parts are summed in, the pseudorandom streams
that mask them, Shamir's secret sharing of the seeds, and the sparse graph of who masks with
whom. `collectives/secure.py` runs the protocol over them inside the sharded all-reduce.

    encode:   q = round(clip(x) * scale) mod 2^b              (b = 8, 16 or 32; sums exact below 2^(b-1))
    prg:      values of the ChaCha20 stream keyed by HKDF(seed, round), from any offset
    shamir:   a secret < 2^521 - 1 split at points 1..n, any t shares give it back, t - 1 say nothing
    graph:    members on a ring shuffled by the round's seed, each joined to k / 2 each side
"""
from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PRIME = 2**521 - 1  # a Mersenne prime: secrets of 32 bytes (< 2^256) are field elements as they are
RINGS = {8: np.uint8, 16: np.uint16, 32: np.uint32}  # ring bits -> the unsigned type that wraps modulo it
DOMAIN = b"starling-secagg-v1"


class SecAggError(ValueError):
    """A round that cannot be unmasked (too few survivors), or input that fails its checks (a
    share whose signature or commitment does not hold, a part of the wrong size)."""


# ---------------------------------------------------------------------- integers
@dataclass(frozen=True)
class IntegerCodec:
    """Fixed point in Z / 2^bits: a value v becomes round(clip(v, -clip, clip) * scale). The sum
    of m members' parts is exact while m * clip * scale < 2^(bits - 1); what it loses is the
    rounding, at most 0.5 / scale per value and member (`max_error`). A part takes bits / 8
    bytes a value: 8 bits fit 4-bit values of up to 18 members."""

    scale: float = 2.0**16
    clip: float = 8.0
    bits: int = 32

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.clip > 0 and math.isfinite(self.scale * self.clip)):
            raise ValueError(f"scale and clip must be positive and finite, got {self.scale}, {self.clip}")
        if self.bits not in RINGS:
            raise ValueError(f"bits must be one of {sorted(RINGS)}, got {self.bits}")

    @property
    def dtype(self) -> Any:
        return RINGS[self.bits]

    def capacity(self) -> int:
        """How many members' parts can be summed without wrapping."""
        return max(0, int((2 ** (self.bits - 1) - 1) // math.ceil(self.clip * self.scale)))

    def max_error(self, members: int) -> float:
        """The largest error the rounding can put in one value of the decoded sum."""
        return 0.5 * members / self.scale

    def encode(self, x: torch.Tensor) -> np.ndarray:
        if not bool(torch.isfinite(x).all()):
            raise SecAggError("a part with NaN or infinite values cannot be encoded")
        if self.bits == 32 and x.dtype == torch.float32 and self.clip * self.scale < 2**24:
            # float32 holds every integer below 2^24 exactly, and int32's two's complement is Z / 2^32
            q32 = torch.round(x.detach().clamp(-self.clip, self.clip) * self.scale).to(torch.int32)
            return q32.cpu().numpy().view(np.uint32)
        q = torch.round(x.detach().to(torch.float64).clamp(-self.clip, self.clip) * self.scale).to(torch.int64)
        return (q.cpu().numpy() % 2**self.bits).astype(self.dtype)

    def decode_sum(self, total: np.ndarray, members: int) -> torch.Tensor:
        if members > self.capacity():
            raise SecAggError(f"{members} members' parts overflow 2^31 at scale {self.scale:g}, clip {self.clip:g}")
        signed = total.astype(np.int64)
        signed[signed >= 2 ** (self.bits - 1)] -= 2**self.bits
        return torch.from_numpy(signed.astype(np.float64) / self.scale).to(torch.float32)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b modulo the ring of a's unsigned type (it wraps), into `a` when it is writable."""
    return np.add(a, b, out=a) if a.flags.writeable else np.add(a, b, dtype=a.dtype)


def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.subtract(a, b, out=a) if a.flags.writeable else np.subtract(a, b, dtype=a.dtype)


def prg(seed: bytes, n: int, round_id: bytes = b"", dtype: Any = np.uint32, offset: int = 0) -> np.ndarray:
    """Values offset .. offset + n of `dtype` (an unsigned ring type) from the ChaCha20 stream
    keyed by HKDF(seed, round_id): an owner draws its shard's slice of a member's mask without
    the rest (the stream seeks by its block counter)."""
    key = HKDF(hashes.SHA256(), 32, salt=DOMAIN, info=b"prg" + round_id).derive(seed)
    kind = np.dtype(dtype).newbyteorder("<")
    start = kind.itemsize * offset
    block, skip = divmod(start, 64)  # ChaCha20's blocks are 64 bytes; its 16-byte nonce starts with the counter
    nonce = block.to_bytes(4, "little") + b"\0" * 12
    stream = Cipher(algorithms.ChaCha20(key, nonce), None).encryptor().update(bytes(skip + kind.itemsize * n))
    return np.frombuffer(stream, dtype=kind, offset=skip)  # read-only: callers add it into their own arrays


# ---------------------------------------------------------------------- noise
def discrete_gaussian(n: int, sigma: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """n draws of the discrete Gaussian N_Z(0, sigma^2), P(x) proportional to exp(-x^2 / 2 sigma^2)
    over the integers (Canonne, Kamath and Steinke 2020, Algorithm 3, vectorised): discrete
    Laplace proposals of scale t = floor(sigma) + 1 (a difference of two geometric draws),
    each kept with probability exp(-(|y| - sigma^2 / t)^2 / 2 sigma^2). What each member of a
    secure round adds to its integer part for distributed differential privacy (Kairouz et
    al. 2021): the owner's sum carries the members' noise together, and no part alone."""
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    if sigma == 0.0 or n == 0:
        return np.zeros(n, dtype=np.int64)
    rng = rng or np.random.default_rng(secrets.randbits(128))
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)
    out = np.empty(n, dtype=np.int64)
    filled = 0
    while filled < n:
        m = 2 * (n - filled) + 16
        y = rng.geometric(p, m) - rng.geometric(p, m)  # P(y) proportional to exp(-|y| / t)
        keep = y[rng.random(m) < np.exp(-((np.abs(y) - sigma * sigma / t) ** 2) / (2.0 * sigma * sigma))]
        take = keep[: n - filled]
        out[filled:filled + take.size] = take
        filled += take.size
    return out


# ---------------------------------------------------------------------- Shamir
def split_secret(secret: int, threshold: int, xs: Sequence[int],
                 randbelow: Callable[[int], int] = secrets.randbelow) -> dict[int, int]:
    """Shares of `secret` (0 <= secret < PRIME) at the points `xs` (distinct, nonzero): any
    `threshold` of them give it back, fewer say nothing of it."""
    if not 0 <= secret < PRIME:
        raise ValueError("the secret must be a field element")
    if not 1 <= threshold <= len(xs) or len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError(f"need 1 <= threshold ({threshold}) <= {len(xs)} distinct nonzero points")
    coefficients = [secret] + [randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares[x] = y
    return shares


def combine_shares(shares: Mapping[int, int], threshold: int) -> int:
    """The secret from `threshold` shares (Lagrange at 0); SecAggError with fewer."""
    if len(shares) < threshold:
        raise SecAggError(f"{len(shares)} shares, the threshold is {threshold}")
    points = sorted(shares.items())[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        num, den = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret


# ---------------------------------------------------------------------- the graph
def neighbours(members: Sequence[str], k: int, seed: bytes) -> dict[str, tuple[str, ...]]:
    """SecAgg+'s sparse graph: members on a ring shuffled by `seed`, each joined to the k/2
    before and after it (k even; everyone when k >= len(members) - 1). Symmetric."""
    order = sorted(members, key=lambda m: hashlib.sha256(DOMAIN + seed + m.encode()).digest())
    n = len(order)
    if k >= n - 1:
        return {m: tuple(sorted(o for o in members if o != m)) for m in members}
    half = max(1, k // 2)
    out: dict[str, set[str]] = {m: set() for m in members}
    for i, m in enumerate(order):
        for d in range(1, half + 1):
            other = order[(i + d) % n]
            out[m].add(other)
            out[other].add(m)
    return {m: tuple(sorted(v)) for m, v in out.items()}


def graph_degree(members: int, security: float = 1.0) -> int:
    """Neighbours per member for SecAgg+: about 3 log2(n) (rounded up to even), everyone for a
    small round."""
    if members <= 8:
        return members - 1
    k = math.ceil(3 * security * math.log2(members))
    return min(members - 1, k + (k % 2))


def point_of(member: str, members: Sequence[str]) -> int:
    """Member's Shamir evaluation point: its 1-based index in the sorted member list."""
    return sorted(members).index(member) + 1
