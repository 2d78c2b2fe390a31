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
each sends and merges; the fragment does the arithmetic, and weighs what it sends when peers
differ in speed (weights, time-based rounds, quorums: see there). A peer that rounds went on
without (a joiner, one that fell behind, one not drawn by client sampling) takes them from
peers that merged them (`catch_up.py`, `sampling.py`).

Every peer decodes the same averaged packets, so outer parameters stay bit-identical. A shard
whose average did not come back (its owner died) counts as 0 on every member alike, so
survivors keep agreeing instead of each applying its own pseudo-gradient there. Every
`check_every` syncs of fragment 0 the drift guard (`guard.py`) checks that they do, and right
after any round of fragment 0 whose owners saw its members begin it with different outer
states (a round whose members' views differed, the round before).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from starling.collectives import ReduceResult, ShardedReducer, membership
from starling.collectives.buffers import BufferAverager
from starling.collectives.quorum import Closing, QuorumClose
from starling.collectives.retention import KeptPart
from starling.common.text import few
from starling.node.node import Node
from starling.protocols.backprop import BackpropProtocol
from starling.protocols.base import LossFn, ProtocolError, StepClock, StepReport, register
from starling.protocols.catch_up import SYNC_TOPIC, CatchUp
from starling.protocols.diloco_config import DiLoCoConfig, StreamingDiLoCoConfig
from starling.protocols.fragments import FragmentSchedule, FragmentView, SyncClock, count_layers, split_fragments
from starling.protocols.guard import State
from starling.protocols.optim import make_defences, make_optimizer, make_secure, reduce_timeouts
from starling.protocols.outer_sync import (
    Exchange,
    OuterFragment,
    OuterPlacement,
    OuterState,
    SideRounds,
    ledgers_state,
    load_ledgers_state,
)
from starling.protocols.sampling import ClientSampling
from starling.protocols.verification import PseudoVerifier

log = logging.getLogger(__name__)

TOPIC_PREFIX = "diloco."
MISSES_BEFORE_WARNING = 3  # rounds in a row a peer misses before it says why that may keep happening


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
            node, model, f"{TOPIC_PREFIX}buffers", timeouts, self.is_open, config.max_owners,
            config.min_shard_numel)
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
                                         min_shard_numel=config.min_shard_numel,
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
        self._last_loss = float("nan")  # reported by a step that trained nothing (not drawn)
        # Checks of the others' pseudo-gradients by the loss they take off their stated batches
        # (verification.py): drawn after each round, before its outer step.
        self.verifier = PseudoVerifier(node, model, config.verify_rate, config.verify_batches,
                                       max_span=math.ceil(config.weight_cap * config.sync_every) + config.overlap_steps
                                       ) if config.verify_rate > 0.0 else None
        self.catching = CatchUp(node, config, self.fragments, self.schedule, self.clock, self.is_open)
        self.sampling = ClientSampling(node, config, self.catching, self.is_open)
        self._publish()
        self._serve({SYNC_TOPIC: self.catching.serve})

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

    # ------------------------------------------------------------------ client sampling (sampling.py)
    def _wait_step(self, clock: StepClock) -> StepReport:
        """A step of a round this peer was not drawn for: no compute and no traffic. It takes
        the swarm's model when it is next drawn (`ClientSampling.catch_up`), or is evaluated."""
        t = self.step_count
        s = self.step_count = t + 1
        members = self.sampling.members(t // self.config.sync_every)
        for fragment, _ in self._sends_at(s):
            fragment.exchange = None
        for _, r in self._merges_at(s):
            self.sampling.behind = (r + 1, members)  # the swarm merges round r without me
            self.weight_log["rounds_waited"] = self.weight_log.get("rounds_waited", 0) + 1
            self.sampling.await_round(r + 1, members)  # keep time with the round, without its traffic
        self._last_step_end = time.time()
        return self._report(t, self._last_loss, clock, peers=len(members), sampled=False)

    # ------------------------------------------------------------------ training thread
    def step(self, loss_fn: LossFn) -> StepReport:
        if self.config.samples:
            if not self.sampling.drawn(self.step_count):
                return self._wait_step(self._begin_step())
            if self.sampling.catch_up():  # the rounds that went on without me, if any
                self._publish()
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
        work, self.next_step_work = self.next_step_work, 1.0  # `weigh_next_step`: a batch partly padding
        for fragment in self.fragments:
            fragment.ledger.stepped(work)
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
        members = self.sampling.members(k)
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
            self.catching.fetch_merged(fragment, k + 1, membership(self.node))
        elif exchange.pending is None:
            self.catching.fetch_merged(fragment, k + 1, exchange.members)
        else:
            result = exchange.pending.wait()
            if result.ahead > k:
                log.info("%s: fragment %d round %d closed without me (the swarm is in round %d); catching up",
                         self.node.peer_id, f, k, result.ahead)
                self.step_count = self.catching.catch_up(fragment, k, exchange.members, self.step_count)
                return result
            if result.lost:
                log.warning("%s: %s round %d went on without %s", self.node.peer_id, fragment.reducer.topic, k,
                            few(result.lost))
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
        """The fragment's round closed without me (my part is carried): count it, and take the
        merged fragment (`CatchUp.missed`)."""
        self.weight_log["rounds"] += 1
        self.weight_log["missed"] += 1
        self.weight_log["in_a_row"] = in_a_row = self.weight_log.get("in_a_row", 0) + 1
        if in_a_row == MISSES_BEFORE_WARNING and self.clock is None:
            log.warning("%s: %d rounds in a row closed without me: with step-based rounds a peer slower than "
                        "the quorum reaches every round after it closed, and its work never lands; "
                        "sync_every_s (time-based rounds) brings it in", self.node.peer_id, in_a_row)
        self.catching.missed(fragment, exchange)

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

    def _publish(self) -> None:
        self.catching.publish(self.step_count)

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
            fragment.peer_joined(peer_id)

    def on_peer_left(self, peer_id: str) -> None:
        super().on_peer_left(peer_id)
        for fragment in self.fragments:
            fragment.peer_left(peer_id)

    # ------------------------------------------------------------------ state and evaluation
    def outer_state(self) -> OuterState:
        """The outer state as it stands (what every checkpoint keeps of this protocol, see
        `OuterState`): read between steps, it is the state after the last one."""
        return OuterState(self.step_count, tuple(self.versions), tuple(self.outer), tuple(self.momentum),
                          tuple(fragment.view.fragment for fragment in self.fragments))

    def load_outer_state(self, state: OuterState) -> None:
        """Take this outer state and its step, with no round in flight (a checkpoint written in
        another layout, a replica resharded over another rank count, restores through here).
        One that does not fit this model is refused (ProtocolError) and changes nothing."""
        self._check_outer_state(state)
        for fragment, o, m, v in zip(self.fragments, state.outer, state.momentum, state.versions):
            fragment.load(o.reshape(-1), m.reshape(-1), int(v))
            fragment.exchange = None
        self.step_count = int(state.step)
        self._publish()

    def _check_outer_state(self, state: OuterState) -> None:
        why = state.misfit(tuple(fragment.view.fragment for fragment in self.fragments))
        if why is not None:
            raise ProtocolError(f"{self.name}: {why}")

    def state_dict(self) -> dict[str, Any]:
        state, outer = super().state_dict(), self.outer_state()
        state["outer"] = [o.clone() for o in outer.outer]
        state["outer_momentum"] = [m.clone() for m in outer.momentum]
        state["versions"] = list(outer.versions)
        state.update(self.catching.rounds_state())  # the rounds in flight, and the clock's
        if self.buffer_sync is not None:
            state["buffers"] = self.buffer_sync.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        outer = dataclasses.replace(self.outer_state(), step=int(state["step"]), outer=tuple(state["outer"]),
                                    momentum=tuple(state["outer_momentum"]),
                                    versions=tuple(int(v) for v in state["versions"]))
        self._check_outer_state(outer)  # before anything changes
        super().load_state_dict(state)
        self.load_outer_state(outer)
        self.catching.load_rounds_state(state, self.flat.device)
        if self.buffer_sync is not None and "buffers" in state:
            self.buffer_sync.load_state_dict(state["buffers"])
        self._publish()

    def eval_model(self) -> nn.Module:
        """A copy of the model holding the outer (global) parameters (with client sampling, a
        peer that waited out the last rounds takes the swarm's first)."""
        if self.sampling.catch_up():
            self._publish()
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
