"""Client sampling in DiLoCo's rounds (`sample_fraction` F < 1, or `clients_per_round` K).

Round k's members are a draw from the live members (`draw_clients`): every member draws the
same set from the same view, once, at the first step it takes in the round. A member not drawn
trains nothing in the round and keeps time with it (`ClientSampling.await_round`: it asks the
round's members for their versions only); drawn again, or evaluated, it first takes the outer
state the rounds it waited out reached (`ClientSampling.catch_up`, over `diloco.sync`). Only
rounds of the whole model are sampled (one fragment, no overlap, no quorum, step-based).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence

from starling.collectives import membership
from starling.node.node import Node
from starling.protocols.bodies import SyncAsk
from starling.protocols.catch_up import SYNC_TOPIC, CatchUp, read_sync_reply
from starling.protocols.diloco_config import DiLoCoConfig

log = logging.getLogger(__name__)

WAIT_POLL_S = 1.0  # a peer not drawn for a round asks a member this often whether it merged,
WAIT_POLL_MAX_S = 3.0  # or less often, down to this, where many wait on few members


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


class ClientSampling:
    """One peer's view of the draws: each round's members, whether it is among them, and the
    rounds that went on without it since it last trained."""

    def __init__(self, node: Node, config: DiLoCoConfig, catching: CatchUp, is_open: Callable[[], bool]) -> None:
        self.node, self.config, self.catching, self.is_open = node, config, catching, is_open
        self._sample: tuple[int, tuple[str, ...]] | None = None  # (round, its drawn members)
        # (version, members): with sampling, rounds merged without me since I last trained
        self.behind: tuple[int, tuple[str, ...]] | None = None

    def members(self, k: int) -> tuple[str, ...]:
        """The members of round k: every live member, or with client sampling the ones drawn
        for it (from the sample seed and k, so every member draws the same set from the same
        view; fixed at the first step of the round this peer takes)."""
        if not self.config.samples:
            return membership(self.node)
        if self._sample is None or self._sample[0] != k:
            self._sample = (k, draw_clients(membership(self.node), k, self.config))
        return self._sample[1]

    def drawn(self, step: int) -> bool:
        """Whether this peer trains in the round of its step `step` (the round in progress)."""
        k = step // self.config.sync_every
        return not self.config.samples or self.node.peer_id in self.members(k)

    def await_round(self, version: int, members: Sequence[str]) -> None:
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
            if not drawn or not self.is_open() or time.monotonic() >= deadline:
                log.info("%s: round %d's members did not report it merged in time; going on", me, version - 1)
                return
            peer = drawn[i % len(drawn)]
            try:
                msg = self.node.request(peer, SYNC_TOPIC, SyncAsk((), version).to_wire(),
                                        timeout_s=max(0.1, min(poll_s, deadline - time.monotonic())))
                if read_sync_reply(msg, [], [], len(self.catching.fragments)).versions[0] >= version:
                    return
            except Exception as exc:  # not there yet, or gone: ask again, maybe another
                log.debug("%s: waiting for round %d: %s", me, version - 1, exc)
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))

    def catch_up(self) -> bool:
        """Take the model of the rounds that went on without me: the outer state at the version
        they reached, from their members first (bounded by the round timeout). Returns whether
        there were any."""
        if self.behind is None:
            return False
        version, members = self.behind
        self.behind = None
        # each peer asks the members in its own order: hundreds of peers drawn after waiting (or
        # evaluated at the end) would otherwise all ask the first member first
        sources = [*spread(self.node.peer_id, members), *(m for m in membership(self.node) if m not in members)]
        for fragment in self.catching.fragments:
            self.catching.fetch_merged(fragment, version, sources)
            fragment.take_outer()
        return True
