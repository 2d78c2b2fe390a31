"""Robust aggregators: each against its definition, against the attacks they are for, and
the same bits on every run, thread count and memory layout."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from starling.collectives.robust import NORM_HIGH, NORM_LOW, AggregatorConfig, aggregate

ROBUST = ("centered_clip", "trimmed_mean", "median")
ALL = ("mean", *ROBUST)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def config(spec: str) -> AggregatorConfig:
    return AggregatorConfig.parse(spec)


def run(parts, spec, weights=None, center=None):
    return aggregate(parts, weights or [1.0] * len(parts), config(spec), center=center)


def honest_and_attacker(n_honest=15, numel=256, seed=0):
    """Honest parts around a common gradient, their mean, and their median distance from it."""
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(numel, generator=gen)
    honest = [signal + 0.5 * torch.randn(numel, generator=gen) for _ in range(n_honest)]
    mean = torch.stack(honest).double().mean(0).float()
    spread = torch.stack([(h - mean).norm() for h in honest]).median().item()
    return honest, mean, spread


def bits(x: torch.Tensor) -> bytes:
    return x.numpy().tobytes()


# --- mean ---------------------------------------------------------------------------------


def test_mean_is_the_ordered_sum_over_the_count_bit_for_bit():
    """(1e8 + 1) - 1e8 is 0 in float32 and (1e8 - 1e8) + 1 is 1: the sum runs in the parts' order."""
    parts = [t(1e8, 0.1), t(1.0, 0.2), t(-1e8, 0.3), t(3.0, 0.7)]
    expected = (((parts[0] + parts[1]) + parts[2]) + parts[3]) / 4
    result = run(parts, "mean")
    assert bits(result.average) == bits(expected)
    assert result.average[0].item() == 0.75  # (1e8 + 1) rounds to 1e8, so the 1 is lost, the 3 is not
    assert result.screened == {} and result.clipped == frozenset()

    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(1001, generator=gen) * 10 ** (i % 5) for i in range(13)]
    expected = parts[0].clone()
    for part in parts[1:]:
        expected = expected + part
    assert bits(run(parts, "mean").average) == bits(expected / 13)


def test_mean_weighs_parts_by_their_shares():
    parts = [t(1.0, 2.0), t(4.0, -2.0), t(10.0, 0.0)]
    result = run(parts, "mean", weights=[1.0, 3.0, 0.0])  # shares 1/4, 3/4, 0
    assert torch.allclose(result.average, t(3.25, -1.0))
    # each part times its share, added in order: no fused multiply-add whose bits vary by CPU
    gen = torch.Generator().manual_seed(2)
    many = [torch.randn(1001, generator=gen) for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    expected = many[0] * (1 / 15)
    for part, weight in zip(many[1:], weights[1:]):
        expected = expected + part * (weight / 15)
    assert bits(run(many, "mean", weights=weights).average) == bits(expected)
    assert torch.equal(run(parts, "mean", weights=[0.0, 0.0, 0.0]).average, run(parts, "mean").average)
    assert torch.equal(run(parts, "mean", weights=[2.0, 2.0, 2.0]).average, run(parts, "mean").average)


# --- centered clip ------------------------------------------------------------------------


def test_centered_clip_one_step_by_hand():
    """From v_0 = 0: distances 0, 2, 2, 10, median 2, so tau = 2; factors 1, 1, 1, 0.2;
    v_1 = (0 + (2, 0) + (0, 2) + 0.2 (10, 0)) / 4 = (1, 0.5). The far part's factor is below
    one half: reported."""
    parts = [t(0.0, 0.0), t(2.0, 0.0), t(0.0, 2.0), t(10.0, 0.0)]
    result = run(parts, "centered_clip:tau=1,iters=1,screen=0", center=t(0.0, 0.0))
    assert torch.equal(result.average, t(1.0, 0.5))
    assert result.clipped == frozenset({3})
    # tau is a multiple of the median distance: twice the radius keeps the far part at 0.4
    wider = run(parts, "centered_clip:tau=2.0,iters=1,screen=0", center=t(0.0, 0.0))
    assert torch.equal(wider.average, t(1.5, 0.5)) and wider.clipped == frozenset({3})


def reference_centered_clip(parts, weights, clip_tau, iters, center):
    """The definition, in float64 and plain numpy, for comparison."""
    x = np.stack([p.double().numpy() for p in parts])
    s = np.asarray(weights, dtype=np.float64) / sum(weights)
    v = np.median(x, axis=0) if center is None else center.double().numpy()
    for _ in range(iters):
        d = np.linalg.norm(x - v, axis=1)
        tau = clip_tau * np.median(d)
        v = v + ((x - v) * (s * np.minimum(1.0, tau / d))[:, None]).sum(0)
    return torch.from_numpy(v)


@pytest.mark.parametrize("with_center", [False, True])
def test_centered_clip_follows_its_definition(with_center):
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(101, generator=gen) * (1 + i) for i in range(6)]  # even: the median averages two
    weights = [1.0, 2.0, 1.0, 3.0, 1.0, 0.5]
    center = torch.randn(101, generator=gen) if with_center else None
    result = aggregate(parts, weights, config("centered_clip:tau=0.8,iters=4,screen=0"), center=center)
    expected = reference_centered_clip(parts, weights, 0.8, 4, center)
    assert torch.allclose(result.average.double(), expected, rtol=1e-5, atol=1e-5)


