"""Checks of an owner's averages by members drawn after the round: BTARD's validators, so that
one owner per shard is held to account without two more owners to outvote it.

    owner:  keeps every part its groups received, as their authors signed them, for the last
            KEEP_ROUNDS rounds (its own part kept as summed, signed when first asked for), and
            answers a check of one chunk with them all and its signature over which they are:
                sign("checked", topic, t, i, c, view, [[author, content digest], ...])
    member: once round t is answered, for each chunk that another owner averaged, with
            probability rate / (n - 1), drawn from this peer's own randomness: asks the owner
            for the chunk's parts, checks every signature, and averages them again as the owner
            must have (its aggregator and screening in member order, its suspicion scores, its
            codec with the seed its answer names, no error feedback). The owner's signed answer
            must be what comes out, bit for bit, with the same contributors.
    wrong:  the owner's signed answer, its signed list of parts and all their bytes are
            evidence that anyone can recheck (`avg.wrong`): one check bans the owner. Where they
            are too large to carry (over MAX_EVIDENCE_BYTES), the checker is one witness of two.

On average `rate` of a round's chunks are checked, each by one member; a check moves the
chunk's n parts, so checks cost each member about rate x n/(n-1) of the vector a round on top
of the all-reduce's 2 (n-1)/n. The memory is the owner's: it holds every part its groups
received for KEEP_ROUNDS rounds, n times its shard each (for a 100M-parameter model over 8
peers, about 400 MB a round in float32 parts; compressed parts take what they take on the
wire). Nobody knows which chunks are checked, or by whom, until the
parts are sent and the averages signed: an owner cannot lie only where nobody looks, and a
member cannot aim its poison at chunks nobody checks.

What a check shows: an average, contributors or scores that the parts do not give, and a part
its author did not sign. What it does not: an owner that leaves an honest part out, saying it
never came (its author sees that it is not among the contributors, as after a lost message),
nor a member's poison, which the aggregator and the suspicion test judge, now at owners that
cannot lie about them.

So that a checker needs nothing but the parts, owners with checks on start CenteredClip from
the median (not from their own last average) and send averages without error feedback, as
replicated owners do. An owner that does not answer a check is counted (`check_unanswered`),
never accused: silence proves nothing.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives.accumulator import ShardGroup
from starling.collectives.aggregators import AggregatorConfig
from starling.collectives.bodies import BodyError, CheckAsk, Checked, CheckedPart, Refused
from starling.collectives.codec import packet_from_wire
from starling.collectives.compact import view_digest
from starling.collectives.contributions import Contributions, Scores, SignedPart, content_digest
from starling.collectives.defences import RoundDefence
from starling.collectives.requests import request_patiently
from starling.collectives.suspicion import Suspicion
from starling.compressors import Compressor, Packet, decode, from_spec
from starling.node.identity import peer_id_from_key, verify_signature
from starling.node.loop import AwakeDeadline
from starling.node.rpc import Refusal, Refuser, Reply, refusal
from starling.node.trust import Evidence, statement

if TYPE_CHECKING:
    from starling.collectives.accumulator import Verdict
    from starling.collectives.outcome import ShardResult
    from starling.node import Node
    from starling.node.trust import Trust

log = logging.getLogger(__name__)

MISAVERAGED = "avg.wrong"  # verifiable: an owner's signed average that its own signed parts do not give
SUFFIX = ".check"  # a reducer's checks travel on its topic with this suffix
KEEP_ROUNDS = 2  # rounds whose parts an owner keeps for checks
MAX_EVIDENCE_BYTES = 1 << 22  # parts and average an accusation may carry (4 MiB); more: a witness's word
MAX_IN_FLIGHT = 32  # checks one member runs at once; a draw past it is dropped (counted)
MAX_EVIDENCE_PARTS = 4096
_MAX_NUMEL = 1 << 24  # values a part or an average in evidence may decode to


@dataclass
class _Kept:
    """One closed group as its owner shows it to checkers: the members, and each part's
    (author, weight, signed part or None for the owner's own, the owner's own values, the
    state digest the owner's own part names)."""

    members: tuple[str, ...]
    parts: list[tuple[str, float, SignedPart | None, torch.Tensor | None, bytes | None]]


@dataclass(frozen=True)
class Shown:
    """A part as a check shows it: its author's key, what the author signed, and its bytes."""

    author: str
    key: bytes
    weight: float
    sig: bytes
    recipe: tuple[int | bytes, ...] | None
    packet: Packet
    state: bytes | None = None


class Recount:
    """How one topic's owners must average a chunk, the same on every peer of the swarm: the
    aggregator, the suspicion test's sample and the average's codec."""

    def __init__(self, topic: str, aggregator: AggregatorConfig, average_codec: str,
                 suspicion: Suspicion | None, contributions: Contributions,
                 bounds: Callable[[tuple[str, ...], int, int, int], tuple[int, int] | None]) -> None:
        self.topic, self.aggregator, self.suspicion = topic, aggregator, suspicion
        self.codec: Compressor = from_spec(average_codec)
        self.contributions = contributions
        self.bounds = bounds  # (members, t, shard, chunk) -> [lo, hi), None if no such chunk

    def wrong(self, t: int, i: int, c: int, members: tuple[str, ...], contributors: tuple[str, ...],
              average: Packet, scores: Scores | None, parts: Sequence[Shown]) -> str | None:
        """Why the owner's answer (`contributors`, `average`, `scores`, which it signed) is not
        what the `parts` it showed (and signed the list of) give; None if it is, or if nothing is
        proven (a chunk this peer cannot place, parts it cannot read). Never raises."""
        bounds = self.bounds(members, t, i, c)
        if bounds is None:
            return None
        view = view_digest(members)
        order = {m: k for k, m in enumerate(members)}
        authors = [p.author for p in parts]
        if len(set(authors)) != len(authors) or any(a not in order for a in authors) \
                or authors != sorted(authors, key=order.__getitem__):
            return "the parts shown are not one per member, in member order"
        values = []
        for p in parts:
            if peer_id_from_key(p.key) != p.author:
                return None  # not proven: the checker named a key that is not the author's
            signed = self.contributions.part_statement(t, i, c, view, p.weight, content_digest(
                p.packet.header, p.packet.buffers), p.recipe, p.state)
            if not verify_signature(p.key, signed, p.sig):
                return f"a part {p.author} did not sign"
            v = _decoded(p.packet)
            if v is None or v.numel() != bounds[1] - bounds[0]:
                return None  # not proven: the owner should not have taken it, but its author sent it
            values.append(v)
        if not set(contributors) <= set(authors):
            return f"contributors {sorted(set(contributors) - set(authors))} without a part shown"
        group = ShardGroup(members, set(members))
        for p, v in zip(parts, values):
            group.add(p.author, v, weight=p.weight)
        try:
            avg, _, _ = group.average(self.aggregator if self.aggregator.robust else None, None)
        except Exception as exc:  # parts the owner could not have averaged either
            log.info("%s: a check could not average the parts shown: %s", self.topic, exc)
            return None
        if not group.contributors:
            return "an average of parts none of which is finite"
        again = tuple(sorted(group.contributors))
        if again != contributors:
            return f"contributors {list(contributors)}, the parts give {list(again)}"
        if self.suspicion is not None:
            want = self.suspicion.scores(bounds, [group.received.get(m) for m in again])
            if want != scores:
                return "scores that the parts do not give"
        seed = average.header.get("seed")
        try:
            packet = self.codec.encode(avg, seed=seed if type(seed) is int else None)
        except Exception:
            return None
        if content_digest(packet.header, packet.buffers) != content_digest(average.header, average.buffers):
            return "an average that the parts do not give"
        return None


_TOPICS: weakref.WeakKeyDictionary[Trust, dict[str, Recount]] = weakref.WeakKeyDictionary()


def _check_misaveraged(trust: Trust) -> Callable[[Evidence], bool]:
    def check(evidence: Evidence) -> bool:
        d = evidence.detail
        recount = _TOPICS.get(trust, {}).get(d.get("topic"))  # type: ignore[arg-type]
        if recount is None:
            return False
        parsed = _parse(evidence, recount)
        if parsed is None:
            return False
        return recount.wrong(evidence.round, *parsed) is not None
    return check


def _parse(evidence: Evidence, recount: Recount) -> tuple[Any, ...] | None:
    """(shard, chunk, members, contributors, average, scores, parts) of `avg.wrong` evidence
    whose statements the accused signed; None if it is not such evidence."""
    d, t = evidence.detail, evidence.round
    try:
        i, c, members, contributors = d["shard"], d["chunk"], d["members"], d["contributors"]
        if type(i) is not int or type(c) is not int or not isinstance(members, list) \
                or not all(isinstance(m, str) for m in members) or members != sorted(set(members)) \
                or len(members) > MAX_EVIDENCE_PARTS or not isinstance(contributors, list) \
                or not all(isinstance(m, str) for m in contributors):
            return None
        members, contributors = tuple(members), tuple(contributors)
        view = view_digest(members)
        scores = _scores(d.get("scores"))
        average = _packet(d["average"])
        rows = d["parts"]
        if average is None or not isinstance(rows, list) or len(rows) > len(members):
            return None
        if sum(len(b) for b in d["average"][1]) + sum(len(b) for r in rows if isinstance(r, list) and len(r) == 8
                                                   and isinstance(r[6], list) for b in r[6]
                                                   if isinstance(b, bytes)) > MAX_EVIDENCE_BYTES:
            return None
        content = content_digest(average.header, average.buffers)
        if not evidence.signed_by_accused(recount.contributions.average_statement(
                t, i, c, view, contributors, content, scores), d["sig"]):
            return None
        parts = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 8 and isinstance(row[0], str) and isinstance(row[1], bytes)
                    and type(row[2]) is float and isinstance(row[3], bytes)
                    and (row[4] is None or isinstance(row[4], list)) and (row[7] is None or isinstance(row[7], bytes))):
                return None
            packet = _packet([row[5], row[6]])
            if packet is None:
                return None
            parts.append(Shown(row[0], row[1], row[2], row[3], None if row[4] is None else tuple(row[4]), packet,
                               row[7]))
        listed = [[p.author, content_digest(p.packet.header, p.packet.buffers)] for p in parts]
        if not evidence.signed_by_accused(statement("checked", recount.topic, t, i, c, view, listed), d["listed"]):
            return None
        return i, c, members, contributors, average, scores, parts
    except (KeyError, TypeError, ValueError):
        return None


