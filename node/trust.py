"""What this peer holds against other members, and what it does about it.

    statement(*fields)        the bytes a peer signs: msgpack of ["starling", *fields], canonical
    sign(statement)           this peer's Ed25519 signature (its identity key)
    note(peer, kind)          per-peer counts: parts refused, screened, clipped, disputed, ...
    accuse(evidence)          a detector here found something against a member:
        verifiable evidence   (a check registered for its kind confirms it from the evidence
                              alone: a part its author signed and that any peer can see is bad)
                              bans the author at once;
        anything weaker       counts this peer as one witness; a member is banned once
                              `witnesses` distinct members (not banned, not the accused) have
                              accused it, so that one liar cannot ban an honest peer
        either way the accusation goes to every live member ($accuse), signed by its witness
    welcome(peer)             a member that just joined gets the accusations behind every ban
                              (each still signed by its witness), so bans reach later joiners
    ban(peer)                 its messages are dropped and counted (`rejected.banned`), it leaves
                              `live_peers` (so it owns no shard and leads no round), the protocols'
                              `on_ban` hooks run, and the ban is logged with its evidence

The ban set is part of what the members of a round must hold alike: `ban_digest` names it, the
runtime folds it into each round's state digest, and a member whose round's owners saw the
members begin apart shares every ban's accusations again (`share_bans`), so that a member that
missed one bans as the others do by the next round.

Evidence is plain data (`Evidence`): the kind, the accused, the accused's verify key (so that a
check needs no peer table: the key must hash to the accused's id), the round and what the
kind's check reads. The node knows no evidence kind itself: the collectives register a check
for each kind they can prove (`register_check`), so a node that does not run the protocol of
some evidence treats it as a witness's word.

Everything here lives on the network thread. Bounded: counts for at most `max_peers` peers,
witnesses for at most `max_accused` accused peers (the oldest forgotten first), one witness
entry per (accused, witness).
"""
from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from starling.node.identity import peer_id_from_key, verify_signature
from starling.node.local import LocalPeer
from starling.node.membership import PeerTable
from starling.node.stats import OTHERS, NodeStats
from starling.node.wire import Message, RejectReason, WireError

log = logging.getLogger(__name__)

ACCUSE = "$accuse"
SHARE_EVERY_S = 2.0  # `share_bans` sends at most this often
_DOMAIN = "starling"


def statement(*fields: Any) -> bytes:
    """The canonical bytes of a signed statement. Fields are plain data (str, int, float,
    bytes, lists and maps of them); maps are packed with sorted keys, so two peers that build
    the same statement get the same bytes."""
    return msgpack.packb([_DOMAIN, *(_canonical(f) for f in fields)], use_bin_type=True)


_FLAT = frozenset({str, bytes, int, float, bool, type(None)})  # packed as they are


def _canonical(obj: Any) -> Any:
    if isinstance(obj, dict):
        return [[k, _canonical(v)] for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))]
    if isinstance(obj, (list, tuple)):
        if _FLAT.issuperset(map(type, obj)):  # a list of ids: one pass in C, not a call per item
            return obj
        return [_canonical(v) for v in obj]
    return obj


def digest(*chunks: bytes | memoryview) -> bytes:
    """sha256 over byte chunks: what a signature names instead of the bytes themselves."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.digest()


@dataclass(frozen=True)
class Evidence:
    """What an accusation rests on. `detail` is plain data that the kind's check reads
    (signed statements, their signatures, the part's bytes)."""

    kind: str
    accused: str
    key: bytes  # the accused's Ed25519 verify key: hashes to `accused`
    round: int
    detail: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "accused": self.accused, "key": self.key, "round": self.round,
                "detail": self.detail}

    @classmethod
    def from_wire(cls, obj: Any) -> Evidence:
        if not isinstance(obj, dict):
            raise ValueError("evidence must be a map")
        kind, accused, key, t, detail = (obj.get(k) for k in ("kind", "accused", "key", "round", "detail"))
        if not isinstance(kind, str) or not 0 < len(kind) <= 64:
            raise ValueError("evidence kind must be a short string")
        if not isinstance(accused, str) or not isinstance(key, bytes) or len(key) != 32:
            raise ValueError("evidence must name the accused and its 32-byte verify key")
        if peer_id_from_key(key) != accused:
            raise ValueError("the verify key is not the accused's")
        if type(t) is not int or t < 0:
            raise ValueError(f"evidence round must be a whole number, got {t!r}")
        if not isinstance(detail, dict):
            raise ValueError("evidence detail must be a map")
        return cls(kind, accused, key, t, detail)

    def digest(self) -> bytes:
        return digest(statement(self.to_wire()))

    def signed_by_accused(self, signed: bytes, signature: Any) -> bool:
        """Whether the accused signed `signed` (a statement the evidence carries)."""
        return isinstance(signature, bytes) and verify_signature(self.key, signed, signature)


