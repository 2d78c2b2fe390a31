"""Stable integers from hashing: seeds for one purpose, and integers for peer ids.

Both are pure functions of their arguments, the same on every machine and Python (never
the salted built-in `hash`), because peers that never talk must agree on them: the same
weights and data streams, the same owner of a shard, the same SPSA directions.

Their values are pinned by tests and by every run recorded so far, so each scheme that is
in use keeps its exact bits; the arguments choose the scheme rather than a second function
doing the same job.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Literal

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _C1) & _MASK64
    z = ((z ^ (z >> 27)) * _C2) & _MASK64
    return z ^ (z >> 31)


def check_seed(seed: int) -> int:
    """`seed` as an unsigned 64-bit integer; TypeError for a non-int (a bool included), ValueError past 64 bits."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not -(1 << 63) <= seed < (1 << 64):
        raise ValueError(f"seed must fit in 64 bits, got {seed}")
    return seed & _MASK64


def derive_seed(root: int | str, *parts: int) -> int:
    """A 63-bit seed from a root and integer `parts` (a rank, a world size, a step, a row).

    Hashing keeps the streams of different roots and parts unrelated, which ``seed + rank``
    would not (peer 1 of seed 0 would equal peer 0 of seed 1). The root says the scheme:

    - an int root (a swarm's or a codec's seed) is mixed with SplitMix64 in integer
      arithmetic only, cheap enough for a seed per row or per step (compressors' RNG);
    - a str root names a purpose (``"charlm.batches"``) and is hashed with SHA-256 together
      with the parts, so tasks get one stream per purpose without numbering them.
    """
    if isinstance(root, str):
        text = "/".join([root, *(str(int(part)) for part in parts)])
        digest = hashlib.sha256(text.encode()).digest()
        return int.from_bytes(digest[:8], "little") & _MASK63
    h = mix64(check_seed(root))
    for part in parts:
        h = mix64(h ^ mix64(int(part) + _GOLDEN))
    return h >> 1


def peer_hash(peer_id: str, *, digest: Literal["sha256", "blake2b"] = "sha256",
              byteorder: Literal["big", "little"] = "big", bits: Literal[63, 64] = 64) -> int:
    """A stable integer for a peer id: 8 bytes of a digest of its UTF-8 text, read as an integer.

    The default (SHA-256, big-endian, 64 bits) spreads peers over data shards. Callers whose
    integers are already fixed in recorded runs name their scheme: gossip seeds its partner
    choice from the little-endian reading, and SPSA keys are BLAKE2b's 63 high bits (so they
    fit a signed int64 in records).
    """
    if digest == "sha256":
        raw = hashlib.sha256(peer_id.encode()).digest()[:8]
    elif digest == "blake2b":
        raw = hashlib.blake2b(peer_id.encode(), digest_size=8).digest()
    else:
        raise ValueError(f"digest must be sha256 or blake2b, got {digest!r}")
    if bits not in (63, 64):
        raise ValueError(f"bits must be 63 or 64, got {bits!r}")
    return int.from_bytes(raw, byteorder) >> (64 - bits)


def tensor_digest(tensors: Iterable[Any], names: Iterable[str] | None = None) -> Any:
    """The SHA-256 (a `hashlib` object) of the bits of `tensors`, in order, read on the host one
    at a time; with `names`, each tensor's name goes in before it. The one way a tensor state is
    hashed: a model's state digest (`runtime.modelspec.state_digest`, names and values) and the
    round agreement's (`collectives.agreement.digest_bytes`, values only) feed it the same bytes
    they always did."""
    import torch

    digest = hashlib.sha256()
    pairs = zip(names, tensors, strict=True) if names is not None else ((None, t) for t in tensors)
    for name, t in pairs:
        if name is not None:
            digest.update(name.encode())
        digest.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest
