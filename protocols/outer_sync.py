"""One fragment of DiLoCo's outer loop (`OuterFragment`), and what each peer's contribution
weighs when peers differ in speed.

A fragment owns what DiLoCo keeps of it: the view onto its slice of the local parameters,
its outer parameters and Nesterov momentum (float32, where `OuterPlacement` puts them), the
round it merges next (its version), its all-reduce and quorum, the exchange it has in flight
and the tokens its next contribution weighs (`TokenLedger`). `DiLoCo` (diloco.py) holds one
per fragment and decides when each sends and merges. Fragment 0's merge carries small rounds
of its own (`SideRounds`: the buffers' average, the drift guard's check); `OuterState` is the
outer state of all fragments as checkpoints keep it.

Peers of different speeds. Each pseudo-gradient travels with its weight, the inner steps it
was computed on, and owners average by weight (equal weights: the plain average, bit for
bit). `sync_every_s` replaces the step schedule with a clock (`fragments.SyncClock`): a
fragment's send falls due at a time, after as many steps as fit, and its merge follows after
as many of the peer's own steps as fit in `overlap_window_share` of a fragment's window (at
least tau), so that fast peers hide the round behind more steps. `quorum` adds a question
before the all-reduce: the round's leader names the members whose contributions it takes
(`collectives/quorum.py`); those average among themselves, the rest fetch the merged fragment
and carry their pseudo-gradient into the next round.

A contribution's weight is the inner steps it was computed on since this peer's last
contribution of that fragment (every batch of a swarm has the same size, so steps count
tokens). With a quorum (collectives/quorum.py) a peer may miss a round's close; its
pseudo-gradient is not lost but carried, and folded into its next contribution of that
fragment, exactly once, with a staleness weight gamma:

    part   = (w d + gamma w_late d_late) / (w + gamma w_late)
    weight = w + gamma w_late

so that in the owners' weighted average the late pseudo-gradient counts as a contribution of
weight gamma w_late of its own. A carry that misses again is carried again (gamma twice, and
so on); one that is in a closing set is spent.
"""
from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives import PendingReduce, ShardedReducer, membership
from starling.collectives.quorum import Closing, QuorumClose
from starling.node.loop import AwakeDeadline
from starling.protocols.diloco_config import DiLoCoConfig
from starling.protocols.fragments import Fragment, FragmentView, SyncClock

if TYPE_CHECKING:
    from starling.collectives.buffers import BufferAverager
    from starling.node.node import Node
    from starling.protocols.guard import DriftGuard

log = logging.getLogger(__name__)
ASK_WAIT_S = 5.0  # past the leader's own deadlines: a backstop for a closing set's future


@dataclass
class Exchange:
    """One fragment's round in flight."""

    round: int
    members: tuple[str, ...]
    delta: torch.Tensor  # my pseudo-gradient as sent (a joiner re-sends the donor's)
    average: torch.Tensor | None = None  # where the average lands
    pending: PendingReduce | None = None  # None: not my round (I joined mid-flight): fetch its result
    # The reducer's error-feedback residuals from just before this round encoded: what a restart
    # restores, so that re-sending `delta` encodes the very packets the round sent.
    residuals_before: dict[str, Any] | None = None
    weight: float = 1.0  # the tokens `delta` was computed on (a late carry's included)
    merge_at: int = 0  # time-based rounds: the step after which it merges
    # With a quorum: the leader's answer, then the set it closed with (None until known)
    asking: concurrent.futures.Future[Closing | None] | None = None
    closing: Closing | None = None
    missed: bool = False  # the round closed without me: `delta` is carried to the next one
    provisional: torch.Tensor | None = None  # eager updates: the outer fragment my own delta would make


def alpha_merge(alpha: float, local: torch.Tensor, outer: torch.Tensor,
                provisional: torch.Tensor | None = None) -> torch.Tensor:
    """Streaming DiLoCo's merge of a global fragment into the local one, alpha local + (1 - alpha)
    outer. After an eager update (`provisional`: the stand-in merged at the send) only the
    difference between the two outer fragments is merged, into `local` in place, so that the
    steps taken meanwhile keep their full size (Kale et al. 2025)."""
    if provisional is not None:
        return local.add_(outer - provisional, alpha=1.0 - alpha)
    return outer if alpha == 0.0 else alpha * local + (1.0 - alpha) * outer


