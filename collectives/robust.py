"""The robust aggregators' former home, kept so that imports of it still work: everything here
lives in `starling.collectives.aggregators`, whose docstring says what each aggregator computes
and how its results stay the same bits everywhere."""
from __future__ import annotations

from starling.collectives.aggregators import (
    CLIP_REPORTED,
    NORM_HIGH,
    NORM_LOW,
    Aggregate,
    AggregatorConfig,
    aggregate,
    registered_aggregators,
)

__all__ = ["CLIP_REPORTED", "NORM_HIGH", "NORM_LOW", "Aggregate", "AggregatorConfig", "aggregate"]


def __getattr__(name: str) -> object:  # AGGREGATORS, out of __all__: a star import would freeze it
    if name == "AGGREGATORS":  # the names registered now, built-ins first: registration adds to them
        return registered_aggregators()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