def test_centered_clip_stays_near_the_honest_mean_when_one_part_is_scaled_100x():
    honest, honest_mean, spread = honest_and_attacker()
    parts = [*honest[:7], honest[7] * 100, *honest[8:]]
    clipped = run(parts, "centered_clip:screen=0")  # the clip alone, no screen in front of it
    plain = run(parts, "mean")
    assert (clipped.average - honest_mean).norm() < 0.2 * spread
    assert (plain.average - honest_mean).norm() > 5 * spread
    assert clipped.clipped == frozenset({7})


def test_centered_clip_with_every_part_at_the_center_divides_by_nothing():
    """A median distance of 0 (tau = 0): the parts at the center pull by nothing, the others
    are cut to nothing."""
    c = t(1.0, -2.0, 3.0)
    same = run([c.clone(), c.clone(), c.clone()], "centered_clip:screen=0", center=c)
    assert torch.equal(same.average, c) and same.clipped == frozenset()
    majority = run([c.clone(), c.clone(), c.clone(), t(9.0, 9.0, 9.0)], "centered_clip:screen=0", center=c)
    assert torch.equal(majority.average, c) and majority.clipped == frozenset({3})


def test_centered_clip_cuts_a_part_whose_norm_overflows_to_nothing():
    """Finite values past ~1e19 square to inf: such a part is infinitely far, and its factor
    0 must not meet an inf difference (0 * inf is NaN)."""
    honest, honest_mean, spread = honest_and_attacker(n_honest=7)
    parts = [*honest, torch.full_like(honest[0], 3e38), torch.full_like(honest[0], -3e38)]
    result = run(parts, "centered_clip:screen=0")
    assert torch.isfinite(result.average).all()
    assert (result.average - honest_mean).norm() < spread
    assert result.clipped == frozenset({7, 8})


# --- trimmed mean and median -----------------------------------------------------------------


def test_trimmed_mean_by_hand():
    """Coordinate 0: 1 2 3 4 100 -> 2 3 4 -> 3. Coordinate 1: -50 0 1 2 3 -> 0 1 2 -> 1.
    The last part is cut off in both coordinates (reported), the first and fourth in one of two
    (not: that is not more than half)."""
    parts = [t(1.0, 0.0), t(2.0, 1.0), t(3.0, 2.0), t(4.0, 3.0), t(100.0, -50.0)]
    result = run(parts, "trimmed_mean:trim=0.2,screen=0")
    assert torch.equal(result.average, t(3.0, 1.0))
    assert result.clipped == frozenset({4})
    # floor(0.19 * 5) = 0: nothing cut, the plain mean of the sorted values
    assert torch.allclose(run(parts, "trimmed_mean:trim=0.19,screen=0").average, t(22.0, -8.8))
    # the default quarter of 5 parts cuts one at each end; weights are ignored
    assert torch.equal(run(parts, "trimmed_mean:screen=0", weights=[9.0, 1, 1, 1, 1]).average, t(3.0, 1.0))


