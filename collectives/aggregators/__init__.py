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

Each aggregator is a module here that registers itself (`mean`, `centered_clip`,
`trimmed_mean`, `median`): its name in specs, the options a spec may set (`Option`: key,
type, default, accepted values) and a function of the parts kept after screening (`Inputs`)
to their average and the parts it flagged. `shared` holds what they have in common. An
aggregator of your own joins them with `register_aggregator`:

    from starling.collectives.aggregators import AggregatorConfig, Option, aggregate, register_aggregator
    from starling.collectives.aggregators.shared import middle, sorted_columns

    def shrunk_median(inputs):  # the coordinate-wise median, pulled towards 0; it flags no part
        return middle(sorted_columns(inputs.matrix)).mul_(inputs.options["pull"]), ()

    pull = Option("pull", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    register_aggregator("shrunk_median", shrunk_median, [pull])
    config = AggregatorConfig.parse("shrunk_median:pull=0.5,screen=3")   # spec() writes it back
    result = aggregate(parts, weights, config)

Its function must give the same bits for the same parts on every peer (build it from
`shared`), and every peer of a swarm must register it under the same name before its
protocol reads the spec.
"""
from __future__ import annotations

# imported in this order, the built-ins register in it, and specs and errors list them so
# isort: off
from starling.collectives.aggregators import mean, centered_clip, trimmed_mean, median
# isort: on
from starling.collectives.aggregators.centered_clip import CLIP_REPORTED
from starling.collectives.aggregators.core import Aggregate, AggregatorConfig, aggregate
from starling.collectives.aggregators.registry import (
    Aggregator,
    Inputs,
    Option,
    lookup,
    register,
    register_aggregator,
    registered_aggregators,
)
from starling.collectives.aggregators.shared import NORM_HIGH, NORM_LOW

__all__ = [
    "CLIP_REPORTED", "NORM_HIGH", "NORM_LOW", "Aggregate", "Aggregator", "AggregatorConfig", "Inputs", "Option",
    "aggregate", "centered_clip", "lookup", "mean", "median", "register", "register_aggregator",
    "registered_aggregators", "trimmed_mean",
]
