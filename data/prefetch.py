"""Read ahead on a background thread, so the training step never waits on reading or tokenizing
while batches are ready.

    with Prefetcher(batches(), depth=4) as ready:
        for inputs, targets in ready:
            ...

The source iterator runs on one daemon thread and fills a queue of at most `depth` items; the
consumer takes them in order. An exception the source raises comes out of the consumer's
`next()` at the position it happened, with its traceback. `close()` stops the thread also when
it waits on a full queue.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _End:
    """The source is used up."""


@dataclass(frozen=True)
class _Failure:
    """The source raised `error`."""

    error: BaseException


def pin_tensors(item: Any) -> Any:
    """`item` with every tensor in it (also inside tuples, lists and dicts) in pinned memory,
    so its copy to the GPU can run asynchronously."""
    if isinstance(item, torch.Tensor):
        return item.pin_memory()
    if isinstance(item, tuple):
        pinned = [pin_tensors(value) for value in item]
        return type(item)(*pinned) if hasattr(item, "_fields") else tuple(pinned)
    if isinstance(item, list):
        return [pin_tensors(value) for value in item]
    if isinstance(item, dict):
        return {key: pin_tensors(value) for key, value in item.items()}
    return item


class Prefetcher(Generic[T]):
    """An iterator over `iterator`'s items, read up to `depth` items ahead on a background thread.

    `pin_memory=True` pins every tensor of each item on that thread (it needs CUDA; the caller
    decides). The source is iterated only by the background thread; when it is a generator, it
    is closed there once the prefetcher stops, so its `finally` blocks run.
    """

    def __init__(self, iterator: Iterator[T], depth: int = 4, pin_memory: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.depth = depth
        self.pin_memory = pin_memory
        self._source = iterator
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="starling-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for item in self._source:
                if self.pin_memory:
                    item = pin_tensors(item)
                if self._stopping.is_set():
                    return
                self._queue.put(item)
                if self._stopping.is_set():
                    return
            self._queue.put(_End())
        except BaseException as error:  # the consumer re-raises it where it happened
            self._queue.put(_Failure(error))
        finally:
            close = getattr(self._source, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    logger.warning("closing the prefetcher's source failed", exc_info=True)

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        return item  # type: ignore[no-any-return]

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop reading ahead and drop what was read. Returns at once when the background thread
        waits on the queue; a source blocked inside its own `next()` is waited for at most
        `timeout_s` (the thread is a daemon, so it never holds the process open). Idempotent.
        Call it from the consuming thread, not while another thread waits in `next()`."""
        self._finished = True
        self._stopping.set()
        # Emptying the queue releases a producer blocked in `put`. Only the producer puts, and
        # it checks `_stopping` after each put, so it puts at most one more item, into a queue
        # with room for it: it cannot block again.
        self._drain()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the prefetcher's source did not stop within %.1f s; leaving its thread behind", timeout_s)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
