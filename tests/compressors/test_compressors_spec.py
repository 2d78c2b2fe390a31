"""Spec strings: canonical round trip and composition rules (bad specs: test_compressors_errors)."""
from __future__ import annotations

import pytest
import torch
from _compressors_support import ALL_SPECS
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from starling.compressors import FP4, Int8, TopK, from_spec


@pytest.mark.parametrize("spec", ALL_SPECS + ["int8:128", "fp4:e2m1,block=64", "INT8", " topk : 0.1 "])
def test_spec_round_trip(spec: str) -> None:
    c = from_spec(spec)
    assert from_spec(c.spec).spec == c.spec


def test_canonical_forms_and_objects() -> None:
    assert from_spec("int8:128").spec == "int8:block=128"
    assert from_spec("fp4:e2m1,block=64").spec == "fp4"
    c = from_spec("topk:0.01+int8:block=64,stochastic=true")
    assert isinstance(c, TopK) and isinstance(c.inner, Int8) and c.inner.block == 64 and c.inner.stochastic
    assert c.spec == "topk:0.01+int8:block=64,stochastic=true"
    assert TopK(0.01, inner=FP4("e3m0")).spec == "topk:0.01+fp4:e3m0"
    with pytest.raises(ValueError):
        Int8(inner=Int8())


@settings(max_examples=25, deadline=None)
@given(arrays("float32", st.integers(1, 300), elements=st.floats(-2.0**100, 2.0**100, width=32)),
       st.sampled_from([8, 16, 64, 256]))
def test_int8_error_within_half_a_step(values, block: int) -> None:
    x = torch.from_numpy(values.copy())
    c = Int8(block=block)
    y = c.decode(c.encode(x))
    for start in range(0, x.numel(), block):
        xb, yb = x[start : start + block].double(), y[start : start + block].double()
        step = float(xb.abs().max()) / 127
        assert float((xb - yb).abs().max()) <= step * 0.5 * (1 + 1e-5) + 1e-38
