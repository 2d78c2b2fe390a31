"""`AggregatorConfig`, the text that names an aggregator and its options, and `aggregate`,
which screens a chunk's parts and hands the rest to the aggregator the config names."""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from starling.collectives.aggregators.centered_clip import CENTERED_CLIP, ITERS, TAU
from starling.collectives.aggregators.registry import SCREEN_KEY, Aggregator, Inputs, lookup, registered_aggregators
from starling.collectives.aggregators.shared import check_parts, describe, row_norms, screen
from starling.collectives.aggregators.trimmed_mean import TRIM, TRIMMED_MEAN
from starling.common import coerce_option, split_option

__all__ = ["Aggregate", "AggregatorConfig", "aggregate"]

# The config's fields that hold a built-in aggregator's options (specs name them by the option's
# key). Each shapes its aggregator alone: a value other than its default for another aggregator
# is refused rather than silently ignored.
_FIELDS = {"clip_tau": (CENTERED_CLIP, TAU), "clip_iters": (CENTERED_CLIP, ITERS), "trim": (TRIMMED_MEAN, TRIM)}
_ROBUST_SCREEN_NORM = 4.0


@dataclass(frozen=True)
class AggregatorConfig:
    """How an owner aggregates a chunk's parts; ``parse``/``spec`` read and write it as text.

    - `name`: a registered aggregator (`registered_aggregators()`).
    - `clip_tau` (2.0): CenteredClip's radius as a multiple of the median distance of the
      parts from the current center. Scale-free, so no unit to tune per model or step. Each
      attacker pulls by at most one radius times its share. At 1.0 half the honest parts are
      clipped every iteration too: small-batch SGD gradients, whose noise is most of their
      distance, were shrunk enough to cost allreduce 6% of its eval loss at 30 steps on charlm
      (8 peers); at 2.0 honest parts pass almost whole (0.02%), and the attacks that clipping
      alone would let through for longer are screened, audited or banned within rounds.
    - `clip_iters` (5): from a median start (or last round's average) CenteredClip moves most
      of the way in its first steps; five land within a few percent of twenty (BTARD's count)
      even from a stale start, and each costs ~5 passes over the parts, a fraction of the sort.
    - `trim` (0.25): the fraction dropped at each end per coordinate; a quarter matches a
      threat of up to a quarter of the members all pushing the same way. Always keeps at least
      one value (floor(trim n) <= trim n < n / 2 at each end).
    - `screen_norm` (None: 4.0 for the robust aggregators, 0 = off for ``mean``, the
      "defences off" baseline): honest gradients' norms differ by a small factor, while scaled,
      noise and zeroed parts are off by far more than 4x.
    - `extra`: the options of an aggregator registered from Python (a mapping, or
      (key, value) pairs), which have no field of their own; kept as (key, value) pairs in the
      order the aggregator declares them, every option there, defaults filled in.
    """

    name: str = "mean"
    clip_tau: float = TAU.default
    clip_iters: int = ITERS.default
    trim: float = TRIM.default
    screen_norm: float | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        aggregator = lookup(self.name)
        if aggregator is None:
            raise ValueError(f"name={self.name!r}: expected one of {', '.join(registered_aggregators())}")
        for field_name, (_, option) in _FIELDS.items():
            object.__setattr__(self, field_name, option.validate(field_name, getattr(self, field_name)))
        if self.screen_norm is None:
            object.__setattr__(self, "screen_norm", _ROBUST_SCREEN_NORM if aggregator.robust else 0.0)
        # a factor of 1 or less would leave out every part whose norm is not the median's
        if isinstance(self.screen_norm, bool) or not isinstance(self.screen_norm, numbers.Real) \
                or not math.isfinite(self.screen_norm) or not (self.screen_norm == 0 or self.screen_norm > 1):
            raise ValueError(f"screen_norm={self.screen_norm!r}: expected 0 (off) or a factor above 1")
        object.__setattr__(self, "screen_norm", float(self.screen_norm))
        for field_name, (owner, option) in _FIELDS.items():
            value = getattr(self, field_name)
            if owner is not aggregator and value != option.default:
                raise ValueError(f"{field_name}={value!r} applies to {owner.name} only, not to {self.name}")
        object.__setattr__(self, "extra", _extra(aggregator, self.extra))

    @property
    def aggregator(self) -> Aggregator:
        """The registered aggregator `name` names."""
        aggregator = lookup(self.name)
        assert aggregator is not None  # checked when made; the registry only grows
        return aggregator

    @property
    def robust(self) -> bool:
        return self.aggregator.robust

    def options(self) -> dict[str, Any]:
        """The named aggregator's options by key (``screen`` aside), as its function gets them."""
        values = dict(self.extra)
        for field_name, (owner, option) in _FIELDS.items():
            if owner.name == self.name:
                values[option.key] = getattr(self, field_name)
        return {option.key: values[option.key] for option in self.aggregator.options}

    @classmethod
    def parse(cls, spec: str) -> AggregatorConfig:
        """``"median"``, ``"centered_clip:tau=1.5,iters=5"``, ``"trimmed_mean:trim=0.25,screen=3"``.

        Keys: those the named aggregator declares (``tau`` and ``iters`` for centered_clip,
        ``trim`` for trimmed_mean), and ``screen`` for any (0 turns screening off). ValueError
        naming the spec and what in it is wrong.
        """
        if not isinstance(spec, str):
            raise ValueError(f"aggregator spec {spec!r}: expected text such as 'centered_clip:tau=1.5'")
        name, colon, rest = spec.strip().partition(":")
        name = name.strip()
        aggregator = lookup(name)
        if aggregator is None:
            raise ValueError(f"aggregator spec {spec!r}: unknown aggregator {name!r}; "
                             f"known: {', '.join(registered_aggregators())}")
        fields: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        given: set[str] = set()
        for item in rest.split(",") if colon else ():
            key, text = split_option(item, f"aggregator spec {spec!r}: option")
            option = aggregator.option(key)
            if option is None and key != SCREEN_KEY:
                raise ValueError(f"aggregator spec {spec!r}: {name} has no option {key!r} "
                                 f"(options: {', '.join(aggregator.keys)})")
            if key in given:
                raise ValueError(f"aggregator spec {spec!r}: option {key!r} given twice")
            given.add(key)
            try:
                value = coerce_option(key, text, float if option is None else option.kind)
            except ValueError as exc:
                raise ValueError(f"aggregator spec {spec!r}: {exc}") from None
            if option is None:
                fields["screen_norm"] = value
            elif (field_name := _field_of(name, key)) is not None:
                fields[field_name] = value
            else:
                extra[key] = value
        try:
            return cls(name=name, **fields, extra=tuple(extra.items()))
        except ValueError as exc:
            raise ValueError(f"aggregator spec {spec!r}: {exc}") from None

    def spec(self) -> str:
        """The text ``parse`` reads back to this config: the name, then the options that differ
        from the name's defaults."""
        values = {**self.options(), SCREEN_KEY: self.screen_norm}
        defaults = {**{option.key: option.default for option in self.aggregator.options},
                    SCREEN_KEY: _ROBUST_SCREEN_NORM if self.robust else 0.0}
        options = [f"{key}={value!r}" for key, value in values.items() if value != defaults[key]]
        return self.name + (":" + ",".join(options) if options else "")


