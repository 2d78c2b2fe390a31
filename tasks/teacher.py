"""`teacher`: a student MLP learns to classify like a fixed random teacher MLP.

Inputs are standard Gaussian vectors; the label of x is the argmax of a random one-hidden-layer
tanh teacher, whose output biases are calibrated so the classes are about equally likely.

Label skew across peers (`non_iid` = a in [0, 1]): peer r draws each example's label from

    p_r = (1 - a) * uniform(all classes) + a * uniform(S_r),
    S_r = {c : c mod world == r}   (or {r mod num_classes} when that set is empty),

then an input with that label. a = 0 is IID (plain teacher-labelled Gaussians); a = 1 gives each
peer only its own classes. When world divides num_classes, or num_classes divides world, the
peers' mixes average to the uniform distribution the held-out set is drawn from.

Or `partition` (``iid``, ``dirichlet:ALPHA``, ``shards:K``): each peer's label distribution is
the one Flower's partitioner of that name gives it (`tasks/partition.py`), drawn from `seed`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from starling.common.devices import to_model_device

from .base import Task, check_rank, evaluating, make_generator
from .partition import Partition

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs (B, input_dim) float32, labels (B,) int64


@dataclass(frozen=True)
class TeacherConfig:
    seed: int = 0  # teacher weights, student initial weights, held-out set
    input_dim: int = 32
    num_classes: int = 10
    teacher_hidden: int = 64
    hidden: int = 64  # student width
    depth: int = 2  # student hidden layers
    batch_size: int = 64
    non_iid: float = 0.0
    partition: str = ""  # iid, dirichlet:ALPHA or shards:K (tasks/partition.py); "" : non_iid's rule
    eval_size: int = 2048

    def __post_init__(self) -> None:
        for field in ("input_dim", "teacher_hidden", "hidden", "depth", "batch_size", "eval_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if not 0.0 <= self.non_iid <= 1.0:
            raise ValueError(f"non_iid must be in [0, 1], got {self.non_iid}")
        if self.partition:
            Partition.parse(self.partition)
            if self.non_iid:
                raise ValueError("give partition or non_iid, not both")


class Teacher:
    """The fixed labelling function: argmax of tanh(x W1 + b1) W2 + b2."""

    CALIBRATION_SAMPLES = 16384
    CALIBRATION_ROUNDS = 30

    def __init__(self, config: TeacherConfig) -> None:
        g = make_generator("teacher.teacher", config.seed)
        d, h, c = config.input_dim, config.teacher_hidden, config.num_classes
        self.w1 = torch.randn(d, h, generator=g) / math.sqrt(d)
        self.b1 = 0.1 * torch.randn(h, generator=g)
        self.w2 = torch.randn(h, c, generator=g) * (3.0 / math.sqrt(h))
        self.b2 = torch.zeros(c)
        # Shift each class's bias by its log excess frequency until classes are near-balanced,
        # so no peer's label mix asks for a class the teacher almost never emits.
        x = torch.randn(self.CALIBRATION_SAMPLES, d, generator=g)
        logits = self.logits(x)
        for _ in range(self.CALIBRATION_ROUNDS):
            counts = torch.bincount((logits + self.b2).argmax(1), minlength=c).float()
            self.b2 -= 0.5 * torch.log((counts + 1.0) / (counts.mean() + 1.0))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2

    def label(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x).argmax(dim=1)


class TeacherTask(Task):
    name = "teacher"
    config_class = TeacherConfig

    def __init__(self, config: TeacherConfig | None = None) -> None:
        self.config = config or TeacherConfig()
        self.teacher = Teacher(self.config)
        g = make_generator("teacher.eval", self.config.seed)
        eval_x = torch.randn(self.config.eval_size, self.config.input_dim, generator=g)
        self._eval_set: Batch = (eval_x, self.teacher.label(eval_x))

    def make_model(self) -> nn.Module:
        cfg = self.config
        widths = [cfg.input_dim] + [cfg.hidden] * cfg.depth
        layers: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(widths):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], cfg.num_classes))
        model = nn.Sequential(*layers)
        # Redraw torch's default Linear init range from our generator, so the weights do not
        # depend on the global RNG's state.
        g = make_generator("teacher.student", cfg.seed)
        with torch.no_grad():
            for module in model:
                if isinstance(module, nn.Linear):
                    bound = 1.0 / math.sqrt(module.in_features)
                    module.weight.uniform_(-bound, bound, generator=g)
                    module.bias.uniform_(-bound, bound, generator=g)
        return model

    def label_mix(self, rank: int, world: int) -> torch.Tensor:
        """Peer `rank`'s label distribution p_r (see the module docstring)."""
        check_rank(rank, world)
        c = self.config.num_classes
        if self.config.partition:
            return Partition.parse(self.config.partition).label_mixes(c, world, self.config.seed)[rank]
        own = [k for k in range(c) if k % world == rank] or [rank % c]
        skewed = torch.zeros(c)
        skewed[own] = 1.0 / len(own)
        return (1.0 - self.config.non_iid) * torch.full((c,), 1.0 / c) + self.config.non_iid * skewed

    def batches(self, rank: int, world: int, seed: int) -> Iterator[Batch]:
        check_rank(rank, world)
        g = make_generator("teacher.batches", seed, rank, world)
        if self.config.non_iid == 0.0 and self.config.partition in ("", "iid"):
            return self._iid_batches(g)
        return self._skewed_batches(g, self.label_mix(rank, world))

    def _iid_batches(self, g: torch.Generator) -> Iterator[Batch]:
        while True:
            x = torch.randn(self.config.batch_size, self.config.input_dim, generator=g)
            yield x, self.teacher.label(x)

    def _skewed_batches(self, g: torch.Generator, mix: torch.Tensor) -> Iterator[Batch]:
        """Draw labels from `mix`, then inputs with those labels from per-class pools.

        Pools are refilled from fresh teacher-labelled Gaussians; each pool is capped, which drops
        surplus inputs of classes this peer rarely needs without biasing any class's inputs.
        """
        cfg = self.config
        refill, cap = max(1024, 4 * cfg.batch_size), 4 * cfg.batch_size
        pools = [torch.empty(0, cfg.input_dim) for _ in range(cfg.num_classes)]
        while True:
            labels = torch.multinomial(mix, cfg.batch_size, replacement=True, generator=g)
            need = torch.bincount(labels, minlength=cfg.num_classes).tolist()
            while any(len(pool) < n for pool, n in zip(pools, need)):
                x = torch.randn(refill, cfg.input_dim, generator=g)
                y = self.teacher.label(x)
                pools = [
                    torch.cat([pool, x[y == c]])[: max(cap, n)]
                    for c, (pool, n) in enumerate(zip(pools, need))
                ]
            xs = []
            for c, n in enumerate(need):
                xs.append(pools[c][:n])
                pools[c] = pools[c][n:]
            x = torch.cat(xs)
            y = torch.repeat_interleave(torch.arange(cfg.num_classes), torch.tensor(need))
            order = torch.randperm(cfg.batch_size, generator=g)
            yield x[order], y[order]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x, y = to_model_device(self._eval_set, model)
        with evaluating(model):
            logits = model(x)
            return {
                "eval_loss": F.cross_entropy(logits, y).item(),
                "eval_accuracy": (logits.argmax(dim=1) == y).float().mean().item(),
            }
