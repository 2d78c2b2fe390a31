"""DiLoCo's pseudo-gradients checked the way open training runs score their miners: by the loss
they take off the batches their author says it trained on, against batches it never saw.

An audit (`audit.py`) recomputes a gradient; a pseudo-gradient cannot be recomputed, since it
comes from many inner steps and the author's private optimizer state. But it can be scored:

    author, at each send of fragment f (signed with every part, `DiLoCo._send`):
        recipe = (rank, world, first, last, sha256(outer_f)[:16])
        batches first..last of shard (rank, world): those it trained since its last merge of f
    every owner keeps the signed parts its shards received in the round
    after the round, before the outer step (outer_f is still what the authors started from),
    each member, with probability verify_rate, from its own randomness: one other author b
        d      = b's pseudo-gradient, its signed parts gathered from every owner
        x      = the outer parameters of every fragment; x' = x with fragment f moved by -d
        own    = mean over `verify_batches` batches i drawn from [first, last]:
                     loss(x; batch i) - loss(x'; batch i)
        other  = the same over twice as many batches of b's shard past `last`, which b had
                 not trained on when it sent d
        x''    = x moved by the round's average pseudo-gradient on the same values
        margin = (own - other) - (own - other at x''): passed when > 0
    a running test per author (`Verdicts`): a failed check adds 1, a passed one takes `drift`
    (0.5) off, never below 0; at `threshold` (8) the member accuses b (`pseudo.unverified`, a
    witness). A cheater fails about half its checks and gains 0.25 a check: accused in about 32
    checks. An honest author that fails one check in five loses 0.2 a check, and reaches 8 in
    under 1 of 1,000 excursions; one that fails one in three is at risk (see the limits).

Why it works: inner steps fit the batches they run on, so x' has a lower loss on those than on
batches of the same shard it never saw, by a margin that grows with the dimension. The round's
average is the control: it fits the author's shard less than the author does, so what is left
of own - other after its share is taken off is the fit to the stated batches themselves. A pseudo-gradient computed
on other data than its recipe states, or crafted, moves both alike: its margin is noise
around 0, and about half its checks fail. Draws are each checker's own, made after the parts
are signed and sent: an author cannot know which rounds are checked.

From public inputs only: the outer parameters every member holds, the task's data, the signed
recipe and the signed parts. But the evidence is a witness's word: a peer without the round's
outer parameters cannot recompute the losses, so two checkers must accuse (`node.trust`).

Why the whole pseudo-gradient: the margin's signal grows with the values moved and its noise
with their square root. On charlm (110k parameters), moving all of them gave a margin 3.6
standard deviations above 0, moving an eighth 0.9 (a check then fails in 1 of 5 honest rounds).
So a checker gathers the author's parts from every owner: one fragment's worth of the
author's compressed parts a check, the bytes of one more part per member at verify_rate 1.

Limits, stated: a batch recipe names a shard that its author reads (a task whose peers read
their own shard), not units handed out by a ledger; an owner that does not answer a gather
leaves its chunks unmoved (a smaller margin); an author stating a digest other than the
checker's outer parameters is skipped and counted (`verify_skipped`), as audits do. Each check
costs 9 x verify_batches forward passes on the checker's training thread, and every send hashes
the fragment's outer parameters.
"""
from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from starling.collectives.agreement import digest_bytes
from starling.collectives.retention import KeptPart
from starling.node.trust import Evidence
from starling.protocols.base import LossFn

if TYPE_CHECKING:
    from starling.node.node import Node
    from starling.protocols.audit import AuditData
    from starling.protocols.fragments import FragmentView

log = logging.getLogger(__name__)

UNVERIFIED = "pseudo.unverified"  # witness evidence: pseudo-gradients that fail their checks, round after round
DIGEST_BYTES = 16
MAX_WORLD = 1 << 20


@dataclass(frozen=True)
class Margin:
    """Mean loss drops a pseudo-gradient gives its author's batches (`own`) and unseen ones
    (`other`), and those the round's average gives the same batches (`reference_own`,
    `reference_other`; 0 without a reference)."""

    own: float
    other: float
    reference_own: float = 0.0
    reference_other: float = 0.0

    @property
    def value(self) -> float:
        """How much more the pseudo-gradient favours its batches than the reference does."""
        return (self.own - self.other) - (self.reference_own - self.reference_other)

    @property
    def passed(self) -> bool:
        return math.isfinite(self.value) and self.value > 0.0


