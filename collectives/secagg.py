"""Secure aggregation's arithmetic (Bonawitz et al. 2017, with SecAgg+'s sparse graph, Bell et
al. 2020): members mask their integer-encoded parts so that an owner learns only their sum.

One round, one owner, members M (sorted ids), each with a part x_i of n values:

    encode:   q_i = round(clip(x_i) * scale) mod 2^b              (b = 8, 16 or 32; sums exact below 2^(b-1))
    graph:    N(i), k neighbours of i on a ring shuffled by the round's seed (symmetric)
    keys:     i draws a mask key pair (X25519) and a self-mask seed b_i; it publishes its
              public mask key and SHA-256 commitments to both secrets, signed
    shares:   i splits its mask private key and b_i into Shamir shares (threshold t, over the
              prime 2^521 - 1) and gives one of each to every neighbour, each share signed
    mask:     y_i = q_i + PRG(b_i) + sum_{j in N(i), j > i} PRG(s_ij) - sum_{j in N(i), j < i} PRG(s_ij)
              mod 2^b, where s_ij = HKDF(X25519(i, j), round) (so s_ij = s_ji)
    owner:    Y = sum of the y_i that came (survivors S, dropped D)
    unmask:   survivors reveal, for each neighbour, the b share if it survived and the mask-key
              share if it dropped (never both for one member); with t shares of each, the owner
              rebuilds b_i (i in S) and the mask keys of D, checks each against its commitment,
              and removes PRG(b_i) for i in S and the pair masks between D and S:
              sum_{i in S} q_i = Y - sum_{i in S} PRG(b_i) - sum_{d in D, j in N(d) & S} +-PRG(s_jd)

A member's part alone is q_i plus masks drawn from ChaCha20 streams keyed by secrets nobody
else holds whole: uniformly random to anyone who lacks them. Who can undo one member's masks:
anyone who learns b_i and all its pair secrets, i.e. t of its neighbours' shares of both (which
honest survivors never reveal together) or its neighbours' mask keys. With the graph's k
neighbours and threshold t, the guarantee holds against fewer than t colluding members (the
owner among them); a round where some member has fewer than t surviving neighbours cannot be
unmasked, and is dropped (`SecAggError`), never opened part by part.

This module is the arithmetic and the checks, with no sockets: what travels, and when, is the
reducer's business.
"""
from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

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
    bytes a value: 8 bits fit 4-bit values of up to 16 members."""

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


# ---------------------------------------------------------------------- signed messages
Signer = Callable[[bytes], bytes]
Verifier = Callable[[str, bytes, bytes], bool]  # (member, data, signature) -> valid


def _share_bytes(round_id: bytes, dealer: str, holder: str, kind: str, x: int, y: int) -> bytes:
    return b"|".join([DOMAIN, b"share", round_id, dealer.encode(), holder.encode(), kind.encode(), str(x).encode(),
                      str(y).encode()])


def _keys_bytes(round_id: bytes, member: str, public: bytes, commit_key: bytes, commit_seed: bytes) -> bytes:
    return b"|".join([DOMAIN, b"keys", round_id, member.encode(), public, commit_key, commit_seed])


@dataclass(frozen=True)
class Advert:
    """What member publishes before the round: its public mask key and commitments to its two
    secrets (its mask private key and its self-mask seed), signed."""

    member: str
    public: bytes
    commit_key: bytes
    commit_seed: bytes
    signature: bytes

    def check(self, round_id: bytes, verify: Verifier) -> None:
        if not verify(self.member, _keys_bytes(round_id, self.member, self.public, self.commit_key,
                                               self.commit_seed), self.signature):
            raise SecAggError(f"{self.member}'s advertised mask key is not signed by it")


@dataclass(frozen=True)
class Share:
    """One Shamir share of `dealer`'s mask key ("key") or self-mask seed ("seed"), held by
    `holder`, signed by the dealer: a holder cannot alter it unseen."""

    dealer: str
    holder: str
    kind: str
    x: int
    y: int
    signature: bytes

    def check(self, round_id: bytes, verify: Verifier) -> None:
        if self.kind not in ("key", "seed") or not 0 <= self.y < PRIME:
            raise SecAggError(f"malformed share of {self.dealer}")
        if not verify(self.dealer, _share_bytes(round_id, self.dealer, self.holder, self.kind, self.x, self.y),
                      self.signature):
            raise SecAggError(f"a share of {self.dealer}'s {self.kind} held by {self.holder} is not signed by "
                              f"{self.dealer}: tampered")


def _commit(secret: bytes, round_id: bytes) -> bytes:
    return hashlib.sha256(DOMAIN + b"commit" + round_id + secret).digest()


def _pair_seed(mine: X25519PrivateKey, theirs: bytes, round_id: bytes) -> bytes:
    shared = mine.exchange(X25519PublicKey.from_public_bytes(theirs))
    return HKDF(hashes.SHA256(), 32, salt=DOMAIN, info=b"pair" + round_id).derive(shared)


# ---------------------------------------------------------------------- a member
@dataclass
class MaskingMember:
    """One member's side of a round: its secrets, the shares it deals and holds, its masked
    part, and what it reveals to the owner."""

    member: str
    members: tuple[str, ...]
    round_id: bytes
    threshold: int
    degree: int
    sign: Signer
    random_bytes: Callable[[int], bytes] = secrets.token_bytes
    held: dict[tuple[str, str], Share] = field(default_factory=dict)  # (dealer, kind) -> my share of it

    def __post_init__(self) -> None:
        self.members = tuple(sorted(self.members))
        if self.member not in self.members:
            raise ValueError(f"{self.member} is not a member of the round")
        self.graph = neighbours(self.members, self.degree, self.round_id)
        self.mine = self.graph[self.member]
        if not 1 <= self.threshold <= max(1, len(self.mine)):
            raise ValueError(f"threshold {self.threshold} needs at least that many neighbours, {self.member} has "
                             f"{len(self.mine)}")
        self._key = X25519PrivateKey.from_private_bytes(self.random_bytes(32))
        self._seed = self.random_bytes(32)
        public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        ck, cs = _commit(self._key_bytes(), self.round_id), _commit(self._seed, self.round_id)
        self.advert = Advert(self.member, public, ck, cs,
                             self.sign(_keys_bytes(self.round_id, self.member, public, ck, cs)))

    def _key_bytes(self) -> bytes:
        return self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def deal(self) -> list[Share]:
        """My two secrets' shares, one of each for every neighbour (sent to each over its
        encrypted channel)."""
        def rand(bound: int) -> int:
            return int.from_bytes(self.random_bytes(80), "big") % bound

        xs = [point_of(n, self.members) for n in self.mine]
        out = []
        for kind, secret in (("key", self._key_bytes()), ("seed", self._seed)):
            for holder, (x, y) in zip(self.mine, split_secret(int.from_bytes(secret, "big"), self.threshold, xs,
                                                              rand).items()):
                out.append(Share(self.member, holder, kind, x, y,
                                 self.sign(_share_bytes(self.round_id, self.member, holder, kind, x, y))))
        return out

    def hold(self, share: Share, verify: Verifier) -> None:
        """Keep a neighbour's share of its secret, once its signature holds (SecAggError if not)."""
        if share.holder != self.member or share.dealer not in self.mine:
            raise SecAggError(f"a share from {share.dealer} for {share.holder} is not mine to hold")
        share.check(self.round_id, verify)
        if share.x != point_of(self.member, self.members):
            raise SecAggError(f"{share.dealer}'s share is at the wrong point")
        self.held[share.dealer, share.kind] = share

    def mask(self, part: np.ndarray, adverts: Mapping[str, Advert], verify: Verifier) -> np.ndarray:
        """My integer part plus my masks (in its ring, wrapping)."""
        if part.dtype not in [np.dtype(t) for t in RINGS.values()]:
            raise SecAggError(f"a part must be of a ring type ({', '.join(np.dtype(t).name for t in RINGS.values())}), "
                              f"got {part.dtype}")
        masked = add(part.copy(), prg(self._seed, part.size, self.round_id, part.dtype))
        for other in self.mine:
            advert = adverts.get(other)
            if advert is None:
                raise SecAggError(f"no advertised mask key of {other}")
            advert.check(self.round_id, verify)
            stream = prg(_pair_seed(self._key, advert.public, self.round_id), part.size, self.round_id, part.dtype)
            masked = add(masked, stream) if other > self.member else sub(masked, stream)
        return masked

    def reveal(self, survivors: Sequence[str]) -> list[Share]:
        """For the owner: my share of each surviving neighbour's seed and of each dropped
        neighbour's mask key, never both for one member."""
        alive = set(survivors)
        out = []
        for other in self.mine:
            kind = "seed" if other in alive else "key"
            share = self.held.get((other, kind))
            if share is not None:
                out.append(share)
        return out