def _field_of(name: str, key: str) -> str | None:
    """The config field that holds option `key` of aggregator `name`, or None (it is in `extra`)."""
    return next((field_name for field_name, (owner, option) in _FIELDS.items()
                 if owner.name == name and option.key == key), None)


def _extra(aggregator: Aggregator, given: object) -> tuple[tuple[str, Any], ...]:
    """`given` (a mapping or (key, value) pairs) checked against `aggregator`'s options that
    have no field of their own: every one of them, in its order, defaults filled in."""
    try:
        pairs = list(given.items()) if isinstance(given, Mapping) else [tuple(pair) for pair in given]  # type: ignore[attr-defined]
    except TypeError:
        pairs = [()]
    if any(len(pair) != 2 or not isinstance(pair[0], str) for pair in pairs):
        raise ValueError(f"extra={given!r}: expected a mapping of option keys to values, or (key, value) pairs")
    values = dict(pairs)
    if len(values) != len(pairs):
        raise ValueError(f"extra={given!r}: an option given twice")
    own = [option for option in aggregator.options if _field_of(aggregator.name, option.key) is None]
    for key in values:
        if (field_name := _field_of(aggregator.name, key)) is not None:
            raise ValueError(f"extra={given!r}: {aggregator.name}'s option {key!r} is the field {field_name}")
        if key not in [option.key for option in own]:
            raise ValueError(f"extra={given!r}: {aggregator.name} has no option {key!r} "
                             f"(options: {', '.join(option.key for option in own) or 'none'})")
    return tuple((option.key, option.validate(option.key, values[option.key]) if option.key in values
                  else option.default) for option in own)


