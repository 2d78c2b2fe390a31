"""Secure aggregation inside a sharded all-reduce: each shard's owner learns only the sum of
its members' parts (SecAgg+ over `collectives/secagg.py`'s arithmetic).

One round t over members M (the view every part of a group names), per member i:

    q_i   = round(clip(x_i * w_i / unit) * scale) mod 2^32          the whole vector, once
    N(i)  = neighbours(M, k, rid)                                   rid = H(topic, t, view)
    s_ij  = HKDF(X25519(i's curve key, j's curve key), rid)         from the signed peer records
    b_i   = 32 fresh random bytes
    y_i   = q_i + PRG(b_i) + sum_{j in N(i)} (+PRG(s_ij) if j > i else -PRG(s_ij))
    deal  Shamir shares of b_i (threshold t) to N(i), each signed by i and sealed for its
          holder (ChaCha20-Poly1305 under a key from X25519(i, j))
    send  y_i[shard] to each shard's owner, as the reducer sends any part, with the signed
          recipe (b"secagg", H(rid, b_i), H(rid, H(s_ij) for j in N(i)))

An owner closes a group as usual (all parts in, or its timeout) and tells the round's unmasker
whose parts it holds (`Held`). The unmasker waits (up to a round timeout) until every live
owner has said, and takes as survivors S the members whose parts every group holds, dropped
D = M - S: a member whose part reached some owners and not others (it died in the middle of
sending) is dropped at every owner alike. The unmasker first asks each survivor j for its pair
seeds s_jd (d in N(j) & D), with j's list of pair-seed hashes (a survivor that gives no answer
at all, gone since its part came, is dropped too, and the asks repeat for it); only then for its
shares of b_n (n in N(j) & S), so no holder is asked to call alive a member that ends up
dropped. It rebuilds each b_n from t shares (dealer-signed, checked against n's signed commitment), checks each s_jd
against j's signed hashes, and passes the secrets on to the other owners, who check them
against the commitments in their own parts (an owner that holds a part the unmasker did not
leaves it out; one that lacks a part the unmasker summed asks the survivors itself). Each owner
removes the masks from its slice of the streams:

    sum_{i in S} q_i = sum y_i - sum_{n in S} PRG(b_n) - sum_{d in D, j in N(d) & S} (+-PRG(s_jd))

The average is that sum decoded, times unit, over the survivors' weights.

A holder answers only an owner of the round, only for its own neighbours, and never reveals
both a member's self-mask share and its pair seed in one round, to any owner (a member one
owner counts alive and another dropped costs the second owner's shard its average, not the
member its privacy). An owner that cannot unmask (a survivor with fewer than t shares, a share
or seed that breaks its commitment) drops its group: every member keeps its local values for
that chunk, and the owner counts it.

What it does not protect: a member's weight travels in clear, as with every part; the average
every member receives is the survivors' mean, so with two members each learns the other's
part (as any aggregate does).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from starling.collectives.accumulator import Verdict
from starling.collectives.bodies import (
    SHARE_BYTES,
    SIGNATURE_BYTES,
    BodyError,
    Deal,
    Held,
    Passed,
    Reveal,
    Revealed,
)
from starling.collectives.compact import contributor_mask, contributors_of
from starling.collectives.secagg import (
    DOMAIN,
    PRIME,
    IntegerCodec,
    SecAggError,
    add,
    combine_shares,
    discrete_gaussian,
    graph_degree,
    neighbours,
    point_of,
    prg,
    split_secret,
    sub,
)
from starling.common.faults import fault_point
from starling.node.rpc import Refusal, Refuser, refusal

if TYPE_CHECKING:
    from starling.collectives.accumulator import ShardGroup
    from starling.node import Node

log = logging.getLogger(__name__)

RECIPE_TAG = b"secagg"
_GONE_POLL_S = 0.25  # how often an owner waiting for the unmasker's secrets checks that it is still alive
FIT_BITS = 29  # a fitted round's parts sum within +-2^29: the ring's top bits are the DP noise's
_KEEP_ROUNDS = 8  # rounds whose secrets, shares and reveals a peer keeps (late owners ask within them)


@dataclass(frozen=True)
class SecureAggregation:
    """The secure stage's settings, which every peer of a swarm must share.

    `scale`, `clip`: the fixed-point encoding (`IntegerCodec`, modulo 2^32): a value is clipped
    to +-clip and rounded to 1/scale; the sum of m parts is exact while m * clip * scale <
    2^31, and the average's rounding error is at most 0.5 / scale a value (its standard
    deviation 1 / (scale sqrt(12 m))). `scale` 0 (the default) fits the ring to each round's
    member count: the largest power of two with m * clip * scale <= 2^29, which leaves the
    top bits to the members' DP noise (a round of 16 at clip 8: 2^22, 64 times finer than a
    fixed 2^16, which fits 4095 members). Every member and owner of a round computes the same
    scale from its member list, so nothing more is agreed. `threshold`: the fraction of a
    member's neighbours whose shares rebuild its secrets (SecAgg+'s t = ceil(threshold * k),
    at least 1); the secrets stay hidden from fewer than t colluding neighbours, and a
    survivor needs t of its neighbours alive.
    `degree`: neighbours per member (0: SecAgg+'s ~3 log2 n, everyone up to 8 members).
    `unit`: the weight a part is scaled against (w / unit; no weight counts 1), set by the
    protocol to the weight a part usually carries (a gradient 1, a pseudo-gradient its round's
    inner steps), so that weighted parts stay within the clip."""

    scale: float = 0.0
    clip: float = 8.0
    threshold: float = 0.5
    degree: int = 0
    unit: float = 1.0

    def __post_init__(self) -> None:
        if self.scale < 0 or not math.isfinite(self.scale):
            raise ValueError(f"secure aggregation's scale must be 0 (fit each round) or > 0, got {self.scale}")
        IntegerCodec(self.scale or 1.0, self.clip, 32)  # raises for a bad scale or clip
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"secure aggregation's threshold must be in (0, 1], got {self.threshold}")
        if self.degree < 0 or self.degree == 1:
            raise ValueError(f"secure aggregation's degree must be 0 (automatic) or >= 2, got {self.degree}")
        if not (math.isfinite(self.unit) and self.unit > 0):
            raise ValueError(f"secure aggregation's unit must be a finite number > 0, got {self.unit}")

    @classmethod
    def parse(cls, spec: str) -> SecureAggregation | None:
        """"off" (None), "on", or "on:scale=0,clip=8,threshold=0.5,degree=0" (scale 0: fit each round)."""
        if not isinstance(spec, str):
            raise ValueError(f"secure_aggregation must be a string, got {spec!r}")
        name, _, params = spec.partition(":")
        if name == "off" and not params:
            return None
        if name != "on":
            raise ValueError(f"secure_aggregation must be 'off' or 'on[:scale=S,clip=C,threshold=T,degree=K]', "
                             f"got {spec!r}")
        kwargs: dict[str, Any] = {}
        for item in filter(None, params.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in ("scale", "clip", "threshold", "degree"):
                raise ValueError(f"secure_aggregation: unknown setting {item!r} (scale, clip, threshold, degree)")
            try:
                kwargs[key] = int(value) if key == "degree" else float(value)
            except ValueError:
                raise ValueError(f"secure_aggregation: {key} must be a number, got {value!r}") from None
        return cls(**kwargs)

    def codec(self, members: int) -> IntegerCodec:
        """The ring's encoding for a round of `members`."""
        if self.scale:
            return IntegerCodec(self.scale, self.clip, 32)
        headroom = FIT_BITS - math.log2(max(1, members) * self.clip)
        return IntegerCodec(2.0 ** math.floor(headroom), self.clip, 32)

    def shape(self, members: int) -> tuple[int, int]:
        """(k, t) for a round of `members`: neighbours per member and the share threshold."""
        k = min(members - 1, self.degree) if self.degree else graph_degree(members)
        return k, max(1, math.ceil(self.threshold * k))


def check_secure_config(config: Any) -> SecureAggregation | None:
    """For `__post_init__` of the configs of protocols that offer it: the parsed setting, or
    ValueError naming what it cannot go with."""
    secure = SecureAggregation.parse(config.secure_aggregation)
    if secure is None:
        return None
    if getattr(config, "aggregator", "mean") != "mean":
        raise ValueError("secure_aggregation hides each member's part from its owner, and a robust aggregator "
                         f"({config.aggregator!r}) must see the parts to screen or clip them: use one or the other")
    if getattr(config, "owner_replication", 1) != 1:
        raise ValueError("secure_aggregation needs owner_replication 1: replicated owners compare averages of the "
                         "same parts, and each owner's unmasking would draw on the members' secrets again")
    if getattr(config, "check_rate", 0.0) > 0.0:
        raise ValueError("secure_aggregation and check_rate exclude each other: a check averages an owner's parts "
                         "again, which secure aggregation hides")
    if getattr(config, "audit_rate", 0.0) > 0.0:
        raise ValueError("secure_aggregation and audit_rate exclude each other: an audit recomputes a member's part, "
                         "which secure aggregation hides")
    if config.compressor != "none":
        raise ValueError(f"secure_aggregation encodes parts itself (integers modulo 2^32); set compressor 'none', "
                         f"got {config.compressor!r}")
    return secure


def round_id(topic: str, t: int, view: bytes) -> bytes:
    return hashlib.blake2b(b"|".join([DOMAIN, topic.encode(), str(t).encode(), view]), digest_size=32).digest()


def _derive(secret: bytes, purpose: bytes, rid: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=DOMAIN, info=purpose + rid).derive(secret)


def _commit(secret: bytes, rid: bytes) -> bytes:
    return hashlib.sha256(DOMAIN + b"commit" + rid + secret).digest()


def _share_statement(rid: bytes, dealer: str, holder: str, x: int, y: int) -> bytes:
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
class _Mine:
    """My secrets of one round: what I reveal to owners as a holder of my neighbours' shares."""

    neighbours: tuple[str, ...]
    pairs: dict[str, bytes]  # neighbour -> s_ij
    commits: list[bytes]  # H(s_ij), neighbour by neighbour
    seed_commit: bytes


_Secrets = tuple[dict[str, bytes], dict[tuple[str, str], bytes]]  # survivors' seeds, (survivor, dropped) pair seeds
_Unmasking = tuple[tuple[str, ...], dict[str, bytes], dict[tuple[str, str], bytes]]  # survivors summed, _Secrets


@dataclass
class _Round:
    """One round as a holder and an owner see it: which kind I revealed of whom, my own
    secrets, and the secrets owners gathered or were passed (by survivor set)."""

    revealed: dict[str, str] = field(default_factory=dict)  # member -> "seed" | "pair"
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) as passed secrets arrive
    mine: _Mine | None = None
    secrets: dict[tuple[str, ...], _Unmasking] = field(default_factory=dict)  # by the survivors I hold
    passed: dict[tuple[str, ...], Passed] = field(default_factory=dict)  # by the survivors the unmasker held
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
    mine: _Mine


