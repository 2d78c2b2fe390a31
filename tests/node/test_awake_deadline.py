"""AwakeDeadline: a budget spent only while the loop can listen, bounded in wall time."""
from __future__ import annotations

import asyncio
import gc
import time

import pytest

from starling.node.loop import AwakeDeadline, LoopLag, close_in_time


async def _ready_after(iterations: int) -> str:
    """Something that takes a few loop turns once the loop runs (a message being read)."""
    for _ in range(iterations):
        await asyncio.sleep(0)
    return "read"


def test_a_stall_of_the_loop_is_not_spent_from_the_budget():
    async def main():
        loop = asyncio.get_running_loop()
        arrived = loop.create_future()
        deadline = AwakeDeadline(1.0, tick_s=0.25)
        waiting = asyncio.ensure_future(deadline.wait(arrived))
        await asyncio.sleep(0.05)
        time.sleep(2.0)  # the whole loop stalls for twice the budget
        # What arrived during the stall is read on the first turns after it: still in time.
        asyncio.ensure_future(_ready_after(5)).add_done_callback(lambda f: arrived.set_result(f.result()))
        return await waiting, deadline

    got, deadline = asyncio.run(main())
    assert got == "read"
    assert deadline.stalled_s >= 1.0  # most of the stall was pardoned


def test_a_plain_timer_would_have_expired_in_the_same_stall():
    """The failure AwakeDeadline exists for: wait_for's timer runs before the late arrival is read."""
    async def main():
        loop = asyncio.get_running_loop()
        arrived = loop.create_future()
        waiting = asyncio.ensure_future(asyncio.wait_for(arrived, 1.0))
        await asyncio.sleep(0.05)
        time.sleep(2.0)
        loop.call_soon(lambda: asyncio.ensure_future(_ready_after(5)).add_done_callback(
            lambda f: arrived.set_result(f.result())))
        with pytest.raises(asyncio.TimeoutError):
            await waiting

    asyncio.run(main())


def test_running_out_a_budget_goes_on_after_a_stall_longer_than_it():
    """`run_out` spends the budget in awake time: a stall longer than the whole budget costs
    it at most two ticks, and the rest is waited once the loop runs again."""
    async def main():
        deadline = AwakeDeadline(0.5, tick_s=0.05)
        waiting = asyncio.ensure_future(deadline.run_out())
        await asyncio.sleep(0.02)
        time.sleep(1.0)
        after_stall = time.monotonic()
        turned = asyncio.ensure_future(_ready_after(20))
        await waiting
        return turned.done(), time.monotonic() - after_stall

    turned, waited_after = asyncio.run(main())
    assert turned and waited_after >= 0.3


def test_an_idle_wait_expires_after_its_budget_not_before():
    async def main():
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await AwakeDeadline(0.6, tick_s=0.1).wait(asyncio.sleep(3600))
        return time.monotonic() - start

    assert asyncio.run(main()) >= 0.6


def test_a_loop_that_keeps_stalling_still_ends_by_stretch_times_the_budget():
    async def hog():
        while True:
            time.sleep(0.2)  # every turn of the loop is slow: nothing but stalls
            await asyncio.sleep(0)

    async def main():
        hogger = asyncio.ensure_future(hog())
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await AwakeDeadline(0.5, tick_s=0.05, stretch=3.0).wait(asyncio.sleep(3600))
        hogger.cancel()
        return time.monotonic() - start

    elapsed = asyncio.run(main())
    assert 0.5 <= elapsed < 1.5 + 1.0  # the wall bound, plus a hogged turn or two on a loaded box


def test_the_awaited_work_is_cancelled_on_expiry_and_results_pass_through():
    async def main():
        inner = asyncio.ensure_future(asyncio.sleep(3600))
        with pytest.raises(asyncio.TimeoutError):
            await AwakeDeadline(0.05, tick_s=0.01).wait(inner)
        await asyncio.sleep(0)
        assert inner.cancelled()
        assert await AwakeDeadline(1.0).wait(_ready_after(2)) == "read"
        with pytest.raises(ValueError, match="boom"):
            await AwakeDeadline(1.0).wait(_raise())

    async def _raise():
        raise ValueError("boom")

    asyncio.run(main())


def test_bad_arguments_are_refused():
    async def main():
        with pytest.raises(ValueError):
            AwakeDeadline(1.0, tick_s=0)
        with pytest.raises(ValueError):
            AwakeDeadline(1.0, stretch=0.5)

    asyncio.run(main())


def test_close_in_time_closes_once_late_and_never_leaves_waiters_hanging():
    async def main():
        calls = []
        done = asyncio.Event()
        await close_in_time(0.05, done, lambda: calls.append("closed"))
        assert calls == ["closed"] and done.is_set()

        early = asyncio.Event()
        timer = asyncio.ensure_future(close_in_time(5.0, early, lambda: calls.append("late")))
        early.set()  # everyone came in: the timer ends without closing
        await timer
        assert calls == ["closed"]

        def broken() -> None:
            raise RuntimeError("close failed")

        failed = asyncio.Event()
        with pytest.raises(RuntimeError):
            await close_in_time(0.05, failed, broken)
        assert failed.is_set()  # waiters wake and find no result

    asyncio.run(main())


def test_loop_lag_reports_a_stall_from_when_it_ended_and_forgets_it_after_its_window():
    async def main():
        loop = asyncio.get_running_loop()
        lag = LoopLag(loop, tick_s=0.02, window_s=0.5)
        lag.start()
        await asyncio.sleep(0.1)
        before = loop.time()
        calm = lag.worst_since(before)
        time.sleep(0.3)  # the loop runs nothing for 0.3 s
        behind_now = lag.worst_since(before)  # the due tick has not run yet: behind right now
        await asyncio.sleep(0.05)
        after_stall = lag.worst_since(before)
        later = loop.time()
        await asyncio.sleep(0.1)
        since_later = lag.worst_since(later)
        await asyncio.sleep(0.6)
        return calm, behind_now, after_stall, since_later, lag.worst_since(before)

    calm, behind_now, after_stall, since_later, forgotten = asyncio.run(main())
    assert calm < 0.02
    assert behind_now >= 0.25 and after_stall >= 0.25
    assert since_later < 0.25  # a stall that ended before `since` is not counted
    assert forgotten < 0.25  # past the window



def test_what_a_deadline_gives_up_on_is_read_even_if_it_fails_as_it_is_cancelled():
    """A send that times out as it is cancelled ends with its error, not CancelledError: the
    deadline reads it, so asyncio logs nothing as never retrieved."""
    unread: list[dict] = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise ConnectionError("send timed out") from None

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context))
        with pytest.raises(asyncio.TimeoutError):
            await AwakeDeadline(0.05, tick_s=0.01).wait(stubborn())
        await asyncio.sleep(0.05)  # the cancelled task ends with its error

    asyncio.run(main())
    gc.collect()  # an unread exception is reported when its task is collected
    assert not unread, unread
