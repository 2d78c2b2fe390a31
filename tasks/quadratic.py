"""`quadratic`: a convex objective with a known optimum, for exact tests of protocols.

    f(x)   = 1/2 (x - x*)^T A (x - x*),   A = diag(a), a log-spaced in [1/condition_number, 1]
    f_r(x) = 1/2 (x - x*_r)^T A (x - x*_r),   x*_r = x* + d_r,   sum_r d_r = 0

Peer r's batches are noisy targets t = x*_r + noise_std * xi, and its loss is
1/2 (x - t)^T A (x - t), so its expected gradient is A (x - x*_r). The peers' mean gradient is
A (x - x*): the swarm's optimum is exactly x*, while each peer alone would drift to its own
x*_r (`peer_spread` sets how far). The largest curvature is 1, so plain gradient descent is
stable for learning rates below 2 and converges at rate (1 - lr / condition_number).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .base import Task, check_rank, evaluating, make_generator


@dataclass(frozen=True)
class QuadraticConfig:
    seed: int = 0  # x*, the peers' offsets
    dim: int = 1000
    condition_number: float = 100.0
    peer_spread: float = 1.0  # std of each coordinate of a peer's offset d_r
    noise_std: float = 0.0  # std of the per-batch target noise
    init_scale: float = 0.0  # x0 = init_scale * N(0, 1); 0 starts at the origin

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if self.condition_number < 1.0:
            raise ValueError(f"condition_number must be >= 1, got {self.condition_number}")
        for field in ("peer_spread", "noise_std", "init_scale"):
            if getattr(self, field) < 0.0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")


class QuadraticModel(nn.Module):
    """The model is just the point x."""

    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(x0.clone())

    def forward(self) -> torch.Tensor:
        return self.x


class QuadraticTask(Task):
    name = "quadratic"
    config_class = QuadraticConfig

    def __init__(self, config: QuadraticConfig | None = None) -> None:
        self.config = config or QuadraticConfig()
        cfg = self.config
        self._curvature = torch.logspace(
            -torch.log10(torch.tensor(cfg.condition_number, dtype=torch.float64)).item(),
            0.0,
            cfg.dim,
            dtype=torch.float64,
        )
        g = make_generator("quadratic.optimum", cfg.seed)
        self._optimum = torch.randn(cfg.dim, generator=g, dtype=torch.float64)
        self._offsets: dict[int, torch.Tensor] = {}
        # a simulator's peers start together, each on its thread: without it each of them drew
        # the whole (world, dim) table (1024 peers: 8 MB and 10 ms apiece, all at once)
        self._offsets_lock = threading.Lock()

    def curvature(self) -> torch.Tensor:
        """The diagonal a of A (float64)."""
        return self._curvature.clone()

    def optimum(self) -> torch.Tensor:
        """x*, the swarm's optimum (float64)."""
        return self._optimum.clone()

    def peer_offsets(self, world: int) -> torch.Tensor:
        """(world, dim) offsets d_r with zero mean over peers (float64), fixed by (seed, world)."""
        check_rank(0, world)
        with self._offsets_lock:
            if world not in self._offsets:
                g = make_generator("quadratic.offsets", self.config.seed, world)
                d = torch.randn(world, self.config.dim, generator=g, dtype=torch.float64)
                d = self.config.peer_spread * d
                self._offsets[world] = d - d.mean(dim=0)
            return self._offsets[world]

    def peer_optimum(self, rank: int, world: int) -> torch.Tensor:
        """x*_r, the optimum of peer `rank`'s own objective (float64)."""
        check_rank(rank, world)
        return self._optimum + self.peer_offsets(world)[rank]

    def make_model(self) -> QuadraticModel:
        g = make_generator("quadratic.init", self.config.seed)
        x0 = self.config.init_scale * torch.randn(self.config.dim, generator=g)
        return QuadraticModel(x0)

    def batches(self, rank: int, world: int, seed: int) -> Iterator[torch.Tensor]:
        target = self.peer_optimum(rank, world).float()
        return self._targets(target, make_generator("quadratic.batches", seed, rank, world))

    def _targets(self, target: torch.Tensor, g: torch.Generator) -> Iterator[torch.Tensor]:
        while True:
            if self.config.noise_std == 0.0:
                yield target.clone()
            else:
                yield target + self.config.noise_std * torch.randn(self.config.dim, generator=g)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        x = _point(model)
        a = self._curvature.to(x.device, x.dtype)
        return 0.5 * torch.sum(a * (x - batch) ** 2)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        with evaluating(model):
            delta = _point(model).double().cpu() - self._optimum
            gap = 0.5 * torch.sum(self._curvature * delta**2)
            return {"eval_loss": gap.item(), "distance": delta.norm().item()}


def _point(model: nn.Module) -> torch.Tensor:
    """x as one vector, for the task's own model or any module holding `dim` parameters."""
    if isinstance(model, QuadraticModel):
        return model.x
    return torch.cat([p.reshape(-1) for p in model.parameters()])
