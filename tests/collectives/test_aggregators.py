"""The aggregator registry: the built-ins as modules that register themselves, and an
aggregator registered from Python that specs name, configs check and `aggregate` runs."""
from __future__ import annotations

import pytest
import torch

from starling.collectives import robust
from starling.collectives.accumulator import ShardGroup
from starling.collectives.aggregators import (
    NORM_HIGH,
    Aggregator,
    AggregatorConfig,
    Inputs,
    Option,
    aggregate,
    centered_clip,
    lookup,
    mean,
    median,
    register,
    register_aggregator,
    registered_aggregators,
    trimmed_mean,
)
from starling.collectives.aggregators import registry as registry_module
from starling.collectives.defences import Defences

BUILT_IN = ("mean", "centered_clip", "trimmed_mean", "median")


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """Each test registers into a copy of the registry, which is put back after it."""
    monkeypatch.setattr(registry_module, "_AGGREGATORS", dict(registry_module._AGGREGATORS))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def scaled_median(inputs: Inputs):
    """The coordinate-wise (upper) median times `scale`, flagging the parts whose first value is above `flag_above`."""
    ordered = torch.sort(inputs.matrix, dim=0).values
    average = ordered[ordered.shape[0] // 2] * inputs.options["scale"]
    flagged = [i for i, part in enumerate(inputs.parts) if part[0].item() > inputs.options["flag_above"]] \
        if inputs.options["flag"] else []
    return average, flagged


SCALE = Option("scale", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
FLAG_ABOVE = Option("flag_above", int, 100)
FLAG = Option("flag", bool, False)


def register_scaled() -> Aggregator:
    return register_aggregator("scaled_median", scaled_median, [SCALE, FLAG_ABOVE, FLAG])


def test_the_built_ins_are_modules_registered_in_order_with_their_options():
    assert registered_aggregators() == BUILT_IN
    modules = {"mean": mean.MEAN, "centered_clip": centered_clip.CENTERED_CLIP,
               "trimmed_mean": trimmed_mean.TRIMMED_MEAN, "median": median.MEDIAN}
    assert {name: lookup(name) for name in BUILT_IN} == modules
    assert {name: agg.keys for name, agg in modules.items()} == {
        "mean": ("screen",), "centered_clip": ("tau", "iters", "screen"), "trimmed_mean": ("trim", "screen"),
        "median": ("screen",)}
    assert [agg.robust for agg in modules.values()] == [False, True, True, True]
    assert (centered_clip.TAU.default, centered_clip.ITERS.default, trimmed_mean.TRIM.default) == (2.0, 5, 0.25)
    assert AggregatorConfig("centered_clip", clip_tau=1.5).options() == {"tau": 1.5, "iters": 5}
    assert AggregatorConfig("median").options() == {} and AggregatorConfig("median").extra == ()


def test_a_registered_aggregator_parses_from_a_spec_and_aggregates():
    aggregator = register_scaled()
    assert registered_aggregators() == (*BUILT_IN, "scaled_median") and lookup("scaled_median") is aggregator
    config = AggregatorConfig.parse("scaled_median: scale=0.5 , flag=yes,screen=3")
    assert config == AggregatorConfig("scaled_median", screen_norm=3.0,
                                      extra={"scale": 0.5, "flag": True})
    assert config.extra == (("scale", 0.5), ("flag_above", 100), ("flag", True))  # declared order, defaults in
    assert config.spec() == "scaled_median:scale=0.5,flag=True,screen=3.0"
    assert AggregatorConfig.parse(config.spec()) == config
    assert AggregatorConfig.parse("scaled_median").spec() == "scaled_median"
    assert AggregatorConfig.parse("scaled_median").screen_norm == 4.0 and config.robust

    parts = [t(1.0, 10.0), t(2.0, 30.0), t(3.0, 20.0), t(500.0, -40.0), t(4.0, 0.0)]
    result = aggregate(parts, [1.0] * 5, AggregatorConfig.parse("scaled_median:scale=0.5,flag=true,screen=0"))
    assert result.average.tolist() == [1.5, 5.0]  # the medians 3 and 10, halved
    assert result.screened == {} and result.clipped == frozenset({3})
    assert Defences("scaled_median:scale=0.25").aggregator == AggregatorConfig("scaled_median", extra=[("scale", 0.25)])


def test_an_owner_averages_its_parts_with_a_registered_aggregator():
    """The accumulator hands a registered (robust) aggregator the finite parts in member order,
    and names by member the part it screened out and the one it flagged."""
    register_scaled()
    group = ShardGroup(("a", "b", "c", "d", "e"), {"a", "b", "c", "d", "e"})
    for sender, part in [("e", t(4.0, 8.0)), ("b", t(2.0, 30.0)), ("a", t(1.0, 10.0)), ("d", t(200.0, 5.0)),
                         ("c", t(3.0, 20.0))]:
        group.add(sender, part)
    average, shares, verdict = group.average(AggregatorConfig.parse("scaled_median:scale=0.5,flag=true,flag_above=2"))
    assert average.tolist() == [1.5, 10.0]  # of a, b, c, e: the upper medians 3 and 20, halved
    assert shares is None and verdict.screened == {"d": NORM_HIGH} and verdict.clipped == frozenset({"c", "e"})
    assert group.contributors == ["e", "b", "a", "c"]


def test_the_function_gets_the_parts_kept_after_screening_and_its_flags_name_the_parts_given():
    seen: list[Inputs] = []

    def record(inputs: Inputs):
        seen.append(inputs)
        return inputs.matrix[0].clone(), [len(inputs.parts) - 1]

    register_aggregator("first", record)
    parts = [t(1.0, 1.0), t(100.0, 100.0), t(2.0, 1.0), t(1.0, 2.0), t(2.0, 2.0)]
    center = t(0.5, 0.5)
    result = aggregate(parts, [1.0, 9.0, 2.0, 2.0, 4.0], AggregatorConfig("first"), center=center)
    assert result.screened == {1: NORM_HIGH} and result.clipped == frozenset({4})
    inputs = seen[0]
    assert [p.tolist() for p in inputs.parts] == [[1.0, 1.0], [2.0, 1.0], [1.0, 2.0], [2.0, 2.0]]
    assert inputs.matrix.tolist() == [p.tolist() for p in inputs.parts]
    assert inputs.weights == (1.0, 2.0, 2.0, 4.0) and inputs.shares == [1 / 9, 2 / 9, 2 / 9, 4 / 9]
    assert inputs.center is center and dict(inputs.options) == {}
    with pytest.raises(TypeError):
        inputs.options["x"] = 1  # type: ignore[index]


def test_an_average_that_is_a_part_is_copied():
    register_aggregator("second", lambda inputs: (inputs.parts[1], ()))
    parts = [t(1.0, 2.0), t(3.0, 4.0), t(5.0, 6.0)]
    average = aggregate(parts, [1.0] * 3, AggregatorConfig("second", screen_norm=0)).average
    assert average.tolist() == [3.0, 4.0]
    average.add_(1.0)
    assert parts[1].tolist() == [3.0, 4.0]


@pytest.mark.parametrize(("returned", "message"), [
    (lambda inputs: inputs.parts[0], "returned a torch.float32 tensor of shape \\(2,\\) on cpu; expected \\(a 1-D"),
    (lambda inputs: (inputs.matrix, ()), "returned \\(a torch.float32 tensor of shape \\(3, 2\\) on cpu, \\[\\]\\)"),
    (lambda inputs: (inputs.parts[0].double(), ()), "returned \\(a torch.float64 tensor of shape \\(2,\\) on cpu, \\[\\]\\)"),
    (lambda inputs: (inputs.parts[0].clone(), [3]), "\\[3\\]\\); expected \\(.*, the indices below 3 of the parts it flagged\\)$"),
    (lambda inputs: (inputs.parts[0].clone(), [True]), "\\[True\\]"),
    (lambda inputs: (inputs.parts[0].clone(), None), "returned 'tuple'"),
])
def test_an_aggregator_that_returns_something_else_is_named(returned, message):
    register_aggregator("broken", returned)
    with pytest.raises(ValueError, match=message) as caught:
        aggregate([t(1.0, 2.0), t(3.0, 4.0), t(5.0, 6.0)], [1.0] * 3, AggregatorConfig("broken"))
    assert str(caught.value).startswith("aggregator 'broken' returned ")


@pytest.mark.parametrize(("spec", "message"), [
    ("geometric_median", "unknown aggregator 'geometric_median'; known: mean, centered_clip, trimmed_mean, "
                         "median, scaled_median$"),
    ("scaled_median:tau=2", "scaled_median has no option 'tau' \\(options: scale, flag_above, flag, screen\\)$"),
    ("median:scale=0.5", "median has no option 'scale' \\(options: screen\\)$"),
    ("scaled_median:scale=0", "scale=0.0: expected a number in \\(0, 1\\]$"),
    ("scaled_median:flag_above=1.5", "flag_above='1.5': expected int$"),
    ("scaled_median:flag=maybe", "flag='maybe': expected bool$"),
    ("scaled_median:scale=0.5,scale=0.5", "option 'scale' given twice$"),
])
def test_a_spec_with_an_unknown_name_or_an_option_it_does_not_take_is_refused_in_one_line(spec, message):
    register_scaled()
    with pytest.raises(ValueError, match=message) as caught:
        AggregatorConfig.parse(spec)
    assert str(caught.value).startswith(f"aggregator spec {spec!r}: ") and "\n" not in str(caught.value)


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "nope"}, "name='nope': expected one of mean, centered_clip, trimmed_mean, median, scaled_median"),
    ({"clip_tau": 3.0}, "clip_tau=3.0 applies to centered_clip only, not to scaled_median"),
    ({"trim": 0.1}, "trim=0.1 applies to trimmed_mean only, not to scaled_median"),
    ({"extra": {"tau": 1.0}}, "scaled_median has no option 'tau' \\(options: scale, flag_above, flag\\)"),
    ({"extra": {"scale": 2.0}}, "scale=2.0: expected a number in \\(0, 1\\]"),
    ({"extra": {"flag": 1}}, "flag=1: expected True or False"),
    ({"extra": [("scale", 0.5), ("scale", 0.5)]}, "an option given twice"),
    ({"extra": 5}, "extra=5: expected a mapping of option keys to values, or \\(key, value\\) pairs"),
    ({"name": "centered_clip", "extra": {"tau": 1.0}}, "centered_clip's option 'tau' is the field clip_tau"),
    ({"name": "median", "extra": {"scale": 0.5}}, "median has no option 'scale' \\(options: none\\)"),
])
def test_a_config_refuses_options_its_aggregator_does_not_take(fields, message):
    register_scaled()
    with pytest.raises(ValueError, match=message):
        AggregatorConfig(**{"name": "scaled_median", **fields})


