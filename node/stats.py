"""Byte and message counters: per peer, per topic, sent and received, plus rejections.

These are what protocols and benchmarks report, so they count whole messages as
they cross the socket (header frame plus every payload frame).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class NodeStats:
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    bytes_sent: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    bytes_received: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    messages_sent: int = 0
    messages_received: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    send_failures: int = 0
    stalls: int = 0  # times this node's own liveness loop woke late (see Swarm.heartbeat_loop)
    stalled_s: float = 0.0  # their total lateness, not counted against peers' silence

    def count_sent(self, peer: str, topic: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent[peer][topic] += nbytes
            self.messages_sent += 1

    def count_received(self, peer: str, topic: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_received[peer][topic] += nbytes
            self.messages_received += 1

    def count_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def count_send_failure(self) -> None:
        with self._lock:
            self.send_failures += 1

    def count_stall(self, seconds: float) -> None:
        with self._lock:
            self.stalls += 1
            self.stalled_s += seconds

    def total_sent(self, topic_prefix: str = "") -> int:
        with self._lock:
            return sum(n for per in self.bytes_sent.values() for t, n in per.items() if t.startswith(topic_prefix))

    def total_received(self, topic_prefix: str = "") -> int:
        with self._lock:
            return sum(n for per in self.bytes_received.values() for t, n in per.items() if t.startswith(topic_prefix))

    def snapshot(self) -> dict[str, Any]:
        """A plain, JSON-ready copy."""
        with self._lock:
            return {
                "bytes_sent": {p: dict(t) for p, t in self.bytes_sent.items()},
                "bytes_received": {p: dict(t) for p, t in self.bytes_received.items()},
                "messages_sent": self.messages_sent,
                "messages_received": self.messages_received,
                "rejected": dict(self.rejected),
                "send_failures": self.send_failures,
                "stalls": self.stalls,
                "stalled_s": round(self.stalled_s, 3),
            }