class TokenLedger:
    """One fragment's inner steps since my last contribution, and a late contribution waiting
    to be folded into the next one. Private to this peer (a joiner starts at zero: its first
    contribution weighs the steps it took itself)."""

    def __init__(self, staleness_weight: float) -> None:
        self.gamma = staleness_weight
        self.steps: float = 0  # inner steps, each weighed by the share of a full batch it trained
        self.carry: tuple[torch.Tensor, float] | None = None

    def stepped(self, work: float = 1.0) -> None:
        """One inner step, of `work` full batches' training (1.0 but for a batch partly padding)."""
        self.steps += 1 if work == 1.0 else work  # whole steps stay an int, as checkpoints have held them

    def contribution(self, delta: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The part to send now and its weight; restarts the count."""
        weight, self.steps = float(self.steps), 0
        if self.carry is None:
            return delta, weight
        late, late_weight = self.carry
        stale = self.gamma * late_weight
        if weight + stale <= 0.0:
            return delta, weight
        folded = delta.mul(weight / (weight + stale)).add_(late.to(delta.device), alpha=stale / (weight + stale))
        return folded, weight + stale

    def included(self) -> None:
        """My last contribution is in a closing set: its carry is spent."""
        self.carry = None

    def missed(self, part: torch.Tensor, weight: float) -> None:
        """My last contribution missed its round: carry it (the old carry is in it)."""
        self.carry = (part.detach().clone(), weight)

    def state_dict(self) -> dict[str, Any]:
        carry = None if self.carry is None else {"part": self.carry[0].cpu().clone(), "weight": self.carry[1]}
        return {"steps": self.steps, "carry": carry}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        steps = state.get("steps", self.steps)
        self.steps = int(steps) if float(steps).is_integer() else float(steps)
        carry = state.get("carry")
        self.carry = None if carry is None else (carry["part"].to(torch.float32), float(carry["weight"]))


def ledgers_state(ledgers: Sequence[TokenLedger]) -> dict[str, Any]:
    """The ledgers of all fragments as one checkpoint entry: {steps: [...], carry: [...]}."""
    states = [ledger.state_dict() for ledger in ledgers]
    return {"steps": [s["steps"] for s in states], "carry": [s["carry"] for s in states]}


def load_ledgers_state(ledgers: Sequence[TokenLedger], state: Mapping[str, Any]) -> None:
    steps, carries = list(state.get("steps", ())), list(state.get("carry", ()))
    for f, ledger in enumerate(ledgers):
        ledger.load_state_dict({"steps": steps[f] if f < len(steps) else ledger.steps,
                                "carry": carries[f] if f < len(carries) else None})


class OuterPlacement:
    """Where the outer parameters and momentum live: the model's device, or where
    `DiLoCo.place_state` puts them (pinned host memory beside an accelerator, to spare its
    memory). Shared by every fragment of a peer."""

    def __init__(self, model_device: torch.device) -> None:
        self.model_device = model_device
        self.device = model_device
        self.pin = False

    def move_to(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cpu" and self.model_device.type != "cpu"

    def placed(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as outer state: float32, on the state's device, pinned where that is the host
        beside an accelerator (a copy; the caller's tensor is left as it is)."""
        t = t.to(device=self.device, dtype=torch.float32)
        return t.pin_memory() if self.pin and not t.is_pinned() else t

    def fresh(self, like: torch.Tensor) -> torch.Tensor:
        """A new tensor for the next outer state (`diloco.sync` may be sending the old one)."""
        return torch.empty(like.shape, dtype=like.dtype, device=like.device, pin_memory=self.pin)

    def here(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the model's device (itself when it is there already)."""
        return t.to(self.model_device, non_blocking=t.is_pinned())


class OuterFragment:
    """One fragment in DiLoCo's outer loop: its outer parameters, momentum and version, the
    exchange it has in flight, and what starts, admits, steps and merges that exchange.

    `round_state` gives the digest my parts name of the state I begin each round with (fragment
    0's: the drift guard's, `DriftGuard.round_digest`). `on_skip` is told of every round of this
    fragment that I send nothing in (fragment 0's carries the small rounds that ride on its
    merge: the buffers' average, the drift guard)."""

    def __init__(self, view: FragmentView, reducer: ShardedReducer, quorum: QuorumClose | None,
                 config: DiLoCoConfig, placement: OuterPlacement, me: str, version: int,
                 on_skip: Callable[[int], None] | None = None,
                 round_state: Callable[[], bytes] | None = None) -> None:
        self.index = view.fragment.index
        self.view, self.reducer, self.quorum = view, reducer, quorum
        self.config, self.placement, self.me = config, placement, me
        self.on_skip = on_skip
        self.round_state = round_state  # the digest my parts name of the state I begin a round with
        self.outer = placement.placed(view.read())
        self.momentum = torch.zeros_like(self.outer)
        self.version = version  # the round this fragment merges next
        self.next_round = version  # time-based rounds: the round it sends next
        self.exchange: Exchange | None = None  # the round in flight
        self.last_closing: Closing | None = None  # the latest closing set (None: none came, or no quorum)
        self.ledger = TokenLedger(config.staleness_weight)
        self.recipe: tuple[int | bytes, ...] | None = None  # what my next parts say they came from, signed with them

    # ------------------------------------------------------------------ the outer state
    def place(self) -> None:
        """Move the outer state to where `placement` now says."""
        self.outer, self.momentum = self.placement.placed(self.outer), self.placement.placed(self.momentum)

    def load(self, outer: torch.Tensor, momentum: torch.Tensor, version: int) -> None:
        """Take this outer state (a copy, placed); rounds before `version` closed elsewhere, and
        this peer's quorum never closes one of them again."""
        self.outer = self.placement.placed(outer.detach().clone())
        self.momentum = self.placement.placed(momentum.detach().clone())
        self.version = version
        if self.quorum is not None:
            self.quorum.resume_at(version)

    def adopt(self, outer: torch.Tensor, momentum: torch.Tensor, version: int) -> None:
        """A peer's outer state, fetched: taken unless mine is newer."""
        if version >= self.version:
            self.outer, self.momentum = self.placement.placed(outer), self.placement.placed(momentum)
            self.version = version
            if self.quorum is not None:
                self.quorum.resume_at(version)

    def take_outer(self) -> None:
        """The local fragment becomes the outer one (my local progress is dropped)."""
        self.view.write(self.outer)

    def pseudo_gradient(self) -> torch.Tensor:
        """outer - local, on the model's device."""
        return self.placement.here(self.outer) - self.view.read()

    def outer_step(self, delta: torch.Tensor, commit: bool = True) -> torch.Tensor:
        """Nesterov SGD on the outer fragment, the averaged pseudo-gradient as its gradient, in
        float32 where the outer state lives. New tensors, not in-place updates: `diloco.sync`
        may be sending the old ones. (The same operations in the same order on every peer:
        outer parameters stay bit-identical.) `commit=False`: only return the outer fragment
        this step would make (an eager update's stand-in)."""
        mu, lr, fresh = self.config.outer_momentum, self.config.outer_lr, self.placement.fresh
        delta = delta.to(self.placement.device)
        momentum = torch.mul(self.momentum, mu, out=fresh(self.momentum)).add_(delta)
        outer = torch.mul(momentum, mu, out=fresh(self.outer)).add_(delta).mul_(lr)
        outer = torch.sub(self.outer, outer, out=outer)
        if commit:
            self.outer, self.momentum = outer, momentum
            self.version += 1
        return outer

    def merge_local(self, provisional: torch.Tensor | None = None) -> None:
        """The outer fragment into the local one (`alpha_merge`)."""
        alpha, here = self.config.alpha, self.placement.here
        if provisional is None and alpha == 0.0:  # the outer fragment as it is, without reading the local one
            self.view.write(self.outer)
        else:
            self.view.write(alpha_merge(alpha, self.view.read(), here(self.outer),
                                        None if provisional is None else here(provisional)))

    def merge(self, exchange: Exchange | None, k: int) -> None:
        """Round k's outer step with its average (a shard nobody averaged counts as 0), when
        this fragment's outer state is still at round k; then the merge into the local one."""
        if exchange is not None and exchange.average is not None and self.version == k:
            self.outer_step(exchange.average)
        self.merge_local(exchange.provisional if exchange is not None else None)

    # ------------------------------------------------------------------ the round in flight
    def start(self, k: int, members: tuple[str, ...], delta: torch.Tensor, weight: float = 1.0,
              merge_at: int = 0) -> Exchange:
        """Start averaging `delta` in round k with `members`; the exchange is in flight."""
        self.exchange = self._started(k, members, delta, weight, merge_at)
        return self.exchange

    def ask(self, k: int, members: tuple[str, ...], delta: torch.Tensor, weight: float, merge_at: int) -> None:
        """With a quorum: ask round k's leader for its closing set first (`admit` starts the
        averaging once the set is known)."""
        assert self.quorum is not None
        self.exchange = Exchange(k, members, delta, weight=weight, merge_at=merge_at,
                                 asking=self.quorum.ask(k, members, weight))

    def skip(self, k: int) -> None:
        """I send nothing in round k, nor in the rounds that ride on it: nobody waits for my parts."""
        self.reducer.skip(k)
        if self.on_skip is not None:
            self.on_skip(k)

    def _started(self, k: int, members: tuple[str, ...], delta: torch.Tensor, weight: float,
                 merge_at: int) -> Exchange:
        if (len(members) > 1 and self.me not in members) or delta.numel() != self.view.numel:
            self.skip(k)  # a donor's round that began without me: others may count me in it
            return Exchange(k, members, delta, weight=weight, merge_at=merge_at)
        average = delta.clone()
        before = self.reducer.state_dict() if not self.reducer.codec.lossless else None
        state = self.round_state() if self.round_state is not None and len(members) > 1 else None
        pending = self.reducer.start(k, members, average, weight=weight, state=state, recipe=self.recipe)
        return Exchange(k, members, delta, average, pending, before, weight=weight, merge_at=merge_at)

    def eager_update(self) -> None:
        """Eager updates (Kale et al. 2025): until the average comes, my own pseudo-gradient
        stands in for it. The local fragment merges the outer step it would make now; the
        merge later adds only the difference to the real one (`merge_local`)."""
        assert self.exchange is not None
        self.exchange.provisional = provisional = self.outer_step(self.exchange.delta, commit=False)
        self.view.write(alpha_merge(self.config.alpha, self.view.read(), self.placement.here(provisional)))

    def due_round(self, clock: SyncClock, now: float) -> int | None:
        """Time-based rounds: the round whose exchange starts now, if any (rounds that went by
        during a step so long that they fell due one after another are skipped)."""
        k = max(self.next_round, self.version)
        if self.exchange is not None or not clock.should_send(self.index, k, now):
            return None
        while clock.should_send(self.index, k + 1, now):
            self.skip(k)
            k += 1
        self.next_round = k + 1
        return k

    def merges_by(self, s: int) -> bool:
        """Time-based rounds: whether the exchange in flight merges after step s."""
        return self.exchange is not None and self.exchange.merge_at <= s

    def answered(self) -> bool:
        """Whether the leader's answer to my question has come (training need not wait for it)."""
        return self.exchange is not None and self.exchange.asking is not None and self.exchange.asking.done()

    def admit(self) -> None:
        """The leader's answer is in (or a backstop ran out): average with the closing set,
        or, left out of it, carry my contribution into the fragment's next round."""
        exchange = self.exchange
        assert exchange is not None and exchange.asking is not None
        c = self.config
        try:
            closing = exchange.asking.result(
                timeout=AwakeDeadline.STRETCH * (c.round_timeout_s + c.reply_grace_s) + ASK_WAIT_S)
        except Exception as exc:
            log.warning("%s: no closing set for fragment %d round %d: %s", self.me, self.index, exchange.round, exc)
            closing = None
        exchange.asking, exchange.closing = None, closing
        self.last_closing = closing
        if closing is None or self.me not in closing.members:
            exchange.missed = True
            self.ledger.missed(exchange.delta, exchange.weight)
            return
        self.ledger.included()
        started = self._started(exchange.round, closing.members, exchange.delta, exchange.weight, exchange.merge_at)
        exchange.members, exchange.average, exchange.pending = closing.members, started.average, started.pending
        exchange.residuals_before = started.residuals_before

    def in_flight_state(self) -> dict[str, Any] | None:
        """The exchange in flight as a checkpoint or a joiner takes it (None: none)."""
        e = self.exchange
        if e is None:
            return None
        return {"fragment": self.index, "round": e.round, "members": list(e.members), "delta": e.delta.clone(),
                "weight": e.weight, "merge_at": e.merge_at}

    def resume(self, entry: Mapping[str, Any], device: torch.device) -> None:
        """Take up the exchange in flight that `in_flight_state` wrote (a checkpoint's or a
        donor's): re-send its pseudo-gradient, or, with a quorum (the donor asked for a closing
        set, not me), fetch the round's result at its merge."""
        k, delta = int(entry["round"]), entry["delta"].to(device=device, dtype=torch.float32).clone()
        members, weight = tuple(str(m) for m in entry["members"]), float(entry.get("weight", 1.0))
        merge_at = int(entry.get("merge_at", 0))
        if self.quorum is not None:
            self.skip(k)
            self.exchange = Exchange(k, members, delta, weight=weight, merge_at=merge_at)
        else:
            self.start(k, members, delta, weight, merge_at)

    def peer_joined(self, peer_id: str) -> None:
        if self.quorum is not None:
            self.quorum.peer_joined(peer_id)

    def peer_left(self, peer_id: str) -> None:
        if self.quorum is not None:
            self.quorum.peer_left(peer_id)

    def residuals(self) -> dict[str, Any]:
        """My reducer's residuals; with a round in flight, as they were before it encoded (a
        restart re-sends that round and encodes it again)."""
        before = self.exchange.residuals_before if self.exchange is not None else None
        return before if before is not None else self.reducer.state_dict()


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


@dataclass(frozen=True)
class OuterState:
    """DiLoCo's outer state, as checkpoints keep it: the step, and per fragment its version (the
    round it merges next), outer parameters and momentum (flat float32 vectors), with the layout
    that maps those vectors onto the trainable parameters (each fragment's runs of their flat
    vector). The tensors are the peer's own: it replaces them at every outer step and never
    changes them in place, so a state read between steps stays as it was read."""

    step: int
    versions: tuple[int, ...]
    outer: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]
    layout: tuple[Fragment, ...]

    def misfit(self, layout: Sequence[Fragment]) -> str | None:
        """Why this state does not fit fragments laid out as `layout` (None: it fits)."""
        sizes = [fragment.numel for fragment in layout]
        if [t.numel() for t in self.outer] != sizes or [t.numel() for t in self.momentum] != sizes \
                or len(self.versions) != len(sizes):
            return (f"outer state of fragments of {[t.numel() for t in self.outer]} values and "
                    f"{len(self.versions)} versions; this model's fragments are {sizes}")
        if tuple(self.layout) != tuple(layout):
            return "outer state laid out over other runs of the parameters (another fragment_assignment or model)"
        return None

    def scatter(self, flats: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
        """Write `flats` (one per fragment, as `outer` or `momentum`) into `params`: tensors of
        the trainable parameters' shapes, in their order."""
        for fragment, flat in zip(self.layout, flats):
            FragmentView(params, fragment).write(flat)

    def gather(self, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """What `params` (tensors of the trainable parameters' shapes, in their order) hold,
        fragment by fragment: the inverse of `scatter`."""
        return tuple(FragmentView(params, fragment).read() for fragment in self.layout)