def test_median_by_hand_and_symmetric_for_even_counts():
    odd = [t(1.0, 0.0), t(2.0, 1.0), t(3.0, 2.0), t(4.0, 3.0), t(100.0, -50.0)]
    result = run(odd, "median:screen=0")
    assert torch.equal(result.average, t(3.0, 1.0))
    assert result.clipped == frozenset({4})  # the highest in coordinate 0, the lowest in 1
    even = [t(1.0), t(2.0), t(3.0), t(100.0)]
    assert torch.equal(run(even, "median:screen=0").average, t(2.5))  # the mean of the middle two
    gen = torch.Generator().manual_seed(4)
    parts = [torch.randn(300, generator=gen) for _ in range(6)]
    up = run(parts, "median:screen=0").average
    down = run([-p for p in parts], "median:screen=0").average
    assert bits(down) == bits(-up)
    # identical extremes are all at the end, whichever one a sort puts first
    twins = [t(1.0, 3.0), t(2.0, 1.0), t(3.0, 2.0), t(9.0, 9.0), t(9.0, 9.0)]
    assert run(twins, "median:screen=0").clipped == frozenset({3, 4})


@pytest.mark.parametrize("spec", ["trimmed_mean:screen=0", "median:screen=0"])
def test_order_statistics_ignore_one_extreme_part(spec):
    honest, _, _ = honest_and_attacker(n_honest=8)
    moderate = run([*honest, torch.full_like(honest[0], 100.0)], spec)  # past every honest value
    extreme = run([*honest, torch.full_like(honest[0], 1e30)], spec)
    assert torch.equal(moderate.average, extreme.average)  # beyond the cut, how far is irrelevant
    assert 8 in extreme.clipped


# --- screening ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [*ROBUST, "mean:screen=4"])
def test_screening_leaves_out_a_scaled_part_and_a_zero_part_and_says_why(spec):
    honest, honest_mean, spread = honest_and_attacker(n_honest=8)
    parts = [*honest[:3], honest[3] * 100, *honest[4:6], torch.zeros_like(honest[0]), *honest[6:]]
    result = run(parts, spec)
    assert result.screened == {3: NORM_HIGH, 6: NORM_LOW}
    # screened parts never reach the aggregator: the same as aggregating the rest alone
    rest = [p for i, p in enumerate(parts) if i not in result.screened]
    alone = run(rest, spec.split(":")[0] + ":screen=0")
    assert torch.equal(result.average, alone.average)


def test_mean_does_not_screen_unless_asked():
    honest, _, _ = honest_and_attacker(n_honest=8)
    parts = [*honest, honest[0] * 100]
    assert AggregatorConfig().screen_norm == 0.0 and config("median").screen_norm == 4.0
    assert run(parts, "mean").screened == {}
    assert run(parts, "mean:screen=4").screened == {8: NORM_HIGH}
    assert run(parts, "median:screen=0").screened == {}


def test_screening_never_leaves_out_half_or_more():
    """The median norm is an honest part's only while the honest ones are a majority: a screen
    that would leave out half or more (the honest half, perhaps) leaves out none."""
    big, small = t(100.0, 0.0), t(1.0, 0.0)
    # norms 1 1 10 100 100: median 10, four of five are off by more than 4x
    parts = [small, small.clone(), t(10.0, 0.0), big, big.clone()]
    assert run(parts, "median").screened == {}
    # two parts: one is always "off"; four parts with two off: exactly half
    assert run([small, big], "median").screened == {}
    assert run([small, small.clone(), big, big.clone()], "median").screened == {}
    # two of five is fewer than half: screened
    assert run([t(10.0, 0.0), t(11.0, 0.0), t(12.0, 0.0), big, small], "median").screened == {
        3: NORM_HIGH, 4: NORM_LOW}