def margin(place: Callable[[str], None], own: Sequence[LossFn], other: Sequence[LossFn],
           reference: bool = False) -> Margin:
    """The margin of a pseudo-gradient: `place(where)` puts in the model the parameters it
    started from ("start"), those it leads to ("author") and, with `reference`, those the
    round's average leads to ("reference"); each loss is evaluated at each, without grads."""
    if not own or not other:
        raise ValueError("a margin needs at least one of the author's batches and one unseen")
    losses = (*own, *other)
    n = len(own)

    def drops(where: str) -> tuple[float, float]:
        place(where)
        after = [float(f()) for f in losses]
        d = [b - a for b, a in zip(before, after)]
        return sum(d[:n]) / n, sum(d[n:]) / (len(d) - n)
    with torch.no_grad():
        place("start")
        before = [float(f()) for f in losses]
        mine = drops("author")
        theirs = drops("reference") if reference else (0.0, 0.0)
    return Margin(*mine, *theirs)


class Verdicts:
    """Each author's running test over its checks (a one-sided CUSUM on failures): a failed
    check adds 1, a passed one takes `drift` off, never below 0. `add` says when the statistic
    reaches `threshold` (once per crossing). Bounded: at most `max_peers` authors."""

    def __init__(self, threshold: float = 8.0, drift: float = 0.5, max_peers: int = 4096) -> None:
        if not threshold > 0.0 or not drift > 0.0:
            raise ValueError(f"threshold and drift must be > 0, got {threshold!r} and {drift!r}")
        self.threshold, self.drift, self.max_peers = threshold, drift, max_peers
        self.statistic: dict[str, float] = {}
        self.checks: dict[str, int] = {}
        self.failed: dict[str, int] = {}

    def add(self, author: str, passed: bool) -> bool:
        if author not in self.statistic and len(self.statistic) >= self.max_peers:
            oldest = next(iter(self.statistic))
            for table in (self.statistic, self.checks, self.failed):
                table.pop(oldest, None)
        before = self.statistic.get(author, 0.0)
        now = max(0.0, before - self.drift) if passed else before + 1.0
        self.statistic[author] = now
        self.checks[author] = self.checks.get(author, 0) + 1
        if not passed:
            self.failed[author] = self.failed.get(author, 0) + 1
        return before < self.threshold <= now


