"""Catching up: how a DiLoCo peer takes the rounds that went on without it, from peers that
merged them ("diloco.sync"), and the outer state every peer publishes there for the others.

Elastic membership. A joiner loads a peer's `state_dict` (outer parameters, momentum, round,
inner optimizer state, rounds in flight: `CatchUp.rounds_state`). For a round in flight it takes part in (its member
list names the joiner), it sends the donor's pseudo-gradient; for one it does not, it fetches
the outer fragment after that merge from a member ("diloco.sync"). A peer that learns it has
fallen a round behind fetches the whole outer state and jumps to that peer's step. Either way
it tells the others which rounds it sends nothing in (`ShardedReducer.skip`): members that
already counted it in would otherwise wait for its part until the round timeout. A peer left
out of a quorum's closing set takes the merged fragment from a member of the set.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from starling.collectives import membership
from starling.node.node import Node
from starling.node.rpc import Refusal, Refuser, Reply, refusal
from starling.node.wire import Message
from starling.protocols.bodies import BodyError, NotYet, SyncAsk, SyncState
from starling.protocols.diloco_config import DiLoCoConfig
from starling.protocols.fragments import FragmentSchedule, SyncClock
from starling.protocols.outer_sync import Exchange, OuterFragment

log = logging.getLogger(__name__)

SYNC_TOPIC = "diloco.sync"  # outer parameters and momentum of some fragments, as a peer holds them now


@dataclass(frozen=True)
class Published:
    """What `diloco.sync` serves: references to tensors the training thread never changes in place."""

    step: int
    versions: tuple[int, ...]
    outer: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]


def read_sync_reply(msg: Message, fragments: list[int], sizes: list[int], count: int) -> Published:
    """A peer's answer to a `SyncAsk` for `fragments` (of `sizes` values each, of `count`);
    ValueError (a `BodyError` for a malformed body) naming what is wrong."""
    body = SyncState.from_wire(msg.body)
    versions = body.versions
    if len(versions) != count or list(body.fragments) != fragments or len(msg.payload) != 2 * len(fragments):
        raise ValueError("reply does not match the request")
    outer: list[torch.Tensor] = [torch.zeros(0)] * count
    momentum: list[torch.Tensor] = [torch.zeros(0)] * count
    for i, (f, n) in enumerate(zip(fragments, sizes)):
        o, m = (torch.as_tensor(t).reshape(-1).to(torch.float32).clone() for t in msg.payload[2 * i:2 * i + 2])
        if o.numel() != n or m.numel() != n or not (torch.isfinite(o).all() and torch.isfinite(m).all()):
            raise ValueError(f"fragment {f}: expected {n} finite values")
        outer[f], momentum[f] = o, m
    return Published(body.step, versions, tuple(outer), tuple(momentum))


class CatchUp:
    """One peer's side of `diloco.sync`: the outer state it last published, served to others on
    the network thread, and, on the training thread, what it fetches from them and takes when
    rounds of its fragments went on without it."""

    def __init__(self, node: Node, config: DiLoCoConfig, fragments: Sequence[OuterFragment],
                 schedule: FragmentSchedule, clock: SyncClock | None, is_open: Callable[[], bool]) -> None:
        self.node, self.config, self.fragments = node, config, list(fragments)
        self.schedule, self.clock, self.is_open = schedule, clock, is_open
        self.published = Published(0, (), (), ())
        self._refuse = Refuser(node.stats, SYNC_TOPIC, node.peer_id)  # counts malformed requests

    def publish(self, step: int) -> None:
        """What `diloco.sync` serves from now on: the fragments' outer state as it is, at `step`."""
        fragments = self.fragments
        self.published = Published(step, tuple(f.version for f in fragments), tuple(f.outer for f in fragments),
                                   tuple(f.momentum for f in fragments))

    def rounds_state(self) -> dict[str, Any]:
        """The rounds as a joiner (or this peer's restart) takes them up: each exchange in flight,
        in the order sent, and with time-based rounds the clock's epoch and each fragment's next round."""
        in_flight = [e for fragment in self.fragments if (e := fragment.in_flight_state()) is not None]
        in_flight.sort(key=lambda e: (e["round"], e["fragment"]))  # in the order sent
        state: dict[str, Any] = {"in_flight": in_flight}
        if self.clock is not None:
            state["clock_epoch"] = self.clock.epoch  # the swarm's: a joiner's rounds fall due with the others'
            state["next_round"] = [fragment.next_round for fragment in self.fragments]
        return state

    def load_rounds_state(self, state: Mapping[str, Any], device: torch.device) -> None:
        """Take up the rounds `rounds_state` wrote, once the outer state they start from is in."""
        if self.clock is not None:
            self.clock.epoch = state.get("clock_epoch", self.clock.epoch)
            next_round = state.get("next_round", [fragment.version for fragment in self.fragments])
            for fragment, r in zip(self.fragments, next_round):
                fragment.next_round = int(r)
        for entry in state["in_flight"]:
            self.fragments[int(entry["fragment"])].resume(entry, device)

    # ------------------------------------------------------------------ training thread
    def missed(self, fragment: OuterFragment, exchange: Exchange) -> None:
        """The fragment's round closed without me (my part is carried): take the merged fragment
        from a member of the set, and the global fragment as it is (alpha or not: my local
        progress travels in the carry, and would otherwise count twice)."""
        f, k = fragment.index, exchange.round
        log.info("%s: fragment %d round %d closed without me; my part goes into round %d", self.node.peer_id, f, k,
                 k + 1)
        sources = exchange.closing.members if exchange.closing is not None else membership(self.node)
        self.fetch_merged(fragment, k + 1, sources)
        fragment.take_outer()

    def fetch_merged(self, fragment: OuterFragment, version: int, sources: Sequence[str]) -> None:
        """I missed the fragment's round: take its outer fragment from a member that merged it."""
        f = fragment.index
        got = self.fetch([f], sources, lambda versions: versions[f] >= version, at_least=version)
        if got is None:
            log.warning("%s: no peer had fragment %d at version %d; keeping mine", self.node.peer_id, f, version)
            return
        fragment.adopt(got.outer[f], got.momentum[f], got.versions[f])

    def catch_up(self, fragment: OuterFragment, k: int, sources: Sequence[str], step: int) -> int:
        """The fragment's round k closed without me (at `step`): take the outer state and step of
        a peer that merged it, and join the rounds that follow. Returns my step from here on."""
        got = self.fetch(list(range(len(self.fragments))), sources, lambda versions: versions[fragment.index] > k)
        if got is None:
            log.warning("%s: could not fetch the swarm's outer state; staying at step %d", self.node.peer_id, step)
            return step
        before = [other.version for other in self.fragments]  # the round of each fragment I would have merged next
        for f, other in enumerate(self.fragments):
            other.exchange = None  # my rounds were refused as late
            other.adopt(got.outer[f], got.momentum[f], got.versions[f])
            other.take_outer()  # my local progress belongs to rounds that closed without me
        if self.clock is not None:  # time-based rounds: the clock says which round is next
            for other, first in zip(self.fragments, before):
                for r in range(first, other.version):
                    other.skip(r)
            return step
        for g, r in self.schedule.in_flight_at(got.step):  # started before I arrived: fetched at merge
            self.fragments[g].exchange = Exchange(r, tuple(sources), torch.zeros(0))
        for other, first in zip(self.fragments, before):
            # the rounds I jumped over, or fetch at their merge: members that count me in them
            # stop waiting for my part (only the latest two can still be open anywhere)
            first_mine = other.exchange.round + 1 if other.exchange is not None else other.version
            for r in range(max(first, first_mine - 2), first_mine):
                other.skip(r)
        return max(step, got.step)

    def fetch(self, fragments: list[int], sources: Sequence[str],
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

    # ------------------------------------------------------------------ network thread
    def serve(self, msg: Message) -> Reply | dict[str, Any]:
        """A peer's `SyncAsk`: the fragments it names as last published, or, where one is not
        at the version it asks for yet, a short `NotYet`."""
        if not self.is_open():
            return refusal(Refusal.CLOSED, "protocol closed")
        state = self.published
        try:
            ask = SyncAsk.from_wire(msg.body)
            if ask.fragments and ask.fragments[-1] >= len(state.outer):
                raise BodyError(f"fragment {ask.fragments[-1]}: this model has {len(state.outer)}")
        except BodyError as exc:
            return self._refuse(Refusal.MALFORMED, f"{msg.sender}: {exc}; body must be "
                                f"{{fragments: [ascending in 0..{len(state.outer) - 1}], at_least: int}}")
        fragments = list(ask.fragments)
        if any(state.versions[f] < ask.at_least for f in fragments or range(len(state.versions))):
            # not there yet: a short answer, not the state
            return NotYet.before(state.versions, ask.at_least).to_wire()
        payload = [t for f in fragments for t in (state.outer[f], state.momentum[f])]
        return Reply(SyncState(state.step, state.versions, ask.fragments).to_wire(), payload)
