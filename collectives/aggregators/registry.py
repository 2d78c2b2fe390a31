"""The aggregators there are, by the name a spec gives them, and what each is given and returns.

An aggregator is a name, the options a spec may set for it (each with its type, default and
the values it accepts), and a function of the parts kept after screening (`Inputs`) that
returns their average and the parts it flagged. `register_aggregator` adds one.
"""
from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from starling.collectives.aggregators.shared import shares

__all__ = ["Aggregator", "Inputs", "Option", "lookup", "register", "register_aggregator", "registered_aggregators"]

# what a name or an option key may be: it is read back from a spec ("name:key=value,...")
_NAME = re.compile(r"[a-z][a-z0-9_]*")
SCREEN_KEY = "screen"  # the option every aggregator takes (AggregatorConfig.screen_norm)
_KINDS = (float, int, bool)
_EXPECTED = {float: "a finite number", int: "an integer", bool: "True or False"}


@dataclass(frozen=True)
class Option:
    """One option a spec may set for an aggregator: ``KEY=VALUE`` after its name.

    - `key`: its name in specs (lower case letters, digits and underscores; not ``screen``,
      which every aggregator takes).
    - `kind`: ``float`` (finite), ``int`` or ``bool``.
    - `default`: its value when a spec does not give it; a spec writes only values that differ.
    - `check`: which values of `kind` it accepts (None: all), and `expected`, what those are
      in words, for the error that refuses any other (``"a number in [0, 0.5)"``).
    """

    key: str
    kind: type
    default: Any
    check: Callable[[Any], bool] | None = None
    expected: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not _NAME.fullmatch(self.key) or self.key == SCREEN_KEY:
            raise ValueError(f"option key {self.key!r}: expected lower case letters, digits and underscores "
                             f"(a letter first), other than {SCREEN_KEY!r}")
        if self.kind not in _KINDS:
            raise ValueError(f"option {self.key!r}: kind {self.kind!r}; expected float, int or bool")
        if not self.expected:
            object.__setattr__(self, "expected", _EXPECTED[self.kind])
        object.__setattr__(self, "default", self.validate(self.key, self.default))

    def validate(self, label: str, value: Any) -> Any:
        """`value` as `kind` (an int passes as a float); ValueError ``"<label>=<value>: expected
        <expected>"`` if it is not one, or `check` refuses it."""
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = not isinstance(value, bool) and isinstance(value, numbers.Integral)
        else:
            ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
        if ok:
            typed = self.kind(value)
            if self.check is None or self.check(typed):
                return typed
        raise ValueError(f"{label}={value!r}: expected {self.expected}")


class Inputs:
    """What an aggregator's function is given: the parts left after screening, in member order.

    - `parts`: 1-D float32 tensors of one length on one device, finite; never to be written
      (they are often views of wire buffers).
    - `weights`: one per part, >= 0; `shares` are w_i / sum_j w_j (exactly 1/n each when all
      are equal or all zero).
    - `options`: the aggregator's options by key, as the config gives them.
    - `center`: where an iterative aggregator may start (the chunk's last average), or None.
    - `matrix`: the parts as the rows of one tensor of this call's own, which the function may
      overwrite (made on first use; screening has often made it already).
    """

    __slots__ = ("_matrix", "_stacked", "center", "options", "parts", "weights")

    def __init__(self, parts: Sequence[torch.Tensor], weights: Sequence[float], options: Mapping[str, Any],
                 center: torch.Tensor | None = None,
                 matrix: Callable[[], torch.Tensor] | None = None) -> None:
        self.parts = tuple(parts)
        self.weights = tuple(float(w) for w in weights)
        self.options: Mapping[str, Any] = MappingProxyType(dict(options))
        self.center = center
        self._stacked = matrix
        self._matrix: torch.Tensor | None = None

    @property
    def shares(self) -> list[float]:
        return shares(self.weights)

    @property
    def matrix(self) -> torch.Tensor:
        if self._matrix is None:
            self._matrix = self._stacked() if self._stacked is not None else torch.stack(self.parts)
        return self._matrix


# the average, and the parts it flagged (indices into Inputs.parts): clipped hard, trimmed away
Result = tuple[torch.Tensor, Collection[int]]


@dataclass(frozen=True)
class Aggregator:
    """A registered aggregator: its `name` in specs, the `options` a spec may set, and its
    `function`, which maps `Inputs` to ``(average, flagged)``: the average, a 1-D float32
    tensor of the parts' length that is no view of a part, and the indices (into
    ``inputs.parts``) of the parts it acted on, which an owner reports and watches.

    `robust` is False for the plain mean alone: an owner averages such parts itself as they
    arrive (and secure aggregation may hide them), so no screening, watch or off-loop work is
    set up for it. Every other aggregator is robust.
    """

    name: str
    function: Callable[[Inputs], Result]
    options: tuple[Option, ...] = ()
    robust: bool = True
    _by_key: Mapping[str, Option] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"aggregator name {self.name!r}: expected lower case letters, digits and "
                             "underscores, a letter first")
        if not callable(self.function):
            raise ValueError(f"aggregator {self.name!r}: function {self.function!r} is not callable")
        options = tuple(self.options)
        for option in options:
            if not isinstance(option, Option):
                raise ValueError(f"aggregator {self.name!r}: option {option!r} is not an Option")
        keys = [option.key for option in options]
        twice = sorted({key for key in keys if keys.count(key) > 1})
        if twice:
            raise ValueError(f"aggregator {self.name!r}: option {twice[0]!r} declared twice")
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "_by_key", MappingProxyType({option.key: option for option in options}))

    def option(self, key: str) -> Option | None:
        """The option `key`, or None if this aggregator takes none of that name."""
        return self._by_key.get(key)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key a spec may give it, ``screen`` last."""
        return (*self._by_key, SCREEN_KEY)


_AGGREGATORS: dict[str, Aggregator] = {}


def register(aggregator: Aggregator) -> Aggregator:
    """Make `aggregator` known to specs by its name; ValueError if the name is taken."""
    if not isinstance(aggregator, Aggregator):
        raise ValueError(f"register: {aggregator!r} is not an Aggregator")
    if aggregator.name in _AGGREGATORS:
        raise ValueError(f"aggregator {aggregator.name!r} is registered already")
    _AGGREGATORS[aggregator.name] = aggregator
    return aggregator


def register_aggregator(name: str, function: Callable[[Inputs], Result],
                        options: Iterable[Option] = ()) -> Aggregator:
    """Register a robust aggregator from Python: `name` in specs, `function` of `Inputs` to
    ``(average, flagged)``, and the `options` a spec may set. ValueError naming what is wrong
    (a name taken or not of lower case letters, digits and underscores, an option twice).

    Every peer of a swarm must register the same aggregator under the same name before its
    protocol reads the spec, and the function must give the same bits for the same parts on
    every peer (build it from `starling.collectives.aggregators.shared`); owners whose answers
    are checked also hold it to the bound a robust average meets (docs/security.md).
    """
    return register(Aggregator(name, function, tuple(options)))


def lookup(name: Any) -> Aggregator | None:
    """The aggregator registered as `name`, or None."""
    return _AGGREGATORS.get(name) if isinstance(name, str) else None


def registered_aggregators() -> tuple[str, ...]:
    """The names specs may give, in the order they were registered."""
    return tuple(_AGGREGATORS)
