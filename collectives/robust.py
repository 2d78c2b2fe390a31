"""Robust aggregation: what an owner makes of one chunk's parts when not every member can be trusted.

Input: parts x_1..x_n (1-D float32, in member order), weights w_i, shares s_i = w_i / sum_j w_j,
and optionally a center c (the chunk's average last round).

    screen (S > 0)  r = median_i ||x_i||
                    leave out x_i with ||x_i|| > S r ("norm_high") or ||x_i|| < r / S ("norm_low"),
                    unless the parts kept would not be a strict majority
    mean            sum_i s_i x_i                   (equal weights: (x_1 + ... + x_n) / n)
    centered_clip   v_0 = c, or the coordinate-wise median
                    for k < K:  d_i = ||x_i - v_k||,  tau_k = T median_i d_i
                                v_{k+1} = v_k + sum_i s_i (x_i - v_k) min(1, tau_k / d_i)
    trimmed_mean    per coordinate: sort, drop the b = floor(beta n) lowest and highest, mean of the rest
    median          per coordinate: the middle value (the mean of the two middle ones for even n)

Every result is the same bits on every run, machine and thread count, so that two owners (or
a replay) that aggregate the same parts agree: every sum runs in a fixed order (the mean's in
member order, the others' in a fixed pairwise tree) through elementwise ops only, never
through reductions whose order SIMD width or thread count decides, nor through fused
multiply-adds; the scalar work (medians of norms, clip factors) is done in Python floats.

Parts are never written: they are often views of wire buffers. Non-finite parts must already
be left out (the accumulator does).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from starling.common import coerce_option, split_option

__all__ = ["AGGREGATORS", "CLIP_REPORTED", "NORM_HIGH", "NORM_LOW", "Aggregate", "AggregatorConfig", "aggregate"]

AGGREGATORS = ("mean", "centered_clip", "trimmed_mean", "median")
NORM_HIGH = "norm_high"  # a part screened out for a norm above screen_norm times the median norm
NORM_LOW = "norm_low"  # a part screened out for a norm below the median norm divided by screen_norm
# centered_clip reports a part whose last clip factor was below this: it sat more than twice the
# radius away, so it was pulled in hard, not just trimmed at the edge like an honest straggler
CLIP_REPORTED = 0.5

# spec keys -> fields, and which aggregators each field shapes (a field that has no effect on
# the chosen aggregator is refused rather than silently ignored)
_SPEC_KEYS = {"tau": "clip_tau", "iters": "clip_iters", "trim": "trim", "screen": "screen_norm"}
_FIELD_TYPES: dict[str, type] = {"clip_tau": float, "clip_iters": int, "trim": float, "screen_norm": float}
_APPLIES_TO = {
    "clip_tau": ("centered_clip",),
    "clip_iters": ("centered_clip",),
    "trim": ("trimmed_mean",),
    "screen_norm": AGGREGATORS,
}
_ROBUST_SCREEN_NORM = 4.0


@dataclass(frozen=True)
class AggregatorConfig:
    """How an owner aggregates a chunk's parts; ``parse``/``spec`` read and write it as text.

    - ``clip_tau`` (2.0): CenteredClip's radius as a multiple of the median distance of the
      parts from the current center. Scale-free, so no unit to tune per model or step. Each
      attacker pulls by at most one radius times its share. At 1.0 half the honest parts are
      clipped every iteration too: small-batch SGD gradients, whose noise is most of their
      distance, were shrunk enough to cost allreduce 6% of its eval loss at 30 steps on charlm
      (8 peers); at 2.0 honest parts pass almost whole (0.02%), and the attacks that clipping
      alone would let through for longer are screened, audited or banned within rounds.
    - ``clip_iters`` (5): from a median start (or last round's average) CenteredClip moves most
      of the way in its first steps; five land within a few percent of twenty (BTARD's count)
      even from a stale start, and each costs ~5 passes over the parts, a fraction of the sort.
    - ``trim`` (0.25): the fraction dropped at each end per coordinate; a quarter matches a
      threat of up to a quarter of the members all pushing the same way. Always keeps at least
      one value (floor(trim n) <= trim n < n / 2 at each end).
    - ``screen_norm`` (None: 4.0 for the robust aggregators, 0 = off for ``mean``, the
      "defences off" baseline): honest gradients' norms differ by a small factor, while scaled,
      noise and zeroed parts are off by far more than 4x.
    """

    name: str = "mean"
    clip_tau: float = 2.0
    clip_iters: int = 5
    trim: float = 0.25
    screen_norm: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in AGGREGATORS:
            raise ValueError(f"name={self.name!r}: expected one of {', '.join(AGGREGATORS)}")
        _check_real("clip_tau", self.clip_tau, lambda v: v > 0, "a finite number above 0")
        if isinstance(self.clip_iters, bool) or not isinstance(self.clip_iters, numbers.Integral) \
                or self.clip_iters < 1:
            raise ValueError(f"clip_iters={self.clip_iters!r}: expected an integer of at least 1")
        _check_real("trim", self.trim, lambda v: 0 <= v < 0.5, "a number in [0, 0.5)")
        if self.screen_norm is None:
            object.__setattr__(self, "screen_norm", _ROBUST_SCREEN_NORM if self.robust else 0.0)
        # a factor of 1 or less would leave out every part whose norm is not the median's
        _check_real("screen_norm", self.screen_norm, lambda v: v == 0 or v > 1, "0 (off) or a factor above 1")
        for field_name, kind in _FIELD_TYPES.items():
            object.__setattr__(self, field_name, kind(getattr(self, field_name)))
        for field_name, names in _APPLIES_TO.items():
            value = getattr(self, field_name)
            if self.name not in names and value != _default(self.name, field_name):
                raise ValueError(f"{field_name}={value!r} applies to {' and '.join(names)} only, "
                                 f"not to {self.name}")

    @property
    def robust(self) -> bool:
        return self.name != "mean"

    @classmethod
    def parse(cls, spec: str) -> AggregatorConfig:
        """``"median"``, ``"centered_clip:tau=1.5,iters=5"``, ``"trimmed_mean:trim=0.25,screen=3"``.

        Keys: ``tau`` and ``iters`` (centered_clip), ``trim`` (trimmed_mean), ``screen`` (any;
        0 turns screening off). ValueError naming the spec and what in it is wrong.
        """
        if not isinstance(spec, str):
            raise ValueError(f"aggregator spec {spec!r}: expected text such as 'centered_clip:tau=1.5'")
        name, colon, rest = spec.strip().partition(":")
        name = name.strip()
        if name not in AGGREGATORS:
            raise ValueError(f"aggregator spec {spec!r}: unknown aggregator {name!r}; known: {', '.join(AGGREGATORS)}")
        keys = [key for key, field_name in _SPEC_KEYS.items() if name in _APPLIES_TO[field_name]]
        values: dict[str, float | int] = {}
        for item in rest.split(",") if colon else ():
            key, text = split_option(item, f"aggregator spec {spec!r}: option")
            if key not in keys:
                raise ValueError(f"aggregator spec {spec!r}: {name} has no option {key!r} "
                                 f"(options: {', '.join(keys)})")
            field_name = _SPEC_KEYS[key]
            if field_name in values:
                raise ValueError(f"aggregator spec {spec!r}: option {key!r} given twice")
            try:
                values[field_name] = coerce_option(key, text, _FIELD_TYPES[field_name])
            except ValueError as exc:
                raise ValueError(f"aggregator spec {spec!r}: {exc}") from None
        try:
            return cls(name=name, **values)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"aggregator spec {spec!r}: {exc}") from None

    def spec(self) -> str:
        """The text ``parse`` reads back to this config: the name, then the options that differ
        from the name's defaults."""
        options = [f"{key}={getattr(self, field_name)!r}" for key, field_name in _SPEC_KEYS.items()
                   if getattr(self, field_name) != _default(self.name, field_name)]
        return self.name + (":" + ",".join(options) if options else "")


def _default(name: str, field_name: str) -> object:
    """The value `field_name` takes in the config of aggregator `name` when nothing is said."""
    if field_name == "screen_norm":
        return _ROBUST_SCREEN_NORM if name != "mean" else 0.0
    return next(f.default for f in fields(AggregatorConfig) if f.name == field_name)


@dataclass(frozen=True)
class Aggregate:
    """One chunk's aggregate, and which parts the defences acted on (indices into the parts given)."""

    average: torch.Tensor  # a tensor of its own, never a view of a part
    screened: dict[int, str]  # part -> why it was left out before aggregating (NORM_HIGH, NORM_LOW)
    # centered_clip: parts whose last clip factor was below CLIP_REPORTED; trimmed_mean: parts
    # at a trimmed value in more than half the coordinates; median: parts at the lowest or
    # highest value in more than half the coordinates (n >= 3). Ties count for every part tied.
    clipped: frozenset[int]


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], config: AggregatorConfig,
              center: torch.Tensor | None = None) -> Aggregate:
    """Aggregate `parts` (1-D float32, one length, finite, in member order) as `config` says.

    `weights` (>= 0, one per part) give the shares of ``mean`` and ``centered_clip``; all equal,
    or all zero, means equal shares. ``trimmed_mean`` and ``median`` ignore them: an order
    statistic has no weighted form that a heavy attacker could not claim. `center` is
    CenteredClip's starting point (others ignore it). Parts are never written.
    """
    _check_parts(parts, weights, center)
    if len(parts) == 1 or parts[0].numel() == 0:
        return Aggregate(parts[0].clone(), {}, frozenset())
    if not config.screen_norm and not config.robust:
        return Aggregate(_mean(list(parts), [float(w) for w in weights]), {}, frozenset())

    matrix = torch.stack(list(parts))
    screened = _screen(_row_norms(matrix), config.screen_norm) if config.screen_norm else {}
    kept = [i for i in range(len(parts)) if i not in screened]  # a strict majority: two or more
    kept_weights = [float(weights[i]) for i in kept]
    if screened and config.robust:
        matrix = matrix[kept]
    clipped: list[int] = []
    if config.name == "mean":
        average = _mean([parts[i] for i in kept], kept_weights)
    elif config.name == "centered_clip":
        average, clipped = _centered_clip(matrix, _shares(kept_weights), config.clip_tau, config.clip_iters, center)
    else:
        average, clipped = _order_statistic(matrix, config.trim if config.name == "trimmed_mean" else None)
    return Aggregate(average, screened, frozenset(kept[j] for j in clipped))


