"""Byte and message counters: per peer, per topic, sent and received, plus rejections.

These are what protocols and benchmarks report, so they count whole messages as
they cross the socket (header frame plus every payload frame).

They stay bounded whatever peers send. Only authenticated members get entries of their own.
Everything to and from senders outside the swarm is counted under `STRANGERS`. Past
`max_peers` peers, or `max_topics` topics of one peer, the rest is counted under `OTHERS`.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

STRANGERS = "<strangers>"  # every sender outside the swarm (public requests), one entry
OTHERS = "<others>"  # peers, or one peer's topics, past the caps
BOOTSTRAP = "<bootstrap>"  # requests to an address rather than to a member: hellos, dial-backs


@dataclass
class NodeStats:
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    bytes_sent: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    bytes_received: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    messages_sent: int = 0
    messages_received: int = 0
    messages_sent_by_topic: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # sends that had to open a socket (a DEALER, and its monitor) to their peer, by topic
    sockets_opened_by_topic: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    send_failures: int = 0
    stalls: int = 0  # times this node's own liveness loop woke late (see Swarm.run)
    stalled_s: float = 0.0  # their total lateness, not counted against peers' silence
    # peers this node declared dead because their address refused its connections (a process
    # gone): after their connection dropped, or in an unanswered probe (see FailureDetector)
    refused_deaths: int = 0
    # replies that came after their request had ended (timed out, or its peer declared gone)
    late_replies: int = 0
    max_peers: int = field(default=1024, repr=False)
    max_topics: int = field(default=64, repr=False)

    def __post_init__(self) -> None:
        if self.max_peers < 0 or self.max_topics < 1:
            raise ValueError(f"need max_peers >= 0 and max_topics >= 1: {self.max_peers}, {self.max_topics}")

    def _add(self, table: dict[str, dict[str, int]], peer: str, topic: str, nbytes: int) -> None:
        per = table.get(peer)
        if per is None:
            per = table[peer if len(table) < self.max_peers else OTHERS]
        if topic not in per and len(per) >= self.max_topics:
            topic = OTHERS
        per[topic] += nbytes

    def count_sent(self, peer: str, topic: str, nbytes: int) -> None:
        with self._lock:
            self._add(self.bytes_sent, peer, topic, nbytes)
            self.messages_sent += 1
            by_topic = self.messages_sent_by_topic
            by_topic[topic if topic in by_topic or len(by_topic) < self.max_topics else OTHERS] += 1

    def count_socket_opened(self, topic: str) -> None:
        with self._lock:
            by_topic = self.sockets_opened_by_topic
            by_topic[topic if topic in by_topic or len(by_topic) < self.max_topics else OTHERS] += 1

    def count_received(self, peer: str, topic: str, nbytes: int) -> None:
        with self._lock:
            self._add(self.bytes_received, peer, topic, nbytes)
            self.messages_received += 1

    def count_late_reply(self) -> None:
        with self._lock:
            self.late_replies += 1

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

    def count_refused_death(self) -> None:
        with self._lock:
            self.refused_deaths += 1

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
                "messages_sent_by_topic": dict(self.messages_sent_by_topic),
                "sockets_opened_by_topic": dict(self.sockets_opened_by_topic),
                "messages_received": self.messages_received,
                "rejected": dict(self.rejected),
                "send_failures": self.send_failures,
                "stalls": self.stalls,
                "stalled_s": round(self.stalled_s, 3),
                "refused_deaths": self.refused_deaths,
                "late_replies": self.late_replies,
            }
