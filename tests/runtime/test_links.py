"""Link emulation: bandwidth as a FIFO per destination, latency, seeded loss, rate parsing.

Timings are checked as ratios or lower bounds with wide margins: the CI box is small and busy.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from starling.runtime import LinkEmulator, LinkModel, RateError, format_rate, parse_rate


@pytest.mark.parametrize("text, bps", [
    ("100mbit", 100e6), ("10Mbps", 10e6), ("1gbit", 1e9), ("500kbit", 500e3), ("1.5Gbps", 1.5e9),
    ("2.5e6", 2.5e6), ("64000", 64e3), ("10 mbit", 10e6), ("10MB/s", 80e6), ("1KBps", 8e3), ("300bit", 300.0),
])
def test_rates_read_as_bits_per_second(text, bps):
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("text, needle", [
    ("fast", "cannot read"), ("10m", "no unit"), ("0mbit", "positive"), ("-5mbit", "cannot read"),
    ("10 furlongs", "cannot read"), ("", "cannot read"), ("1x", "cannot read"),
])
def test_bad_rates_name_the_input(text, needle):
    with pytest.raises(RateError, match=needle) as info:
        parse_rate(text)
    assert repr(text) in str(info.value)


def test_format_rate_round_trips():
    for bps in (500e3, 10e6, 1e9):
        assert parse_rate(format_rate(bps)) == pytest.approx(bps)
    assert format_rate(None) == "unlimited"


@pytest.mark.parametrize("kwargs", [dict(bandwidth_bps=0), dict(latency_s=-1), dict(loss=1.0), dict(loss=-0.1)])
def test_link_model_rejects_impossible_links(kwargs):
    with pytest.raises(ValueError):
        LinkModel(**kwargs)


async def _send_all(emulator: LinkEmulator, sends: list[tuple[str, int]]) -> tuple[float, list[str]]:
    """Admit every (peer, nbytes) concurrently, as queued sends on the network loop would."""
    arrivals: list[str] = []

    async def one(index: int, peer: str, nbytes: int) -> None:
        if await emulator.admit(peer, nbytes):
            arrivals.append(f"{peer}{index}")

    start = time.monotonic()
    await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(sends)))
    return time.monotonic() - start, arrivals


def test_bandwidth_serializes_messages_on_one_link():
    link = LinkModel(bandwidth_bps=1e6)  # 12_500 bytes = 0.1 s each
    elapsed, arrivals = asyncio.run(_send_all(LinkEmulator(link), [("a", 12_500)] * 4))
    assert elapsed >= 0.4 * 0.95  # four messages one after another, never faster
    assert elapsed < 0.4 * 10 + 1.0
    assert arrivals == ["a0", "a1", "a2", "a3"]  # FIFO


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_schedule_is_a_fifo_per_destination():
    clock = FakeClock()
    emulator = LinkEmulator(LinkModel(bandwidth_bps=1e6, latency_s=0.05), clock=clock)
    waits = [emulator.schedule("a", 12_500)[0] for _ in range(3)]  # 0.1 s each on the wire
    assert waits == pytest.approx([0.15, 0.25, 0.35])
    assert emulator.schedule("b", 12_500)[0] == pytest.approx(0.15)  # another link: no queue
    clock.now += 1.0  # the link to a has drained
    assert emulator.schedule("a", 1250)[0] == pytest.approx(0.01 + 0.05)


def test_links_to_different_peers_do_not_wait_on_each_other():
    link = LinkModel(bandwidth_bps=1e6)
    four = LinkEmulator(link)
    _, arrivals = asyncio.run(_send_all(four, [("a", 12_500), ("b", 12_500), ("c", 12_500), ("d", 12_500)] * 3))
    assert len(arrivals) == 12
    # Each link queues only its own 3 messages (0.1 + 0.2 + 0.3 s); one shared queue of 12
    # would book 0.1 + ... + 1.2 = 7.8 s. Booked delays, not wall time, so load cannot fail it.
    assert four.counters.delay_s == pytest.approx(4 * 0.6, rel=0.1)


def test_latency_delays_each_message_but_does_not_add_up():
    link = LinkModel(latency_s=0.2)
    emulator = LinkEmulator(link)
    elapsed, arrivals = asyncio.run(_send_all(emulator, [("a", 100)] * 10))
    assert len(arrivals) == 10
    assert elapsed >= 0.2 * 0.95
    # Pipelined: each message is booked 0.2 s, not 0.2 s more than the one before it (which
    # would book 11 s in all). Booked delays, not wall time, so a loaded machine cannot fail it.
    assert emulator.counters.delay_s == pytest.approx(10 * 0.2, rel=0.1)


def test_bandwidth_and_latency_combine():
    link = LinkModel(bandwidth_bps=8e5, latency_s=0.1)  # 10_000 bytes = 0.1 s
    emulator = LinkEmulator(link)
    elapsed, _ = asyncio.run(_send_all(emulator, [("a", 10_000)] * 2))
    assert elapsed >= (0.2 + 0.1) * 0.95
    assert emulator.counters.delay_s == pytest.approx(0.2 + 0.3, rel=0.05)  # 0.2 s, then 0.3 s


def test_loss_drops_about_the_configured_fraction_and_repeats_with_the_seed():
    def run(seed: int) -> list[bool]:
        emulator = LinkEmulator(LinkModel(loss=0.3, seed=seed))

        async def go() -> list[bool]:
            return [await emulator.admit("a", 10) for _ in range(4000)]

        results = asyncio.run(go())
        assert emulator.counters.dropped == results.count(False)
        assert emulator.counters.bytes_dropped == 10 * results.count(False)
        return results

    first = run(7)
    assert 0.25 < first.count(False) / len(first) < 0.35
    assert run(7) == first
    assert run(8) != first


def test_an_ideal_link_admits_at_once():
    emulator = LinkEmulator(LinkModel())
    elapsed, arrivals = asyncio.run(_send_all(emulator, [("a", 1 << 20)] * 50))
    assert len(arrivals) == 50 and elapsed < 1.0
    assert LinkModel().is_ideal and not LinkModel(latency_s=0.01).is_ideal