# --- the aggregators ---------------------------------------------------------------------


def _mean(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i s_i x_i in order; equal shares take sum / count, bit for bit the accumulator's plain average."""
    shares = _shares(weights)
    if len(set(shares)) == 1:
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        return total.div_(len(parts))
    # mul then add, never add_(alpha=): torch fuses that into an FMA in its vector loop but not
    # in its scalar tail, so its bits would depend on the CPU and on where a chunk ends
    total = torch.mul(parts[0], shares[0])
    term = torch.empty_like(total)
    for part, share in zip(parts[1:], shares[1:]):
        total.add_(torch.mul(part, share, out=term))
    return total


def _centered_clip(matrix: torch.Tensor, shares: list[float], clip_tau: float, iters: int,
                   center: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip from `center` (or the coordinate-wise median); the indices of the parts
    whose last clip factor was below CLIP_REPORTED."""
    n = matrix.shape[0]
    v = center.clone() if center is not None else _middle(_sorted_columns(matrix))
    diff, scratch = torch.empty_like(matrix), torch.empty_like(matrix)
    factors = [1.0] * n
    for _ in range(iters):
        torch.sub(matrix, v, out=diff)
        distances = _row_norms(diff, out=scratch)
        # The radius follows the current center's median distance instead of staying at v_0's.
        # A start that is off (last round's average, after the gradients moved) makes every
        # part far; a radius fixed there lets each attacker pull by that whole error on every
        # iteration, forever. Re-measured, it shrinks to the honest spread as v nears the
        # honest mean, and fewer than half the parts cannot move a median either way.
        tau = clip_tau * _median(distances)
        factors = [1.0 if d <= tau else tau / d for d in distances]  # d = inf: 0, never inf / inf
        if tau == 0.0:
            # more than half the parts sit on v: they pull by nothing, the others are cut to nothing
            break
        coefficients = [share * factor for share, factor in zip(shares, factors)]
        torch.mul(diff, torch.tensor(coefficients, dtype=matrix.dtype, device=matrix.device)[:, None], out=scratch)
        for i, coefficient in enumerate(coefficients):
            if not coefficient:  # 0 * a difference that overflowed to inf would be NaN
                scratch[i].zero_()
        v.add_(_fold(scratch, dim=0))
    return v, [i for i, factor in enumerate(factors) if factor < CLIP_REPORTED]


def _order_statistic(matrix: torch.Tensor, trim: float | None) -> tuple[torch.Tensor, list[int]]:
    """Per coordinate, the trimmed mean (`trim`) or the median (None); the indices of the
    parts that were at a cut-off end in more than half the coordinates."""
    n, numel = matrix.shape
    ordered = _sorted_columns(matrix)
    if trim is None:
        average = _middle(ordered)
        cut = 1 if n >= 3 else 0  # the lowest and highest value; with two parts both are ends
    else:
        cut = math.floor(trim * n)
        average = _fold(ordered[cut:n - cut], dim=0).div(n - 2 * cut).add_(0.0)  # +0.0: see _sorted_columns
    if cut == 0:
        return average, []
    # A part is at an end where its value is at or beyond the innermost value cut off there
    # (ties count: identical attackers are all at the end, not the one a sort put first).
    at_ends = torch.le(matrix, ordered[cut - 1]).logical_or_(torch.ge(matrix, ordered[n - cut]))
    # integer sums are exact in any order; int32 sums twice as fast as the default int64
    counts = at_ends.sum(dim=1, dtype=torch.int32 if numel < 2**31 else torch.int64).tolist()
    return average, [i for i, count in enumerate(counts) if 2 * count > numel]


# --- shared arithmetic -------------------------------------------------------------------


def _screen(norms: list[float], screen_norm: float) -> dict[int, str]:
    """The parts whose norm is off the median norm by more than `screen_norm` either way.

    Nothing is screened unless the rest is a strict majority: the median norm is an honest
    part's only while the honest parts are a majority, and a screen that would leave out half
    or more may be leaving out the honest ones (two parts: one of them is always "off").
    """
    middle = _median(norms)
    screened: dict[int, str] = {}
    for i, norm in enumerate(norms):
        if norm > screen_norm * middle:
            screened[i] = NORM_HIGH
        elif norm < middle / screen_norm:
            screened[i] = NORM_LOW
    return screened if 2 * len(screened) < len(norms) else {}


def _row_norms(matrix: torch.Tensor, out: torch.Tensor | None = None) -> list[float]:
    """The L2 norm of each row of `matrix`. `out` (matrix's shape) is overwritten with scratch.

    torch's own norms reduce in an order that SIMD width and thread count decide, and one ulp
    in a norm changes a clip factor and so the aggregate's bits; `_fold` does not. A value past
    ~1e19 squares to inf: that row is infinitely far (screened out high, clipped to nothing).
    """
    squares = torch.mul(matrix, matrix, out=out)
    return torch.sqrt(_fold(squares, dim=1)).tolist()


def _fold(matrix: torch.Tensor, dim: int) -> torch.Tensor:
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


def _sorted_columns(matrix: torch.Tensor) -> torch.Tensor:
    """Each column of `matrix` sorted ascending, in a new tensor.

    numpy's SIMD sort is ~10x faster than torch.sort here (64 x 1M: 0.2 s against 2 s) and
    makes no index tensor. Sorted values are unique up to the order of tied -0.0 and +0.0, which
    an unstable sort may place either way; that changes no result but the sign of a zero one,
    so results built from sorted values add +0.0 (-0.0 + 0.0 is +0.0; x + 0.0 is x otherwise).
    """
    if matrix.device.type != "cpu":
        return torch.sort(matrix, dim=0).values
    return torch.from_numpy(np.sort(matrix.detach().numpy(), axis=0))


def _middle(ordered: torch.Tensor) -> torch.Tensor:
    """The median of each column of a column-sorted matrix; even counts average the middle two,
    so the median of the negated parts is the negated median. Zeros come out as +0.0."""
    n = ordered.shape[0]
    if n % 2:
        return ordered[n // 2].add(0.0)
    return torch.add(ordered[n // 2 - 1], ordered[n // 2]).div_(2).add_(0.0)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _shares(weights: list[float]) -> list[float]:
    """w_i / sum_j w_j; equal (or all zero) weights give exactly 1/n each."""
    whole = sum(weights)
    if len(set(weights)) == 1 or whole == 0.0:
        return [1.0 / len(weights)] * len(weights)
    return [w / whole for w in weights]


def _check_parts(parts: Sequence[torch.Tensor], weights: Sequence[float], center: torch.Tensor | None) -> None:
    if len(parts) == 0:
        raise ValueError("aggregate: no parts")
    if len(weights) != len(parts):
        raise ValueError(f"aggregate: {len(weights)} weights for {len(parts)} parts")
    numel = parts[0].numel() if isinstance(parts[0], torch.Tensor) else -1
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor) or part.dim() != 1 or part.dtype != torch.float32 \
                or part.numel() != numel or part.device != parts[0].device:
            raise ValueError(f"aggregate: part {i} is {_describe(part)}; expected 1-D float32 "
                             f"of length {numel} on {parts[0].device}, like part 0")
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) \
                or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"aggregate: weight {i} is {weight!r}; expected a finite number >= 0")
    if center is not None and (not isinstance(center, torch.Tensor) or center.dim() != 1
                               or center.dtype != torch.float32 or center.numel() != numel
                               or center.device != parts[0].device):
        raise ValueError(f"aggregate: center is {_describe(center)}; expected 1-D float32 of length {numel}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return repr(type(value).__name__)


def _check_real(name: str, value: object, ok: Callable[[float], bool], expected: str) -> None:
    """ValueError naming `name` unless `value` is a finite real number (not a bool) that `ok` accepts."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not ok(float(value)):
        raise ValueError(f"{name}={value!r}: expected {expected}")