Check = Callable[[Evidence], bool]


@dataclass(frozen=True)
class Ban:
    peer: str
    kind: str
    round: int
    witnesses: tuple[str, ...]  # who accused it; one, with verifiable evidence
    verifiable: bool

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "round": self.round, "witnesses": list(self.witnesses),
                "verifiable": self.verifiable}


class Trust:
    """One node's counts, accusations and bans (see the module docstring)."""

    def __init__(self, local: LocalPeer, table: PeerTable, stats: NodeStats, send: Callable[[str, str, Any], Any],
                 spawn: Callable[[Any], Any], witnesses: int = 2, max_peers: int = 1024,
                 max_accused: int = 4096) -> None:
        if witnesses < 1:
            raise ValueError(f"ban witnesses must be >= 1, got {witnesses}")
        self.local, self.table, self.stats = local, table, stats
        self._send, self._spawn = send, spawn  # send(peer, topic, body): a coroutine
        self.witnesses = witnesses
        self.max_peers, self.max_accused = max_peers, max_accused
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.banned: dict[str, Ban] = {}
        self._accusers: OrderedDict[str, dict[str, Evidence]] = OrderedDict()  # accused -> witness -> evidence
        self._checks: dict[str, Check] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._spread: set[bytes] = set()  # digests of my own accusations already sent
        # the signed accusations behind each ban, kept to show a joiner: at most `witnesses` per ban
        self._proofs: dict[str, list[dict[str, Any]]] = {}
        self._bodies: dict[tuple[str, str], dict[str, Any]] = {}  # (accused, witness) -> its signed accusation
        self._ban_digest = b""  # of the sorted banned ids: replaced (never changed) at each ban, read by any thread
        self._shared_at = -math.inf  # when `share_bans` last sent

    # ------------------------------------------------------------------ signing
    def sign(self, signed: bytes) -> bytes:
        return self.local.identity.sign(signed)

    def verify(self, peer: str, signed: bytes, signature: Any) -> bool:
        """Whether `peer` (a member in the table) signed `signed`; never raises."""
        info = self.table.get(peer)
        if peer == self.local.peer_id:
            key = self.local.identity.verify_key
        elif info is None:
            return False
        else:
            key = info.record.verify_key
        return isinstance(signature, bytes) and verify_signature(key, signed, signature)

    def key_of(self, peer: str) -> bytes | None:
        if peer == self.local.peer_id:
            return self.local.identity.verify_key
        info = self.table.get(peer)
        return None if info is None else info.record.verify_key

    # ------------------------------------------------------------------ counts
    def note(self, peer: str, kind: str, n: int = 1) -> None:
        per = self.counts.get(peer)
        if per is None:
            per = self.counts[peer if len(self.counts) < self.max_peers else OTHERS]
        per[kind] += n

    # ------------------------------------------------------------------ evidence and bans
    def register_check(self, kind: str, check: Check) -> None:
        """`check(evidence)` says whether evidence of `kind` proves the accused's fault by
        itself; it must not raise for any evidence, and must cost work bounded by its size.
        Evidence of that kind that came before (a joiner hears of bans before its protocol,
        which registers the checks, is built) is checked now."""
        self._checks[kind] = check
        for accused, accusers in list(self._accusers.items()):
            for witness, evidence in list(accusers.items()):
                if evidence.kind == kind and accused not in self.banned and self.verifiable(evidence):
                    self._ban(Ban(accused, kind, evidence.round, (witness,), True), evidence)

    def on_ban(self, callback: Callable[[str], None]) -> None:
        self._listeners.append(callback)

    def is_banned(self, peer: str) -> bool:
        return peer in self.banned

    def verifiable(self, evidence: Evidence) -> bool:
        check = self._checks.get(evidence.kind)
        if check is None:
            return False
        try:
            return bool(check(evidence))
        except Exception:  # a check must not raise; if one does, the evidence proves nothing
            log.exception("%s: the check of %s evidence raised", self.local.peer_id, evidence.kind)
            return False

    def accuse(self, evidence: Evidence) -> None:
        """A detector of this peer found `evidence` against a member (network thread)."""
        me = self.local.peer_id
        if evidence.accused == me or evidence.accused in self.banned:
            return
        self.note(evidence.accused, f"accused.{evidence.kind}")
        key = evidence.digest()
        fresh = key not in self._spread
        body = {"ev": evidence.to_wire(), "sig": self.sign(statement("accuse", key))}
        self._keep_body(evidence.accused, me, {**body, "witness": me})  # before a ban takes it as proof
        self._witness(me, evidence, self.verifiable(evidence))
        if not fresh:
            return
        self._spread.add(key)
        if len(self._spread) > self.max_accused:
            self._spread.clear()
        for peer in self.table.live():
            if peer.peer_id != evidence.accused and peer.peer_id not in self.banned:
                self._spawn(self._send(peer.peer_id, ACCUSE, body))

    def on_accusation(self, msg: Message) -> None:
        """`$accuse` from a member: an accusation signed by its witness, the sender itself or
        (passed on to a joiner) another member."""
        body = msg.body
        if not isinstance(body, dict) or not {"ev", "sig"} <= set(body) <= {"ev", "sig", "witness"}:
            raise WireError(RejectReason.BAD_FIELD, "an accusation must be {ev, sig, witness?}", field="body")
        witness = body.get("witness", msg.sender)
        if not isinstance(witness, str):
            raise WireError(RejectReason.BAD_FIELD, "witness must be a peer id", field="body")
        try:
            evidence = Evidence.from_wire(body["ev"])
        except ValueError as exc:
            raise WireError(RejectReason.BAD_FIELD, f"bad evidence: {exc}", field="body") from None
        if not self.verify(witness, statement("accuse", evidence.digest()), body["sig"]):
            raise WireError(RejectReason.BAD_SIGNATURE, "an accusation its witness did not sign", field="body")
        if evidence.accused == self.local.peer_id:
            log.warning("%s: %s accuses me (%s, round %d)", self.local.peer_id, witness, evidence.kind,
                        evidence.round)
            return
        if evidence.accused in self.banned or witness in self.banned or witness == self.local.peer_id:
            return
        self.note(witness, "accusations_made")
        self._keep_body(evidence.accused, witness, {"ev": body["ev"], "sig": body["sig"], "witness": witness})
        self._witness(witness, evidence, self.verifiable(evidence))

    @property
    def ban_digest(self) -> bytes:
        """sha256 of the sorted ids this node bans (empty when none): what the members of a round
        compare. Any thread."""
        return self._ban_digest

    def share_bans(self, peers: list[str], now: float, every_s: float = SHARE_EVERY_S) -> int:
        """Send the accusations behind every ban to `peers` again (network thread), at most once
        every `every_s`: a member whose ban set differs from the others' takes theirs, and gives
        them its own. Returns how many accusations went."""
        if now - self._shared_at < every_s or not self._proofs:
            return 0
        self._shared_at = now
        sent = 0
        for peer in peers:
            if peer in self.banned:
                continue
            for accused, bodies in list(self._proofs.items()):
                if accused != peer:
                    for body in bodies:
                        self._spawn(self._send(peer, ACCUSE, body))
                        sent += 1
        return sent

    def welcome(self, peer: str) -> None:
        """A member that just joined (network thread): send it the accusations behind every
        ban, each signed by its own witness, so that it bans as the swarm does."""
        if not self._proofs:  # every record a forming swarm learns comes here
            return
        for accused, bodies in list(self._proofs.items()):
            if accused != peer:
                for body in bodies:
                    self._spawn(self._send(peer, ACCUSE, body))

    def _keep_body(self, accused: str, witness: str, body: dict[str, Any]) -> None:
        if len(self._bodies) >= 4 * self.max_accused:  # bounded: the oldest accusations go first
            self._bodies.pop(next(iter(self._bodies)))
        self._bodies.setdefault((accused, witness), body)

    def _witness(self, witness: str, evidence: Evidence, verifiable: bool) -> None:
        accused = evidence.accused
        if verifiable:
            self._ban(Ban(accused, evidence.kind, evidence.round, (witness,), True), evidence)
            return
        accusers = self._accusers.setdefault(accused, {})
        self._accusers.move_to_end(accused)
        while len(self._accusers) > self.max_accused:
            self._accusers.popitem(last=False)
        accusers.setdefault(witness, evidence)
        honest = sorted(w for w in accusers if w != accused and w not in self.banned)
        if len(honest) >= self.witnesses:
            self._ban(Ban(accused, evidence.kind, evidence.round, tuple(honest), False), evidence)

    def _ban(self, ban: Ban, evidence: Evidence) -> None:
        if ban.peer in self.banned or ban.peer == self.local.peer_id:
            return
        self.banned[ban.peer] = ban
        self._ban_digest = hashlib.sha256("\n".join(sorted(self.banned)).encode()).digest()
        self._accusers.pop(ban.peer, None)
        self._proofs[ban.peer] = [b for w in ban.witnesses if (b := self._bodies.pop((ban.peer, w), None))]
        for key in [k for k in self._bodies if k[0] == ban.peer]:
            del self._bodies[key]
        log.warning("%s: banned %s: %s evidence of round %d (%s by %s); detail keys %s", self.local.peer_id,
                    ban.peer, ban.kind, ban.round, "verifiable" if ban.verifiable else "witnessed",
                    ", ".join(ban.witnesses), sorted(evidence.detail))
        for callback in list(self._listeners):
            try:
                callback(ban.peer)
            except Exception:
                log.exception("%s: a ban hook raised", self.local.peer_id)

    def state_dict(self) -> dict[str, Any]:
        """The bans, with the signed accusations behind each, as plain data for this peer's
        checkpoints: a swarm restarted from them still holds its bans."""
        return {"bans": [{**ban.summary(), "peer": peer, "proofs": list(self._proofs.get(peer, ()))}
                         for peer, ban in self.banned.items()]}

    def load_state_dict(self, state: Any) -> int:
        """Take the bans of this peer's own checkpoint (trusted as its own words; their proofs go
        to joiners as before); returns how many were new. Network thread. ValueError for a
        malformed state, which changes nothing."""
        try:
            bans = [(Ban(str(b["peer"]), str(b["kind"]), int(b["round"]), tuple(str(w) for w in b["witnesses"]),
                         bool(b["verifiable"])), [dict(p) for p in b.get("proofs") or ()])
                    for b in (state or {}).get("bans") or ()]
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"a checkpoint's bans are malformed: {exc}") from None
        new = 0
        for ban, proofs in bans:
            if ban.peer in self.banned or ban.peer == self.local.peer_id:
                continue
            self._ban(ban, Evidence(ban.kind, ban.peer, b"", ban.round, {"restored": True}))
            self._proofs[ban.peer] = proofs[:max(1, self.witnesses)]
            new += 1
        return new

    def status(self) -> dict[str, Any]:
        """Plain data for `node status`: per-peer counts, bans, and who stands accused."""
        return {"counts": {p: dict(c) for p, c in self.counts.items()},
                "banned": {p: b.summary() for p, b in self.banned.items()},
                "accused": {p: sorted(w) for p, w in self._accusers.items()}}
