"""Bounds on the work that other processes can make a node do.

Everything a node reads on its ROUTER passes `Admission` (called by `node.dispatch`). There
are three kinds of bound:

- **Requests in flight.** A request runs as a task until its answer is sent. Each connection
  (a ROUTER routing id) may have `requests_per_connection` in flight if it is a member's, and
  `stranger_requests_per_connection` if it is not. All strangers in a process together may
  have `stranger_requests_per_process`, and the whole process `requests_per_process`. A
  request over a cap never reaches its handler. The requester gets a typed busy error
  (`rpc.BusyError`), and the node counts it as `rejected["busy"]`.
- **Rate.** A stranger is a sender that is not an authenticated member. What it sends (public
  requests, and messages that fail a check) spends tokens: one from its connection's bucket
  and one from the node's bucket for all strangers. When the node's bucket is empty, a
  public request gets the busy error. When the connection's bucket is empty, its messages
  are dropped before they are even decoded, counted as `rejected["rate_limited"]`, until the
  bucket refills. Members' messages spend no tokens.
- **Reading.** Messages that were only dropped or refused are waste. After every
  `waste_batch` of them, the ROUTER's reader pauses for `waste_pause_s`. ZeroMQ's receive
  queue then fills and TCP pushes back on the sender, and the network thread's time goes to
  the node's own work (replies, probes, training sends).

**Why members are treated differently.** One ROUTER multiplexes every peer, so no single
connection can be paused by itself. Instead, ZeroMQ's ROUTER fair-queues its connections on
receive. A member's message therefore waits behind at most one message from each other
connection, however many a flooder has queued. Members are never rate-limited or paused one
by one. Their requests can wait on each other (an owner answers a round's part only once
every member's part is in), so holding one back could stall a round until it times out.
Their cap per connection sits far above what the protocols put in flight (one request per
chunk per round). It is a backstop against a member gone wrong.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

BUSY_DETAIL = {
    "connection": "too many requests in flight on this connection",
    "strangers": "too many requests in flight from outside the swarm",
    "process": "too many requests in flight in this process",
    "rate": "too many requests from outside the swarm; try again later",
}


@dataclass(frozen=True)
class AdmissionConfig:
    requests_per_connection: int = 4096  # a member's; protocols send one per chunk per round
    stranger_requests_per_connection: int = 4
    stranger_requests_per_process: int = 256  # every node of the process together
    requests_per_process: int = 1 << 17
    stranger_rate_per_s: float = 10.0  # each stranger's connection: public requests + rejects
    stranger_burst: float = 20.0
    # all strangers of one node together; the burst lets a simulated swarm of hundreds of
    # peers join through one node one after another (a joiner's hello comes from a stranger)
    strangers_rate_per_s: float = 200.0
    strangers_burst: float = 1000.0
    tracked_connections: int = 4096  # stranger buckets kept, least recently used dropped
    # What a pull of the peer table may cost: a stranger's hello is answered with at most this
    # many times its own bytes (the rest of the table is paged with `$sync` once it is a
    # member), and each member's pulls (`$sync` pages, records sent for `$want`) share a
    # budget of bytes per second.
    stranger_reply_factor: int = 10
    table_page_bytes: int = 64 * 1024
    member_pull_bytes_per_s: float = 1e6
    member_pull_burst_bytes: float = 1e6
    waste_batch: int = 64  # dropped or refused messages between two pauses of the reader
    waste_pause_s: float = 0.002
    # A joiner's hello that waited this long on the loop before its handler ran finds the node
    # behind: it is turned away as busy, with other members to try (`node.hello`), unless the
    # join was turned away twice already.
    hello_busy_after_s: float = 1.0

    def __post_init__(self) -> None:
        counts = (self.requests_per_connection, self.stranger_requests_per_connection,
                  self.stranger_requests_per_process, self.requests_per_process, self.tracked_connections,
                  self.waste_batch)
        counts += (self.stranger_reply_factor, self.table_page_bytes)
        if min(counts) < 1:
            raise ValueError(f"admission caps must be >= 1: {self}")
        if min(self.stranger_rate_per_s, self.strangers_rate_per_s) <= 0 or \
                min(self.stranger_burst, self.strangers_burst) < 1 or self.waste_pause_s < 0 \
                or self.hello_busy_after_s <= 0:
            raise ValueError(f"admission rates and hello_busy_after_s must be > 0, bursts >= 1 and the pause >= 0: "
                             f"{self}")
        if self.member_pull_bytes_per_s <= 0 or self.member_pull_burst_bytes < self.table_page_bytes:
            raise ValueError(f"member pulls need a rate > 0 and a burst of at least one table page: {self}")


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; starts full."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, now

    def _refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def has(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= 1

    def take(self, now: float) -> bool:
        """Spend one token if there is one; False if the bucket is empty."""
        return self.spend(1.0, now)

    def spend(self, amount: float, now: float) -> bool:
        """Spend `amount` tokens if there are that many; False (and nothing spent) if not."""
        self._refill(now)
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True

    def charge(self, amount: float, now: float) -> None:
        """Spend `amount` tokens even past empty: the debt is paid from the refill first."""
        self._refill(now)
        self.tokens -= amount

    def available(self, now: float) -> float:
        self._refill(now)
        return self.tokens


@dataclass
class ProcessLoad:
    """Requests in flight across every node of a process (one per `NetworkThread`)."""

    requests: int = 0
    strangers: int = 0


class Admission:
    """One node's bounds (see the module docstring). Lives on the network thread."""

    def __init__(self, config: AdmissionConfig, process: ProcessLoad,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.process = process
        self._clock = clock
        self._in_flight: dict[bytes, int] = {}  # per connection, only while non-zero
        self.strangers_in_flight = 0  # this node's
        self._buckets: OrderedDict[bytes, TokenBucket] = OrderedDict()  # stranger connections
        self._strangers = TokenBucket(config.strangers_rate_per_s, config.strangers_burst, clock())
        self._waste = 0

    def readable(self, route: bytes) -> bool:
        """False while `route` is a stranger's connection with an empty bucket: drop its
        message unread."""
        bucket = self._buckets.get(route)
        return bucket is None or bucket.has(self._clock())

    def charge(self, route: bytes) -> bool:
        """A stranger's message on `route` spends a token of its connection and one of all
        strangers; False if either bucket was empty (then refuse it)."""
        now = self._clock()
        bucket = self._buckets.get(route)
        if bucket is None:
            bucket = self._buckets[route] = TokenBucket(self.config.stranger_rate_per_s,
                                                        self.config.stranger_burst, now)
            if len(self._buckets) > self.config.tracked_connections:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(route)
        return bucket.take(now) and self._strangers.take(now)

    def admit(self, route: bytes, member: bool) -> str | None:
        """Count a request (or an async one-way handler) in flight on `route`; None if it may
        run, else which cap it hit (a key of `BUSY_DETAIL`). Every admitted one is `release`d."""
        c, p = self.config, self.process
        here = self._in_flight.get(route, 0)
        if here >= (c.requests_per_connection if member else c.stranger_requests_per_connection):
            return "connection"
        if not member and p.strangers >= c.stranger_requests_per_process:
            return "strangers"
        if p.requests >= c.requests_per_process:
            return "process"
        self._in_flight[route] = here + 1
        p.requests += 1
        if not member:
            p.strangers += 1
            self.strangers_in_flight += 1
        return None

    def release(self, route: bytes, member: bool) -> None:
        left = self._in_flight.pop(route) - 1
        if left:
            self._in_flight[route] = left
        self.process.requests -= 1
        if not member:
            self.process.strangers -= 1
            self.strangers_in_flight -= 1

    def in_flight(self, route: bytes | None = None) -> int:
        """Requests in flight on one connection, or on all of this node's."""
        return sum(self._in_flight.values()) if route is None else self._in_flight.get(route, 0)

    @property
    def tracked(self) -> int:
        """Stranger connections whose buckets are kept."""
        return len(self._buckets)

    def wasted(self) -> bool:
        """Count a message that was only dropped or refused; True when the reader should
        pause now (once every `waste_batch`)."""
        self._waste += 1
        if self._waste < self.config.waste_batch:
            return False
        self._waste = 0
        return True
