"""Differential-privacy pieces of `sketch-dp`: clipping, Gaussian noise, the accountant,
per-sample gradients and Poisson-sampled private data.

The accounting is Opacus' (`opacus.accountants`, RDP or PRV), imported only when a run has
noise: importing Opacus is slow, and a run without noise spends no privacy to account for.
Our accountant keeps Opacus' own history format, a list of (noise multiplier, sample rate,
steps), as plain data, so that it travels in a protocol's state dict and a joiner reports
the same epsilon.

Noise is drawn from a generator seeded by the OS's entropy, never from the swarm seed:
a peer that could regenerate another's noise could subtract it.
"""
from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import torch
from torch import nn

MECHANISMS = ("rdp", "prv")
UNITS = ("peer", "sample")
Batch = tuple[torch.Tensor, ...]
SampleLoss = Callable[[Any, Batch], torch.Tensor]  # loss(model, batch) -> scalar, a Task's `loss`


@dataclass(frozen=True)
class PrivacyReport:
    """What a peer has spent so far; `epsilon` is inf without noise."""

    epsilon: float
    delta: float
    noise_multiplier: float  # sigma
    noise_std: float  # sigma * C, per sketch coordinate
    clip: float  # C, the L2 bound in sketch space (per peer or per sample, see dp_unit)
    dp_unit: str  # "peer": one peer's whole contribution per round; "sample": one training example
    sample_rate: float  # q: Poisson rate of samples (1 for the peer unit: every peer, every round)
    rounds: int
    accountant: str
    noise: str = "local"  # "distributed": members' shares, summed in a secure aggregation (noise_std is the sum's)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON data: an infinite epsilon (no noise) is the string "inf"."""
        out = asdict(self)
        out["epsilon"] = self.epsilon if math.isfinite(self.epsilon) else "inf"
        return out


class Accountant:
    """Opacus' RDP or PRV accountant over a plain-data history."""

    def __init__(self, mechanism: str = "rdp") -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"accountant must be one of {', '.join(MECHANISMS)}, got {mechanism!r}")
        self.mechanism = mechanism
        self.history: list[tuple[float, float, int]] = []
        self._cache: tuple[tuple[tuple[float, float, int], ...], float, float] | None = None

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        """One round released under (sigma, q); consecutive equal rounds merge, as in Opacus."""
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, steps = self.history[-1]
            self.history[-1] = (sigma, q, steps + 1)
        else:
            self.history.append((float(noise_multiplier), float(sample_rate), 1))

    @property
    def rounds(self) -> int:
        return sum(steps for _, _, steps in self.history)

    def epsilon(self, delta: float) -> float:
        if not self.history:
            return 0.0
        if any(sigma <= 0.0 for sigma, _, _ in self.history):
            return math.inf
        key = tuple(self.history)
        if self._cache is None or self._cache[:2] != (key, delta):
            accountant = _opacus_accountant(self.mechanism)
            accountant.history = list(self.history)
            with warnings.catch_warnings():  # PRV at q = 1 takes log(1 - q) on its way: harmless
                warnings.simplefilter("ignore", RuntimeWarning)
                self._cache = (key, delta, float(accountant.get_epsilon(delta=delta, **_orders(self.mechanism))))
        return self._cache[2]

    def state(self) -> list[list[float]]:
        return [[sigma, q, float(steps)] for sigma, q, steps in self.history]

    def load(self, state: Sequence[Sequence[float]]) -> None:
        self.history = [(float(sigma), float(q), int(steps)) for sigma, q, steps in state]
        self._cache = None


def _orders(mechanism: str) -> dict[str, Any]:
    """RDP orders past Opacus' default largest (63): with much noise or few rounds the best
    order lies beyond it, and Opacus then reports a looser epsilon than it could (and warns).
    More orders never loosen the bound; the minimum over them is taken."""
    if mechanism != "rdp":
        return {}
    from opacus.accountants import RDPAccountant

    return {"alphas": [*RDPAccountant.DEFAULT_ALPHAS, 64, 80, 96, 128, 192, 256, 384, 512, 768, 1024]}


