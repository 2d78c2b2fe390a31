"""``trimmed_mean``: per coordinate, sort, drop the b = floor(beta n) lowest and highest, and
average the rest.

Option: ``trim`` (beta, 0.25, in [0, 0.5) so that at least one value is kept);
`AggregatorConfig` holds it as ``trim``. Weights are ignored: an order statistic has no
weighted form that a heavy attacker could not claim. The parts it flags are those at a
trimmed value in more than half the coordinates.
"""
from __future__ import annotations

import math

import torch

from starling.collectives.aggregators.registry import Aggregator, Inputs, Option, register
from starling.collectives.aggregators.shared import at_ends, fold, sorted_columns

__all__ = ["TRIM", "TRIMMED_MEAN", "trimmed_mean"]

TRIM = Option("trim", float, 0.25, lambda v: 0 <= v < 0.5, "a number in [0, 0.5)")


def trimmed_mean(matrix: torch.Tensor, trim: float) -> tuple[torch.Tensor, list[int]]:
    """The trimmed mean of each column of `matrix` (not written); the rows at a trimmed end in
    more than half the columns."""
    n = matrix.shape[0]
    ordered = sorted_columns(matrix)
    cut = math.floor(trim * n)
    # fold overwrites only the rows kept, not the ends at_ends reads; +0.0: see sorted_columns
    average = fold(ordered[cut:n - cut], dim=0).div(n - 2 * cut).add_(0.0)
    return average, at_ends(matrix, ordered, cut)


def _trimmed_mean(inputs: Inputs) -> tuple[torch.Tensor, list[int]]:
    return trimmed_mean(inputs.matrix, inputs.options[TRIM.key])


TRIMMED_MEAN = register(Aggregator("trimmed_mean", _trimmed_mean, (TRIM,)))
