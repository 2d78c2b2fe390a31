"""A client's relays: which members a node behind NAT keeps as its relays, and how it keeps
their connections to it alive.

A client (a node others cannot dial) is reached through relays: members that can be dialled
and offer to relay, which reach the client down the connection it opened to them
(`Transport.attach`). That connection lives only while the client uses it, so every probe
period the client sends each relay it keeps a message; one that has not answered down that
connection yet is probed instead, since the answer is what lets the client name it in `$via`
(`node.relay`). A client keeps a few relays (`kept`: its `$via` count and a spare), not every
relay of the swarm: those it kept that are still alive (a suspect one until it is dead: most
suspicions are refuted), topped up from the others, ones that already answered it first, then
at random, so that the clients of a swarm spread over its relays.

This is NAT's business, not membership's: the membership protocol (`node.swarm`) calls `keep`
once a period and `greet` once joined, and lends the two sends it makes.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from starling.node.local import LocalPeer
from starling.node.membership import PeerStatus, PeerTable
from starling.node.outbox import Outbox, Spawn


class RelayKeeper:
    """The relays one client keeps. `touch(relay)` sends a relay a message that asks nothing
    (it refreshes the connection); `probe(relay)` asks it for an answer down that connection."""

    def __init__(self, local: LocalPeer, table: PeerTable, outbox: Outbox, spawn: Spawn, rng: random.Random, *,
                 touch: Callable[[str], Awaitable[None]], probe: Callable[[str], Awaitable[object]]) -> None:
        self.local = local
        self.table = table
        self.outbox = outbox
        self.kept = 4  # the node sets its `$via` count plus a spare
        self._spawn = spawn
        self._rng = rng
        self._touch = touch
        self._probe = probe
        self._relays: list[str] = []

    def client(self) -> bool:
        """Whether this node is a client (others cannot dial it)."""
        record = self.local.record
        return record is not None and not record.reachable

    def _is_relay(self, peer_id: str, *statuses: PeerStatus) -> bool:
        info = self.table.get(peer_id)
        return info is not None and info.status in statuses and info.record.relay and info.record.reachable

    def choose(self) -> list[str]:
        """The relays kept now: those kept before that are still alive (or suspect), topped up
        to `kept`. Only a short list walks the table."""
        kept = [r for r in self._relays if self._is_relay(r, PeerStatus.ALIVE, PeerStatus.SUSPECT)]
        if len(kept) < self.kept:
            transport = self.outbox.transport
            others = [p.peer_id for p in self.table.live()
                      if p.peer_id not in kept and self._is_relay(p.peer_id, PeerStatus.ALIVE)]
            self._rng.shuffle(others)
            others.sort(key=lambda r: not (transport is not None and transport.heard(r)))
            kept += others[: self.kept - len(kept)]
        self._relays = kept
        return kept

    def home(self) -> list[str]:
        """The relays this client keeps (empty for a node that can be dialled)."""
        return list(self._relays) if self.client() else []

    def keep(self) -> None:
        """Once a period: a message to each relay kept, or a probe to one that has not answered
        down its connection yet."""
        transport = self.outbox.transport
        if transport is None or not self.client():
            return
        for relay in self.choose():
            self._spawn(self._touch(relay) if transport.heard(relay) else self._probe(relay))

    async def greet(self) -> None:
        """A client that just joined: a message to each relay it keeps, handed to their
        connections before this returns (then probes, as every period: `keep`)."""
        if not self.client():
            return
        await asyncio.gather(*(self._touch(r) for r in self.choose()))
        self.keep()