# ---------------------------------------------------------------------- the owner
@dataclass
class Unmasker:
    """The owner's side of a round: sums the masked parts that came and removes the masks
    with the shares survivors reveal. Counts what it refuses (`rejected`)."""

    members: tuple[str, ...]
    round_id: bytes
    threshold: int
    degree: int
    size: int
    bits: int = 32  # the ring (IntegerCodec.bits)
    rejected: int = 0

    def __post_init__(self) -> None:
        self.members = tuple(sorted(self.members))
        self.graph = neighbours(self.members, self.degree, self.round_id)
        self.parts: dict[str, np.ndarray] = {}
        self.dtype = np.dtype(RINGS[self.bits])

    def receive(self, member: str, masked: np.ndarray) -> None:
        if member not in self.members or member in self.parts:
            self.rejected += 1
            raise SecAggError(f"a part from {member}, who is not a member or sent one already")
        if masked.dtype != self.dtype or masked.shape != (self.size,):
            self.rejected += 1
            raise SecAggError(f"{member}'s part is {masked.dtype} of {masked.shape}, expected {self.dtype} of "
                              f"{self.size}")
        self.parts[member] = masked

    def survivors(self) -> tuple[str, ...]:
        return tuple(sorted(self.parts))

    def unmask(self, adverts: Mapping[str, Advert], revealed: Sequence[Share], verify: Verifier) -> np.ndarray:
        """The sum of the survivors' integer parts. SecAggError, and nothing learned of any one
        part, when some survivor's seed or dropped member's key has fewer than `threshold`
        valid shares revealed, or a rebuilt secret breaks its commitment."""
        alive = self.survivors()
        dropped = [m for m in self.members if m not in self.parts]
        if not alive:
            raise SecAggError("no member sent its part")
        shares: dict[tuple[str, str], dict[int, int]] = {}
        for share in revealed:
            try:
                share.check(self.round_id, verify)
                wanted = "seed" if share.dealer in self.parts else "key"
                if share.kind != wanted or share.holder not in self.graph.get(share.dealer, ()) \
                        or share.holder not in self.parts or share.x != point_of(share.holder, self.members):
                    raise SecAggError(f"{share.holder} revealed a share of {share.dealer}'s {share.kind} it should "
                                      "not")
            except SecAggError:
                self.rejected += 1
                continue
            shares.setdefault((share.dealer, share.kind), {})[share.x] = share.y
        total = np.zeros(self.size, dtype=self.dtype)
        for part in self.parts.values():
            total = add(total, part)
        for member in alive:  # its self mask
            advert = self._advert(adverts, member, verify)
            seed = self._rebuild(shares, member, "seed", 32, advert.commit_seed)
            total = sub(total, prg(seed, self.size, self.round_id, self.dtype))
        for gone in dropped:  # the pair masks its surviving neighbours added for it
            advert = self._advert(adverts, gone, verify)
            key = X25519PrivateKey.from_private_bytes(self._rebuild(shares, gone, "key", 32, advert.commit_key))
            for other in self.graph[gone]:
                if other not in self.parts:
                    continue
                stream = prg(_pair_seed(key, self._advert(adverts, other, verify).public, self.round_id), self.size,
                             self.round_id, self.dtype)
                # `other` added +stream if gone > other, else -stream
                total = sub(total, stream) if gone > other else add(total, stream)
        return total

    def _advert(self, adverts: Mapping[str, Advert], member: str, verify: Verifier) -> Advert:
        advert = adverts.get(member)
        if advert is None:
            raise SecAggError(f"no advertised keys of {member}")
        advert.check(self.round_id, verify)
        return advert

    def _rebuild(self, shares: Mapping[tuple[str, str], dict[int, int]], member: str, kind: str, size: int,
                 commitment: bytes) -> bytes:
        got = shares.get((member, kind), {})
        if len(got) < self.threshold:
            raise SecAggError(f"the round is dropped: {len(got)} shares of {member}'s {kind} came, it needs "
                              f"{self.threshold} (nothing is unmasked)")
        value = combine_shares(got, self.threshold)
        if value >= 2 ** (8 * size):
            raise SecAggError(f"{member}'s {kind} rebuilt out of range: a wrong share")
        secret = value.to_bytes(size, "big")
        if _commit(secret, self.round_id) != commitment:
            self.rejected += 1
            raise SecAggError(f"{member}'s {kind} rebuilt from its shares breaks its commitment: a wrong share or "
                              "mask seed (the round is dropped)")
        return secret


def record_verifier(keys: Mapping[str, bytes]) -> Verifier:
    """Verify against members' Ed25519 verify keys (from their signed peer records)."""
    from starling.node.identity import verify_signature

    def verify(member: str, data: bytes, signature: bytes) -> bool:
        key = keys.get(member)
        return key is not None and verify_signature(key, data, signature)

    return verify
