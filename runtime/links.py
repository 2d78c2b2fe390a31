"""Link emulation for the simulator: bandwidth, latency and loss on every directed link.

A `LinkEmulator` is a node's `shaper` (see `LinkShaper` in node.py): the node awaits
`admit(peer, nbytes)` on the network loop before every protocol-topic send. Each
destination is one FIFO link:

    departure            = max(now, link_free_at[peer]) + nbytes * 8 / bandwidth_bps
    link_free_at[peer]   = departure
    the message arrives  = departure + latency_s      (the send waits until then)
    it is lost           with probability `loss` (a seeded RNG, so runs repeat)

Waiting is an `asyncio.sleep` on the network loop, so a slow link delays only the
sends queued on it, never the other links or the node's heartbeats.
"""
from __future__ import annotations

import asyncio
import random
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

_RATE = re.compile(r"\s*(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+)\s*([kmgtKMGT]?)(bits?|bit/s|bps|b/s|Bps|B/s)?\s*")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNITS = "e.g. 500kbit, 10Mbps, 100mbit, 1gbit (bits per second) or 10MB/s, 10MBps (bytes per second)"


class RateError(ValueError):
    """A bandwidth string could not be read."""


def parse_rate(text: str) -> float:
    """A bandwidth in bits per second. "100mbit", "10Mbps", "1gbit", "500kbit" and a plain
    number are bits per second (prefixes are decimal, case-insensitive); a capital-B unit,
    "10MB/s" or "10MBps", is bytes per second."""
    match = _RATE.fullmatch(text)
    if not match:
        raise RateError(f"cannot read bandwidth {text!r}; {_UNITS}")
    number, prefix, unit = float(match.group(1)), match.group(2).lower(), match.group(3)
    if prefix and unit is None:
        raise RateError(f"bandwidth {text!r} has no unit; {_UNITS}")
    bps = number * _PREFIX[prefix] * (8.0 if unit in ("Bps", "B/s") else 1.0)
    if not bps > 0:
        raise RateError(f"bandwidth {text!r} must be positive")
    return bps


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "unlimited"
    for prefix, scale in (("g", 1e9), ("m", 1e6), ("k", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{prefix}bit"
    return f"{bps:g}bit"


@dataclass(frozen=True)
class LinkModel:
    """One directed link's properties (the same for every link of a simulation)."""

    bandwidth_bps: float | None = None  # None: unlimited
    latency_s: float = 0.0  # one-way propagation delay
    loss: float = 0.0  # probability that a protocol message is dropped
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be positive or None, got {self.bandwidth_bps}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")

    @property
    def is_ideal(self) -> bool:
        return self.bandwidth_bps is None and self.latency_s == 0 and self.loss == 0

    def transmit_s(self, nbytes: int) -> float:
        """Serialization time of `nbytes` on this link."""
        return 0.0 if self.bandwidth_bps is None else nbytes * 8.0 / self.bandwidth_bps

    def describe(self) -> dict[str, float | None]:
        return {"bandwidth_bps": self.bandwidth_bps, "latency_s": self.latency_s, "loss": self.loss}


@dataclass
class LinkCounters:
    admitted: int = 0
    dropped: int = 0
    bytes_admitted: int = 0
    bytes_dropped: int = 0
    delay_s: float = 0.0  # total emulated delay (queueing, transmission, latency) of admitted and lost sends


class LinkEmulator:
    """The outgoing links of one node. Use one emulator per node (its `shaper`)."""

    def __init__(self, model: LinkModel, *, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic, unreachable: set[str] | None = None) -> None:
        self.model = model
        # Peers whose host is gone (the simulator's crashed peers): what is sent to them is lost.
        self.unreachable = unreachable if unreachable is not None else set()
        self.counters = LinkCounters()
        self._rng = random.Random(model.seed if seed is None else seed)
        self._clock = clock
        self._free_at: dict[str, float] = defaultdict(float)

    def schedule(self, peer: str, nbytes: int) -> tuple[float, bool]:
        """Book `nbytes` on the link to `peer`: (seconds until it arrives, whether it is lost).
        Loss is drawn here, in send order, so a seed gives the same drops whatever the timing."""
        now = self._clock()
        departure = max(now, self._free_at[peer]) + self.model.transmit_s(nbytes)
        self._free_at[peer] = departure
        lost = self.model.loss > 0 and self._rng.random() < self.model.loss
        return departure + self.model.latency_s - now, lost

    async def admit(self, peer: str, nbytes: int) -> bool:
        if peer in self.unreachable:
            self.counters.dropped += 1
            self.counters.bytes_dropped += nbytes
            return False
        wait_s, lost = self.schedule(peer, nbytes)
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self.counters.delay_s += wait_s
        if lost:
            self.counters.dropped += 1
            self.counters.bytes_dropped += nbytes
            return False
        self.counters.admitted += 1
        self.counters.bytes_admitted += nbytes
        return True