# --- contracts: inputs, copies, determinism ------------------------------------------------


@pytest.mark.parametrize("spec", [*ALL, "mean:screen=4"])
def test_inputs_are_never_written_and_the_average_is_a_tensor_of_its_own(spec):
    honest, _, _ = honest_and_attacker(n_honest=6)
    wire = torch.cat([*honest, honest[0] * 100])  # parts as views of one wire buffer
    parts = list(wire.view(7, -1))
    center = honest[1] + 0.1
    before, center_before = wire.clone(), center.clone()
    for some in (parts, parts[:1]):  # a lone part is copied too
        result = run(some, spec, center=center)
        assert torch.equal(wire, before) and torch.equal(center, center_before)
        assert result.average.untyped_storage().data_ptr() not in (
            wire.untyped_storage().data_ptr(), center.untyped_storage().data_ptr())


def test_one_part_is_copied_and_no_parts_is_an_error():
    part = t(1.0, 2.0)
    for spec in ALL:
        result = run([part], spec)
        assert torch.equal(result.average, part) and result.average.data_ptr() != part.data_ptr()
    with pytest.raises(ValueError, match="no parts"):
        aggregate([], [], AggregatorConfig())
    empty = run([torch.empty(0), torch.empty(0)], "centered_clip")
    assert empty.average.numel() == 0


@pytest.mark.parametrize("spec", ALL)
def test_the_same_parts_give_the_same_bits_on_any_thread_count_and_layout(spec):
    """Two owners aggregating the same parts must agree bit for bit: no reduction here takes an
    order from the thread count or SIMD width (the length is past torch's grain of 32768, so
    two threads do split the work), and a part's memory layout changes nothing."""
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(70_001, generator=gen) * (1 + i % 3) for i in range(9)]
    parts[4] = parts[4] * 30
    weights = [1.0 + i for i in range(9)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = aggregate(parts, weights, config(spec))
        torch.set_num_threads(2)
        together = aggregate(parts, weights, config(spec))
    finally:
        torch.set_num_threads(threads)
    again = aggregate(parts, weights, config(spec))
    strided = torch.stack(parts, dim=1)  # each part a stride-9 view
    spread_out = aggregate([strided[:, i] for i in range(9)], weights, config(spec))
    assert bits(alone.average) == bits(together.average) == bits(again.average) == bits(spread_out.average)
    assert alone.screened == together.screened and alone.clipped == together.clipped


@pytest.mark.parametrize("spec", ["trimmed_mean", "median"])
def test_order_statistics_give_the_same_bits_in_any_member_order(spec):
    """They sort first, so they are symmetric in the parts to the last bit (mean and
    centered_clip sum in member order: their callers pass the parts in that order)."""
    gen = torch.Generator().manual_seed(6)
    parts = [torch.randn(5000, generator=gen) for _ in range(8)]
    parts[2] = torch.zeros(5000)
    parts[5][:100] = -0.0  # tied zeros of both signs, which a sort may place either way
    forward = run(parts, spec + ":screen=0")
    backward = run(parts[::-1], spec + ":screen=0")
    assert bits(forward.average) == bits(backward.average)
    assert forward.clipped == frozenset(7 - i for i in backward.clipped)


# --- configs --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [
    "mean", "median", "centered_clip", "trimmed_mean", "centered_clip:tau=1.5,iters=8",
    "trimmed_mean:trim=0.1", "trimmed_mean:trim=0.0,screen=3.0", "mean:screen=2.5", "median:screen=0.0",
])
def test_spec_round_trips(spec):
    parsed = config(spec)
    assert parsed.spec() == spec and config(parsed.spec()) == parsed


def test_parse_reads_options_and_spec_writes_only_what_differs():
    assert config(" centered_clip : tau = 1.5 , iters=2 ") == AggregatorConfig("centered_clip", clip_tau=1.5, clip_iters=2)
    assert config("median:screen=4").spec() == "median"  # the robust default
    assert AggregatorConfig("trimmed_mean", trim=0.3, screen_norm=3).spec() == "trimmed_mean:trim=0.3,screen=3.0"
    assert not AggregatorConfig().robust and all(AggregatorConfig(name).robust for name in ROBUST)


