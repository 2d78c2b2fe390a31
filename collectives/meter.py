"""Per-step byte counts, read from the node's counters for one protocol's topics."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starling.node import Node

REPLY_TOPIC_STATS = "$rep"  # the node counts received replies under this topic


class ByteMeter:
    """Per-step byte counts from the node's counters, for this protocol's topics.

    Replies arrive under the node's generic reply topic, so received bytes include every
    reply this node got (in practice only the protocol's own; joins are rare).
    """

    def __init__(self, node: Node, topic_prefix: str) -> None:
        self.node = node
        self.prefix = topic_prefix
        self._last = self._now()

    def _now(self) -> tuple[int, int]:
        s = self.node.stats
        return s.total_sent(self.prefix), s.total_received(self.prefix) + s.total_received(REPLY_TOPIC_STATS)

    def take(self) -> tuple[int, int]:
        """Bytes (sent, received) since the last call."""
        now = self._now()
        delta = (now[0] - self._last[0], now[1] - self._last[1])
        self._last = now
        return delta
