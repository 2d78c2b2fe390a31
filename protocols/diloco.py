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

Every peer decodes the same averaged packets, so outer parameters stay bit-identical. A shard
whose average did not come back (its owner died) counts as 0 on every peer that missed it,
so survivors keep agreeing instead of each applying its own pseudo-gradient there.

Elastic membership. A joiner loads a peer's `state_dict` (outer parameters, momentum, round,
inner optimizer state, rounds in flight). For a round in flight it takes part in (its member
list names the joiner), it sends the donor's pseudo-gradient; for one it does not, it fetches
the outer fragment after that merge from a member ("diloco.sync"). A peer that learns it has
fallen a round behind fetches the whole outer state and jumps to that peer's step. Either way
it tells the others which rounds it sends nothing in (`ShardedReducer.skip`): members that
already counted it in would otherwise wait for its part until the round timeout.

Peers of different speeds (issue 20, `outer_sync.py`). Each pseudo-gradient travels with its
weight, the inner steps it was computed on, and owners average by weight (equal weights: the
plain average, bit for bit). `sync_every_s` replaces the step schedule with a clock
(`fragments.SyncClock`): a fragment's send falls due at a time, after as many steps as fit,
and its merge follows after as many of the peer's own steps as fit in `overlap_window_share`
of a fragment's window (at least tau), so that fast peers hide the round behind more steps.
`quorum` adds a question before the all-reduce: the round's leader names the members whose
contributions it takes (`collectives/quorum.py`); those average among themselves, the rest
fetch the merged fragment and carry their pseudo-gradient into the next round.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from starling.collectives import ReduceResult, ShardedReducer, membership
from starling.collectives.agreement import AgreementCheck
from starling.collectives.buffers import BufferAverager
from starling.collectives.quorum import QuorumClose
from starling.node.node import Node
from starling.node.rpc import Refusal, Reply, refusal
from starling.node.wire import Message
from starling.protocols.backprop import BackpropProtocol
from starling.protocols.base import LossFn, ProtocolError, StepClock, StepReport, register
from starling.protocols.diloco_config import DiLoCoConfig, StreamingDiLoCoConfig
from starling.protocols.fragments import FragmentSchedule, FragmentView, SyncClock, count_layers, split_fragments
from starling.protocols.optim import make_optimizer, reduce_timeouts
from starling.protocols.outer_sync import (
    Exchange,
    OuterSyncRounds,
    Published,
    TokenLedger,
    alpha_merge,
    read_sync_reply,
)

log = logging.getLogger(__name__)

TOPIC_PREFIX = "diloco."
SYNC_TOPIC = "diloco.sync"  # outer parameters and momentum of some fragments, as a peer holds them now


