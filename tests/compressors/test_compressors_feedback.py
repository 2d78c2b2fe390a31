"""ErrorFeedback: running sums track, residuals stay bounded, state round-trips."""
from __future__ import annotations

import pytest
import torch

from starling.compressors import ErrorFeedback, from_spec


@pytest.mark.parametrize("spec", ["sign", "topk:0.05", "topk:0.05+int4", "int4", "randomk:0.1", "powersgd:1"])
def test_running_sums_track_with_bounded_residual(spec: str) -> None:
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(from_spec(spec))
    sum_in = torch.zeros(16, 20, dtype=torch.float64)
    sum_out = torch.zeros_like(sum_in)
    peak = 0.0
    for step in range(60):
        x = torch.randn(16, 20, generator=gen) + 0.5  # a bias the codec must not lose
        packet = ef.encode(x, name="layer.weight", seed=step)
        sum_in += x.double()
        sum_out += ef.decode(packet).double()
        residual = ef.residual("layer.weight").double()
        assert torch.allclose(sum_in - sum_out, residual, atol=1e-3)
        peak = max(peak, float(residual.norm()))
    # bounded: the residual does not grow with the number of steps
    assert float(residual.norm()) < 0.5 * float(sum_in.norm())
    assert peak < 40 * float(torch.randn(16, 20, generator=gen).norm())
    # the decoded sum tracks the input sum far better than dropping the residual would
    plain = from_spec(spec)
    gen2 = torch.Generator().manual_seed(0)
    sum_plain = torch.zeros_like(sum_in)
    for step in range(60):
        x = torch.randn(16, 20, generator=gen2) + 0.5
        sum_plain += plain.decode(plain.encode(x, seed=step, name="p")).double()
    assert float((sum_in - sum_out).norm()) <= float((sum_in - sum_plain).norm()) + 1e-6


def test_names_are_independent_and_reset() -> None:
    ef = ErrorFeedback(from_spec("sign"))
    ef.encode(torch.randn(10), name="a")
    ef.encode(torch.randn(5, 2), name="b")
    assert ef.residual("a").shape == (10,) and ef.residual("b").shape == (5, 2)
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.reset()
    assert ef.residual("b") is None
    ef.encode(torch.randn(3))  # name=None has its own slot
    assert ef.residual() is not None


def test_state_dict_round_trip() -> None:
    gen = torch.Generator().manual_seed(1)
    a = ErrorFeedback(from_spec("powersgd:2+int8"))
    for _ in range(3):
        a.encode(torch.randn(12, 10, generator=gen), name="w")
    b = ErrorFeedback(from_spec("powersgd:2+int8"))
    b.load_state_dict(a.state_dict())
    x = torch.randn(12, 10, generator=gen)
    pa, pb = a.encode(x, name="w"), b.encode(x, name="w")
    assert all(torch.equal(u, v) for u, v in zip(pa.buffers, pb.buffers))
    assert torch.equal(a.residual("w"), b.residual("w"))
    with pytest.raises(ValueError):
        b.load_state_dict({"residuals": {"w": "nope"}})
    assert torch.equal(a.residual("w"), b.residual("w"))  # unchanged after the bad load


def test_half_precision_inputs_keep_float32_residuals() -> None:
    ef = ErrorFeedback(from_spec("int4"))
    x = torch.randn(256).to(torch.bfloat16)
    packet = ef.encode(x, name="h")
    assert ef.decode(packet).dtype == torch.bfloat16
    assert ef.residual("h").dtype == torch.float32
