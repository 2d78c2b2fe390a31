"""The hyper-parameters of `diloco` and `streaming-diloco`, checked when a config is built.

Peers of different speeds add: `sync_every_s` (time-based inner rounds),
`quorum` and `quorum_grace_s` (a round closes without the stragglers) and
`staleness_weight` (what a late contribution counts for in the next round). Every
contribution is weighted by the inner steps it was computed on; equal weights leave the
average exactly the plain one, so a swarm that uses none of these trains as it always did.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from starling.collectives.codec import check_compressor_spec
from starling.protocols.base import MAX_OWNERS, MIN_SHARD_NUMEL, ProtocolConfig
from starling.protocols.fragments import check_assignment, check_overlap_window_share, check_schedule
from starling.protocols.optim import check_reduce_config


@dataclass(frozen=True)
class DiLoCoConfig(ProtocolConfig):
    lr: float = 1e-3  # inner optimizer
    compressor: str = "int4"  # pseudo-gradients travel in 4 bits; the outer step stays float32
    sync_every: int = 100  # H: inner steps between two syncs of the same fragment
    fragments: int = 1  # F: fragments synced one at a time, H / F steps apart
    overlap_steps: int = 0  # tau: a fragment's exchange starts this many steps before its merge
    alpha: float = 0.0  # merge: local = alpha local + (1 - alpha) global
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    inner_optimizer: str = "adamw"  # adamw | sgd
    inner_momentum: float = 0.0  # sgd only
    weight_decay: float = 0.0
    fragment_assignment: str = "strided"  # strided | sequential (see fragments.py)
    reply_grace_s: float = 2.0  # a member waits round_timeout_s + this for an owner's average
    retry_interval_s: float = 0.05  # re-ask a peer that is not ready yet
    max_owners: int = MAX_OWNERS  # the most owners a round's shards have (drawn from its members)
    min_shard_numel: int = MIN_SHARD_NUMEL  # the fewest values a shard holds (fewer owners for a small model)
    # Floating buffers (BatchNorm statistics) are averaged, integer ones set to their maximum, at
    # every sync of fragment 0, so that every peer's eval_model() agrees; True: each peer's own (FedBN).
    local_buffers: bool = False
    # Every this many syncs of fragment 0 the members check that their outer parameters agree bit
    # for bit (a tiny round of digests); a swarm that drifted apart (peers built with different
    # initial weights, say) takes the outer state of its first member. 0: never. The default costs
    # 0.14% more bytes (benchmarks/drift_guard.py, docs/benchmarks.md).
    check_every: int = 10
    # Peers of different speeds. sync_every_s > 0: time-based inner rounds, each peer runs as many
    # inner steps as fit in a window of this many seconds (fragments.SyncClock); 0: every peer
    # runs sync_every steps.
    sync_every_s: float = 0.0
    # With sync_every_s, a fragment's exchange merges after overlap_steps steps or, if more, after
    # as many of this peer's own recent steps as fit in this share of a fragment's window
    # (sync_every_s / fragments): a round takes about the same time on every peer, so a fast peer
    # hides it behind several steps and a slow one behind about one. 0: overlap_steps alone (as
    # with step-based rounds, where this does nothing). Below 1, a fragment merges before its own
    # next send. streaming-diloco's 0.5 keeps the README's fast peers 96% busy, against 86% with 0
    # (docs/benchmarks.md, "Peers of different speeds"); diloco's 0 keeps its rounds blocking, as
    # with alpha 0 the merge would overwrite the steps taken meanwhile.
    overlap_window_share: float = 0.0
    # quorum K >= 1: a fragment's round closes once K members are in plus quorum_grace_s (the
    # round's leader names the set, collectives/quorum.py); 0: a round waits for every member.
    # Pair it with sync_every_s for peers that are slower for good: with step-based rounds such a
    # peer reaches every round after it closed, so its work never lands (a stalled one's does).
    quorum: int = 0
    quorum_grace_s: float = 0.5
    # gamma: a contribution that missed its round's close counts this much in the fragment's
    # next round (outer_sync.py). 0.5 is FedBuff's polynomial staleness 1/(1+delay) at one
    # round of delay; 0 drops late work, 1 counts it in full.
    staleness_weight: float = 0.5
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
    # Checks of pseudo-gradients (protocols/verification.py): after each round, each member with
    # this probability scores one other member's pseudo-gradient by the loss it takes off
    # `verify_batches` of the batches its signed recipe names, against twice as many it had not seen
    # (9 x verify_batches forward passes a check); an author failing round after round is accused.
    # Needs a task whose peers read their own shard. 0: off.
    verify_rate: float = 0.0
    verify_batches: int = 4
    # With a defence on, a part may claim at most weight_cap * sync_every inner steps (late
    # carries included): the most an honest peer computes in a round. Raise it for time-based
    # rounds (sync_every_s) whose fastest peer runs more than that many steps in a window.
    weight_cap: float = 4.0
    # Eager updates (Kale et al. 2025), with overlap: at a fragment's send the local fragment
    # merges the outer step its own pseudo-gradient would make; at the merge only the
    # difference to the real one. Outer parameters are the same as without.
    eager_updates: bool = False
    # Error feedback in the outer loop: with a lossy compressor each peer keeps, per fragment, what
    # its parts of the pseudo-gradient did not carry and adds it to the next one (the reducer's
    # part residuals). False drops it (the sweep of docs/benchmarks.md shows what that costs at 2
    # bits and 1.6% density). Owners always feed back what their re-encoded averages drop.
    error_feedback: bool = True
    # beta of SparseLoCo's error-feedback accumulator, e <- beta e + delta before each send: below 1
    # the residual forgets what it never sent and acts as the outer momentum (with outer_momentum
    # 0). 1 (default): plain error feedback, where every unsent value is owed until it is sent.
    error_feedback_decay: float = 1.0
    # The codec owners send averages in; "" (default): the same as `compressor`. With a sparse
    # compressor, K P per chunk keeps the union of the P parts' supports (one lossy hop for
    # support; see docs/architecture.md for the bytes).
    average_compressor: str = ""
    # Client sampling (federated rounds): each round, only a subset of the members trains and
    # contributes, drawn from `sample_seed` and the round number (every member draws the same);
    # the others wait and take the merged model. sample_fraction F: round(F x members) of them
    # (at least 1); clients_per_round K > 0: K of them. Rounds of the whole model only (fragments
    # 1, no overlap, no quorum, step-based).
    sample_fraction: float = 1.0
    clients_per_round: int = 0
    sample_seed: int = 0

    @property
    def samples(self) -> bool:
        return self.sample_fraction < 1.0 or self.clients_per_round > 0

    def __post_init__(self) -> None:
        if self.check_every < 0:
            raise ValueError(f"check_every must be >= 0, got {self.check_every}")
        check_schedule(self.sync_every, self.fragments, self.overlap_steps)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        check_reduce_config(self, "inner_optimizer", "inner_momentum")
        if not (math.isfinite(self.weight_cap) and self.weight_cap > 0.0):
            raise ValueError(f"weight_cap must be a finite number > 0, got {self.weight_cap}")
        if not self.outer_lr > 0.0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        check_assignment(self.fragment_assignment)
        if not self.sync_every_s >= 0.0 or self.sync_every_s == float("inf"):
            raise ValueError(f"sync_every_s must be a finite number >= 0 (0: sync every sync_every steps), "
                             f"got {self.sync_every_s}")
        check_overlap_window_share(self.overlap_window_share)
        if self.quorum < 0:
            raise ValueError(f"quorum must be >= 0 (0: every member), got {self.quorum}")
        if not 0.0 <= self.quorum_grace_s < float("inf"):
            raise ValueError(f"quorum_grace_s must be a finite number >= 0, got {self.quorum_grace_s}")
        if type(self.error_feedback_decay) not in (int, float) or not 0.0 < self.error_feedback_decay <= 1.0:
            raise ValueError(f"error_feedback_decay must be in (0, 1], got {self.error_feedback_decay!r}")
        if not 0.0 <= self.staleness_weight <= 1.0:
            raise ValueError(f"staleness_weight must be in [0, 1], got {self.staleness_weight}")
        if not 0.0 <= self.verify_rate <= 1.0:
            raise ValueError(f"verify_rate must be in [0, 1], got {self.verify_rate}")
        if type(self.verify_batches) is not int or self.verify_batches < 1:
            raise ValueError(f"verify_batches must be a whole number >= 1, got {self.verify_batches!r}")
        if self.verify_rate > 0.0 and self.secure_aggregation != "off":
            raise ValueError("verify_rate and secure_aggregation exclude each other: a check scores a member's "
                             "pseudo-gradient, which secure aggregation hides")
        if self.eager_updates and self.overlap_steps < 1:
            raise ValueError("eager_updates needs overlap_steps >= 1: without overlap the average is there at once")
        if self.average_compressor:
            check_compressor_spec(self.average_compressor)
        if not 0.0 < self.sample_fraction <= 1.0:
            raise ValueError(f"sample_fraction must be in (0, 1], got {self.sample_fraction}")
        if self.clients_per_round < 0:
            raise ValueError(f"clients_per_round must be >= 0 (0: sample_fraction decides), got "
                             f"{self.clients_per_round}")
        if self.samples and (self.fragments != 1 or self.overlap_steps or self.quorum or self.sync_every_s):
            raise ValueError("client sampling draws whole rounds of the model: it needs fragments 1, overlap_steps 0, "
                             "no quorum and step-based rounds (sync_every, not sync_every_s)")


@dataclass(frozen=True)
class StreamingDiLoCoConfig(DiLoCoConfig):
    fragments: int = 4
    overlap_steps: int = 1
    alpha: float = 0.5
    overlap_window_share: float = 0.5