@register
class DiLoCo(OuterSyncRounds, BackpropProtocol, name="diloco", config_class=DiLoCoConfig, topic_prefix=TOPIC_PREFIX):
    config: DiLoCoConfig
    runs_on_accelerators = True
    local_inner_steps = True
    optimizer_key = "inner_optimizer"

    def __init__(self, node: Node, model: nn.Module, config: DiLoCoConfig) -> None:
        super().__init__(node, model, config)
        try:
            fragments = split_fragments(self.flat.numel, count_layers(model), config.fragments,
                                        config.fragment_assignment)
        except ValueError as exc:
            raise ProtocolError(f"{self.name}: {exc}") from None
        self.views = [FragmentView(self.flat.params, f) for f in fragments]
        self.schedule = FragmentSchedule(config.sync_every, config.fragments, config.overlap_steps)
        # Outer parameters and momentum (float32) live on the model's device, or where
        # place_state() puts them (pinned CPU memory, to spare an accelerator's memory).
        self.state_device = self.flat.device
        self._pin = False
        self.outer = [view.read() for view in self.views]
        self.momentum = [torch.zeros_like(o) for o in self.outer]
        # time-based inner rounds (sync_every_s), or None: the step schedule
        self.clock = SyncClock(config.sync_every_s, config.fragments, config.overlap_steps,
                               config.overlap_window_share) if config.sync_every_s else None
        # the round each fragment merges next: its outer parameters' version
        self.versions = [0 if self.clock else self.schedule.first_round(f) for f in range(len(self.views))]
        self.next_round = list(self.versions)  # time-based: the round each fragment sends next
        self.in_flight: dict[int, Exchange] = {}
        self.ledger = TokenLedger(len(self.views), config.staleness_weight)
        # my share of each round's average (0 in a round that closed without me): what I weigh
        self.weight_log = {"rounds": 0, "missed": 0, "share_sum": 0.0}
        self.last_closing: dict[int, Any] = {}
        self.last_shares: dict[str, float] = {}
        self._last_step_end: float | None = None
        timeouts = reduce_timeouts(config)
        self.reducers = [ShardedReducer(node, f"{TOPIC_PREFIX}f{i}", view.numel, config.compressor, timeouts,
                                        self.is_open, part_feedback=config.error_feedback,
                                        average_compressor=config.average_compressor or None,
                                        part_feedback_decay=config.error_feedback_decay)
                         for i, view in enumerate(self.views)]
        self.quorums = [QuorumClose(node, f"{TOPIC_PREFIX}q{i}", config.quorum, config.quorum_grace_s, timeouts,
                                    self.is_open, salt=i) for i in range(len(self.views))] if config.quorum else []
        self.buffer_sync = None if config.local_buffers else BufferAverager(
            node, model, f"{TOPIC_PREFIX}buffers", timeouts, self.is_open)
        self.agreement = AgreementCheck(node, f"{TOPIC_PREFIX}agree", timeouts, self.is_open) \
            if config.check_every else None
        self.side_reducers = [*(self.buffer_sync.reducers if self.buffer_sync else ()),
                              *((self.agreement.reducer,) if self.agreement else ())]
        self._eval: tuple[nn.Module, list[FragmentView]] | None = None
        self._publish()
        self._serve({SYNC_TOPIC: self._on_sync})

    def place_state(self, device: torch.device | str) -> None:
        """Keep the outer parameters and momentum on `device`. With the model on an accelerator
        and `device` the CPU, they sit in pinned host memory (as torchft offers): each sync
        copies one fragment to the accelerator to form its pseudo-gradient, and takes the
        outer step on the CPU, so the accelerator holds only the model and inner optimizer."""
        self.state_device = torch.device(device)
        self._pin = self.state_device.type == "cpu" and self.flat.device.type != "cpu"
        self.outer = [self._placed(o) for o in self.outer]
        self.momentum = [self._placed(m) for m in self.momentum]
        self._publish()

    def start_from(self, model: nn.Module) -> None:
        """The outer parameters start from `model`'s (full-precision) values, not from this
        peer's model rounded to its dtype: a bfloat16 peer and a float32 peer then hold the
        same outer parameters from the start."""
        params = [p for p in model.parameters() if p.requires_grad]
        self.outer = [self._placed(FragmentView(params, view.fragment).read()) for view in self.views]
        self._publish()

    def _placed(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as outer state: float32, on the state's device, pinned where that is the host
        beside an accelerator (a copy; the caller's tensor is left as it is)."""
        t = t.to(device=self.state_device, dtype=torch.float32)
        return t.pin_memory() if self._pin and not t.is_pinned() else t

    def _fresh(self, like: torch.Tensor) -> torch.Tensor:
        """A new tensor for the next outer state (`diloco.sync` may be sending the old one)."""
        return torch.empty(like.shape, dtype=like.dtype, device=like.device, pin_memory=self._pin)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        return make_optimizer(self.flat.params, c.inner_optimizer, c.lr, c.inner_momentum, c.weight_decay)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The inner optimizer (the paper's name for it): the one that takes the local steps."""
        return self.optimizer

    # ------------------------------------------------------------------ training thread
    def step(self, loss_fn: LossFn) -> StepReport:
        clock, began = self._begin_step(), time.time()
        if self.clock is not None:
            self.clock.started(began)
        with clock.computing():
            loss = self._backprop(loss_fn)
            self.inner.step()
        if self.clock is not None:  # a step's time: from the last one's end (data, emulated slowness) to now
            self.clock.stepped(time.time() - (self._last_step_end or began))

        t = self.step_count
        s = self.step_count = t + 1
        self.ledger.stepped()
        result: ReduceResult | None = None
        for f, k in self._sends_at(s):
            self._send(f, k)
        self._admit_answered()
        for f, k in self._merges_at(s):
            result = self._merge(f, k, clock) or result
        self._publish()
        self._last_step_end = time.time()
        if result is None:
            return self._report(t, loss, clock)
        return self._report(t, loss, clock, synced=result.synced, peers=result.peers, lost=result.lost)

    def _send(self, f: int, k: int) -> None:
        """Start averaging fragment f's pseudo-gradient (weighted by the steps it took, a late
        one folded in); training goes on until its merge. With a quorum, first ask the
        round's leader for its closing set."""
        delta = self._here(self.outer[f]) - self.views[f].read()  # on the model's device
        part, weight = self.ledger.contribution(f, delta)
        members = membership(self.node)
        # a step count, whichever rounds: a checkpoint or a joiner takes it as it is
        merge_at = self.step_count + (self.clock.overlap() if self.clock else self.config.overlap_steps)
        if self.quorums and len(members) > 1:
            self.in_flight[f] = Exchange(f, k, members, part, weight=weight, merge_at=merge_at,
                                         asking=self.quorums[f].ask(k, members, weight))
        else:
            self.in_flight[f] = self._start(f, k, members, part, weight, merge_at)
        if self.config.eager_updates:
            self._eager_update(self.in_flight[f])

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the model's device (itself when it is there already)."""
        return t.to(self.flat.device, non_blocking=t.is_pinned())

    def _start(self, f: int, k: int, members: tuple[str, ...], delta: torch.Tensor, weight: float = 1.0,
               merge_at: int = 0) -> Exchange:
        if (len(members) > 1 and self.node.peer_id not in members) or delta.numel() != self.views[f].numel:
            self._skip(f, k)  # a donor's round that began without me: others may count me in it
            return Exchange(f, k, members, delta, weight=weight, merge_at=merge_at)
        average = delta.clone()
        before = self.reducers[f].state_dict() if not self.reducers[f].codec.lossless else None
        pending = self.reducers[f].start(k, members, average, weight=weight)
        if len(members) > 1:
            # start() has encoded my parts, so the buffer is free until wait(): any shard
            # still NaN after it was not averaged
            average.fill_(math.nan)
        return Exchange(f, k, members, delta, average, pending, before, weight=weight, merge_at=merge_at)

    def _merge(self, f: int, k: int, clock: StepClock) -> ReduceResult | None:
        """Wait for fragment f's average, take the outer step, merge it into the local parameters."""
        exchange = self.in_flight.pop(f, None)
        result = None
        if exchange is not None and exchange.asking is not None:
            self._admit(exchange)  # waits for the leader's set
        if exchange is not None and exchange.missed:
            self._missed(exchange)
            return None
        if exchange is None or exchange.round != k:
            log.warning("%s: no exchange of fragment %d round %d in flight; fetching it", self.node.peer_id, f, k)
            self._skip(f, k)
            self._fetch_merged(f, k + 1, membership(self.node))
        elif exchange.pending is None:
            self._fetch_merged(f, k + 1, exchange.members)
        else:
            result = exchange.pending.wait()
            if result.ahead > k:
                log.info("%s: fragment %d round %d closed without me (the swarm is in round %d); catching up",
                         self.node.peer_id, f, k, result.ahead)
                self._catch_up(f, k, exchange.members)
                return result
            if result.lost:
                log.warning("%s: %s round %d went on without %s", self.node.peer_id, self.reducers[f].topic, k,
                            list(result.lost))
            self._log_share(result, exchange.members)
        with clock.computing():
            if exchange is not None and exchange.average is not None and self.versions[f] == k:
                average = exchange.average.nan_to_num_(nan=0.0)
                self._outer_step(f, average)
            self._merge_local(f, exchange.provisional if exchange is not None else None)
        if f == 0 and exchange is not None and exchange.pending is not None:  # the same members, the same rounds
            if self.buffer_sync is not None:
                self.buffer_sync.sync(k, exchange.members)
            if self.agreement is not None and k % self.config.check_every == 0:
                self._check_agreement(k, exchange.members)
        return result

    def _check_agreement(self, k: int, members: tuple[str, ...]) -> None:
        """Round k's members compare digests of their outer parameters; on a mismatch every
        member but the first takes the first member's outer state (the drift guard)."""
        assert self.agreement is not None
        if self.agreement.agree(k, members, self.outer) is not False:
            return
        source = members[0]
        if source == self.node.peer_id:
            log.warning("%s: outer parameters differ across the swarm after round %d; the others take mine",
                        self.node.peer_id, k)
            return
        log.warning("%s: my outer parameters differ from the swarm's after round %d; taking %s's",
                    self.node.peer_id, k, source)
        got = self._fetch(list(range(len(self.views))), [source], lambda versions: versions == tuple(self.versions))
        if got is None:
            log.warning("%s: could not fetch %s's outer state; checking again at the next sync", self.node.peer_id,
                        source)
            return
        self._adopt(got, range(len(self.views)))
        for view, outer in zip(self.views, self.outer):
            view.write(outer)
        self._publish()

    def _outer_step(self, f: int, delta: torch.Tensor, commit: bool = True) -> torch.Tensor:
        """Nesterov SGD on the outer fragment, the averaged pseudo-gradient as its gradient, in
        float32 where the outer state lives. New tensors, not in-place updates: `diloco.sync`
        may be sending the old ones. (The same operations in the same order on every peer:
        outer parameters stay bit-identical.) `commit=False`: only return the outer fragment
        this step would make (an eager update's stand-in)."""
        mu, lr = self.config.outer_momentum, self.config.outer_lr
        delta = delta.to(self.state_device)
        momentum = torch.mul(self.momentum[f], mu, out=self._fresh(self.momentum[f])).add_(delta)
        outer = torch.mul(momentum, mu, out=self._fresh(self.outer[f])).add_(delta).mul_(lr)
        outer = torch.sub(self.outer[f], outer, out=outer)
        if commit:
            self.outer[f], self.momentum[f] = outer, momentum
            self.versions[f] += 1
        return outer

    def _merge_local(self, f: int, provisional: torch.Tensor | None = None) -> None:
        """local = alpha local + (1 - alpha) outer; after an eager update (`provisional`, the
        stand-in merged at the send) only the difference between the two outer fragments is
        merged, so the steps taken meanwhile keep their full size (Kale et al. 2025)."""
        alpha = self.config.alpha
        if provisional is not None:
            correction = self._here(self.outer[f]) - self._here(provisional)
            self.views[f].write(self.views[f].read().add_(correction, alpha=1.0 - alpha))
        elif alpha == 0.0:  # the outer fragment as it is, without reading the local one
            self.views[f].write(self.outer[f])
        else:
            self.views[f].write(alpha_merge(alpha, self.views[f].read(), self._here(self.outer[f])))

    # ------------------------------------------------------------------ catching up
    def _fetch_merged(self, f: int, version: int, sources: Sequence[str]) -> None:
        """I missed fragment f's round: take its outer fragment from a member that merged it."""
        got = self._fetch([f], sources, lambda versions: versions[f] >= version)
        if got is None:
            log.warning("%s: no peer had fragment %d at version %d; keeping mine", self.node.peer_id, f, version)
            return
        self._adopt(got, [f])

    def _catch_up(self, f: int, k: int, sources: Sequence[str]) -> None:
        """Fragment f's round k closed without me: take the outer state and step of a peer
        that merged it, and join the rounds that follow."""
        got = self._fetch(list(range(len(self.views))), sources, lambda versions: versions[f] > k)
        if got is None:
            log.warning("%s: could not fetch the swarm's outer state; staying at step %d",
                        self.node.peer_id, self.step_count)
            return
        self.in_flight.clear()  # my rounds were refused as late
        before = list(self.versions)  # the round of each fragment I would have merged next
        self._adopt(got, range(len(self.views)))
        for view, outer in zip(self.views, self.outer):
            view.write(outer)  # my local progress belongs to rounds that closed without me
        if self.clock is not None:  # time-based rounds: the clock says which round is next
            for g in range(len(self.views)):
                for r in range(before[g], self.versions[g]):
                    self._skip(g, r)
            return
        self.step_count = max(self.step_count, got.step)
        for g, r in self.schedule.in_flight_at(got.step):  # started before I arrived: fetched at merge
            self.in_flight[g] = Exchange(g, r, tuple(sources), torch.zeros(0))
        for g in range(len(self.views)):
            # the rounds I jumped over, or fetch at their merge: members that count me in them
            # stop waiting for my part (only the latest two can still be open anywhere)
            first_mine = self.in_flight[g].round + 1 if g in self.in_flight else self.versions[g]
            for r in range(max(before[g], first_mine - 2), first_mine):
                self._skip(g, r)

    def _skip(self, f: int, k: int) -> None:
        """I send nothing in fragment f's round k, nor in the rounds that ride on fragment 0's
        merge (buffers, the drift guard's check): nobody waits for my parts there."""
        self.reducers[f].skip(k)
        if f == 0 and self.buffer_sync is not None:
            self.buffer_sync.skip(k, membership(self.node))
        if f == 0 and self.agreement is not None and k % self.config.check_every == 0:
            self.agreement.reducer.skip(k)

    def _adopt(self, got: Published, fragments: Sequence[int]) -> None:
        for f in fragments:
            if got.versions[f] >= self.versions[f]:
                self.outer[f], self.momentum[f] = self._placed(got.outer[f]), self._placed(got.momentum[f])
                self.versions[f] = got.versions[f]

    def _fetch(self, fragments: list[int], sources: Sequence[str],
               ready: Callable[[tuple[int, ...]], bool]) -> Published | None:
        """Ask `sources` in turn for these fragments until one answers with `ready(versions)`
        true, or the round timeout (plus grace) has passed."""
        me, sizes = self.node.peer_id, [self.views[f].numel for f in fragments]
        peers = [p for p in sources if p != me]
        deadline = time.monotonic() + self.config.round_timeout_s + self.config.reply_grace_s
        while peers and time.monotonic() < deadline:
            for peer in peers:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:  # a bounded wait per peer, so that a dead one leaves time to ask the others
                    msg = self.node.request(peer, SYNC_TOPIC, {"fragments": fragments},
                                            timeout_s=min(remaining, max(1.0, self.config.round_timeout_s / 4)))
                    got = read_sync_reply(msg, fragments, sizes, len(self.views))
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
            fragments = [int(f) for f in msg.body["fragments"]]
            if not all(0 <= f < len(state.outer) for f in fragments):
                raise ValueError(fragments)
        except (TypeError, KeyError, ValueError):
            return refusal(Refusal.MALFORMED, f"body must be {{fragments: [0..{len(state.outer) - 1}]}}")
        payload = [t for f in fragments for t in (state.outer[f], state.momentum[f])]
        return Reply({"ok": True, "step": state.step, "versions": list(state.versions), "fragments": fragments},
                     payload)

    def private_state(self) -> dict[str, Any]:
        """Each fragment's residuals; for a fragment with a round in flight, as they were before
        it encoded (load_state_dict re-sends that round and encodes it again). And my tokens
        since my last contributions, with any late one carried: a joiner starts from none."""
        states = []
        for f, reducer in enumerate(self.reducers):
            exchange = self.in_flight.get(f)
            before = exchange.residuals_before if exchange is not None else None
            states.append(before if before is not None else reducer.state_dict())
        return {"reducers": states, "ledger": self.ledger.state_dict()}

    def load_private_state(self, state: Mapping[str, Any]) -> None:
        super().load_private_state(state)
        if "ledger" in state:
            self.ledger.load_state_dict(state["ledger"])

    def on_peer_joined(self, peer_id: str) -> None:
        super().on_peer_joined(peer_id)
        for quorum in self.quorums:
            quorum.peer_joined(peer_id)

    def on_peer_left(self, peer_id: str) -> None:
        super().on_peer_left(peer_id)
        for quorum in self.quorums:
            quorum.peer_left(peer_id)

    # ------------------------------------------------------------------ state and evaluation
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["outer"] = [o.clone() for o in self.outer]
        state["outer_momentum"] = [m.clone() for m in self.momentum]
        state["versions"] = list(self.versions)
        state["in_flight"] = [{"fragment": e.fragment, "round": e.round, "members": list(e.members),
                               "delta": e.delta.clone(), "weight": e.weight, "merge_at": e.merge_at}
                              for e in self.in_flight.values()]
        if self.clock is not None:
            state["clock_epoch"] = self.clock.epoch  # the swarm's: a joiner's rounds fall due with the others'
            state["next_round"] = list(self.next_round)
        if self.buffer_sync is not None:
            state["buffers"] = self.buffer_sync.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        sizes = [view.numel for view in self.views]
        outer, momentum = list(state["outer"]), list(state["outer_momentum"])
        if [o.numel() for o in outer] != sizes or [m.numel() for m in momentum] != sizes:
            raise ProtocolError(f"{self.name}: state has fragments of {[o.numel() for o in outer]} values, "
                                f"this model's are {sizes}")
        super().load_state_dict(state)
        self.outer = [self._placed(o.detach().clone()) for o in outer]
        self.momentum = [self._placed(m.detach().clone()) for m in momentum]
        self.versions = [int(v) for v in state["versions"]]
        self.in_flight = {}
        if self.clock is not None:
            self.clock.epoch = state.get("clock_epoch", self.clock.epoch)
            self.next_round = [int(r) for r in state.get("next_round", self.versions)]
        for e in state["in_flight"]:
            f, k = int(e["fragment"]), int(e["round"])
            delta = e["delta"].to(device=self.flat.device, dtype=torch.float32).clone()
            members, weight, merge_at = tuple(str(m) for m in e["members"]), float(e.get("weight", 1.0)), \
                int(e.get("merge_at", 0))
            if self.quorums:  # the donor asked for a closing set, not me: fetch the round's result at merge
                self._skip(f, k)
                self.in_flight[f] = Exchange(f, k, members, delta, weight=weight, merge_at=merge_at)
            else:
                self.in_flight[f] = self._start(f, k, members, delta, weight, merge_at)
        if self.buffer_sync is not None and "buffers" in state:
            self.buffer_sync.load_state_dict(state["buffers"])
        self._publish()

    def eval_model(self) -> nn.Module:
        """A copy of the model holding the outer (global) parameters."""
        if self._eval is None:
            twin = copy.deepcopy(self.model)
            params = [p for p in twin.parameters() if p.requires_grad]
            self._eval = (twin, [FragmentView(params, view.fragment) for view in self.views])
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
                "fragment_sizes": [view.numel for view in self.views], "versions": list(self.versions),
                "rounds": self.weight_log["rounds"], "missed_rounds": self.weight_log["missed"],
                "mean_share": self.weight_log["share_sum"] / max(1, self.weight_log["rounds"]),
                **({"overlap_now": self.clock.overlap()} if self.clock else {})}


@register
class StreamingDiLoCo(DiLoCo, name="streaming-diloco", config_class=StreamingDiLoCoConfig):
    """DiLoCo with fragments on a staggered schedule, overlapped and merged with alpha."""
