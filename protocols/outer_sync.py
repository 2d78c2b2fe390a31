"""One fragment's outer-sync round as DiLoCo runs it, and what each peer's contribution weighs
(issue 20: peers of different speeds).

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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from starling.collectives import PendingReduce, ReduceResult, membership
from starling.collectives.quorum import Closing
from starling.node.loop import AwakeDeadline
from starling.protocols.fragments import FragmentSchedule, FragmentView, SyncClock

if TYPE_CHECKING:
    from starling.node.node import Node
    from starling.node.wire import Message

log = logging.getLogger(__name__)
MISSES_BEFORE_WARNING = 3  # rounds in a row a peer misses before it says why that may keep happening
ASK_WAIT_S = 5.0  # past the leader's own deadlines: a backstop for a closing set's future


@dataclass
class Exchange:
    """One fragment's round in flight."""

    fragment: int
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


def alpha_merge(alpha: float, local: torch.Tensor, outer: torch.Tensor) -> torch.Tensor:
    """Streaming DiLoCo's merge of a global fragment into the local one."""
    return outer if alpha == 0.0 else alpha * local + (1.0 - alpha) * outer


class TokenLedger:
    """Per fragment: the inner steps since my last contribution, and a late contribution
    waiting to be folded into the next one. Private to this peer (a joiner starts at zero:
    its first contribution weighs the steps it took itself)."""

    def __init__(self, fragments: int, staleness_weight: float) -> None:
        self.gamma = staleness_weight
        self.steps = [0] * fragments
        self.carry: list[tuple[torch.Tensor, float] | None] = [None] * fragments

    def stepped(self) -> None:
        self.steps = [n + 1 for n in self.steps]

    def contribution(self, f: int, delta: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Fragment f's part to send now and its weight; restarts f's count."""
        weight, self.steps[f] = float(self.steps[f]), 0
        carry = self.carry[f]
        if carry is None:
            return delta, weight
        late, late_weight = carry
        stale = self.gamma * late_weight
        if weight + stale <= 0.0:
            return delta, weight
        folded = delta.mul(weight / (weight + stale)).add_(late.to(delta.device), alpha=stale / (weight + stale))
        return folded, weight + stale

    def included(self, f: int) -> None:
        """Fragment f's last contribution is in a closing set: its carry is spent."""
        self.carry[f] = None

    def missed(self, f: int, part: torch.Tensor, weight: float) -> None:
        """Fragment f's last contribution missed its round: carry it (its old carry is in it)."""
        self.carry[f] = (part.detach().clone(), weight)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps),
                "carry": [None if c is None else {"part": c[0].cpu().clone(), "weight": c[1]} for c in self.carry]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = [int(n) for n in state.get("steps", self.steps)]
        carries = state.get("carry", [None] * len(self.carry))
        self.carry = [None if c is None else (c["part"].to(torch.float32), float(c["weight"])) for c in carries]


