"""Audits by recomputation (BTARD-SGD's): a member checks another's gradient by computing it again.

    every round t, at the parameters x_t every member holds bit for bit:
        each author states what its gradient was computed from, signed with every part:
                recipe = (rank, world, batch index, sha256(x_t))
        every owner keeps the signed parts its shards received (`reducer.keep`)
        after the round, each member draws from its own randomness, with probability
        audit_rate, one other member b to audit:
                g' = grad of loss(x_t, batch(rank, world, index)), on its own copy of x_t
                relative L2 distance |part - g'[shard]| / |g'[shard]| over b's kept chunks
                > audit_tolerance: note(b, "audit_failed") and accuse(b, "audit.mismatch")

The draw. It is made once the parts are signed and sent, from each auditor's own randomness
(not from the round or the parameters, which every member knows beforehand): an author cannot
tell which of its rounds are audited, so one that forges only where nobody looks cannot exist.
The price is memory: an owner keeps every part its shards received until its own audit of the
round is done (one round's worth of its shards, about the vector's size over the members, times
the members).

The batch recipe. A peer's batch index is the number of batches it trained on (from its start,
or from the checkpoint it resumed), which differs from the round after a catch-up or a join,
and a `node start` peer's data shard (rank, world) is its own choice. So the author states
both, signed with its parts: the auditor reads its batch from `task.batches(rank, world, seed)`
(the runtime keeps an iterator per audited shard and advances it: `AuditData`). An author may
state any shard's batch: audits check that a part is an honest gradient of some batch of the
task's data, not which one (a member can still choose its data). A recipe that no honest peer
states (an index past the round, a rank outside its world, no recipe at all) fails the audit.

The parameters' digest is in the recipe too. An author whose parameters differ from the
auditor's (it drifted, or fell behind, until the drift guard repairs it) computed its gradient
honestly at other parameters: the audit is skipped and counted against it (`audit_skipped`,
`note(b, "audit.other_parameters")`), never failed. The price: a member can dodge audits by
stating another digest, and is then only counted, not banned.

The tolerance (`audit_tolerance`, default 1e-3). Peers on the same hardware and kernels compute
the same bits; other thread counts, BLAS libraries or GPU atomics (an embedding's backward)
move a gradient by about 1e-6 relative, and mixed precision (bf16 autocast) on different
hardware by about 1e-2, for which the option must be raised. A forged part is far off: -g is 2,
zeros 1, 10 g 0.9. Audits need a lossless compressor (an author's lossy part carries its
error-feedback residual, which nobody else knows) and a deterministic loss (no dropout).

Witness evidence only: a peer without the round's parameters cannot recompute, so an audit
mismatch is one auditor's word (`node.trust`), and a member is banned once two auditors have
accused it (the evidence carries the signed part, the recipe and the parameters' digest).

Cost: each audit is one more forward and backward pass on the auditor's training thread
(audit_rate of a step's compute, on average), and every member hashes its parameters every
step; a part's recipe adds about 45 bytes. Nothing runs with audit_rate 0 (the default).
"""
from __future__ import annotations

import logging
import math
import random
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from starling.collectives import ShardedReducer
from starling.collectives.agreement import digest_bytes
from starling.collectives.contributions import Recipe
from starling.collectives.retention import KeptPart
from starling.node.trust import Evidence
from starling.protocols.base import LossFn

if TYPE_CHECKING:
    from starling.node.node import Node

log = logging.getLogger(__name__)

MISMATCH = "audit.mismatch"  # witness evidence: a signed part far from the gradient its recipe gives
DIGEST_BYTES = 32
MAX_WORLD = 1 << 20  # the most shards a recipe may name


class AuditData(typing.Protocol):
    """What the runtime gives a protocol that audits (`protocol.audit_data`): its own batch's
    recipe, and any member's batch by its recipe, as a loss closure at the protocol's model."""

    seed: int  # the task's data seed (the swarm's)

    def recipe(self) -> tuple[int, int, int]:
        """(rank, world, index) of the batch this peer's current step trains on."""

    def loss_fn(self, rank: int, world: int, index: int) -> LossFn | None:
        """The loss on batch `index` of shard (rank, world), at the protocol's model, as the
        runtime builds its own step's loss; None if it cannot make that batch."""


@dataclass(frozen=True)
class _Round:
    t: int
    parameters: bytes  # sha256 of x_t
    others: tuple[str, ...]  # the members this peer may audit in round t


