"""The network thread: one asyncio loop per process that serves every node in it.

Training code runs in its own threads and talks to the loop through thread-safe
futures, so a protocol can start a send, keep computing, and wait later.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, TypeVar

import zmq
import zmq.asyncio

from starling.node.admission import ProcessLoad
from starling.node.allocator import AllocatorTuning, keep_freed_memory
from starling.node.security import ZapRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")

# One ROUTER per node plus its open DEALERs (at most TransportConfig.max_open_dealers each):
# 256 simulated nodes with 64 open each need 16,640. Each socket also holds a file
# descriptor, so the process's RLIMIT_NOFILE bounds this too.
MAX_SOCKETS_PER_PROCESS = 32768


class LoopLag:
    """How far behind its timers a loop has run: a callback every `tick_s`, and the lateness
    of each one that ran more than half a tick late (the loop was busy with other nodes'
    messages, or the process was not scheduled), kept for `window_s`.

    A node that hears nothing from a peer while its own loop was late by a good part of the
    wait cannot blame the peer: the answer may be sitting unread in its socket. This is
    Lifeguard's local health measured instead of inferred, and shared by every node of the
    process (a simulator's worker runs hundreds on one loop, all slow together)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float = 0.1, window_s: float = 60.0) -> None:
        self._loop = loop
        self.tick_s = tick_s
        self.window_s = window_s
        self._lags: deque[tuple[float, float]] = deque()  # (loop time it caught up, seconds late)
        self._due = loop.time() + tick_s

    def start(self) -> None:
        """On the loop: the first tick."""
        self._due = self._loop.time() + self.tick_s
        self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        late = now - self._due
        if late > self.tick_s / 2:
            self._lags.append((now, late))
        while self._lags and now - self._lags[0][0] > self.window_s:
            self._lags.popleft()
        self._due = now + self.tick_s
        self._loop.call_at(self._due, self._tick)

    def worst_since(self, since: float) -> float:
        """The most the loop fell behind in a stall that ended at or after `since` (loop time,
        `time.monotonic`), counting the tick that is due and not yet run (behind right now)."""
        now = self._loop.time()
        worst = max(0.0, now - self._due)
        for when, late in reversed(self._lags):
            if when < since:
                break
            worst = max(worst, late)
        return worst


class NetworkThread:
    """A daemon thread running an asyncio loop and owning the process's ZeroMQ context.

    There is one per process (inproc endpoints only connect within one context);
    after a fork the child gets a fresh one.
    """

    _instance: ClassVar[NetworkThread | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()
    tuning: ClassVar[AllocatorTuning | None] = None  # what keep_freed_memory() did in this process

    def __init__(self) -> None:
        self.pid = os.getpid()
        NetworkThread.tuning = keep_freed_memory()  # before the I/O thread allocates its first buffer
        self.context = zmq.asyncio.Context()
        self.context.set(zmq.MAX_SOCKETS, MAX_SOCKETS_PER_PROCESS)
        self.loop = asyncio.new_event_loop()
        self.zap = ZapRegistry(self.context)  # one ZAP handler per context
        self.load = ProcessLoad()  # requests in flight across this process's nodes (node.admission)
        self.lag = LoopLag(self.loop)  # how far behind the loop runs (the failure detector asks)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="starling-network", daemon=True)
        self._thread.start()
        self._ready.wait()

    @classmethod
    def get(cls) -> NetworkThread:
        with cls._instance_lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = NetworkThread()
            return cls._instance

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self.lag.start)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def in_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop from any thread; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the loop and block the calling (non-loop) thread for its result."""
        if self.in_loop():
            coro.close()
            raise RuntimeError("NetworkThread.run() called from the network thread; await instead")
        return self.submit(coro).result(timeout_s)


def read_outcome(future: asyncio.Future[Any]) -> None:
    """A done-callback that reads how `future` ended: one that fails as it is cancelled or given
    up on (a send timing out) is otherwise logged by asyncio as never retrieved."""
    if not future.cancelled():
        future.exception()


def spawn_logged(coro: Any, tasks: set[asyncio.Task[Any]], peer_id: str) -> asyncio.Future[Any]:
    """Run `coro` as one of a node's background tasks (`tasks`, which it leaves when done), its
    failure logged (`_logged`)."""
    task = asyncio.ensure_future(_logged(coro, peer_id))
    # A task cancelled before it starts never starts `coro`: close it, or Python warns that
    # it was never awaited (a closed node cancels what it spawned).
    task.add_done_callback(lambda _: getattr(coro, "close", lambda: None)())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


async def _logged(coro: Any, peer_id: str) -> Any:
    """Run a background task's coroutine and log its failure here: a done-callback that reads
    it never runs when the node's loop stops first, and asyncio then logs it as never retrieved
    (hundreds of lines as a thousand simulated peers close)."""
    try:
        return await coro
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.debug("%s: background task failed: %s", peer_id, exc)
        return None


class AwakeDeadline:
    """A time budget counted in the loop's awake time, for waits that must not expire while
    the loop itself was stalled.

    A plain `asyncio.wait_for(x, 5)` measures wall time. When this process is starved (a
    loaded host, the GIL held by training threads), its loop can wake seconds late, and the
    expired timer then runs before the loop has read what arrived meanwhile: a round closes
    without a part that was already waiting in the socket. Here a wait goes in ticks, and a
    tick that woke late counts as at most two ticks, so the budget is spent only while the
    loop could listen; the time lost to a stall is not counted, the way the failure detector
    pardons its own stalls (`PeerTable.pardon`). `stretch` bounds the wall time: the budget
    always ends by `stretch` times its length, however slow the loop.
    """

    STRETCH = 3.0  # the default bound: waits that must agree on it (member and owner) use this

    def __init__(self, seconds: float, tick_s: float = 0.25, stretch: float = STRETCH) -> None:
        if tick_s <= 0 or stretch < 1:
            raise ValueError(f"tick_s must be > 0 and stretch >= 1, got {tick_s} and {stretch}")
        self.left = max(seconds, 0.0)
        self.tick_s = tick_s
        self.hard = asyncio.get_running_loop().time() + self.left * stretch
        self.stalled_s = 0.0  # wall time not counted against the budget

    def expired(self) -> bool:
        return self.left <= 0 or asyncio.get_running_loop().time() >= self.hard

    def wall_left(self) -> float:
        """At most this much wall time remains (the bound for a wait's own timeout)."""
        return max(self.hard - asyncio.get_running_loop().time(), 0.0)

    async def wait(self, aw: Any) -> Any:
        """`await aw` within the budget left; on expiry cancel it and raise TimeoutError.

        One timer a tick, which spends the tick from the budget and arms the next: a thousand
        idle waits (a round's parts waiting for their owners) cost a timer callback a tick each,
        not a wait of their own (a future, callbacks and a timer each, every tick)."""
        loop = asyncio.get_running_loop()
        fut = asyncio.ensure_future(aw)
        try:
            if fut.done():
                return fut.result()
            if self.expired():
                raise asyncio.TimeoutError
            woken = loop.create_future()  # `fut` ended, or the budget ran out

            def wake(_: Any = None) -> None:
                if not woken.done():
                    woken.set_result(None)

            tick = _Tick(self, loop, wake)
            fut.add_done_callback(wake)
            try:
                tick.arm()
                await woken
            finally:
                fut.remove_done_callback(wake)
                tick.stop()  # spends the part of a tick that passed before `fut` ended
            if fut.done():
                return fut.result()
            raise asyncio.TimeoutError
        finally:
            if not fut.done():
                fut.cancel()
            fut.add_done_callback(read_outcome)

    async def run_out(self) -> None:
        """Wait until the budget is spent, in awake time (`sleep` wakes by its wall clock)."""
        try:
            await self.wait(asyncio.Event().wait())
        except asyncio.TimeoutError:
            pass

    async def sleep(self, seconds: float) -> None:
        """Sleep up to `seconds`, spending them from the budget (never past it)."""
        try:
            await self.wait(asyncio.sleep(min(seconds, self.left)))
        except asyncio.TimeoutError:
            pass


class _Tick:
    """The timer of one `AwakeDeadline.wait`: each tick spends what it took, as awake time,
    from the deadline's budget (a tick that woke late counts as at most two), then arms the
    next, or wakes the wait once the budget is spent."""

    __slots__ = ("deadline", "loop", "started", "step", "timer", "wake")

    def __init__(self, deadline: AwakeDeadline, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self.deadline, self.loop, self.wake = deadline, loop, wake
        self.started, self.step = 0.0, 0.0
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        d = self.deadline
        self.step = min(d.tick_s, d.left, d.wall_left())
        self.started = self.loop.time()
        self.timer = self.loop.call_later(self.step, self._rang)

    def _spend(self) -> None:
        d = self.deadline
        elapsed = self.loop.time() - self.started
        counted = min(elapsed, self.step + d.tick_s)
        d.stalled_s += elapsed - counted
        d.left -= counted

    def _rang(self) -> None:
        self.timer = None
        self._spend()
        if self.deadline.expired():
            self.wake()
        else:
            self.arm()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            self._spend()


async def close_in_time(seconds: float, done: asyncio.Event, close: Callable[[], None]) -> None:
    """Call `close()` unless `done` is set within `seconds` of this loop's awake time (a group
    of a round that waits for the others' contributions). `done` is set on return either way,
    so that nothing waits on it forever, even when `close()` raised."""
    try:
        await AwakeDeadline(seconds).wait(done.wait())
    except asyncio.TimeoutError:
        try:
            close()
        finally:
            done.set()
