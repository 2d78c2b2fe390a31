"""A swarm that restarts from checkpoints agrees on the step it continues from.

Every restarting peer advertises the steps of the checkpoints it holds in its heartbeat
metadata, waits until `quorum` peers (itself included) have advertised theirs, and takes
the newest step that at least `quorum` of them hold. Peers checkpoint at the same step
multiples, so in a whole-swarm restart they usually hold the same steps; one whose last
write a crash cut short holds one fewer, and the quorum decides whether the swarm goes back
a checkpoint for it (quorum = every peer) or leaves it to catch up from the others (a
smaller quorum: it loads the agreed step from a peer's state, see `Trainer.resume_swarm`).

The wait doubles as a barrier: no peer trains before a quorum is back, so the first rounds
after the restart have their members.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from starling.node import Node, PeerStatus
from starling.runtime.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

# Heartbeat metadata: the steps this peer holds, newest first, as "300,290,280" (metadata
# values are scalars of at most 256 characters: 16 steps of up to 9 digits fit).
CHECKPOINTS_META = "checkpoints"
MAX_ADVERTISED = 16  # what a peer reads of another's list: remote input stays bounded


class RestartError(Exception):
    """The swarm could not agree on a step to resume from."""


def held_steps(node: Node) -> dict[str, set[int]]:
    """The checkpoint steps each live peer advertises (peers that advertise none are left out);
    malformed lists count as empty."""
    out: dict[str, set[int]] = {}
    for peer in node.peers:
        steps = peer.meta.get(CHECKPOINTS_META) if peer.status is PeerStatus.ALIVE else None
        if isinstance(steps, str):
            out[peer.id] = {int(s) for s in steps.split(",")[:MAX_ADVERTISED] if s.isdigit() and len(s) <= 12}
    return out


def agree_on_step(node: Node, store: CheckpointStore, quorum: int, timeout_s: float,
                  poll_s: float = 0.05) -> int | None:
    """Advertise this peer's checkpoints, wait for `quorum` peers (self included) to advertise
    theirs, and return the newest step at least `quorum` of them hold; None if none does.
    Raises RestartError if fewer than `quorum` peers advertise within `timeout_s`."""
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    mine = [c.step for c in store.list()][:MAX_ADVERTISED]
    node.set_meta(**{CHECKPOINTS_META: ",".join(map(str, mine))})
    deadline = time.monotonic() + timeout_s
    while True:
        views = {**held_steps(node), node.peer_id: set(mine)}
        if len(views) >= quorum:
            break
        if time.monotonic() > deadline:
            raise RestartError(f"only {len(views)} of the {quorum} peers needed to resume advertised their "
                               f"checkpoints within {timeout_s:g} s")
        time.sleep(poll_s)
    counts = Counter(step for steps in views.values() for step in steps)
    agreed = max((step for step, n in counts.items() if n >= quorum), default=None)
    log.info("%s: resuming at step %s (held by %d of %d peers seen; mine: %s)", node.peer_id, agreed,
             counts.get(agreed, 0) if agreed is not None else 0, len(views), mine)
    return agreed


def holders_of(node: Node, step: int) -> list[str]:
    """Live peers that advertise a checkpoint of `step`."""
    return sorted(peer for peer, steps in held_steps(node).items() if step in steps)
