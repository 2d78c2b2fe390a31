"""Peer events as protocols see them: who joined, who is gone, and the member view a round is
built on."""
from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

from starling.node.membership import PeerStatus, StatusChange

if TYPE_CHECKING:
    from starling.node import Node

GONE = (PeerStatus.DEAD, PeerStatus.LEFT)


def watch_peers(node: Node, joined: Callable[[str], None], left: Callable[[str], None],
                is_open: Callable[[], bool]) -> None:
    """Route the node's status changes to a protocol's join/leave hooks (network thread). A
    peer this node bans is gone for the protocol too: no round waits for it again."""

    def on_change(change: StatusChange) -> None:
        if not is_open():
            return
        if change.new in GONE:
            left(change.peer_id)
        elif change.new is PeerStatus.ALIVE and (change.old is None or change.old in GONE):
            joined(change.peer_id)

    node.on_peer_change(on_change)
    node.on_ban(lambda peer: left(peer) if is_open() else None)


def membership(node: Node) -> tuple[str, ...]:
    """Sorted live peers plus this node: the view a round is built on. `live_peers` comes
    sorted, without this node: it goes in at its place (every member builds this every step)."""
    live, me = node.live_peers(), node.peer_id
    at = bisect.bisect_left(live, me)
    if at < len(live) and live[at] == me:
        return tuple(live)
    return (*live[:at], me, *live[at:])
