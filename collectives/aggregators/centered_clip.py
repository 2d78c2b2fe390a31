"""``centered_clip``: CenteredClip, iterated from a center.

    v_0 = c, or the coordinate-wise median
    for k < K:  d_i = ||x_i - v_k||,  tau_k = T median_i d_i
                v_{k+1} = v_k + sum_i s_i (x_i - v_k) min(1, tau_k / d_i)

Options: ``tau`` (T, 2.0) and ``iters`` (K, 5); `AggregatorConfig` holds them as ``clip_tau``
and ``clip_iters``. The parts it flags are those whose last clip factor was below
`CLIP_REPORTED`.
"""
from __future__ import annotations

import torch

from starling.collectives.aggregators.registry import Aggregator, Inputs, Option, register
from starling.collectives.aggregators.shared import fold, median_of, middle, row_norms, sorted_columns

__all__ = ["CENTERED_CLIP", "CLIP_REPORTED", "ITERS", "TAU", "centered_clip"]

# centered_clip reports a part whose last clip factor was below this: it sat more than twice the
# radius away, so it was pulled in hard, not just trimmed at the edge like an honest straggler
CLIP_REPORTED = 0.5

TAU = Option("tau", float, 2.0, lambda v: v > 0, "a finite number above 0")
ITERS = Option("iters", int, 5, lambda v: v >= 1, "an integer of at least 1")


def centered_clip(matrix: torch.Tensor, shares: list[float], clip_tau: float, iters: int,
                  center: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip of the rows of `matrix` (not written) from `center` (or the coordinate-wise
    median); the indices of the rows whose last clip factor was below CLIP_REPORTED."""
    n = matrix.shape[0]
    v = center.clone() if center is not None else middle(sorted_columns(matrix))
    diff, scratch = torch.empty_like(matrix), torch.empty_like(matrix)
    factors = [1.0] * n
    for _ in range(iters):
        torch.sub(matrix, v, out=diff)
        distances = row_norms(diff, out=scratch)
        # The radius follows the current center's median distance instead of staying at v_0's.
        # A start that is off (last round's average, after the gradients moved) makes every
        # part far; a radius fixed there lets each attacker pull by that whole error on every
        # iteration, forever. Re-measured, it shrinks to the honest spread as v nears the
        # honest mean, and fewer than half the parts cannot move a median either way.
        tau = clip_tau * median_of(distances)
        factors = [1.0 if d <= tau else tau / d for d in distances]  # d = inf: 0, never inf / inf
        if tau == 0.0:
            # more than half the parts sit on v: they pull by nothing, the others are cut to nothing
            break
        coefficients = [share * factor for share, factor in zip(shares, factors)]
        torch.mul(diff, torch.tensor(coefficients, dtype=matrix.dtype, device=matrix.device)[:, None], out=scratch)
        for i, coefficient in enumerate(coefficients):
            if not coefficient:  # 0 * a difference that overflowed to inf would be NaN
                scratch[i].zero_()
        v.add_(fold(scratch, dim=0))
    return v, [i for i, factor in enumerate(factors) if factor < CLIP_REPORTED]


def _centered_clip(inputs: Inputs) -> tuple[torch.Tensor, list[int]]:
    return centered_clip(inputs.matrix, inputs.shares, inputs.options[TAU.key], inputs.options[ITERS.key],
                         inputs.center)


CENTERED_CLIP = register(Aggregator("centered_clip", _centered_clip, (TAU, ITERS)))
