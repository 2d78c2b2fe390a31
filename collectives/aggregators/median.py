"""``median``: per coordinate, the middle value (the mean of the two middle ones for even n).

No options. Weights are ignored, as for the trimmed mean. The parts it flags are those at the
lowest or highest value in more than half the coordinates (n >= 3; with two parts both are
ends, and none is flagged).
"""
from __future__ import annotations

import torch

from starling.collectives.aggregators.registry import Aggregator, Inputs, register
from starling.collectives.aggregators.shared import at_ends, middle, sorted_columns

__all__ = ["MEDIAN", "coordinate_median"]


def coordinate_median(matrix: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The median of each column of `matrix` (not written); the rows at an end in more than
    half the columns."""
    ordered = sorted_columns(matrix)
    return middle(ordered), at_ends(matrix, ordered, 1 if matrix.shape[0] >= 3 else 0)


def _median(inputs: Inputs) -> tuple[torch.Tensor, list[int]]:
    return coordinate_median(inputs.matrix)


MEDIAN = register(Aggregator("median", _median))