class Auditor:
    """One peer's audits of one reducer's gradient rounds (training thread): `before(t, members)`
    keeps the round's parts and returns this peer's recipe for its parts; `after(t)` draws whom
    to audit, recomputes and compares. Counts `audits`, `failed` and `skipped`."""

    def __init__(self, node: Node, reducer: ShardedReducer, params: Sequence[nn.Parameter], model: nn.Module,
                 rate: float, tolerance: float) -> None:
        self.node, self.reducer, self.params, self.model = node, reducer, list(params), model
        self.rate, self.tolerance = rate, tolerance
        self.audits = self.failed = self.skipped = 0
        self._round: _Round | None = None
        self._rng = random.SystemRandom()  # not the swarm's seeds: nobody may know the draw beforehand

    def before(self, t: int, members: tuple[str, ...], data: AuditData) -> Recipe:
        """Round t's parameters (x_t); every other member's parts kept; my recipe."""
        parameters = digest_bytes(self.params, DIGEST_BYTES)
        others = tuple(m for m in members if m != self.node.peer_id)
        self._round = _Round(t, parameters, others)
        if others and self.rate > 0.0:
            self.reducer.keep(t, frozenset(others))
        rank, world, index = data.recipe()
        return (rank, world, index, parameters)

    def after(self, t: int, data: AuditData) -> None:
        """Draw whether to audit round t, and whom, then audit it on the parts my shards kept
        (after the round's `wait()`, the parameters still x_t)."""
        round_, self._round = self._round, None
        if round_ is None or round_.t != t or not round_.others or self.rate <= 0.0:
            return
        kept = self.reducer.take_kept(t)
        if self._rng.random() >= self.rate:
            return
        author = self._rng.choice(round_.others)
        parts = kept.get(author)
        if parts:  # else I own none of its shards, or it sent nothing in round t
            self._audit(t, author, parts, round_.parameters, data)

    def _audit(self, t: int, author: str, parts: list[KeptPart], parameters: bytes, data: AuditData) -> None:
        recipe = parts[0].detail.get("recipe")
        why = _bad_recipe(recipe, t) or next((f"chunk {p.chunk} of shard {p.shard} states another recipe"
                                              for p in parts if p.detail.get("recipe") != recipe), None)
        if why is not None:
            self._failed(t, author, parts[0], parameters, data, why, math.inf)
            return
        rank, world, index, stated = recipe  # type: ignore[misc]
        if stated != parameters:
            self.skipped += 1
            self.node.run(self._note(author, "audit.other_parameters"))
            log.info("%s: %s computed round %d at other parameters than mine; not audited", self.node.peer_id,
                     author, t)
            return
        loss_fn = data.loss_fn(rank, world, index)
        if loss_fn is None:
            self.skipped += 1
            return
        grad = self._recompute(loss_fn)
        got = torch.cat([p.values.to(torch.float32) for p in parts])
        want = torch.cat([grad[p.lo:p.hi] for p in parts])
        distance = _relative_distance(got, want)
        self.audits += 1
        if not distance <= self.tolerance:
            worst = max(parts, key=lambda p: _relative_distance(p.values.to(torch.float32), grad[p.lo:p.hi]))
            self._failed(t, author, worst, parameters, data, "gradient differs", distance)

    def _recompute(self, loss_fn: LossFn) -> torch.Tensor:
        """The flat float32 gradient of `loss_fn` at my parameters, on the host, leaving the
        parameters' `.grad` (this round's average) and the model's buffers as they were."""
        buffers = [b.detach().clone() for b in self.model.buffers()]
        try:
            loss = loss_fn()
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        finally:
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), buffers):
                    b.copy_(saved)
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).to(torch.float32).cpu()
                          for p, g in zip(self.params, grads)])

    def _failed(self, t: int, author: str, part: KeptPart, parameters: bytes, data: AuditData, why: str,
                distance: float) -> None:
        self.failed += 1
        log.warning("%s: %s failed the audit of round %d: %s (relative distance %.3g, tolerance %.3g)",
                    self.node.peer_id, author, t, why, distance, self.tolerance)
        detail = {**part.detail, "step": t, "parameters": parameters, "task_seed": data.seed, "why": why,
                  "distance": distance if math.isfinite(distance) else -1.0, "tolerance": self.tolerance}
        self.node.run(self._accuse(author, t, detail))

    async def _note(self, author: str, kind: str) -> None:
        self.node.trust.note(author, kind)

    async def _accuse(self, author: str, t: int, detail: dict[str, Any]) -> None:
        trust = self.node.trust
        trust.note(author, "audit_failed")
        key = trust.key_of(author)
        if key is not None:
            trust.accuse(Evidence(MISMATCH, author, key, t, detail))

    def counts(self) -> dict[str, int]:
        return {"audits": self.audits, "audit_failed": self.failed, "audit_skipped": self.skipped}


def _bad_recipe(recipe: Any, t: int) -> str | None:
    """Why no honest peer states `recipe` in round t; None if one may."""
    if recipe is None:
        return "no recipe"
    if not (isinstance(recipe, list) and len(recipe) == 4 and all(type(f) is int for f in recipe[:3])
            and isinstance(recipe[3], bytes) and len(recipe[3]) == DIGEST_BYTES):
        return f"malformed recipe {recipe!r:.80}"
    rank, world, index, _ = recipe
    if not (0 < world <= MAX_WORLD and 0 <= rank < world):
        return f"shard {rank} of {world}"
    if not 0 <= index <= t:  # a peer trains at most one batch a round
        return f"batch {index} in round {t}"
    return None


def _relative_distance(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return math.inf
    scale = float(want.norm())
    error = float((got - want).norm())
    if not math.isfinite(error):
        return math.inf
    return error / scale if scale > 0.0 else (0.0 if error == 0.0 else math.inf)