def _opacus_accountant(mechanism: str) -> Any:
    from opacus.accountants import create_accountant

    return create_accountant(mechanism=mechanism)


def solve_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                           mechanism: str = "rdp") -> float:
    """The sigma that spends (target_epsilon, delta) in `steps` rounds at rate q (Opacus' search)."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                      steps=steps, accountant=mechanism, **_orders(mechanism)))


def clip_rows_(rows: torch.Tensor, clip: float) -> torch.Tensor:
    """Scale each row of a (B, s) matrix in place to L2 norm <= clip; returns the factors."""
    norms = rows.norm(dim=1)
    factors = (clip / norms.clamp_min(1e-12)).clamp_max(1.0)
    rows.mul_(factors.unsqueeze(1))
    return factors


def secret_generator() -> torch.Generator:
    """A generator no other peer can reproduce (for noise and Poisson sampling)."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def gaussian_noise(numel: int, std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(numel, generator=generator).mul_(std)


# ---------------------------------------------------------------- per-sample gradients
class BoundParams:
    """Calls a module with given parameter tensors (torch.func.functional_call), so that a
    task's `loss(model, batch)` runs unchanged under vmap."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self.module, self.tensors = module, tensors

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.module, self.tensors, args, kwargs)


def per_sample_grads(model: nn.Module, loss: SampleLoss, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, d) per-sample gradients in `model.parameters()` order, (B,) per-sample losses)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = tuple(p.detach() for n, p in model.named_parameters() if p.requires_grad)
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    fixed.update(dict(model.named_buffers()))

    def one(values: tuple[torch.Tensor, ...], sample: Batch) -> torch.Tensor:
        bound = BoundParams(model, {**fixed, **dict(zip(names, values))})
        return loss(bound, tuple(t.unsqueeze(0) for t in sample))

    grads, losses = torch.func.vmap(torch.func.grad_and_value(one), in_dims=(None, 0))(params, batch)
    size = batch[0].shape[0]
    return torch.cat([g.reshape(size, -1) for g in grads], dim=1), losses.detach()


# ---------------------------------------------------------------- a peer's private data
@dataclass(frozen=True)
class PrivateData:
    """A peer's finite training set: tensors sharing a leading sample dimension, and the
    task's loss. Sample-level DP needs it finite (q = expected batch / size) and Poisson-sampled."""

    tensors: Batch
    loss: SampleLoss

    def __post_init__(self) -> None:
        if not self.tensors or any(t.shape[:1] != self.tensors[0].shape[:1] for t in self.tensors):
            raise ValueError("private data must be tensors sharing a leading sample dimension")
        if self.size < 1:
            raise ValueError("private data holds no samples")

    @property
    def size(self) -> int:
        return int(self.tensors[0].shape[0])

    def poisson_batch(self, sample_rate: float, generator: torch.Generator) -> Batch:
        """Each sample independently with probability q (the batch size varies; may be 0)."""
        keep = (torch.rand(self.size, generator=generator) < sample_rate).nonzero().view(-1)
        return tuple(t[keep] for t in self.tensors)

    @classmethod
    def from_task(cls, task: Any, rank: int, world: int, seed: int, size: int) -> PrivateData:
        """The first `size` samples of peer `rank`'s stream (`task.batches`), kept as its dataset.

        The Task API streams batches without a notion of dataset or sample, so this needs
        batches that are a tensor or a tuple of tensors with a leading sample dimension."""
        parts: list[Batch] = []
        have = 0
        batches: Iterator[Any] = task.batches(rank, world, seed)
        for batch in islice(batches, 1_000_000):
            batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
            if not batch or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in batch):
                raise ValueError(f"task {getattr(task, 'name', task)!r}: per-sample DP needs batches of "
                                 "tensors with a leading sample dimension")
            if batch[0].dim() < 2 and len(batch) == 1:
                raise ValueError(f"task {getattr(task, 'name', task)!r}: a batch is one vector, not samples")
            parts.append(batch)
            have += int(batch[0].shape[0])
            if have >= size:
                break
        tensors = tuple(torch.cat(column)[:size] for column in zip(*parts))
        return cls(tensors, task.loss)
