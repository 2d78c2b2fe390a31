"""A model's floating buffers (BatchNorm's running mean and variance) averaged over a round's
members, so that after a sync every peer evaluates with the same statistics.

The buffers travel losslessly (they are small next to the parameters) through a sharded
all-reduce of their own; owners sum in member order, so every member holds the same bits.
Integer buffers (`num_batches_tracked`) stay each peer's own: they only count steps, and a
mean of counts would be neither peer's count. A chunk whose owner died keeps its local
values, as the parameters' chunks do.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from starling.collectives.reduce import ReduceResult, ReduceTimeouts, ShardedReducer

if TYPE_CHECKING:
    from starling.node import Node


class BufferAverager:
    """Averages `model`'s floating buffers under `topic`; `averaged` is the last average."""

    def __init__(self, node: Node, model: nn.Module, topic: str, timeouts: ReduceTimeouts,
                 is_open: Callable[[], bool]) -> None:
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.numel = sum(b.numel() for b in self.buffers)
        self.reducer = ShardedReducer(node, topic, self.numel, "none", timeouts, is_open) if self.numel else None
        self.averaged: torch.Tensor | None = None  # what every member of the last sync holds

    def sync(self, t: int, members: tuple[str, ...]) -> ReduceResult | None:
        """Average the buffers over `members` in round t (blocking) and write the average back."""
        if self.reducer is None:
            return None
        vector = torch.cat([b.detach().reshape(-1).to(torch.float32) for b in self.buffers])
        result = self.reducer.reduce(t, members, vector)
        self._write(self.buffers, vector)
        self.averaged = vector
        return result

    def write_averaged(self, model: nn.Module) -> None:
        """Put the last average into `model`'s floating buffers (a twin of the synced model)."""
        if self.averaged is not None:
            self._write([b for b in model.buffers() if b.is_floating_point()], self.averaged)

    @staticmethod
    @torch.no_grad()
    def _write(buffers: list[torch.Tensor], vector: torch.Tensor) -> None:
        for b, chunk in zip(buffers, torch.split(vector, [b.numel() for b in buffers])):
            b.copy_(chunk.view_as(b).to(b.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {"averaged": None if self.averaged is None else self.averaged.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        averaged = state.get("averaged")
        if averaged is not None and averaged.numel() != self.numel:
            raise ValueError(f"averaged buffers of {averaged.numel()} values, this model's have {self.numel}")
        self.averaged = None if averaged is None else averaged.to(torch.float32).clone()