@pytest.mark.parametrize(("spec", "message"), [
    ("", "unknown aggregator ''"),
    ("krum", "unknown aggregator 'krum'.*known: mean, centered_clip, trimmed_mean, median"),
    ("median:tau=2", "median has no option 'tau' \\(options: screen\\)"),
    ("centered_clip:trim=0.1", "centered_clip has no option 'trim'"),
    ("centered_clip:clip_tau=2", "no option 'clip_tau'"),
    ("centered_clip:tau=abc", "tau='abc': expected float"),
    ("centered_clip:iters=2.5", "iters='2.5': expected int"),
    ("trimmed_mean:trim=0.5", "trim=0.5: expected a number in \\[0, 0.5\\)"),
    ("median:screen", "'screen' is not of the form NAME=VALUE"),
    ("median:", "is not of the form NAME=VALUE"),
    ("median:screen=3,screen=4", "'screen' given twice"),
    ("median:screen=1", "screen_norm=1.0: expected 0 \\(off\\) or a factor above 1"),
])
def test_parse_refuses_bad_specs_clearly(spec, message):
    with pytest.raises(ValueError, match=message) as caught:
        config(spec)
    assert repr(spec) in str(caught.value)


@pytest.mark.parametrize(("fields", "message"), [
    ({"name": "Median"}, "name='Median'"),
    ({"clip_tau": 0.0}, "clip_tau=0.0: expected a finite number above 0"),
    ({"clip_tau": -1.0}, "clip_tau=-1.0"),
    ({"clip_tau": math.inf}, "clip_tau=inf"),
    ({"clip_tau": math.nan}, "clip_tau=nan"),
    ({"clip_tau": True}, "clip_tau=True"),
    ({"clip_iters": 0}, "clip_iters=0: expected an integer of at least 1"),
    ({"clip_iters": 2.0}, "clip_iters=2.0"),
    ({"trim": -0.1, "name": "trimmed_mean"}, "trim=-0.1"),
    ({"trim": 0.5, "name": "trimmed_mean"}, "trim=0.5"),
    ({"screen_norm": 0.5}, "screen_norm=0.5: expected 0 \\(off\\) or a factor above 1"),
    ({"screen_norm": -4.0}, "screen_norm=-4.0"),
    ({"screen_norm": math.inf}, "screen_norm=inf"),
    ({"screen_norm": "4"}, "screen_norm='4'"),
    ({"name": "median", "clip_tau": 3.0}, "clip_tau=3.0 applies to centered_clip only, not to median"),
    ({"name": "mean", "trim": 0.1}, "trim=0.1 applies to trimmed_mean only, not to mean"),
])
def test_config_refuses_bad_fields_naming_them(fields, message):
    base = {"name": "centered_clip"}
    with pytest.raises(ValueError, match=message):
        AggregatorConfig(**{**base, **fields})


def test_aggregate_refuses_bad_input_naming_it():
    a, b = t(1.0, 2.0), t(3.0, 4.0)
    cases = [
        (([a, b], [1.0]), "1 weights for 2 parts"),
        (([a, t(1.0)], [1.0, 1.0]), "part 1 is a torch.float32 tensor of shape \\(1,\\)"),
        (([a, b.double()], [1.0, 1.0]), "part 1 is a torch.float64 tensor"),
        (([a, torch.ones(1, 2)], [1.0, 1.0]), "part 1 is a torch.float32 tensor of shape \\(1, 2\\)"),
        (([a, b], [1.0, -1.0]), "weight 1 is -1.0"),
        (([a, b], [1.0, math.nan]), "weight 1 is nan"),
    ]
    for (parts, weights), message in cases:
        with pytest.raises(ValueError, match=message):
            aggregate(parts, weights, AggregatorConfig())
    with pytest.raises(ValueError, match="center is a torch.float32 tensor of shape \\(3,\\)"):
        aggregate([a, b], [1.0, 1.0], config("centered_clip"), center=t(0.0, 0.0, 0.0))
