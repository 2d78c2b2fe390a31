"""`diloco` and `streaming-diloco`: peers train alone for many steps, then average where
their parameters went (DiLoCo, Douillard et al. 2023; Streaming DiLoCo, Douillard et al. 2025).

Each peer, with H = sync_every, F = fragments, tau = overlap_steps, and the fragment split
and schedule of `fragments.py` (diloco: F = 1, tau = 0, alpha = 0):

    outer_f = a float32 copy of fragment f of the parameters; momentum_f = 0
    for every inner step s = 1, 2, ...:
        loss_fn(); backward(); inner optimizer (AdamW) step on the local parameters
        if s == send(f, k):                                  # tau steps before f's merge
            delta_f = outer_f - local_f                      # f's pseudo-gradient
            start averaging delta_f over the live peers      # sharded all-reduce, quantized
        if s == merge(f, k):                                 # training went on meanwhile
            wait for the average of delta_f                  # a shard nobody averaged: 0
            momentum_f = mu momentum_f + delta_f             # outer SGD, Nesterov, float32
            outer_f    = outer_f - outer_lr (delta_f + mu momentum_f)
            local_f    = alpha local_f + (1 - alpha) outer_f # alpha 0: take the global fragment

Each fragment is one `OuterFragment` (`outer_sync.py`): its outer parameters, momentum,
version, all-reduce, quorum and the exchange it has in flight. `DiLoCo` below decides when
each sends and merges; the fragment does the arithmetic.

Every peer decodes the same averaged packets, so outer parameters stay bit-identical. A shard
whose average did not come back (its owner died) counts as 0 on every member alike, so
survivors keep agreeing instead of each applying its own pseudo-gradient there. Every
`check_every` syncs of fragment 0 the drift guard (`guard.py`) checks that they do, and right
after any round of fragment 0 whose owners saw its members begin it with different outer
states (a round whose members' views differed, the round before).

Elastic membership. A joiner loads a peer's `state_dict` (outer parameters, momentum, round,
inner optimizer state, rounds in flight). For a round in flight it takes part in (its member
list names the joiner), it sends the donor's pseudo-gradient; for one it does not, it fetches
the outer fragment after that merge from a member ("diloco.sync"). A peer that learns it has
fallen a round behind fetches the whole outer state and jumps to that peer's step. Either way
it tells the others which rounds it sends nothing in (`ShardedReducer.skip`): members that
already counted it in would otherwise wait for its part until the round timeout.

Peers of different speeds. Each pseudo-gradient travels with its weight, the inner steps it
was computed on, and owners average by weight (equal weights: the plain average, bit for
bit). `sync_every_s` replaces the step schedule with a clock (`fragments.SyncClock`): a
fragment's send falls due at a time, after as many steps as fit, and its merge follows after
as many of the peer's own steps as fit in `overlap_window_share` of a fragment's window (at
least tau), so that fast peers hide the round behind more steps. `quorum` adds a question
before the all-reduce: the round's leader names the members whose contributions it takes
(`collectives/quorum.py`); those average among themselves, the rest fetch the merged fragment
and carry their pseudo-gradient into the next round.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from starling.collectives import ReduceResult, ShardedReducer, membership
from starling.collectives.buffers import BufferAverager
from starling.collectives.quorum import Closing, QuorumClose
from starling.collectives.retention import KeptPart
from starling.node.node import Node
from starling.node.rpc import Refusal, Refuser, Reply, refusal
from starling.node.wire import Message
from starling.protocols.backprop import BackpropProtocol
from starling.protocols.base import LossFn, ProtocolError, StepClock, StepReport, register
from starling.protocols.bodies import BodyError, NotYet, SyncAsk, SyncState
from starling.protocols.diloco_config import DiLoCoConfig, StreamingDiLoCoConfig
from starling.protocols.fragments import FragmentSchedule, FragmentView, SyncClock, count_layers, split_fragments
from starling.protocols.guard import DriftGuard, State
from starling.protocols.optim import make_defences, make_optimizer, make_secure, reduce_timeouts
from starling.protocols.outer_sync import (
    Exchange,
    OuterFragment,
    OuterPlacement,
    Published,
    ledgers_state,
    load_ledgers_state,
    read_sync_reply,
)
from starling.protocols.verification import PseudoVerifier

log = logging.getLogger(__name__)

TOPIC_PREFIX = "diloco."
SYNC_TOPIC = "diloco.sync"  # outer parameters and momentum of some fragments, as a peer holds them now
WAIT_POLL_S = 1.0  # a peer not drawn for a round asks a member this often whether it merged,
WAIT_POLL_MAX_S = 3.0  # or less often, down to this, where many wait on few members
MISSES_BEFORE_WARNING = 3  # rounds in a row a peer misses before it says why that may keep happening
# With client sampling a round's members are a draw from a large swarm (100 of 1000): shards of
# at least this many values, so that a small model's round is not members^2 requests over more
# owners than a node keeps sockets open to (the simulator caps them near 13 per node at 1000
# nodes on one box, and the connections churned until the rounds timed out).
SAMPLED_MIN_SHARD_NUMEL = 512


def spread(me: str, peers: Sequence[str]) -> list[str]:
    """`peers` in an order of `me`'s own (a hash of the two ids): many peers that each ask the
    same list in turn start with different ones."""
    return sorted(peers, key=lambda m: hashlib.sha256((me + m).encode()).digest())


def draw_clients(members: Sequence[str], k: int, config: DiLoCoConfig) -> tuple[str, ...]:
    """Round k's clients: `members` ordered by a hash of (sample seed, k, id), the first
    round(F x members) (at least 1) or `clients_per_round` of them; sorted."""
    count = config.clients_per_round or max(1, round(config.sample_fraction * len(members)))
    key = f"{config.sample_seed}:{k}:".encode()
    order = sorted(members, key=lambda m: hashlib.sha256(key + m.encode()).digest())
    return tuple(sorted(order[:count]))


class SideRounds:
    """The small lossless rounds that ride on fragment 0's merge, with its members: the
    buffers' average and the drift guard's check. A round of fragment 0 that I send nothing
    in, I send nothing in them either: nobody waits for my parts there."""

    def __init__(self, node: Node, buffers: BufferAverager | None, guard: DriftGuard | None) -> None:
        self.node, self.buffers, self.guard = node, buffers, guard

    def after_merge(self, k: int, members: tuple[str, ...], diverged: bool = False) -> None:
        """`diverged`: an owner of the round saw its members begin it with different outer
        states, so the guard checks now, due or not."""
        if self.buffers is not None:
            self.buffers.sync(k, members)
        if self.guard is not None and (self.guard.due(k) or diverged):
            self.guard.run(k, members)

    def skip(self, k: int) -> None:
        if self.buffers is not None:
            self.buffers.skip(k, membership(self.node))
        if self.guard is not None and self.guard.due(k):
            self.guard.reducer.skip(k)


@register
class DiLoCo(BackpropProtocol, name="diloco", config_class=DiLoCoConfig, topic_prefix=TOPIC_PREFIX):
    """One peer: the inner optimizer on the local model, one `OuterFragment` per fragment, and
    the schedule (or clock) that says which fragment sends and which merges after each step."""

    config: DiLoCoConfig
    runs_on_accelerators = True
    replicas_agree = True
    local_inner_steps = True
    optimizer_key = "inner_optimizer"

    def __init__(self, node: Node, model: nn.Module, config: DiLoCoConfig) -> None:
        super().__init__(node, model, config)
        try:
            split = split_fragments(self.flat.numel, count_layers(model), config.fragments,
                                    config.fragment_assignment)
        except ValueError as exc:
            raise ProtocolError(f"{self.name}: {exc}") from None
        self.schedule = FragmentSchedule(config.sync_every, config.fragments, config.overlap_steps)
        # time-based inner rounds (sync_every_s), or None: the step schedule
        self.clock = SyncClock(config.sync_every_s, config.fragments, config.overlap_steps,
                               config.overlap_window_share) if config.sync_every_s else None
        timeouts = reduce_timeouts(config)
        self.buffer_sync = None if config.local_buffers else BufferAverager(
            node, model, f"{TOPIC_PREFIX}buffers", timeouts, self.is_open, config.max_owners)
        if self.buffer_sync is not None:
            self.side_reducers += self.buffer_sync.reducers
        # the drift guard compares the outer state (see the _replica_* methods below)
        self.guard = self._drift_guard(f"{TOPIC_PREFIX}guard.", "outer parameters")
        self.side_rounds = SideRounds(node, self.buffer_sync, self.guard)
        # Outer parameters and momentum (float32) live on the model's device, or where
        # place_state() puts them (pinned CPU memory, to spare an accelerator's memory).
        self.placement = OuterPlacement(self.flat.device)
        self.fragments = [
            OuterFragment(FragmentView(self.flat.params, fragment),
                          ShardedReducer(node, f"{TOPIC_PREFIX}f{f}", fragment.numel, config.compressor, timeouts,
                                         self.is_open, part_feedback=config.error_feedback,
                                         min_shard_numel=SAMPLED_MIN_SHARD_NUMEL if config.samples else 1,
                                         max_owners=config.max_owners,
                                         average_compressor=config.average_compressor or None,
                                         part_feedback_decay=config.error_feedback_decay,
                                         defences=make_defences(config, config.weight_cap * config.sync_every),
                                         secure=make_secure(config, config.sync_every), unaveraged=0.0),
                          QuorumClose(node, f"{TOPIC_PREFIX}q{f}", config.quorum, config.quorum_grace_s, timeouts,
                                      self.is_open, salt=f) if config.quorum else None,
                          config, self.placement, node.peer_id,
                          version=0 if self.clock else self.schedule.first_round(f),
                          on_skip=self.side_rounds.skip if f == 0 else None,
                          round_state=self._round_state if f == 0 and self.guard is not None else None)
            for f, fragment in enumerate(split)]
        self.reducers = [fragment.reducer for fragment in self.fragments]
        # my share of each round's average (0 in a round that closed without me): what I weigh
        self.weight_log = {"rounds": 0, "missed": 0, "share_sum": 0.0}
        self.last_shares: dict[str, float] = {}
        self._last_step_end: float | None = None
        self._eval: tuple[nn.Module, list[FragmentView]] | None = None
        self._sample: tuple[int, tuple[str, ...]] | None = None  # (round, its drawn members)
        # (version, members): with sampling, rounds merged without me since I last trained
        self._behind: tuple[int, tuple[str, ...]] | None = None
        self._last_loss = float("nan")  # reported by a step that trained nothing (not drawn)
        # Checks of the others' pseudo-gradients by the loss they take off their stated batches
        # (verification.py): drawn after each round, before its outer step.
        self.verifier = PseudoVerifier(node, model, config.verify_rate, config.verify_batches,
                                       max_span=math.ceil(config.weight_cap * config.sync_every) + config.overlap_steps
                                       ) if config.verify_rate > 0.0 else None
        self._publish()
        self._refuse_sync = Refuser(node.stats, SYNC_TOPIC, node.peer_id)  # counts malformed requests
        self._serve({SYNC_TOPIC: self._on_sync})

    # ------------------------------------------------------------------ the fragments, read-only
    @property
    def views(self) -> list[FragmentView]:
        return [fragment.view for fragment in self.fragments]

    @property
    def outer(self) -> list[torch.Tensor]:
        """The outer parameters, fragment by fragment."""
        return [fragment.outer for fragment in self.fragments]

    @property
    def momentum(self) -> list[torch.Tensor]:
        return [fragment.momentum for fragment in self.fragments]

    @property
    def versions(self) -> list[int]:
        """The round each fragment merges next."""
        return [fragment.version for fragment in self.fragments]

    @property
    def in_flight(self) -> dict[int, Exchange]:
        """Each fragment's exchange in flight, by fragment."""
        return {f.index: f.exchange for f in self.fragments if f.exchange is not None}

    @property
    def last_closing(self) -> dict[int, Closing | None]:
        """Each fragment's latest closing set (with a quorum)."""
        return {f.index: f.last_closing for f in self.fragments}

    # ------------------------------------------------------------------ placement
    def place_state(self, device: torch.device | str) -> None:
        """Keep the outer parameters and momentum on `device`. With the model on an accelerator
        and `device` the CPU, they sit in pinned host memory (as torchft offers): each sync
        copies one fragment to the accelerator to form its pseudo-gradient, and takes the
        outer step on the CPU, so the accelerator holds only the model and inner optimizer."""
        self.placement.move_to(device)
        for fragment in self.fragments:
            fragment.place()
        self._publish()

    def start_from(self, model: nn.Module) -> None:
        """The outer parameters start from `model`'s (full-precision) values, not from this
        peer's model rounded to its dtype: a bfloat16 peer and a float32 peer then hold the
        same outer parameters from the start."""
        params = [p for p in model.parameters() if p.requires_grad]
        for fragment in self.fragments:
            fragment.outer = self.placement.placed(FragmentView(params, fragment.view.fragment).read())
        self._publish()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        return make_optimizer(self.flat.params, c.inner_optimizer, c.lr, c.inner_momentum, c.weight_decay)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The inner optimizer (the paper's name for it): the one that takes the local steps."""
        return self.optimizer

    # ------------------------------------------------------------------ client sampling
    def round_members(self, k: int) -> tuple[str, ...]:
        """The members of round k: every live member, or with client sampling the ones drawn
        for it (from the sample seed and k, so every member draws the same set from the same
        view; fixed at the first step of the round this peer takes)."""
        if not self.config.samples:
            return membership(self.node)
        if self._sample is None or self._sample[0] != k:
            self._sample = (k, draw_clients(membership(self.node), k, self.config))
        return self._sample[1]

    def sampled(self) -> bool:
        """Whether this peer trains in the round in progress (the round of its next step)."""
        k = self.step_count // self.config.sync_every
        return not self.config.samples or self.node.peer_id in self.round_members(k)

    def _wait_step(self, clock: StepClock) -> StepReport:
        """A step of a round this peer was not drawn for: no compute and no traffic. It takes
        the swarm's model when it is next drawn (`_catch_up_sampled`), or is evaluated."""
        t = self.step_count
        s = self.step_count = t + 1
        members = self.round_members(t // self.config.sync_every)
        for fragment, _ in self._sends_at(s):
            fragment.exchange = None
        for _, r in self._merges_at(s):
            self._behind = (r + 1, members)  # the swarm merges round r without me
            self.weight_log["rounds_waited"] = self.weight_log.get("rounds_waited", 0) + 1
            self._await_round(r + 1, members)  # keep time with the round, without its traffic
        self._last_step_end = time.time()
        return self._report(t, self._last_loss, clock, peers=len(members), sampled=False)

    def _await_round(self, version: int, members: Sequence[str]) -> None:
        """Wait (bounded by the round timeout) until a member of the round reports the version it
        merges to: a peer that was not drawn keeps time with the rounds instead of running ahead
        of them. It asks one member at a time, every WAIT_POLL_S (or a few seconds, where many wait
        on few members), for versions only."""
        me = self.node.peer_id
        drawn = [m for m in spread(me, members) if m != me]
        # the swarm's waiting peers ask the round's members about once a second each between
        # them, whatever the share drawn (900 waiting on 100 members: each asks every 3 s at most)
        poll_s = min(WAIT_POLL_MAX_S, max(WAIT_POLL_S, len(membership(self.node)) / max(1, len(members)) / 3))
        deadline = time.monotonic() + self.config.round_timeout_s + self.config.reply_grace_s
        for i in itertools.count():
            if not drawn or not self._open or time.monotonic() >= deadline:
                log.info("%s: round %d's members did not report it merged in time; going on", me, version - 1)
                return
            peer = drawn[i % len(drawn)]
            try:
                msg = self.node.request(peer, SYNC_TOPIC, SyncAsk((), version).to_wire(),
                                        timeout_s=max(0.1, min(poll_s, deadline - time.monotonic())))
                if read_sync_reply(msg, [], [], len(self.fragments)).versions[0] >= version:
                    return
            except Exception as exc:  # not there yet, or gone: ask again, maybe another
                log.debug("%s: waiting for round %d: %s", me, version - 1, exc)
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))

    def _catch_up_sampled(self) -> None:
        """Take the model of the rounds that went on without me: the outer state at the version
        they reached, from their members first (bounded by the round timeout)."""
        if self._behind is None:
            return
        version, members = self._behind
        self._behind = None
        # each peer asks the members in its own order: hundreds of peers drawn after waiting (or
        # evaluated at the end) would otherwise all ask the first member first
        sources = [*spread(self.node.peer_id, members), *(m for m in membership(self.node) if m not in members)]
        for fragment in self.fragments:
            self._fetch_merged(fragment, version, sources)
            fragment.take_outer()
        self._publish()

    # ------------------------------------------------------------------ training thread
    def step(self, loss_fn: LossFn) -> StepReport:
        if self.config.samples:
            if not self.sampled():
                return self._wait_step(self._begin_step())
            self._catch_up_sampled()
        clock, began = self._begin_step(), time.time()
        if self.clock is not None:
            self.clock.started(began)
        with clock.computing():
            loss = self._backprop(loss_fn)
            self.inner.step()
        self._last_loss = loss
        if self.clock is not None:  # a step's time: from the last one's end (data, emulated slowness) to now
            self.clock.stepped(time.time() - (self._last_step_end or began))

        t = self.step_count
        s = self.step_count = t + 1
        for fragment in self.fragments:
            fragment.ledger.stepped()
        result: ReduceResult | None = None
        for fragment, k in self._sends_at(s):
            self._send(fragment, k)
        for fragment in self.fragments:
            if fragment.answered():  # start averaging with the closing set; training need not wait for it
                fragment.admit()
        for fragment, k in self._merges_at(s):
            result = self._merge(fragment, k, clock) or result
        self._publish()
        self._last_step_end = time.time()
        if result is None:
            return self._report(t, loss, clock)
        return self._report(t, loss, clock, synced=result.synced, peers=result.peers, lost=result.lost,
                            diverged=result.diverged)

    def _sends_at(self, s: int) -> list[tuple[OuterFragment, int]]:
        """(fragment, round) pairs whose exchange starts after step s."""
        if self.clock is None:
            sending = self.schedule.sending_at(s)
            return [] if sending is None else [(self.fragments[sending[0]], sending[1])]
        now = time.time()
        return [(fragment, k) for fragment in self.fragments if (k := fragment.due_round(self.clock, now)) is not None]

    def _merges_at(self, s: int) -> list[tuple[OuterFragment, int]]:
        """(fragment, round) pairs that merge after step s."""
        if self.clock is None:
            merging = self.schedule.merging_at(s)
            return [] if merging is None else [(self.fragments[merging[0]], merging[1])]
        due = [(f, f.exchange.round) for f in self.fragments if f.merges_by(s) and f.exchange is not None]
        return sorted(due, key=lambda fk: (fk[1], fk[0].index))

    def _send(self, fragment: OuterFragment, k: int) -> None:
        """Start averaging the fragment's pseudo-gradient (weighted by the steps it took, a late
        one folded in); training goes on until its merge. With a quorum, first ask the round's
        leader for its closing set."""
        part, weight = fragment.ledger.contribution(fragment.pseudo_gradient())
        members = self.round_members(k)
        fragment.recipe = None
        if self.verifier is not None and len(members) > 1:
            if self.audit_data is None:
                raise ProtocolError(f"{self.name}: verify_rate needs the runtime's batches (audit_data, which the "
                                    "Trainer sets)")
            fragment.recipe = self.verifier.recipe(fragment.index, fragment.outer, self.audit_data)
            fragment.reducer.keep(k, frozenset(m for m in members if m != self.node.peer_id))
        # a step count, whichever rounds: a checkpoint or a joiner takes it as it is
        merge_at = self.step_count + (self.clock.overlap() if self.clock else self.config.overlap_steps)
        if fragment.quorum is not None and len(members) > 1:
            fragment.ask(k, members, part, weight, merge_at)
        else:
            fragment.start(k, members, part, weight, merge_at)
        if self.config.eager_updates:
            fragment.eager_update()

    def _merge(self, fragment: OuterFragment, k: int, clock: StepClock) -> ReduceResult | None:
        """Wait for the fragment's average, take the outer step, merge it into the local parameters."""
        exchange = fragment.exchange
        if exchange is not None and exchange.asking is not None:
            fragment.admit()  # waits for the leader's set
        fragment.exchange = None
        f, result = fragment.index, None
        if exchange is not None and exchange.missed:
            self._missed(fragment, exchange)
            return None
        if exchange is None or exchange.round != k:
            log.warning("%s: no exchange of fragment %d round %d in flight; fetching it", self.node.peer_id, f, k)
            fragment.skip(k)
            self._fetch_merged(fragment, k + 1, membership(self.node))
        elif exchange.pending is None:
            self._fetch_merged(fragment, k + 1, exchange.members)
        else:
            result = exchange.pending.wait()
            if result.ahead > k:
                log.info("%s: fragment %d round %d closed without me (the swarm is in round %d); catching up",
                         self.node.peer_id, f, k, result.ahead)
                self._catch_up(fragment, k, exchange.members)
                return result
            if result.lost:
                log.warning("%s: %s round %d went on without %s", self.node.peer_id, fragment.reducer.topic, k,
                            list(result.lost))
            self._log_share(result, exchange.members)
            if self.verifier is not None and self.audit_data is not None and fragment.recipe is not None:
                fragment.reducer.take_kept(k)  # my groups' parts, now shown to members that gather them
                others = [m for m in exchange.members if m != self.node.peer_id]
                members = exchange.members

                def gather(author: str, fragment: OuterFragment = fragment) -> list[KeptPart]:
                    return fragment.reducer.gathering.gather(k, members, author)
                with clock.computing():  # before the outer step: the outer parameters the authors started from
                    self.verifier.after(f, k, others, gather, self.views, self.outer, self.audit_data,
                                        exchange.average)
        with clock.computing():
            fragment.merge(exchange, k)
        if self.verifier is not None and self.audit_data is not None:
            self.verifier.merged(f, self.audit_data)
        if f == 0 and exchange is not None and exchange.pending is not None:  # the same members, the same rounds
            self.side_rounds.after_merge(k, exchange.members, result is not None and result.diverged)
        return result

    def _missed(self, fragment: OuterFragment, exchange: Exchange) -> None:
        """The fragment's round closed without me (my part is carried): take the merged fragment
        from a member of the set, and the global fragment as it is (alpha or not: my local
        progress travels in the carry, and would otherwise count twice)."""
        f, k = fragment.index, exchange.round
        log.info("%s: fragment %d round %d closed without me; my part goes into round %d", self.node.peer_id, f, k,
                 k + 1)
        self.weight_log["rounds"] += 1
        self.weight_log["missed"] += 1
        self.weight_log["in_a_row"] = in_a_row = self.weight_log.get("in_a_row", 0) + 1
        if in_a_row == MISSES_BEFORE_WARNING and self.clock is None:
            log.warning("%s: %d rounds in a row closed without me: with step-based rounds a peer slower than "
                        "the quorum reaches every round after it closed, and its work never lands; "
                        "sync_every_s (time-based rounds) brings it in", self.node.peer_id, in_a_row)
        sources = exchange.closing.members if exchange.closing is not None else membership(self.node)
        self._fetch_merged(fragment, k + 1, sources)
        fragment.take_outer()

    def _log_share(self, result: ReduceResult, members: tuple[str, ...]) -> None:
        shares = dict(result.shares) or {m: 1.0 / len(members) for m in members}
        self.last_shares = shares
        self.weight_log["rounds"] += 1
        self.weight_log["in_a_row"] = 0
        self.weight_log["share_sum"] += shares.get(self.node.peer_id, 0.0)

    # ------------------------------------------------------------------ the drift guard's state
    def _replica_tensors(self) -> Sequence[torch.Tensor]:
        """What peers hold bit for bit: the outer parameters (the local ones differ by design)."""
        return self.outer

    def _replica_tensors_of(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        """What `_replica_tensors()` would be after taking this state: its outer parameters."""
        if len(tensors) != 2 * len(self.fragments):
            raise ValueError(f"expected {2 * len(self.fragments)} tensors, outer parameters then momentum")
        return tensors[:len(self.fragments)]

    def _replica_state(self) -> State:
        """What a drifted peer takes from a member holding the majority's outer parameters: the
        outer parameters and momentum of every fragment at these versions, in host memory (kept
        until the next check)."""
        return {"versions": self.versions}, [t.cpu() for t in (*self.outer, *self.momentum)]

    def _take_replica_state(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        count = len(self.fragments)
        if [int(v) for v in header.get("versions", ())] != self.versions:
            raise ValueError(f"outer state at versions {header.get('versions')}, mine are {self.versions}")
        fits = [isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == f.view.numel
                and bool(torch.isfinite(t).all()) for f, t in zip(self.fragments * 2, tensors)]
        if len(tensors) != 2 * count or not all(fits):
            raise ValueError(f"expected {2 * count} finite float32 tensors of sizes "
                             f"{[f.view.numel for f in self.fragments]}, outer parameters then momentum")
        for f, fragment in enumerate(self.fragments):
            fragment.load(tensors[f].reshape(-1), tensors[count + f].reshape(-1), fragment.version)
            fragment.take_outer()
        self._publish()

    # ------------------------------------------------------------------ catching up
    def _fetch_merged(self, fragment: OuterFragment, version: int, sources: Sequence[str]) -> None:
        """I missed the fragment's round: take its outer fragment from a member that merged it."""
        f = fragment.index
        got = self._fetch([f], sources, lambda versions: versions[f] >= version, at_least=version)
        if got is None:
            log.warning("%s: no peer had fragment %d at version %d; keeping mine", self.node.peer_id, f, version)
            return
        fragment.adopt(got.outer[f], got.momentum[f], got.versions[f])

    def _catch_up(self, fragment: OuterFragment, k: int, sources: Sequence[str]) -> None:
        """The fragment's round k closed without me: take the outer state and step of a peer
        that merged it, and join the rounds that follow."""
        got = self._fetch(list(range(len(self.fragments))), sources, lambda versions: versions[fragment.index] > k)
        if got is None:
            log.warning("%s: could not fetch the swarm's outer state; staying at step %d",
                        self.node.peer_id, self.step_count)
            return
        before = self.versions  # the round of each fragment I would have merged next
        for f, other in enumerate(self.fragments):
            other.exchange = None  # my rounds were refused as late
            other.adopt(got.outer[f], got.momentum[f], got.versions[f])
            other.take_outer()  # my local progress belongs to rounds that closed without me
        if self.clock is not None:  # time-based rounds: the clock says which round is next
            for other, first in zip(self.fragments, before):
                for r in range(first, other.version):
                    other.skip(r)
            return
        self.step_count = max(self.step_count, got.step)
        for g, r in self.schedule.in_flight_at(got.step):  # started before I arrived: fetched at merge
            self.fragments[g].exchange = Exchange(r, tuple(sources), torch.zeros(0))
        for other, first in zip(self.fragments, before):
            # the rounds I jumped over, or fetch at their merge: members that count me in them
            # stop waiting for my part (only the latest two can still be open anywhere)
            first_mine = other.exchange.round + 1 if other.exchange is not None else other.version
            for r in range(max(first, first_mine - 2), first_mine):
                other.skip(r)

    def _fetch(self, fragments: list[int], sources: Sequence[str],
               ready: Callable[[tuple[int, ...]], bool], at_least: int = 0) -> Published | None:
        """Ask `sources` in turn for these fragments until one answers with `ready(versions)`
        true, or the round timeout (plus grace) has passed."""
        me, sizes = self.node.peer_id, [self.fragments[f].view.numel for f in fragments]
        peers = [p for p in sources if p != me]
        deadline = time.monotonic() + self.config.round_timeout_s + self.config.reply_grace_s
        while peers and time.monotonic() < deadline:
            for peer in peers:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:  # a bounded wait per peer, so that a dead one leaves time to ask the others
                    body = SyncAsk(tuple(fragments), at_least).to_wire()
                    msg = self.node.request(peer, SYNC_TOPIC, body,
                                            timeout_s=min(remaining, max(1.0, self.config.round_timeout_s / 4)))
                    got = read_sync_reply(msg, fragments, sizes, len(self.fragments))
                except Exception as exc:  # dead, not up yet, or a malformed answer: ask another
                    log.debug("%s: %s from %s failed: %s", me, SYNC_TOPIC, peer, exc)
                    continue
                if ready(got.versions):
                    return got
            time.sleep(self.config.retry_interval_s)
        return None

    def _publish(self) -> None:
        self._published = Published(self.step_count, tuple(self.versions), tuple(self.outer), tuple(self.momentum))

    # ------------------------------------------------------------------ network thread
    def _on_sync(self, msg: Message) -> Reply | dict[str, Any]:
        if not self._open:
            return refusal(Refusal.CLOSED, "protocol closed")
        state = self._published
        try:
            ask = SyncAsk.from_wire(msg.body)
            if ask.fragments and ask.fragments[-1] >= len(state.outer):
                raise BodyError(f"fragment {ask.fragments[-1]}: this model has {len(state.outer)}")
        except BodyError as exc:
            return self._refuse_sync(Refusal.MALFORMED, f"{msg.sender}: {exc}; body must be "
                                     f"{{fragments: [ascending in 0..{len(state.outer) - 1}], at_least: int}}")
        fragments = list(ask.fragments)
        if any(state.versions[f] < ask.at_least for f in fragments or range(len(state.versions))):
            # not there yet: a short answer, not the state
            return NotYet.before(state.versions, ask.at_least).to_wire()
        payload = [t for f in fragments for t in (state.outer[f], state.momentum[f])]
        return Reply(SyncState(state.step, state.versions, ask.fragments).to_wire(), payload)

    def private_state(self) -> dict[str, Any]:
        """Each fragment's residuals; for a fragment with a round in flight, as they were before
        it encoded (load_state_dict re-sends that round and encodes it again). And my tokens
        since my last contributions, with any late one carried: a joiner starts from none."""
        return {"reducers": [fragment.residuals() for fragment in self.fragments],
                "ledger": ledgers_state([fragment.ledger for fragment in self.fragments])}

    def load_private_state(self, state: Mapping[str, Any]) -> None:
        super().load_private_state(state)
        if "ledger" in state:
            load_ledgers_state([fragment.ledger for fragment in self.fragments], state["ledger"])

    def on_peer_joined(self, peer_id: str) -> None:
        super().on_peer_joined(peer_id)
        for fragment in self.fragments:
            if fragment.quorum is not None:
                fragment.quorum.peer_joined(peer_id)

    def on_peer_left(self, peer_id: str) -> None:
        super().on_peer_left(peer_id)
        for fragment in self.fragments:
            if fragment.quorum is not None:
                fragment.quorum.peer_left(peer_id)

    # ------------------------------------------------------------------ state and evaluation
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["outer"] = [o.clone() for o in self.outer]
        state["outer_momentum"] = [m.clone() for m in self.momentum]
        state["versions"] = self.versions
        in_flight = [e for fragment in self.fragments if (e := fragment.in_flight_state()) is not None]
        state["in_flight"] = sorted(in_flight, key=lambda e: (e["round"], e["fragment"]))  # in the order sent
        if self.clock is not None:
            state["clock_epoch"] = self.clock.epoch  # the swarm's: a joiner's rounds fall due with the others'
            state["next_round"] = [fragment.next_round for fragment in self.fragments]
        if self.buffer_sync is not None:
            state["buffers"] = self.buffer_sync.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        sizes = [fragment.view.numel for fragment in self.fragments]
        outer, momentum = list(state["outer"]), list(state["outer_momentum"])
        if [o.numel() for o in outer] != sizes or [m.numel() for m in momentum] != sizes:
            raise ProtocolError(f"{self.name}: state has fragments of {[o.numel() for o in outer]} values, "
                                f"this model's are {sizes}")
        super().load_state_dict(state)
        for fragment, o, m, v in zip(self.fragments, outer, momentum, state["versions"]):
            fragment.load(o, m, int(v))
            fragment.exchange = None
        if self.clock is not None:
            self.clock.epoch = state.get("clock_epoch", self.clock.epoch)
            next_round = state.get("next_round", self.versions)
            for fragment, r in zip(self.fragments, next_round):
                fragment.next_round = int(r)
        for e in state["in_flight"]:
            fragment, k = self.fragments[int(e["fragment"])], int(e["round"])
            delta = e["delta"].to(device=self.flat.device, dtype=torch.float32).clone()
            members, weight, merge_at = tuple(str(m) for m in e["members"]), float(e.get("weight", 1.0)), \
                int(e.get("merge_at", 0))
            if fragment.quorum is not None:  # the donor asked for a closing set, not me: fetch the result at merge
                fragment.skip(k)
                fragment.exchange = Exchange(k, members, delta, weight=weight, merge_at=merge_at)
            else:
                fragment.start(k, members, delta, weight, merge_at)
        if self.buffer_sync is not None and "buffers" in state:
            self.buffer_sync.load_state_dict(state["buffers"])
        self._publish()

    def restore_outer(self, step: int, outer: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                      versions: Sequence[int]) -> None:
        """Take this outer state as it was at `step` (fragment by fragment, as `outer` and
        `momentum` read), with no round in flight: a checkpoint written in another layout (a
        replica resharded over another rank count) restores through here."""
        sizes = [fragment.view.numel for fragment in self.fragments]
        if [t.numel() for t in outer] != sizes or [t.numel() for t in momentum] != sizes \
                or len(versions) != len(sizes):
            raise ProtocolError(f"{self.name}: outer state of fragments {[t.numel() for t in outer]} and "
                                f"{len(versions)} versions; this model's fragments are {sizes}")
        for fragment, o, m, v in zip(self.fragments, outer, momentum, versions):
            fragment.load(o.reshape(-1), m.reshape(-1), int(v))
            fragment.exchange = None
        self.step_count = int(step)
        self._publish()

    def eval_model(self) -> nn.Module:
        """A copy of the model holding the outer (global) parameters (with client sampling, a
        peer that waited out the last rounds takes the swarm's first)."""
        self._catch_up_sampled()
        if self._eval is None:
            twin = copy.deepcopy(self.model)
            params = [p for p in twin.parameters() if p.requires_grad]
            self._eval = (twin, [FragmentView(params, fragment.view.fragment) for fragment in self.fragments])
        twin, views = self._eval
        for view, outer in zip(views, self.outer):
            view.write(outer)
        with torch.no_grad():
            for mine, theirs in zip(twin.buffers(), self.model.buffers()):
                mine.copy_(theirs)
        if self.buffer_sync is not None:
            self.buffer_sync.write_averaged(twin)  # the statistics every peer holds since the last sync
        return twin

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "step": self.step_count, "parameters": self.flat.numel,
                "fragment_sizes": [fragment.view.numel for fragment in self.fragments], "versions": self.versions,
                "rounds": self.weight_log["rounds"], "missed_rounds": self.weight_log["missed"],
                "mean_share": self.weight_log["share_sum"] / max(1, self.weight_log["rounds"]),
                **({"rounds_waited": self.weight_log.get("rounds_waited", 0)} if self.config.samples else {}),
                **({"overlap_now": self.clock.overlap()} if self.clock else {})}


@register
class StreamingDiLoCo(DiLoCo, name="streaming-diloco", config_class=StreamingDiLoCoConfig):
    """DiLoCo with fragments on a staggered schedule, overlapped and merged with alpha."""