class SecureStage:
    """One reducer's secure aggregation: masking and dealing (a member), holding and revealing
    shares (a neighbour), unmasking (an owner). `owners(members, t)` is the reducer's owners of
    a round; `resolve(view)` a member list the reducer knows by digest."""

    def __init__(self, node: Node, topic: str, config: SecureAggregation, refuse: Refuser,
                 owners: Callable[[tuple[str, ...], int], set[str]],
                 resolve: Callable[[bytes], tuple[str, ...] | None], reveal_timeout_s: float,
                 groups: Callable[[tuple[str, ...], int], list[tuple[int, int, tuple[str, ...]]]] | None = None,
                 held_wait_s: float = 0.0) -> None:
        self.node, self.topic, self.config = node, topic, config
        self.reveal_topic = f"{topic}.secagg"
        self._refuse, self._owners, self._resolve = refuse, owners, resolve
        self.reveal_timeout_s = reveal_timeout_s
        # every group of a round as (shard, chunk, owners), and how long the unmasker waits for
        # the other owners to say whose parts their groups hold (a group closes by the round's
        # timeout after its first part): without them, no held sets are gathered
        self._groups, self.held_wait_s = groups, held_wait_s
        self._silent: set[tuple[int, str]] = set()  # (round, holder) that gave no answer at all (gone)
        self._rounds: OrderedDict[bytes, _Round] = OrderedDict()  # network thread: rounds I masked or own
        self._held: dict[str, OrderedDict[bytes, Share]] = {}  # dealer -> round id -> its share for me
        self._share_arrived = asyncio.Event()  # set (and replaced) as shares arrive
        self._latest = -1
        self.dropped = 0  # groups this owner could not unmask
        node.on(self.reveal_topic, self._on_message)

    # ------------------------------------------------------------------ member (caller's thread)
    def mask(self, t: int, members: tuple[str, ...], view: bytes, vector: torch.Tensor,
             weight: float | None, noise_std: float = 0.0) -> Masked:
        """My masked ring vector for round t, and my seed's shares. `noise_std` > 0: discrete
        Gaussian noise of that standard deviation (in the vector's units) is added to my
        integers before masking: my share of the round's noise (distributed DP)."""
        me = self.node.peer_id
        rid = round_id(self.topic, t, view)
        k, threshold = self.config.shape(len(members))
        codec = self.config.codec(len(members))
        if len(members) > codec.capacity():
            raise SecAggError(f"{len(members)} members overflow secure aggregation's ring at scale "
                              f"{codec.scale:g} and clip {codec.clip:g} (at most {codec.capacity()})")
        mine = neighbours(members, k, rid)[me]
        share = (1.0 if weight is None else weight) / self.config.unit  # as the owner counts it: no weight is 1
        scaled = vector.detach().to("cpu", torch.float32)
        if share != 1.0:
            scaled = scaled * share
        ring = codec.encode(scaled)  # uint32, owned
        if noise_std > 0.0:
            add(ring, (discrete_gaussian(ring.size, noise_std * share * codec.scale) % 2**32).astype(np.uint32))
        seed = secrets.token_bytes(32)
        add(ring, prg(seed, ring.size, rid))
        pairs: dict[str, bytes] = {}
        agreed: dict[str, bytes] = {}
        for other in mine:
            secret = self.node.key_agreement(other)
            if secret is None:
                raise SecAggError(f"no signed record of {other}, a neighbour of this round: cannot mask with it")
            agreed[other] = secret
            pairs[other] = _derive(secret, b"pair", rid)
            stream = prg(pairs[other], ring.size, rid)
            (add if other > me else sub)(ring, stream)
        commits = [hashlib.sha256(pairs[o]).digest() for o in mine]
        seed_commit = _commit(seed, rid)
        recipe = (RECIPE_TAG, seed_commit, hashlib.sha256(b"".join(commits)).digest())
        xs = [point_of(o, members) for o in mine]
        deals = {}
        shares = split_secret(int.from_bytes(seed, "big"), threshold, xs,
                              lambda bound: int.from_bytes(secrets.token_bytes(80), "big") % bound)
        for other, x in zip(mine, xs):
            y = shares[x]
            sig = self.node.trust.sign(_share_statement(rid, me, other, x, y))
            box = _seal(agreed[other], rid, me, y.to_bytes(SHARE_BYTES, "big") + sig)
            deals[other] = Deal(t, view, x, box)
        return Masked(ring, recipe, deals, t, rid, _Mine(mine, pairs, commits, seed_commit))

    async def deal(self, masked: Masked, deals: Mapping[str, Deal] | None = None) -> None:
        """Network thread, before my parts go: keep my round's secrets (for the owners' reveal
        requests), and send my seed's shares to my neighbours (`deals`: those that do not
        ride on a part; all by default), one way."""
        self._note_round(masked.round)
        self._round(masked.rid).mine = masked.mine
        for holder, body in (masked.deals if deals is None else deals).items():
            self.node.send(holder, self.reveal_topic, body.to_wire())

    # ------------------------------------------------------------------ holder (network thread)
    def _note_round(self, t: int) -> None:
        self._latest = max(self._latest, t)

    def _round(self, rid: bytes) -> _Round:
        state = self._rounds.get(rid)
        if state is None:
            state = self._rounds[rid] = _Round()
            while len(self._rounds) > 4 * _KEEP_ROUNDS:
                self._rounds.popitem(last=False)
        return state

    async def _on_message(self, msg: Any) -> Any:
        body = msg.body
        try:
            if Deal.is_one(body):
                deal = Deal.from_wire(body)
                self.take_deal(msg.sender, deal.round, deal.view, deal.x, deal.box)
                return {"ok": True}
            if Reveal.is_one(body):
                return await self._on_reveal(msg.sender, Reveal.from_wire(body))
            if Passed.is_one(body):
                self._on_passed(msg.sender, Passed.from_wire(body))
                return {"ok": True}
            if Held.is_one(body):
                self._on_held(msg.sender, Held.from_wire(body))
                return {"ok": True}
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, f"secure aggregation: {exc}")
        return self._refuse(Refusal.MALFORMED, "secure aggregation: neither a deal, a reveal request nor secrets")

    def take_deal(self, dealer: str, t: int, view: bytes, x: int, box: bytes) -> None:
        """A neighbour's sealed share of its mask seed for round t (on its own, or riding on
        its part for a shard I own); network thread."""
        if t < self._latest - _KEEP_ROUNDS or t > self._latest + _KEEP_ROUNDS:
            self._refuse.count("secagg_stale", f"a deal of round {t} from {dealer}")
            return
        rid = round_id(self.topic, t, view)
        agreed = self.node.key_agreement(dealer)
        opened = _open(agreed, rid, dealer, box) if agreed is not None else None
        if opened is None or len(opened) != SHARE_BYTES + SIGNATURE_BYTES:
            self._refuse.count("secagg_bad_share", f"a share from {dealer} that does not open")
            return
        # Sealed under a key only the dealer and I derive: it is the dealer's. Its signature, which
        # lets an owner hold a wrong share against its dealer, is checked by an owner that needs to.
        y, sig = int.from_bytes(opened[:SHARE_BYTES], "big"), opened[SHARE_BYTES:]
        share = Share(dealer, x, y, sig)
        if not 0 <= y < PRIME:
            self._refuse.count("secagg_bad_share", f"a share from {dealer} outside the field")
            return
        # Kept by dealer, the last few rounds of each: a member dealing for rounds that never
        # come (another view, a far round) pushes out only its own shares.
        # (A member that died keeps its last shares here: a part it sent before dying may be
        # summed, and then its seed is rebuilt from them.)
        held = self._held.setdefault(dealer, OrderedDict())
        held.setdefault(rid, share)
        while len(held) > 2 * _KEEP_ROUNDS:
            held.popitem(last=False)
        self._share_arrived.set()
        self._share_arrived = asyncio.Event()

    def _share_of(self, dealer: str, rid: bytes) -> Share | None:
        held = self._held.get(dealer)
        return None if held is None else held.get(rid)

    async def _on_reveal(self, owner: str, ask: Reveal) -> Any:
        t, view, seeds, pairs = ask.round, ask.view, ask.seeds, ask.pairs
        members = self._resolve(view)
        if members is None:
            return refusal(Refusal.UNKNOWN_VIEW, "secure aggregation: no member list of that digest here")
        if owner not in self._owners(members, t):
            return self._refuse(Refusal.NOT_OWNER, f"secure aggregation: {owner} owns no shard of round {t}")
        rid = round_id(self.topic, t, view)
        state = self._rounds.get(rid)  # only rounds I masked in: an owner's request creates none
        mine = None if state is None else state.mine
        if state is None or mine is None:
            return refusal(Refusal.UNKNOWN_STEP, f"secure aggregation: I masked nothing in round {t} of that view")
        wanted = set(seeds) | set(pairs)
        if set(seeds) & set(pairs) or not wanted <= set(mine.neighbours):
            return self._refuse(Refusal.MALFORMED, "secure aggregation: ask only for my neighbours, each once")
        for member in seeds:  # never both kinds for one member, to any owner
            if state.revealed.get(member, "seed") != "seed":
                return self._refuse(Refusal.CONFLICT, f"{member} was reported dropped in this round already")
        for member in pairs:
            if state.revealed.get(member, "pair") != "pair":
                return self._refuse(Refusal.CONFLICT, f"{member} was reported alive in this round already")
        # What I reveal to another owner binds me for the round; asking myself reveals nothing I
        # do not hold, and neither does what an owner asks of its own secrets (its seed's shares,
        # its pair seeds), which it holds: an unmasker that gathered its own seed's shares and
        # died must not leave its holders bound to call it alive. A seed share binds me only once
        # given (one still on its way may never come).
        binding = owner != self.node.peer_id
        if binding:
            for member in pairs:
                if member != owner:
                    state.revealed[member] = "pair"
        deadline = asyncio.get_running_loop().time() + self.reveal_timeout_s
        while any(self._share_of(m, rid) is None for m in seeds):  # a share still on its way from its dealer
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._share_arrived.wait(), left)
            except asyncio.TimeoutError:
                break
        given = [s for m in seeds if state.revealed.get(m, "seed") == "seed" and (s := self._share_of(m, rid))]
        if binding:  # (another owner may have been given a pair seed of one of them meanwhile: left out above)
            for share in given:
                if share.dealer != owner:
                    state.revealed[share.dealer] = "seed"
        shares = tuple((s.dealer, s.x, s.y, s.signature) for s in given)
        return Revealed(shares, tuple((m, mine.pairs[m]) for m in pairs), tuple(mine.commits)).to_wire()

    # ------------------------------------------------------------------ owner (network thread)
    async def close(self, t: int, members: tuple[str, ...], view: bytes, i: int, c: int, bounds: tuple[int, int],
                    group: ShardGroup) -> tuple[torch.Tensor, dict[str, float] | None, Verdict]:
        """A closed group's average, unmasked with its survivors' revealed shares, as the round
        engine answers it; the group's contributors become the survivors summed. A group that
        cannot be unmasked is counted (`secagg_dropped`) and raises: it has no average. First the
        round's unmasker hears whose parts the group holds (`Held`)."""
        recipes = {sender: signed.recipe for sender, signed in group.signed.items()}
        self._tell_held(t, members, view, i, c, tuple(m for m in members if m in group.received))
        try:
            average, shares, summed = await self.unmask(t, members, view, *bounds, group.received, group.weights,
                                                        recipes)
        except Exception as exc:
            self.dropped += 1
            self._refuse.count("secagg_dropped", f"round {t} chunk {bounds}: {exc}")
            raise
        group.contributors = [s for s in group.contributors if s in summed]
        return average, shares, Verdict()

    async def unmask(self, t: int, members: tuple[str, ...], view: bytes, lo: int, hi: int,
                     parts: Mapping[str, torch.Tensor], weights: Mapping[str, float],
                     recipes: Mapping[str, Any]
                     ) -> tuple[torch.Tensor, dict[str, float] | None, tuple[str, ...]]:
        """The survivors' average over [lo, hi) from their masked parts, with the weights'
        shares and the survivors summed (a part the round's unmasker never got is left out).
        SecAggError when the group cannot be unmasked: it is dropped, nothing of any part is
        learned."""
        rid = round_id(self.topic, t, view)
        k, threshold = self.config.shape(len(members))
        graph = neighbours(members, k, rid)
        alive = tuple(m for m in members if m in parts)
        commits = self._commitments(t, rid, alive, recipes)
        alive, seeds, pair_seeds = await self._secrets(t, members, view, rid, graph, alive, commits, threshold)
        n = hi - lo
        total = np.zeros(n, dtype=np.uint32)
        for member in alive:  # in member order
            add(total, parts[member].contiguous().view(torch.int32).numpy().view(np.uint32))
        for member in alive:
            sub(total, prg(seeds[member], n, rid, offset=lo))
        summed = set(alive)
        for gone in sorted(set(members) - summed):
            for j in graph[gone]:
                if j in summed:  # j added +PRG(s_jd) when gone > j, else -PRG
                    (sub if gone > j else add)(total, prg(pair_seeds[j, gone], n, rid, offset=lo))
        decoded = self.config.codec(len(members)).decode_sum(total, len(alive)).to(torch.float64)
        weight = {m: weights.get(m, 1.0) for m in alive}
        whole = sum(weight.values())
        if whole <= 0.0:
            return torch.zeros(n, dtype=torch.float32), None, alive
        average = (decoded * (self.config.unit / whole)).to(torch.float32)
        shares_out = None if len(set(weight.values())) == 1 else {m: w / whole for m, w in weight.items()}
        return average, shares_out, alive

    def _commitments(self, t: int, rid: bytes, alive: Sequence[str],
                     recipes: Mapping[str, Any]) -> dict[str, tuple[bytes, bytes]]:
        """Each survivor's (seed commitment, digest of its pair-seed hashes), as it signed them
        with its parts (mine from my own round)."""
        commits: dict[str, tuple[bytes, bytes]] = {}
        for member in alive:
            recipe = recipes.get(member)
            if member == self.node.peer_id:
                mine = self._round(rid).mine
                if mine is None:
                    raise SecAggError(f"round {t}: my own secrets are gone")
                recipe = (RECIPE_TAG, mine.seed_commit, hashlib.sha256(b"".join(mine.commits)).digest())
            if not (isinstance(recipe, (tuple, list)) and len(recipe) == 3 and recipe[0] == RECIPE_TAG
                    and all(isinstance(r, bytes) and len(r) == 32 for r in recipe[1:])):
                raise SecAggError(f"{member}'s part carries no secure aggregation commitments")
            commits[member] = (recipe[1], recipe[2])
        return commits

    @property
    def unmask_within_s(self) -> float:
        """How long the unmasker may take after its group closed: waiting for every group's held
        set, then two rounds of asks (pair seeds, then seed shares), each up to a reveal timeout."""
        return self.held_wait_s + 2 * (self.reveal_timeout_s + 1.0)

    def _tell_held(self, t: int, members: tuple[str, ...], view: bytes, i: int, c: int,
                   alive: tuple[str, ...]) -> None:
        unmasker = self.unmasker(members, t)
        if unmasker == self.node.peer_id:
            self._note_held(self._round(round_id(self.topic, t, view)), i, c, alive)
        elif self._groups is not None:
            self.node.send(unmasker, self.reveal_topic, Held(t, view, i, c, contributor_mask(members, alive)).to_wire())

    @staticmethod
    def _note_held(state: _Round, i: int, c: int, alive: tuple[str, ...]) -> None:
        state.held.setdefault((i, c), alive)
        state.arrived.set()
        state.arrived = asyncio.Event()

    def _on_held(self, sender: str, body: Held) -> None:
        """An owner's held set for one of its groups (I am the round's unmasker)."""
        t, view = body.round, body.view
        members = self._resolve(view)
        if members is None or self._groups is None or self.unmasker(members, t) != self.node.peer_id:
            self._refuse.count("secagg_not_unmasker", f"a held set of round {t} from {sender}")
            return
        if not any(i == body.shard and c == body.chunk and sender in owners
                   for i, c, owners in self._groups(members, t)):
            self._refuse.count("secagg_not_owner", f"a held set of round {t} from {sender}, which owns no such group")
            return
        try:
            alive = contributors_of(members, body.alive)
        except ValueError as exc:
            self._refuse.count("secagg_malformed", f"a held set from {sender}: {exc}")
            return
        if t < self._latest - _KEEP_ROUNDS or t > self._latest + _KEEP_ROUNDS:
            self._refuse.count("secagg_stale", f"a held set of round {t} from {sender}")
            return
        # (it may come before I masked in the round myself: an owner closed its group first)
        self._note_held(self._round(round_id(self.topic, t, view)), body.shard, body.chunk, alive)

    async def _held_by_all(self, t: int, members: tuple[str, ...], state: _Round,
                           alive: tuple[str, ...]) -> tuple[str, ...]:
        """The unmasker's survivors: those of `alive` whose parts every group of the round holds,
        once every live owner said (or `held_wait_s` passed). A member whose part reached some
        owners and not others (it died in the middle of sending) is then dropped at every owner
        alike, and no holder is asked to call one member both alive and dropped."""
        if self._groups is None:
            return alive
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.held_wait_s
        groups = self._groups(members, t)
        while True:
            live = {*self.node.live_peers_here(), self.node.peer_id}  # an owner found dead meanwhile says nothing
            missing = [(i, c) for i, c, owners in groups if (i, c) not in state.held and any(o in live for o in owners)]
            if not missing:
                break
            left = deadline - loop.time()
            if left <= 0:
                log.info("%s: %s round %d: %d groups did not say whose parts they hold", self.node.peer_id,
                         self.topic, t, len(missing))
                break
            try:
                await asyncio.wait_for(state.arrived.wait(), min(left, _GONE_POLL_S))
            except asyncio.TimeoutError:
                pass
        held = [set(s) for s in state.held.values()]
        return tuple(m for m in alive if all(m in s for s in held))

    def unmasker(self, members: tuple[str, ...], t: int) -> str:
        """The owner that gathers round t's secrets from the holders and passes them on to the
        other owners (who check them against the commitments in their own parts): one owner
        asks, not every one. Rotates with the round."""
        owners = sorted(self._owners(members, t))
        return owners[t % len(owners)]

    async def _secrets(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes,
                       graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                       commits: Mapping[str, tuple[bytes, bytes]], threshold: int) -> _Unmasking:
        """The survivors I sum, their mask seeds and their pair seeds with the dropped: from the
        round's unmasker when it saw the same survivors or fewer (checked here), else gathered
        from the holders."""
        me, key = self.node.peer_id, alive
        state = self._round(rid)
        known = state.secrets.get(key)
        if known is not None:
            return known
        unmasker = self.unmasker(members, t)
        if unmasker == me:
            key = alive = await self._held_by_all(t, members, state, alive)
            known = state.secrets.get(key)
            if known is not None:
                return known
        else:
            passed = await self._passed_on(state, alive, self.unmask_within_s + self.reveal_timeout_s, unmasker)
            if passed is not None:
                used, body = passed
                checked = self._check_passed(t, rid, graph, used, commits, body)
                if checked is not None:
                    state.secrets[key] = (used, *checked)
                    return state.secrets[key]
        used, seeds, pair_seeds = state.secrets[key] = await self._gather(t, members, view, rid, graph, alive,
                                                                          commits, threshold)
        if unmasker == me:
            fault_point("secure.unmasker.gathered", t)
            self._pass_on(t, members, view, rid, used, (seeds, pair_seeds), graph)
        return state.secrets[key]

    async def _passed_on(self, state: _Round, alive: tuple[str, ...], timeout_s: float,
                         unmasker: str) -> tuple[tuple[str, ...], Passed] | None:
        """The unmasker's secrets for my survivors, or for the most of them it saw: a member
        whose part reached me and not every owner is left out of my sum too (its neighbours
        revealed its pair seeds, and will not reveal its seed's shares now). None once the
        unmasker is gone, or after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        mine = set(alive)
        while True:
            fits = [(seen, body) for seen, body in state.passed.items() if set(seen) <= mine]
            if fits:
                return max(fits, key=lambda f: len(f[0]))
            left = deadline - loop.time()
            if left <= 0 or unmasker not in self.node.live_peers_here():
                return None
            try:
                await asyncio.wait_for(state.arrived.wait(), min(left, _GONE_POLL_S))
            except asyncio.TimeoutError:
                pass

    def _pass_on(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes, alive: tuple[str, ...],
                 found: _Secrets, graph: Mapping[str, tuple[str, ...]]) -> None:
        seeds, pairs = found
        lists = {j for j, _ in pairs}
        state = self._round(rid)
        body = Passed(t, view, contributor_mask(members, alive), tuple((m, seeds[m]) for m in alive),
                      tuple((j, d, s) for (j, d), s in sorted(pairs.items())),
                      tuple((j, tuple(state.lists[j])) for j in sorted(lists) if j in state.lists)).to_wire()
        for owner in sorted(self._owners(members, t) - {self.node.peer_id}):
            self.node.send(owner, self.reveal_topic, body)

    def _on_passed(self, sender: str, body: Passed) -> None:
        t, view, mask = body.round, body.view, body.alive
        members = self._resolve(view)
        if members is None or sender != self.unmasker(members, t):
            self._refuse.count("secagg_not_unmasker", f"secrets of round {t} passed on by {sender}")
            return
        try:
            alive = contributors_of(members, mask)
        except ValueError as exc:
            self._refuse.count("secagg_malformed", f"secrets passed on by {sender}: {exc}")
            return
        rid = round_id(self.topic, t, view)
        state = self._rounds.get(rid)  # a round I masked in (every owner did): passes for others make nothing
        if state is None:
            self._refuse.count("secagg_stale", f"secrets of round {t} passed on by {sender}: not a round of mine")
            return
        if len(state.passed) < 8:
            state.passed[alive] = body
        state.arrived.set()
        state.arrived = asyncio.Event()

    def _check_passed(self, t: int, rid: bytes, graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                      commits: Mapping[str, tuple[bytes, bytes]], body: Passed) -> _Secrets | None:
        """The unmasker's secrets if every one keeps the commitment its member signed; None
        (counted) if any does not, or some are missing."""
        try:
            seeds = dict(body.seeds)
            pairs = {(j, d): s for j, d, s in body.pairs}
            lists = {j: list(h) for j, h in body.lists}
            if set(seeds) != set(alive) or any(_commit(seeds[m], rid) != commits[m][0] for m in alive):
                raise ValueError("a seed that breaks its commitment")
            for j, hashes_ in lists.items():
                if hashlib.sha256(b"".join(hashes_)).digest() != commits[j][1]:
                    raise ValueError(f"{j}'s pair-seed hashes break its commitment")
            dropped = set(graph) - set(alive)
            wanted = {(j, d) for d in dropped for j in graph[d] if j in seeds}
            if set(pairs) != wanted:
                raise ValueError("not the pair seeds of the dropped")
            for (j, d), seed in pairs.items():
                if hashlib.sha256(seed).digest() != lists[j][graph[j].index(d)]:
                    raise ValueError(f"a wrong pair seed of {j} with {d}")
        except Exception as exc:
            self._refuse.count("secagg_bad_passed", f"round {t}: the unmasker's secrets: {exc}")
            return None
        return seeds, pairs

    async def _gather(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes,
                      graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                      commits: Mapping[str, tuple[bytes, bytes]], threshold: int,
                      retry: bool = True) -> _Unmasking:
        """First every survivor's pair seeds with its dropped neighbours (`_pairs_of_dropped`: a
        survivor that cannot give them, dead since its part came, is dropped too), then the
        survivors' shares of their surviving neighbours' seeds; rebuild and check them. Returns
        the survivors summed (those whose seed could be rebuilt) with the secrets."""
        alive, pair_seeds = await self._pairs_of_dropped(t, members, view, rid, graph, alive, commits)
        dropped = set(members) - set(alive)
        asks = {j: [n for n in graph[j] if n in alive] for j in alive}
        replies = await asyncio.gather(*(self._ask(j, t, view, seeds, ()) for j, seeds in asks.items()))
        shares: dict[str, dict[int, tuple[str, int, bytes]]] = {}  # dealer -> x -> (holder, y, signature)
        for j, reply in zip(alive, replies):
            if reply is None:
                continue
            for dealer, x, y, sig in reply.shares:
                if dealer not in asks[j] or x != point_of(j, members) or not 0 <= y < PRIME:
                    self._refuse.count("secagg_bad_share", f"round {t}: {j} revealed a share of {dealer} it "
                                       "does not hold")
                    continue
                shares.setdefault(dealer, {})[x] = (j, y, sig)
        short = [m for m in alive if len(shares.get(m, {})) < threshold]
        if short and retry and len(short) < len(alive):
            # Its shares never reached enough holders (it died mid-send), or they gave its pair seeds
            # to an owner that did not get its part: leave its part out, and unmask it as a dropout's.
            log.info("%s: %s round %d: too few shares of %s; summing without", self.node.peer_id, self.topic, t, short)
            left = tuple(m for m in alive if m not in short)
            return await self._gather(t, members, view, rid, graph, left, commits, threshold, retry=False)
        seeds = {m: self._rebuild(t, rid, m, shares.get(m, {}), threshold, commits[m][0]) for m in alive}
        for gone in dropped:
            for j in graph[gone]:
                if j in seeds and (j, gone) not in pair_seeds:
                    raise SecAggError(f"round {t}: {j} did not reveal its mask seed with dropped {gone}")
        return alive, seeds, pair_seeds

    async def _pairs_of_dropped(self, t: int, members: tuple[str, ...], view: bytes, rid: bytes,
                                graph: Mapping[str, tuple[str, ...]], alive: tuple[str, ...],
                                commits: Mapping[str, tuple[bytes, bytes]]
                                ) -> tuple[tuple[str, ...], dict[tuple[str, str], bytes]]:
        """Each survivor's pair seeds with its dropped neighbours, checked against its signed
        hashes. Only a survivor can give them: one that does not (it died after its part came,
        before the unmasking) is dropped as well, its part left out, and its own surviving
        neighbours are asked for their pair seeds with it, until every survivor has answered.
        No seed share is asked for before this ends, so no holder is asked to call a member
        alive that then turns out dropped."""
        state = self._round(rid)
        pair_seeds: dict[tuple[str, str], bytes] = {}
        for _ in range(len(members)):  # each pass drops at least one survivor, or ends
            dropped = set(members) - set(alive)
            asks = {j: [d for d in graph[j] if d in dropped and (j, d) not in pair_seeds] for j in alive}
            asks = {j: pairs for j, pairs in asks.items() if pairs}
            if not asks:
                break
            self._silent = {(r, j) for r, j in self._silent if r >= t - _KEEP_ROUNDS}
            replies = await asyncio.gather(*(self._ask(j, t, view, (), pairs) for j, pairs in asks.items()))
            silent = []
            for j, reply in zip(asks, replies):
                if reply is None:
                    if (t, j) in self._silent:  # no answer at all: gone (a refusal drops the group below)
                        silent.append(j)
                    continue
                hashes_ = list(reply.commits)
                if hashlib.sha256(b"".join(hashes_)).digest() != commits[j][1] or len(hashes_) != len(graph[j]):
                    self._refuse.count("secagg_bad_seed", f"round {t}: {j}'s pair-seed hashes break its commitment")
                    continue
                index = {n: h for n, h in zip(graph[j], hashes_)}
                for d, seed in reply.pairs:
                    if d not in asks[j] or hashlib.sha256(seed).digest() != index.get(d):
                        self._refuse.count("secagg_bad_seed", f"round {t}: {j} revealed a wrong mask seed for {d}")
                        continue
                    pair_seeds[j, d] = seed
                state.lists[j] = hashes_  # what the other owners check my passed pair seeds against
            if not silent:
                break
            log.info("%s: %s round %d: %s gave no pair seeds (gone since its part came): summing without",
                     self.node.peer_id, self.topic, t, silent)
            alive = tuple(m for m in alive if m not in silent)
            pair_seeds = {(j, d): seed for (j, d), seed in pair_seeds.items() if j in alive}
        return alive, pair_seeds

    def _rebuild(self, t: int, rid: bytes, member: str, got: dict[int, tuple[str, int, bytes]], threshold: int,
                 commitment: bytes) -> bytes:
        """A survivor's mask seed from t of the shares its neighbours revealed. The seed it
        committed to in its signed parts says whether they were right; only when it is not
        are the shares' signatures checked, and those not signed by the member (tampered by
        their holder) counted and left out before trying again."""
        if len(got) < threshold:
            raise SecAggError(f"round {t}: {len(got)} shares of {member}'s mask seed came, it needs {threshold}")
        seed = _rebuilt(combine_shares({x: y for x, (_, y, _) in got.items()}, threshold))
        if seed is not None and _commit(seed, rid) == commitment:
            return seed
        good = {}
        for x, (holder, y, sig) in got.items():
            if self.node.trust.verify(member, _share_statement(rid, member, holder, x, y), sig):
                good[x] = y
            else:
                self._refuse.count("secagg_bad_share", f"round {t}: {holder} revealed a share of {member}'s seed "
                                   f"that {member} did not sign: tampered")
        if len(good) >= threshold and len(good) < len(got):
            seed = _rebuilt(combine_shares(good, threshold))
            if seed is not None and _commit(seed, rid) == commitment:
                return seed
        self._refuse.count("secagg_bad_seed", f"round {t}: {member}'s seed rebuilt from its shares breaks its "
                           "commitment")
        raise SecAggError(f"round {t}: {member}'s mask seed rebuilt from its shares breaks its commitment")

    async def _ask(self, holder: str, t: int, view: bytes, seeds: Sequence[str],
                   pairs: Sequence[str]) -> Revealed | None:
        """The holder's answer; None if it refused or gave none (`_silent` holds the latter)."""
        ask = Reveal(t, view, tuple(seeds), tuple(pairs))
        try:
            if holder == self.node.peer_id:
                reply = await self._on_reveal(holder, ask)
            else:
                reply = (await self.node.arequest(holder, self.reveal_topic, ask.to_wire(),
                                                  timeout_s=self.reveal_timeout_s + 1.0)).body
            return Revealed.from_wire(reply)
        except BodyError as exc:  # a refusal, or an answer that is not one: its shares are missing
            if isinstance(reply, dict) and reply.get("ok") is not False:
                self._refuse.count("secagg_malformed", f"round {t}: {holder}'s reveal: {exc}")
            log.info("%s: %s round %d: %s revealed nothing: %s", self.node.peer_id, self.topic, t, holder, exc)
        except Exception as exc:  # a survivor that died since: its shares are missing, no more
            log.info("%s: %s round %d: %s revealed nothing: %s", self.node.peer_id, self.topic, t, holder, exc)
            self._silent.add((t, holder))
        return None


def _rebuilt(value: int) -> bytes | None:
    return value.to_bytes(32, "big") if value < 2**256 else None


def _seal(agreed: bytes, rid: bytes, dealer: str, data: bytes) -> bytes:
    key = _derive(agreed, b"seal", rid)
    # both ends of a pair share the key: the dealer's id makes each direction's nonce its own
    return ChaCha20Poly1305(key).encrypt(hashlib.sha256(dealer.encode()).digest()[:12], data, rid)


def _open(agreed: bytes, rid: bytes, dealer: str, box: bytes) -> bytes | None:
    try:
        return ChaCha20Poly1305(_derive(agreed, b"seal", rid)).decrypt(hashlib.sha256(dealer.encode()).digest()[:12],
                                                                      box, rid)
    except Exception:
        return None


__all__ = ["SecureAggregation", "SecureStage", "check_secure_config"]
