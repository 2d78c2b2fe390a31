"""A user's own task, loaded by tests as ``tasks_user_example:make_task`` (not a test file)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from starling.tasks import Task, make_generator


class LinearRegressionTask(Task):
    name = "user-linear"

    def __init__(self, dim: int = 4) -> None:
        self.config = {"dim": dim}
        self.dim = dim

    def make_model(self) -> nn.Module:
        return nn.Linear(self.dim, 1)

    def batches(self, rank: int, world: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = make_generator("user-linear", seed, rank, world)
        while True:
            x = torch.randn(8, self.dim, generator=g)
            yield x, x.sum(dim=1, keepdim=True)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"eval_loss": 0.0}


def make_task(dim: int = 4) -> LinearRegressionTask:
    return LinearRegressionTask(dim=int(dim))


def not_a_task() -> object:
    return object()


NOT_CALLABLE = 3
