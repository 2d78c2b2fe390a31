"""What the aggregators share: screening by norm, sums in a fixed order, sorted columns and
medians, shares of weights, and the checks on what `aggregate` is given.

Every function here gives the same bits on every run, machine and thread count (see the
package's docstring); an aggregator of your own built from them keeps that guarantee.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "NORM_HIGH", "NORM_LOW", "at_ends", "check_parts", "describe", "fold", "median_of", "middle", "row_norms",
    "screen", "shares", "sorted_columns",
]

NORM_HIGH = "norm_high"  # a part screened out for a norm above screen_norm times the median norm
NORM_LOW = "norm_low"  # a part screened out for a norm below the median norm divided by screen_norm


def screen(norms: list[float], screen_norm: float) -> dict[int, str]:
    """The parts whose norm is off the median norm by more than `screen_norm` either way.

    Nothing is screened unless the rest is a strict majority: the median norm is an honest
    part's only while the honest parts are a majority, and a screen that would leave out half
    or more may be leaving out the honest ones (two parts: one of them is always "off").
    """
    middle_norm = median_of(norms)
    screened: dict[int, str] = {}
    for i, norm in enumerate(norms):
        if norm > screen_norm * middle_norm:
            screened[i] = NORM_HIGH
        elif norm < middle_norm / screen_norm:
            screened[i] = NORM_LOW
    return screened if 2 * len(screened) < len(norms) else {}


def row_norms(matrix: torch.Tensor, out: torch.Tensor | None = None) -> list[float]:
    """The L2 norm of each row of `matrix`. `out` (matrix's shape) is overwritten with scratch.

    torch's own norms reduce in an order that SIMD width and thread count decide, and one ulp
    in a norm changes a clip factor and so the aggregate's bits; `fold` does not. A value past
    ~1e19 squares to inf: that row is infinitely far (screened out high, clipped to nothing).
    """
    squares = torch.mul(matrix, matrix, out=out)
    return torch.sqrt(fold(squares, dim=1)).tolist()


def fold(matrix: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of `matrix` along `dim` (0 or 1), a view into `matrix`, which it overwrites.

    A fixed pairwise tree of elementwise adds (halves onto halves, an odd one out onto the
    first): the same bits on any machine and thread count, an error of O(log n) ulps, and a
    few large ops instead of one per row (each op is a parallel region to enter and leave).
    """
    width = matrix.shape[dim]
    while width > 1:
        half = width // 2
        matrix.narrow(dim, 0, half).add_(matrix.narrow(dim, half, half))
        if width % 2:
            matrix.narrow(dim, 0, 1).add_(matrix.narrow(dim, 2 * half, 1))
        width = half
    return matrix.select(dim, 0)


def sorted_columns(matrix: torch.Tensor) -> torch.Tensor:
    """Each column of `matrix` sorted ascending, in a new tensor.

    numpy's SIMD sort is ~10x faster than torch.sort here (64 x 1M: 0.2 s against 2 s) and
    makes no index tensor. Sorted values are unique up to the order of tied -0.0 and +0.0, which
    an unstable sort may place either way; that changes no result but the sign of a zero one,
    so results built from sorted values add +0.0 (-0.0 + 0.0 is +0.0; x + 0.0 is x otherwise).
    """
    if matrix.device.type != "cpu":
        return torch.sort(matrix, dim=0).values
    return torch.from_numpy(np.sort(matrix.detach().numpy(), axis=0))


def middle(ordered: torch.Tensor) -> torch.Tensor:
    """The median of each column of a column-sorted matrix; even counts average the middle two,
    so the median of the negated parts is the negated median. Zeros come out as +0.0."""
    n = ordered.shape[0]
    if n % 2:
        return ordered[n // 2].add(0.0)
    return torch.add(ordered[n // 2 - 1], ordered[n // 2]).div_(2).add_(0.0)


def at_ends(matrix: torch.Tensor, ordered: torch.Tensor, cut: int) -> list[int]:
    """The rows of `matrix` at one of the `cut` lowest or highest values of `ordered` (its
    columns sorted) in more than half the coordinates; none when `cut` is 0.

    A row is at an end where its value is at or beyond the innermost value cut off there
    (ties count: identical attackers are all at the end, not the one a sort put first).
    """
    n, numel = matrix.shape
    if cut == 0:
        return []
    ends = torch.le(matrix, ordered[cut - 1]).logical_or_(torch.ge(matrix, ordered[n - cut]))
    # integer sums are exact in any order; int32 sums twice as fast as the default int64
    counts = ends.sum(dim=1, dtype=torch.int32 if numel < 2**31 else torch.int64).tolist()
    return [i for i, count in enumerate(counts) if 2 * count > numel]


def median_of(values: list[float]) -> float:
    """The median of Python floats; even counts average the middle two."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def shares(weights: Sequence[float]) -> list[float]:
    """w_i / sum_j w_j; equal (or all zero) weights give exactly 1/n each."""
    whole = sum(weights)
    if len(set(weights)) == 1 or whole == 0.0:
        return [1.0 / len(weights)] * len(weights)
    return [w / whole for w in weights]


def check_parts(parts: Sequence[torch.Tensor], weights: Sequence[float], center: torch.Tensor | None) -> None:
    """ValueError naming the first part, weight or center that `aggregate` cannot take."""
    if len(parts) == 0:
        raise ValueError("aggregate: no parts")
    if len(weights) != len(parts):
        raise ValueError(f"aggregate: {len(weights)} weights for {len(parts)} parts")
    numel = parts[0].numel() if isinstance(parts[0], torch.Tensor) else -1
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor) or part.dim() != 1 or part.dtype != torch.float32 \
                or part.numel() != numel or part.device != parts[0].device:
            raise ValueError(f"aggregate: part {i} is {describe(part)}; expected 1-D float32 "
                             f"of length {numel} on {parts[0].device}, like part 0")
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) \
                or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"aggregate: weight {i} is {weight!r}; expected a finite number >= 0")
    if center is not None and (not isinstance(center, torch.Tensor) or center.dim() != 1
                               or center.dtype != torch.float32 or center.numel() != numel
                               or center.device != parts[0].device):
        raise ValueError(f"aggregate: center is {describe(center)}; expected 1-D float32 of length {numel}")


def describe(value: object) -> str:
    """A tensor's dtype, shape and device, or any other value's type, for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return repr(type(value).__name__)