@pytest.mark.parametrize(("make", "message"), [
    (lambda: register_aggregator("median", scaled_median), "aggregator 'median' is registered already"),
    (lambda: register_aggregator("Scaled", scaled_median), "aggregator name 'Scaled': expected lower case"),
    (lambda: register_aggregator("a:b", scaled_median), "aggregator name 'a:b'"),
    (lambda: register_aggregator("x", "not a function"), "aggregator 'x': function 'not a function' is not callable"),
    (lambda: register_aggregator("x", scaled_median, [SCALE, SCALE]), "aggregator 'x': option 'scale' declared twice"),
    (lambda: register_aggregator("x", scaled_median, ["scale"]), "aggregator 'x': option 'scale' is not an Option"),
    (lambda: register(object()), "is not an Aggregator"),
    (lambda: Option("screen", float, 4.0), "option key 'screen': expected lower case letters"),
    (lambda: Option("two-words", float, 1.0), "option key 'two-words'"),
    (lambda: Option("name", str, "x"), "option 'name': kind <class 'str'>; expected float, int or bool"),
    (lambda: Option("scale", float, 0.0, lambda v: v > 0, "above 0"), "scale=0.0: expected above 0"),
    (lambda: Option("scale", float, float("nan")), "scale=nan: expected a finite number"),
])
def test_registration_refuses_what_a_spec_could_not_name_and_registers_nothing(make, message):
    with pytest.raises(ValueError, match=message):
        make()
    assert registered_aggregators() == BUILT_IN


def test_robust_py_still_names_every_aggregator():
    assert robust.AggregatorConfig is AggregatorConfig and robust.aggregate is aggregate
    register_scaled()
    assert robust.AGGREGATORS == (*BUILT_IN, "scaled_median")
