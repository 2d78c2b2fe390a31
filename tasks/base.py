"""The `Task` seam: what every workload gives the runtime, and the helpers tasks share.

A task owns a model, each peer's data shard, a loss and a held-out evaluation. Everything
random in a task comes from a `torch.Generator` seeded by `derive_seed`, never from torch's
global RNG, so that many peers built in one process (the simulator, one thread per peer) get
the same weights and their own data streams whatever else draws from the global RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

# Re-exported: task authors and the CLI read options and seeds the way every room does.
from starling.common import config_from_options, derive_seed
from starling.common import parse_options as parse_option_pairs


class Task(ABC):
    """A workload: model, per-peer data, loss, held-out evaluation.

    Subclasses set `name` and `config_class` (a frozen dataclass whose fields are the task's
    options) and take their config as the only constructor argument.
    """

    name: ClassVar[str]
    config_class: ClassVar[type | None] = None
    config: Any = None

    @classmethod
    def from_options(cls, **options: Any) -> Task:
        """Build the task from its config defaults overridden by `options`.

        Values may be typed or strings (as the CLI passes them, e.g. ``seq_len="64"``).
        """
        if cls.config_class is None:
            raise TypeError(f"task {cls.__name__} has no config_class; construct it directly")
        return cls(config_from_options(cls.config_class, options))  # type: ignore[call-arg]

    @abstractmethod
    def make_model(self) -> nn.Module:
        """A fresh model with initial weights fixed by the task's seed (same on every peer)."""

    @abstractmethod
    def batches(self, rank: int, world: int, seed: int) -> Iterator[Any]:
        """An endless iterator over peer `rank`'s shard, deterministic for (rank, world, seed)."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """A scalar loss of `model` on `batch`, differentiable in the model's parameters."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics, at least ``eval_loss``; leaves the model's train/eval mode as it was."""

    def data_units(self) -> int | None:
        """How many units (one step's batch each) the task's training data holds, when a
        swarm should hand them out (`starling.data.assignment`); None: each peer reads its own
        `batches()` shard."""
        return None

    def unit_batch(self, index: int) -> Any:
        """The batch of unit `index` (0 <= index < `data_units()`)."""
        raise NotImplementedError(f"task {self.name!r} has no units")

    def shard_batches(self, rank: int, world: int, seed: int) -> int | None:
        """How many batches one epoch of peer `rank`'s `batches()` shard holds (None: the task
        does not say, or its data has no epochs)."""
        return None

    def batch_work(self, batch: Any) -> float:
        """How much training `batch` is, as a share of a full one (1.0): a member of a swarm that
        trains its own data is weighed by the work it did. A task whose batches can be partly
        padding (a streamed unit's last row) says how much of it is text."""
        return 1.0

    def describe(self) -> dict[str, Any]:
        """Name and config as plain data, so peers can compare what they would run."""
        config = self.config
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            fields = dataclasses.asdict(config)
        elif isinstance(config, Mapping):
            fields = dict(config)
        else:
            fields = {}
        return {"name": self.name, "config": fields}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


# ---------------------------------------------------------------- helpers for task authors


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """Run a block in eval mode without autograd, then put the model back in its prior mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def make_generator(purpose: str, *parts: int) -> torch.Generator:
    """A CPU generator seeded by `derive_seed`; the only source of randomness in tasks."""
    return torch.Generator().manual_seed(derive_seed(purpose, *parts))


def check_rank(rank: int, world: int) -> None:
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``["seq_len=64", "non_iid=0.5"]`` -> ``{"seq_len": "64", "non_iid": "0.5"}`` (CLI helper)."""
    return parse_option_pairs(pairs, "task option")