class OuterSyncRounds:
    """DiLoCo's rounds where peers differ in speed: when a fragment's exchange starts and
    merges under time-based rounds, and what a quorum's closing set does to an exchange. A
    mixin of `DiLoCo` (protocols/diloco.py), which holds the state it reads."""

    clock: SyncClock | None
    schedule: FragmentSchedule
    config: Any
    node: Node
    views: list[FragmentView]
    outer: list[torch.Tensor]
    versions: list[int]
    next_round: list[int]
    in_flight: dict[int, Exchange]
    ledger: TokenLedger
    weight_log: dict[str, Any]
    last_closing: dict[int, Closing | None]  # each fragment's latest closing set (None: no valid set came)
    last_shares: dict[str, float]  # each contributor's share of the latest average I applied

    if TYPE_CHECKING:
        def _skip(self, f: int, k: int) -> None: ...
        def _start(self, f: int, k: int, members: tuple[str, ...], delta: torch.Tensor, weight: float = 1.0,
                   merge_at: int = 0) -> Exchange: ...
        def _fetch_merged(self, f: int, version: int, sources: Sequence[str]) -> None: ...
        def _outer_step(self, f: int, delta: torch.Tensor, commit: bool = True) -> torch.Tensor: ...
        def _here(self, t: torch.Tensor) -> torch.Tensor: ...

    def _eager_update(self, exchange: Exchange) -> None:
        """Eager updates (Kale et al. 2025): until the average comes, my own pseudo-gradient
        stands in for it. The local fragment merges the outer step it would make now; the
        merge later adds only the difference to the real one (`DiLoCo._merge_local`)."""
        f = exchange.fragment
        exchange.provisional = provisional = self._outer_step(f, exchange.delta, commit=False)
        self.views[f].write(alpha_merge(self.config.alpha, self.views[f].read(), self._here(provisional)))

    def _sends_at(self, s: int) -> list[tuple[int, int]]:
        """(fragment, round) pairs whose exchange starts after step s."""
        if self.clock is None:
            sending = self.schedule.sending_at(s)
            return [] if sending is None else [sending]
        now, due = time.time(), []
        for f in range(len(self.views)):
            k = max(self.next_round[f], self.versions[f])
            if f in self.in_flight or not self.clock.should_send(f, k, now):
                continue
            while self.clock.should_send(f, k + 1, now):  # a step so long that whole rounds went by
                self._skip(f, k)
                k += 1
            self.next_round[f] = k + 1
            due.append((f, k))
        return due

    def _merges_at(self, s: int) -> list[tuple[int, int]]:
        """(fragment, round) pairs that merge after step s."""
        if self.clock is None:
            merging = self.schedule.merging_at(s)
            return [] if merging is None else [merging]
        return sorted(((e.fragment, e.round) for e in self.in_flight.values() if e.merge_at <= s),
                      key=lambda fk: (fk[1], fk[0]))

    def _admit_answered(self) -> None:
        """Rounds whose closing set has come: start averaging with its members (training
        need not wait for the set)."""
        for exchange in self.in_flight.values():
            if exchange.asking is not None and exchange.asking.done():
                self._admit(exchange)

    def _admit(self, exchange: Exchange) -> None:
        """The leader's answer is in (or a backstop ran out): average with the closing set,
        or, left out of it, carry my contribution into the fragment's next round."""
        assert exchange.asking is not None
        try:
            closing = exchange.asking.result(timeout=AwakeDeadline.STRETCH * (
                self.config.round_timeout_s + self.config.reply_grace_s) + ASK_WAIT_S)
        except Exception as exc:
            log.warning("%s: no closing set for fragment %d round %d: %s", self.node.peer_id, exchange.fragment,
                        exchange.round, exc)
            closing = None
        exchange.asking, exchange.closing = None, closing
        self.last_closing[exchange.fragment] = closing
        f, me = exchange.fragment, self.node.peer_id
        if closing is None or me not in closing.members:
            exchange.missed = True
            self.ledger.missed(f, exchange.delta, exchange.weight)
            return
        self.ledger.included(f)
        started = self._start(f, exchange.round, closing.members, exchange.delta, exchange.weight,
                              exchange.merge_at)
        exchange.members, exchange.average, exchange.pending = closing.members, started.average, started.pending
        exchange.residuals_before = started.residuals_before

    def _missed(self, exchange: Exchange) -> None:
        """Fragment f's round closed without me (my part is carried): take the merged fragment
        from a member of the set, and the global fragment as it is (alpha or not: my local
        progress travels in the carry, and would otherwise count twice)."""
        f, k = exchange.fragment, exchange.round
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
        self._fetch_merged(f, k + 1, sources)
        self.views[f].write(self.outer[f])

    def _log_share(self, result: ReduceResult, members: tuple[str, ...]) -> None:
        shares = dict(result.shares) or {m: 1.0 / len(members) for m in members}
        self.last_shares = shares
        self.weight_log["rounds"] += 1
        self.weight_log["in_a_row"] = 0
        self.weight_log["share_sum"] += shares.get(self.node.peer_id, 0.0)


@dataclass(frozen=True)
class Published:
    """What `diloco.sync` serves: references to tensors the training thread never changes in place."""

    step: int
    versions: tuple[int, ...]
    outer: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]


def read_sync_reply(msg: Message, fragments: list[int], sizes: list[int], count: int) -> Published:
    body = msg.body
    if not isinstance(body, dict) or not body.get("ok"):
        raise ValueError(body.get("reason") if isinstance(body, dict) else "malformed reply")
    versions = tuple(int(v) for v in body["versions"])
    if len(versions) != count or list(body["fragments"]) != fragments or len(msg.payload) != 2 * len(fragments):
        raise ValueError("reply does not match the request")
    outer: list[torch.Tensor] = [torch.zeros(0)] * count
    momentum: list[torch.Tensor] = [torch.zeros(0)] * count
    for i, (f, n) in enumerate(zip(fragments, sizes)):
        o, m = (torch.as_tensor(t).reshape(-1).to(torch.float32).clone() for t in msg.payload[2 * i:2 * i + 2])
        if o.numel() != n or m.numel() != n or not (torch.isfinite(o).all() and torch.isfinite(m).all()):
            raise ValueError(f"fragment {f}: expected {n} finite values")
        outer[f], momentum[f] = o, m
    return Published(int(body["step"]), versions, tuple(outer), tuple(momentum))
