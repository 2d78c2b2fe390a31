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

This file holds the settings and the stage as a member and a neighbour see it (masking,
dealing, holding and revealing shares); the owner's unmasking is `collectives/unmasking.py`,
and the keys, commitments and sealed shares they share are `collectives/masking.py`.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from starling.collectives.bodies import (
    SHARE_BYTES,
    SIGNATURE_BYTES,
    BodyError,
    Deal,
    GaveUp,
    Held,
    Passed,
    Reveal,
    Revealed,
)
from starling.collectives.masking import (
    KEEP_ROUNDS,
    RECIPE_TAG,
    Masked,
    Mine,
    RoundState,
    Share,
    commit,
    derive,
    round_id,
    seal,
    share_statement,
    unseal,
)
from starling.collectives.secagg import (
    PRIME,
    IntegerCodec,
    SecAggError,
    add,
    discrete_gaussian,
    graph_degree,
    neighbours,
    point_of,
    prg,
    split_secret,
    sub,
)
from starling.collectives.unmasking import Unmasking
from starling.node.rpc import Refusal, Refuser, refusal

if TYPE_CHECKING:
    from starling.node import Node

log = logging.getLogger(__name__)

FIT_BITS = 29  # a fitted round's parts sum within +-2^29: the ring's top bits are the DP noise's


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


class SecureStage(Unmasking):
    """One reducer's secure aggregation: masking and dealing (a member), holding and revealing
    shares (a neighbour), unmasking (an owner: `Unmasking`, collectives/unmasking.py).
    `owners(members, t)` is the reducer's owners of a round; `resolve(view)` a member list the
    reducer knows by digest."""

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
        self._rounds: OrderedDict[bytes, RoundState] = OrderedDict()  # network thread: rounds I masked or own
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
            pairs[other] = derive(secret, b"pair", rid)
            stream = prg(pairs[other], ring.size, rid)
            (add if other > me else sub)(ring, stream)
        commits = [hashlib.sha256(pairs[o]).digest() for o in mine]
        seed_commit = commit(seed, rid)
        recipe = (RECIPE_TAG, seed_commit, hashlib.sha256(b"".join(commits)).digest())
        xs = [point_of(o, members) for o in mine]
        deals = {}
        shares = split_secret(int.from_bytes(seed, "big"), threshold, xs,
                              lambda bound: int.from_bytes(secrets.token_bytes(80), "big") % bound)
        for other, x in zip(mine, xs):
            y = shares[x]
            sig = self.node.trust.sign(share_statement(rid, me, other, x, y))
            box = seal(agreed[other], rid, me, y.to_bytes(SHARE_BYTES, "big") + sig)
            deals[other] = Deal(t, view, x, box)
        return Masked(ring, recipe, deals, t, rid, Mine(mine, pairs, commits, seed_commit))

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

    def _round(self, rid: bytes) -> RoundState:
        state = self._rounds.get(rid)
        if state is None:
            state = self._rounds[rid] = RoundState()
            while len(self._rounds) > 4 * KEEP_ROUNDS:
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
            if GaveUp.is_one(body):
                self._on_gave_up(msg.sender, GaveUp.from_wire(body))
                return {"ok": True}
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, f"secure aggregation: {exc}")
        return self._refuse(Refusal.MALFORMED, "secure aggregation: neither a deal, a reveal request nor secrets")

    def take_deal(self, dealer: str, t: int, view: bytes, x: int, box: bytes) -> None:
        """A neighbour's sealed share of its mask seed for round t (on its own, or riding on
        its part for a shard I own); network thread."""
        if t < self._latest - KEEP_ROUNDS or t > self._latest + KEEP_ROUNDS:
            self._refuse.count("secagg_stale", f"a deal of round {t} from {dealer}")
            return
        rid = round_id(self.topic, t, view)
        agreed = self.node.key_agreement(dealer)
        opened = unseal(agreed, rid, dealer, box) if agreed is not None else None
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
        while len(held) > 2 * KEEP_ROUNDS:
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


__all__ = ["Masked", "SecureAggregation", "SecureStage", "check_secure_config", "round_id"]