def _scores(value: Any) -> Scores | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and type(value[0]) is float and isinstance(value[1], list)
            and all(isinstance(r, list) and len(r) == 2 and all(type(x) is float for x in r) for r in value[1])):
        raise ValueError("malformed scores")
    return value[0], tuple((r[0], r[1]) for r in value[1])


def _packet(value: Any) -> Packet | None:
    """A packet from evidence: [header, [buffers]]."""
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], dict) and isinstance(value[1], list)
            and len(value[1]) <= 8 and all(isinstance(b, bytes) for b in value[1])):
        return None
    try:
        return packet_from_wire(value[0], value[1])
    except Exception:
        return None


def _decoded(packet: Packet) -> torch.Tensor | None:
    shape = packet.header.get("shape")
    if not isinstance(shape, list) or len(shape) > 64 or not all(type(d) is int and d >= 0 for d in shape) \
            or math.prod(shape) > _MAX_NUMEL:
        return None
    try:
        values = decode(packet).reshape(-1).to(torch.float32)
    except Exception:
        return None
    return values


def _wire(packet: Packet) -> list[Any]:
    return [packet.header, [bytes(b.numpy()) for b in packet.buffers]]


class Checks(RoundDefence):
    """One reducer's checks (its topic): the owner's kept parts and answers (`on_close`,
    `_serve`), and the member's draws and checks (`after_round`). Network thread."""

    def __init__(self, node: Node, topic: str, rate: float, recount: Recount, refuse: Refuser,
                 timeout_s: float, retry_s: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"check_rate must be in (0, 1], got {rate!r}")
        self.node, self.topic, self.rate, self.recount = node, topic, rate, recount
        self._refuse, self.timeout_s, self.retry_s = refuse, timeout_s, retry_s
        self._plain = from_spec("none")
        self._kept: dict[tuple[int, bytes, int, int], _Kept] = {}
        self._asked: dict[tuple[str, int, bytes], int] = {}  # (checker, round, view) -> checks answered
        self._rng = random.SystemRandom()  # not the swarm's seeds: nobody may know the draw beforehand
        self._running: set[asyncio.Future[None]] = set()
        self.counts = {"checks": 0, "checks_passed": 0, "checks_failed": 0, "checks_unanswered": 0,
                       "checks_dropped": 0}
        trust = node.trust
        _TOPICS.setdefault(trust, {})[topic] = recount
        trust.register_check(MISAVERAGED, _check_misaveraged(trust))
        node.on(topic + SUFFIX, self._serve)

    # ------------------------------------------------------------------ owner
    def on_close(self, t: int, i: int, c: int, bounds: tuple[int, int], group: ShardGroup, verdict: Verdict,
                 avg: torch.Tensor) -> None:
        me = self.node.peer_id
        parts: list[tuple[str, float, SignedPart | None, torch.Tensor | None, bytes | None]] = []
        for author in group.members:
            part = group.received.get(author)
            if part is None:
                continue
            weight = float(group.weights.get(author, 1.0))
            if author in group.signed:
                parts.append((author, weight, group.signed[author].kept(), None, None))
            elif author == me:  # may be a view of the caller's vector, which it writes after the round
                parts.append((author, weight, None, part.clone(), group.states.get(me)))
        self._kept[(t, view_digest(group.members), i, c)] = _Kept(group.members, parts)
        for key in [k for k in self._kept if k[0] <= t - KEEP_ROUNDS]:
            del self._kept[key]
        for key in [k for k in self._asked if k[1] <= t - KEEP_ROUNDS]:
            del self._asked[key]

    async def _serve(self, msg: Any) -> Reply | dict[str, Any]:
        try:
            ask = CheckAsk.from_wire(msg.body)
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, str(exc))
        t, view, i, c = ask.round, ask.view, ask.shard, ask.chunk
        kept = self._kept.get((t, view, i, c))
        if kept is None:  # not bad input: the round is older than what is kept, or it never closed here
            return refusal(Refusal.NOT_FOUND, f"no parts of round {t} shard {i} chunk {c} kept here")
        if msg.sender not in kept.members:
            return self._refuse(Refusal.MALFORMED, "only the round's members check its averages")
        asked = (msg.sender, t, view)
        owned = sum(1 for k in self._kept if k[0] == t and k[1] == view)
        budget = 1 + math.ceil(3 * self.rate * owned / max(1, len(kept.members) - 1))
        if self._asked.get(asked, 0) >= budget:  # a member's checks of a round cost it that many chunks' parts
            return self._refuse(Refusal.BUSY, f"at most {budget} checks of round {t} per member")
        self._asked[asked] = self._asked.get(asked, 0) + 1
        rows, buffers, listed = [], [], []
        for k, (author, weight, signed, own, state) in enumerate(kept.parts):
            if signed is None:  # my own part, signed the first time anyone asks
                assert own is not None
                packet = self._plain.encode(own)
                sig = self.recount.contributions.sign_part(t, i, c, view, weight, packet, None, state)
                signed = SignedPart(view, weight, packet, sig, content_digest(packet.header, packet.buffers), None,
                                    state)
                kept.parts[k] = (author, weight, signed, None, None)
            assert signed.packet is not None
            rows.append(CheckedPart(author, weight, signed.sig, signed.recipe, signed.packet.header,
                                    len(signed.packet.buffers), signed.state))
            buffers.extend(signed.packet.buffers)
            listed.append([author, signed.content])
        sig = self.node.trust.sign(statement("checked", self.topic, t, i, c, view, listed))
        return Reply(Checked(tuple(rows), sig).to_wire(), tuple(buffers))

    # ------------------------------------------------------------------ member
    def after_round(self, t: int, members: tuple[str, ...], chosen: Sequence[ShardResult]) -> None:
        """Draw, for each chunk another owner averaged in round t, whether to check it."""
        me = self.node.peer_id
        p = self.rate / max(1, len(members) - 1)
        for res in chosen:
            if res.packet is None or res.owner == me or res.sig is None or self._rng.random() >= p:
                continue
            if len(self._running) >= MAX_IN_FLIGHT:
                self.counts["checks_dropped"] += 1
                continue
            task = asyncio.ensure_future(self._check(t, members, res))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _check(self, t: int, members: tuple[str, ...], res: ShardResult) -> None:
        owner, i, c = res.owner, res.shard, res.chunk
        view = view_digest(members)
        trust = self.node.trust
        try:
            msg = await request_patiently(self.node, owner, self.topic + SUFFIX, CheckAsk(t, view, i, c).to_wire(),
                                          (), AwakeDeadline(self.timeout_s), self.retry_s)
            refused = Refused.from_wire(msg.body)
            if refused is not None:
                raise RuntimeError(f"refused: {refused.reason}")
            answer = Checked.from_wire(msg.body)
            parts, at = [], 0
            for row in answer.parts:
                frames = msg.payload[at:at + row.buffers]
                at += row.buffers
                key = trust.key_of(row.author)
                if key is None:
                    raise RuntimeError(f"no key of {row.author} here")
                packet = packet_from_wire(row.header, frames)
                parts.append(Shown(row.author, key, row.weight, row.sig, row.recipe, packet, row.state))
            if at != len(msg.payload):
                raise BodyError(f"{len(msg.payload)} frames for {at} buffers")
            listed = [[p.author, content_digest(p.packet.header, p.packet.buffers)] for p in parts]
            if not trust.verify(owner, statement("checked", self.topic, t, i, c, view, listed), answer.sig):
                raise BodyError("an answer its owner did not sign")
            assert res.packet is not None
            contributors = tuple(res.contributors)
            why = await asyncio.get_running_loop().run_in_executor(
                None, self.recount.wrong, t, i, c, members, contributors, res.packet, res.scores, parts)
        except Exception as exc:  # whatever the owner answered, no check, and nothing held against it
            self.counts["checks_unanswered"] += 1
            trust.note(owner, "check_unanswered")
            log.info("%s: %s: no check of %s's shard %d chunk %d of round %d: %s", self.node.peer_id, self.topic,
                     owner, i, c, t, exc)
            return
        self.counts["checks"] += 1
        if why is None:
            self.counts["checks_passed"] += 1
            return
        self.counts["checks_failed"] += 1
        log.warning("%s: %s: %s's average of shard %d chunk %d of round %d fails its check: %s", self.node.peer_id,
                    self.topic, owner, i, c, t, why)
        trust.note(owner, "check_failed")
        key = trust.key_of(owner)
        if key is None:
            return
        detail: dict[str, Any] = {"topic": self.topic, "shard": i, "chunk": c, "members": list(members),
                                  "contributors": list(contributors), "sig": res.sig, "listed": answer.sig,
                                  "why": why}
        if res.scores is not None:
            detail["scores"] = [float(res.scores[0]), [[float(a), float(b)] for a, b in res.scores[1]]]
        size = sum(int(b.numel()) for p in parts for b in p.packet.buffers) \
            + sum(int(b.numel()) for b in res.packet.buffers)
        if size <= MAX_EVIDENCE_BYTES:  # else the checker's word, one witness of two
            detail["average"] = _wire(res.packet)
            detail["parts"] = [[p.author, p.key, p.weight, p.sig, None if p.recipe is None else list(p.recipe),
                                *_wire(p.packet), p.state] for p in parts]
        trust.accuse(Evidence(MISAVERAGED, owner, key, t, detail))
