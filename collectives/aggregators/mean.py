"""``mean``: sum_i s_i x_i in member order (equal weights: (x_1 + ... + x_n) / n).

Not robust: one part can move it anywhere. It is the "defences off" baseline, and the only
aggregator that secure aggregation, which hides the parts, can be combined with.
"""
from __future__ import annotations

import torch

from starling.collectives.aggregators.registry import Aggregator, Inputs, register
from starling.collectives.aggregators.shared import shares

__all__ = ["MEAN", "weighted_mean"]


def weighted_mean(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i s_i x_i in order; equal shares take sum / count, bit for bit the accumulator's plain average."""
    parts_shares = shares(weights)
    if len(set(parts_shares)) == 1:
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total.div_(len(parts))
    # mul then add, never add_(alpha=): torch fuses that into an FMA in its vector loop but not
    # in its scalar tail, so its bits would depend on the CPU and on where a chunk ends
    total = torch.mul(parts[0], parts_shares[0])
    term = torch.empty_like(total)
    for part, share in zip(parts[1:], parts_shares[1:]):
        total.add_(torch.mul(part, share, out=term))
    return total


def _mean(inputs: Inputs) -> tuple[torch.Tensor, tuple[int, ...]]:
    return weighted_mean(list(inputs.parts), list(inputs.weights)), ()


MEAN = register(Aggregator("mean", _mean, robust=False))
