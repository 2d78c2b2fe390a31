"""What secure aggregation's masks are made of, and what a peer keeps of a round
(`collectives/secure.py` tells the protocol): the round's id, keys derived from a pair's
X25519 agreement, commitments to seeds, the statement a dealer signs for each share, shares
sealed for their holder, and the records of a round (`Masked`, `Share`, `Mine`, `RoundState`).
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from starling.collectives.bodies import Deal, Passed
from starling.collectives.secagg import DOMAIN

RECIPE_TAG = b"secagg"
KEEP_ROUNDS = 8  # rounds whose secrets, shares and reveals a peer keeps (late owners ask within them)


def round_id(topic: str, t: int, view: bytes) -> bytes:
    return hashlib.blake2b(b"|".join([DOMAIN, topic.encode(), str(t).encode(), view]), digest_size=32).digest()


def derive(secret: bytes, purpose: bytes, rid: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=DOMAIN, info=purpose + rid).derive(secret)


def commit(secret: bytes, rid: bytes) -> bytes:
    return hashlib.sha256(DOMAIN + b"commit" + rid + secret).digest()


def share_statement(rid: bytes, dealer: str, holder: str, x: int, y: int) -> bytes:
    return b"|".join([DOMAIN, b"share", rid, dealer.encode(), holder.encode(), b"seed", str(x).encode(),
                      str(y).encode()])


@dataclass(frozen=True)
class Share:
    """A holder's Shamir share (at point x) of a dealer's mask seed, signed by the dealer."""

    dealer: str
    x: int
    y: int
    signature: bytes


@dataclass
class Mine:
    """My secrets of one round: what I reveal to owners as a holder of my neighbours' shares."""

    neighbours: tuple[str, ...]
    pairs: dict[str, bytes]  # neighbour -> s_ij
    commits: list[bytes]  # H(s_ij), neighbour by neighbour
    seed_commit: bytes


Secrets = tuple[dict[str, bytes], dict[tuple[str, str], bytes]]  # survivors' seeds, (survivor, dropped) pair seeds
Unmasked = tuple[tuple[str, ...], dict[str, bytes], dict[tuple[str, str], bytes]]  # survivors summed, Secrets


@dataclass
class RoundState:
    """One round as a holder and an owner see it: which kind I revealed of whom, my own
    secrets, and the secrets owners gathered or were passed (by survivor set)."""

    revealed: dict[str, str] = field(default_factory=dict)  # member -> "seed" | "pair"
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) as passed secrets arrive
    mine: Mine | None = None
    secrets: dict[tuple[str, ...], Unmasked] = field(default_factory=dict)  # by the survivors I hold
    passed: dict[tuple[str, ...], Passed] = field(default_factory=dict)  # by the survivors the unmasker held
    gave_up: bool = False  # the unmasker said it could not gather the secrets: no use waiting for them
    # the unmasker's: (shard, chunk) -> whose parts that group holds
    held: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)
    lists: dict[str, list[bytes]] = field(default_factory=dict)  # survivor -> its pair-seed hashes (as revealed)


@dataclass
class Masked:
    """What `mask` gives the reducer: the masked ring vector, the recipe every part carries,
    and the sealed shares to deal (holder -> body)."""

    ring: np.ndarray
    recipe: tuple[bytes, ...]
    deals: dict[str, Deal]
    round: int
    rid: bytes
    mine: Mine


def seal(agreed: bytes, rid: bytes, dealer: str, data: bytes) -> bytes:
    key = derive(agreed, b"seal", rid)
    # both ends of a pair share the key: the dealer's id makes each direction's nonce its own
    return ChaCha20Poly1305(key).encrypt(hashlib.sha256(dealer.encode()).digest()[:12], data, rid)


def unseal(agreed: bytes, rid: bytes, dealer: str, box: bytes) -> bytes | None:
    try:
        return ChaCha20Poly1305(derive(agreed, b"seal", rid)).decrypt(hashlib.sha256(dealer.encode()).digest()[:12],
                                                                      box, rid)
    except Exception:
        return None
