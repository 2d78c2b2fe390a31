"""The runtime's side of audits (`protocols/audit.py`): which batch this peer trains on, and any
member's batch by the recipe it states.

A batch is named by (rank, world, index): batch `index` of `task.batches(rank, world, seed)`, the
index counting the batches a peer trained on since its start (or since the checkpoint it resumed:
that checkpoint's step). An auditor reads another member's batch from an iterator of its own
over that member's shard, advanced to the index (built-in tasks make a batch in microseconds);
it keeps a few such iterators, and makes a batch at most `max_ahead` past an iterator's position
(an index behind it starts the shard again), so that a stated recipe costs bounded work.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from starling.protocols import LossFn
from starling.tasks import Task

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    batches: Iterator[Any]
    position: int = 0  # the index of the batch next() gives
    last: tuple[int, Any] | None = None  # (index, batch) of the last one given


class BatchRecipes:
    """`protocol.audit_data` as a Trainer makes it: `recipe()` is this peer's current batch,
    `loss_fn(rank, world, index)` the loss on a member's batch, through `loss_of(batch)` (the
    Trainer's own step closure: the same placement, autocast and forward model)."""

    def __init__(self, task: Task, seed: int, rank: int, world: int, index: Callable[[], int],
                 loss_of: Callable[[Any], LossFn], max_streams: int = 8, max_ahead: int = 100_000) -> None:
        self.task, self.seed, self.rank, self.world = task, seed, rank, world
        self._index, self._loss_of = index, loss_of
        self.max_streams, self.max_ahead = max_streams, max_ahead
        self._streams: OrderedDict[tuple[int, int], _Stream] = OrderedDict()

    def recipe(self) -> tuple[int, int, int]:
        return self.rank, self.world, self._index()

    def loss_fn(self, rank: int, world: int, index: int) -> LossFn | None:
        batch = self.batch(rank, world, index)
        return None if batch is None else self._loss_of(batch)

    def batch(self, rank: int, world: int, index: int) -> Any | None:
        """Batch `index` of shard (rank, world); None if it is too far to make or not the task's."""
        stream = self._streams.pop((rank, world), None)
        if stream is not None and stream.last is not None and stream.last[0] == index:
            self._streams[(rank, world)] = stream
            return stream.last[1]
        if stream is None or stream.position > index:
            if index > self.max_ahead:
                return None
            try:
                stream = _Stream(self.task.batches(rank, world, self.seed))
            except ValueError as exc:  # a shard this task cannot cut (a world bigger than its data)
                log.info("no batches of shard %d of %d: %s", rank, world, exc)
                return None
        if index - stream.position > self.max_ahead:
            return None
        while stream.position < index:
            next(stream.batches)
            stream.position += 1
        batch = next(stream.batches)
        stream.position += 1
        stream.last = (index, batch)
        self._streams[(rank, world)] = stream
        while len(self._streams) > self.max_streams:
            self._streams.popitem(last=False)
        return batch