@dataclass(frozen=True)
class Aggregate:
    """One chunk's aggregate, and which parts the defences acted on (indices into the parts given)."""

    average: torch.Tensor  # a tensor of its own, never a view of a part
    screened: dict[int, str]  # part -> why it was left out before aggregating (NORM_HIGH, NORM_LOW)
    # centered_clip: parts whose last clip factor was below CLIP_REPORTED; trimmed_mean: parts
    # at a trimmed value in more than half the coordinates; median: parts at the lowest or
    # highest value in more than half the coordinates (n >= 3). Ties count for every part tied.
    # An aggregator registered from Python: the parts its function flagged.
    clipped: frozenset[int]


def aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], config: AggregatorConfig,
              center: torch.Tensor | None = None) -> Aggregate:
    """Aggregate `parts` (1-D float32, one length, finite, in member order) as `config` says.

    `weights` (>= 0, one per part) give the shares of ``mean`` and ``centered_clip``; all equal,
    or all zero, means equal shares. ``trimmed_mean`` and ``median`` ignore them: an order
    statistic has no weighted form that a heavy attacker could not claim. `center` is
    CenteredClip's starting point (others ignore it). Parts are never written.
    """
    check_parts(parts, weights, center)
    if len(parts) == 1 or parts[0].numel() == 0:
        return Aggregate(parts[0].clone(), {}, frozenset())
    aggregator = config.aggregator
    stacked = torch.stack(list(parts)) if config.screen_norm else None
    screened = screen(row_norms(stacked), config.screen_norm) if stacked is not None else {}
    kept = [i for i in range(len(parts)) if i not in screened]  # a strict majority: two or more

    def matrix() -> torch.Tensor:
        if stacked is None:
            return torch.stack([parts[i] for i in kept])
        return stacked[kept] if screened else stacked

    inputs = Inputs([parts[i] for i in kept], [float(weights[i]) for i in kept], config.options(), center, matrix)
    average, flagged = _result(aggregator, aggregator.function(inputs), parts, len(kept))
    return Aggregate(average, screened, frozenset(kept[j] for j in flagged))


def _result(aggregator: Aggregator, result: object, parts: Sequence[torch.Tensor],
            count: int) -> tuple[torch.Tensor, list[int]]:
    """What `aggregator`'s function returned, checked; an average that shares memory with a
    part is copied. ValueError naming the aggregator unless it is (average, flagged)."""
    numel, device = parts[0].numel(), parts[0].device
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Iterable):
        average, flagged = result[0], list(result[1])
        if isinstance(average, torch.Tensor) and average.dim() == 1 and average.dtype == torch.float32 \
                and average.numel() == numel and average.device == device \
                and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < count
                        for i in flagged):
            if any(part.untyped_storage().data_ptr() == average.untyped_storage().data_ptr() for part in parts):
                average = average.clone()
            return average, [int(i) for i in flagged]
        got = f"({describe(average)}, {flagged!r})"
    else:
        got = describe(result)
    raise ValueError(f"aggregator {aggregator.name!r} returned {got}; expected (a 1-D float32 tensor of "
                     f"length {numel} on {device}, the indices below {count} of the parts it flagged)")
