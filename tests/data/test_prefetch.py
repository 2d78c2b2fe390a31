"""The prefetcher: order, errors where they happened, and a close that never hangs."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from starling.data.prefetch import Prefetcher, pin_tensors


def test_items_come_in_order_and_end() -> None:
    prefetcher = Prefetcher(iter(range(100)), depth=3)
    assert list(prefetcher) == list(range(100))
    with pytest.raises(StopIteration):
        next(prefetcher)
    prefetcher.close()


def test_an_error_comes_out_at_its_position() -> None:
    def failing() -> Iterator[int]:
        yield 1
        yield 2
        raise RuntimeError("bad shard")

    received = []
    with Prefetcher(failing(), depth=2) as prefetcher:
        with pytest.raises(RuntimeError, match="bad shard"):
            for item in prefetcher:
                received.append(item)
        assert received == [1, 2]
        with pytest.raises(StopIteration):
            next(prefetcher)


def test_close_releases_a_producer_blocked_on_a_full_queue() -> None:
    queue_full = threading.Event()
    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            for number in range(1_000_000):
                if number == 2:
                    queue_full.set()  # items 0 and 1 are queued: the put of item 2 blocks
                yield number
        finally:
            closed.set()

    prefetcher = Prefetcher(endless(), depth=2)
    assert queue_full.wait(5.0) and prefetcher._queue.full()
    started = time.monotonic()
    prefetcher.close()
    assert time.monotonic() - started < 1.0
    assert not prefetcher._thread.is_alive()
    assert closed.wait(1.0)  # the generator was closed on its own thread
    prefetcher.close()  # idempotent
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_close_without_reading_anything() -> None:
    with Prefetcher(iter(range(10_000)), depth=1) as prefetcher:
        pass
    assert not prefetcher._thread.is_alive()


def test_pin_tensors_keeps_the_structure() -> None:
    if not torch.cuda.is_available():
        # Without CUDA pinning fails; the structure walk is checked with a plain value.
        assert pin_tensors({"a": [1, (2, "x")]}) == {"a": [1, (2, "x")]}
        return
    item = {"inputs": torch.zeros(2), "pair": (torch.ones(1), [torch.ones(1)])}
    pinned = pin_tensors(item)
    assert pinned["inputs"].is_pinned() and pinned["pair"][0].is_pinned() and pinned["pair"][1][0].is_pinned()


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(iter([]), depth=0)