class PseudoVerifier:
    """One DiLoCo peer's checks of the others' pseudo-gradients (training thread): `recipe` at
    each send, `after` once a round is answered and before its outer step."""

    def __init__(self, node: Node, model: nn.Module, rate: float, batches: int, max_span: int,
                 threshold: float = 8.0, drift: float = 0.5) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"verify_rate must be in [0, 1], got {rate!r}")
        if batches < 1:
            raise ValueError(f"verify_batches must be >= 1, got {batches!r}")
        self.node, self.model, self.rate, self.batches, self.max_span = node, model, rate, batches, max_span
        self.verdicts = Verdicts(threshold, drift)
        self._rng = random.SystemRandom()  # not the swarm's seeds: nobody may know the draw beforehand
        self._merged: dict[int, int] = {}  # fragment -> the last batch index before its last merge
        self.counts = {"verified": 0, "verify_failed": 0, "verify_skipped": 0}
        self.margins: deque[tuple[str, float]] = deque(maxlen=256)  # (author, margin) of the last checks
        self._accused: set[str] = set()

    def recipe(self, f: int, outer: torch.Tensor, data: AuditData) -> tuple[int, int, int, int, bytes]:
        """My recipe for fragment f's pseudo-gradient: the batches since its last merge (which
        made the local fragment the outer one, or mostly: what came before counts little)."""
        rank, world, last = data.recipe()
        first = self._merged.get(f, last - self.max_span) + 1
        return rank, world, max(0, min(first, last)), last, digest_bytes([outer], DIGEST_BYTES)

    def merged(self, f: int, data: AuditData) -> None:
        """Fragment f merged after the batch this peer trained last."""
        self._merged[f] = data.recipe()[2]

    def after(self, f: int, k: int, others: Sequence[str], gather: Callable[[str], list[KeptPart]],
              views: Sequence[FragmentView], outer: Sequence[torch.Tensor], data: AuditData,
              average: torch.Tensor | None = None) -> Margin | None:
        """Draw whether to check round k of fragment f and whose pseudo-gradient; gather its
        parts from every owner (`collectives/gathering.py`) and check it."""
        if not others or self._rng.random() >= self.rate:
            return None
        author = self._rng.choice(list(others))
        parts = gather(author)
        if not parts:  # nobody kept any of its parts: it sent nothing
            return None
        recipe = parts[0].detail.get("recipe")
        why = _bad_recipe(recipe, self.max_span)
        if why is None and any(p.detail.get("recipe") != recipe for p in parts):
            why = "parts that state different recipes"
        if why is not None:
            return self._judge(f, k, author, parts[0], Margin(-math.inf, 0.0), why)
        rank, world, first, last, stated = recipe  # type: ignore[misc]
        if stated != digest_bytes([outer[f]], DIGEST_BYTES):
            self.counts["verify_skipped"] += 1
            self.node.run(self._note(author, "verify.other_parameters"))
            return None
        span = list(range(first, last + 1))
        picked = self._rng.sample(span, min(self.batches, len(span)))
        # twice as many unseen batches: their mean is the noisier side (an author's are few)
        unseen = self._rng.sample(range(last + 1, last + 1 + 2 * self.batches), 2 * self.batches)
        own = [data.loss_fn(rank, world, i) for i in picked]
        other = [data.loss_fn(rank, world, i) for i in unseen]
        if any(fn is None for fn in (*own, *other)):
            self.counts["verify_skipped"] += 1
            return None
        result = self._margin(f, parts, views, outer, own, other, average)  # type: ignore[arg-type]
        return self._judge(f, k, author, parts[0], result, None)

    def _margin(self, f: int, parts: list[KeptPart], views: Sequence[FragmentView], outer: Sequence[torch.Tensor],
                own: list[LossFn], other: list[LossFn], average: torch.Tensor | None) -> Margin:
        """Evaluate on my own model, its parameters and buffers put back afterwards. The
        reference moves the same values by the round's average pseudo-gradient."""
        local = [view.read() for view in views]
        buffers = [b.detach().clone() for b in self.model.buffers()]
        start = outer[f].to(torch.float32)
        moved, referenced = start.clone(), start.clone()
        for part in parts:
            moved[part.lo:part.hi] -= part.values.to(device=moved.device, dtype=torch.float32)
            if average is not None:
                referenced[part.lo:part.hi] -= average[part.lo:part.hi].to(device=moved.device, dtype=torch.float32)
        at = {"start": start, "author": moved, "reference": referenced}

        def place(where: str) -> None:
            for g, view in enumerate(views):
                view.write(at[where] if g == f else outer[g])
        try:
            return margin(place, own, other, reference=average is not None)
        finally:
            with torch.no_grad():
                for view, values in zip(views, local):
                    view.write(values)
                for b, saved in zip(self.model.buffers(), buffers):
                    b.copy_(saved)

    def _judge(self, f: int, k: int, author: str, part: KeptPart, result: Margin, why: str | None) -> Margin:
        passed = result.passed and why is None
        self.counts["verified"] += 1
        self.margins.append((author, result.value))
        if not passed:
            self.counts["verify_failed"] += 1
            self.node.run(self._note(author, "verify_failed"))
            why_text = why or f"margin {result.value:.3g} (own {result.own:.3g}, unseen {result.other:.3g})"
            log.info("%s: %s's pseudo-gradient of fragment %d round %d fails its check: %s", self.node.peer_id,
                     author, f, k, why_text)
        if self.verdicts.add(author, passed) and author not in self._accused:
            self._accused.add(author)
            statistic = self.verdicts.statistic[author]
            log.warning("%s: %s's pseudo-gradients fail their checks round after round (%d of %d, statistic %.1f): "
                        "accused", self.node.peer_id, author, self.verdicts.failed.get(author, 0),
                        self.verdicts.checks[author], statistic)
            detail = {**part.detail, "step": k, "fragment": f, "why": why or "margin",
                      "margin": result.value if math.isfinite(result.value) else -1.0,
                      "failed": self.verdicts.failed.get(author, 0), "checks": self.verdicts.checks[author]}
            self.node.run(self._accuse(author, k, detail))
        return result

    async def _note(self, author: str, kind: str) -> None:
        self.node.trust.note(author, kind)

    async def _accuse(self, author: str, k: int, detail: dict[str, Any]) -> None:
        trust = self.node.trust
        key = trust.key_of(author)
        if key is not None:
            trust.accuse(Evidence(UNVERIFIED, author, key, k, detail))


def _bad_recipe(recipe: Any, max_span: int) -> str | None:
    """Why no honest peer states `recipe`; None if one may."""
    if recipe is None:
        return "no recipe"
    if not (isinstance(recipe, list) and len(recipe) == 5 and all(type(v) is int for v in recipe[:4])
            and isinstance(recipe[4], bytes) and len(recipe[4]) == DIGEST_BYTES):
        return f"malformed recipe {recipe!r:.80}"
    rank, world, first, last, _ = recipe
    if not (0 < world <= MAX_WORLD and 0 <= rank < world):
        return f"shard {rank} of {world}"
    if not 0 <= first <= last or last - first + 1 > max_span:
        return f"batches {first} to {last} (at most {max_span} a round)"
    return None

