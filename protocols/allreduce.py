"""`allreduce`: exact data-parallel SGD, gradients averaged over all live peers every step.

    members = sorted(live peers + me)           # this peer's view at step t
    g = flatten(grad)                           # one float32 vector
    g = sharded_all_reduce(t, members, g)       # collectives/reduce.py: reduce-scatter by
                                                # shard owners, 2(P-1)/P of g sent per peer
    optimizer.step() on the averaged gradient   # a shard whose owner did not answer in
                                                # time counts 0 on every member alike

A peer that fell behind (a joiner whose state is a few rounds old) learns from the owners'
refusals which round the swarm is in and jumps there, so it costs the swarm one round.

Replicas are meant to be bit-identical. Every `check_every` steps the members compare digests
of their parameters (`guard.py`); one that drifted (built with other initial weights, or a
round whose members' views differed) takes the parameters and
optimizer state more than half of the members hold, and logs it.

With `audit_rate` > 0, members audit each other's gradients by recomputing them
(`audit.py`): after each round, before the optimizer's step, at the same parameters.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from starling.collectives import BufferAverager, ShardedReducer, membership
from starling.common.text import few
from starling.compressors import from_spec
from starling.node.node import Node
from starling.protocols.audit import Auditor
from starling.protocols.backprop import BackpropProtocol
from starling.protocols.base import (
    MAX_OWNERS,
    MIN_SHARD_NUMEL,
    LossFn,
    ProtocolConfig,
    ProtocolError,
    StepReport,
    register,
)
from starling.protocols.optim import check_reduce_config, make_defences, make_secure, reduce_timeouts

log = logging.getLogger(__name__)

PART_TOPIC = "allreduce.part"


@dataclass(frozen=True)
class AllReduceConfig(ProtocolConfig):
    optimizer: str = "sgd"  # sgd | adamw
    momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0
    reply_grace_s: float = 2.0  # a member waits round_timeout_s + this for an owner's average
    retry_interval_s: float = 0.05  # re-send a part to an owner whose protocol is not up yet
    max_owners: int = MAX_OWNERS  # the most owners a round's shards have (drawn from its members)
    # The fewest values a shard holds (fewer owners for a small model); None: MIN_SHARD_NUMEL, or 1
    # with audits on (a member audits the parts its own shards received, so every member owns one).
    min_shard_numel: int | None = None
    # Floating buffers (BatchNorm statistics) are averaged, integer ones set to their maximum, every
    # step after the gradients, in small lossless rounds of their own; True: each peer's own (FedBN).
    local_buffers: bool = False
    # Every this many steps (step 0 first) the members check that their parameters agree bit for
    # bit (a tiny round of digests) and repair a drifted one; 0: never. The default costs 0.002%
    # more bytes (benchmarks/drift_guard.py).
    check_every: int = 100
    # Against members that cannot be trusted (collectives/defences.py, docs/security.md): how an
    # owner combines the parts (mean | centered_clip | trimmed_mean | median, with parameters:
    # "centered_clip:tau=1.5,iters=3"), and how many owners each shard has (2 or 3: members compare
    # their signed averages; parts cost that many times the bytes)
    aggregator: str = "mean"
    owner_replication: int = 1
    # With one owner per shard: the share of each round's chunks that members drawn after the
    # round check, averaging the owner's signed parts again (collectives/checking.py); 0: off.
    # An owner caught is banned on that one check. Costs about this share of the vector in bytes.
    check_rate: float = 0.0
    # Secure aggregation (collectives/secure.py, docs/security.md): "on" masks every part so that
    # an owner learns only the sum of its shard ("on:scale=0,clip=8,threshold=0.5"; scale 0 fits each round); needs
    # compressor "none", the plain mean and one owner per shard; "off": parts in the clear
    secure_aggregation: str = "off"
    # Audits by recomputation (protocols/audit.py): each round, each member audits one other with
    # this probability, recomputing its gradient on its stated batch (one more forward and backward
    # per audit, and a hash of the parameters every step); 0: off. Needs a lossless compressor and
    # a deterministic loss. A part further than `audit_tolerance` (relative L2) fails its audit.
    audit_rate: float = 0.0
    audit_tolerance: float = 1e-3

    def __post_init__(self) -> None:
        if self.min_shard_numel is None:
            object.__setattr__(self, "min_shard_numel", 1 if self.audit_rate > 0.0 else MIN_SHARD_NUMEL)
        check_reduce_config(self)
        if self.check_every < 0:
            raise ValueError(f"check_every must be >= 0, got {self.check_every}")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ValueError(f"audit_rate must be in [0, 1], got {self.audit_rate}")
        if not self.audit_tolerance > 0.0:
            raise ValueError(f"audit_tolerance must be > 0, got {self.audit_tolerance}")
        if self.audit_rate > 0.0 and not from_spec(self.compressor).lossless:
            raise ValueError(f"audit_rate needs a lossless compressor (a lossy part carries its author's "
                             f"error-feedback residual, which an auditor cannot recompute), got {self.compressor!r}")


@register
class AllReduce(BackpropProtocol, name="allreduce", config_class=AllReduceConfig, topic_prefix="allreduce."):
    config: AllReduceConfig
    runs_on_accelerators = True
    replicas_agree = True

    def __init__(self, node: Node, model: nn.Module, config: AllReduceConfig) -> None:
        super().__init__(node, model, config)
        # a gradient counts 1: a part claiming more is over the cap
        self.reducer = ShardedReducer(node, PART_TOPIC, self.flat.numel, config.compressor,
                                      reduce_timeouts(config), self.is_open, defences=make_defences(config, 1.0),
                                      secure=make_secure(config, 1.0), max_owners=config.max_owners,
                                      min_shard_numel=config.min_shard_numel,
                                      unaveraged=0.0)
        self.reducers = [self.reducer]  # peer events reach it; its residuals are this peer's private state
        self.buffer_sync = None if config.local_buffers else BufferAverager(
            node, model, "allreduce.buffers", reduce_timeouts(config), self.is_open, config.max_owners,
            config.min_shard_numel)
        if self.buffer_sync is not None:
            self.side_reducers += self.buffer_sync.reducers
        self.guard = self._drift_guard("allreduce.")
        self.auditor = Auditor(node, self.reducer, self.flat.params, model, config.audit_rate,
                               config.audit_tolerance) if config.audit_rate > 0.0 else None
        self._serve()

    # ------------------------------------------------------------------ training thread
    weightless_steps = True

    def step(self, loss_fn: LossFn, weight: float | None = None) -> StepReport:
        """One round; `weight` 0 takes part without counting (see `Protocol.weightless_steps`).
        Otherwise a batch that was partly padding (`weigh_next_step`) weighs its share of a full one."""
        work, self.next_step_work = self.next_step_work, 1.0
        if weight is None and work != 1.0:
            weight = work
        clock = self._begin_step()
        with clock.computing():
            loss = self._backprop(loss_fn)
            grad = self.flat.gather_grads()

        t, members = self.step_count, membership(self.node)
        recipe = None
        if self.auditor is not None and len(members) > 1:
            if self.audit_data is None:
                raise ProtocolError("allreduce: audit_rate needs the runtime's batches (audit_data, which the "
                                    "Trainer sets)")
            recipe = self.auditor.before(t, members, self.audit_data)
        state = self._round_state(t) if len(members) > 1 else None
        result = self.reducer.start(t, members, grad, lend=True, recipe=recipe, weight=weight, state=state).wait()
        if len(members) > 1:
            self.flat.scatter_grads(grad)
        if recipe is not None and self.auditor is not None and self.audit_data is not None:
            with clock.computing():  # at x_t still: the optimizer steps after
                self.auditor.after(t, self.audit_data)
        if result.ahead > t:
            log.info("%s: allreduce round %d was late; catching up to round %d", self.node.peer_id, t, result.ahead)
            self.step_count = result.ahead
        with clock.computing():
            self.optimizer.step()
        if self.buffer_sync is not None and len(members) > 1:
            self.buffer_sync.sync(t, members)
        if self.guard is not None:  # (a peer that was late checks at the swarm's next check)
            self.guard.after_round(t, members, result)
        self.step_count = max(self.step_count, t + 1)
        if result.lost:
            log.warning("%s: allreduce step %d went on without %s", self.node.peer_id, t, few(result.lost))
        return self._report(t, loss, clock, synced=result.synced, peers=result.peers, lost=result.lost,
                            absent=result.absent, diverged=result.diverged)

    # ------------------------------------------------------------------ hooks and state
    def describe(self) -> dict[str, Any]:
        audits = self.auditor.counts() if self.auditor is not None else {}
        return {**super().describe(), "step": self.step_count, "parameters": self.flat.numel, **audits}

