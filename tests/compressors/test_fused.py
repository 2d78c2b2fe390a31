"""The block quantizers' one-kernel path (accelerators) writes the CPU loop's bytes.

On the CPU ``Fused`` runs its function eagerly, so these tests check the arithmetic that
``torch.compile`` turns into one kernel on a GPU; the CUDA tests check the compiled kernel.
"""
from __future__ import annotations

import logging

import pytest
import torch

from starling.compressors import from_spec
from starling.compressors.fused import ENV, Fused

FUSED_SPECS = ["int8", "int4", "int8:block=64", "int4:block=128", "fp4", "fp4:e3m0", "fp8", "fp8:e5m2"]


def awkward(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gaussian values with an all-zero block, a block of tiny values and one of huge ones."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[:256] = 0.0
    x[256:512] *= 1e-38
    x[512:768] *= 1e30
    x[800] = -x[801].abs() - 1.0  # a negative block maximum
    return x.to(dtype)


@pytest.mark.parametrize("spec", FUSED_SPECS)
@pytest.mark.parametrize("n", [4096, 4096 + 37, 1000 * 64])
def test_the_fused_path_writes_the_loops_bytes(spec: str, n: int) -> None:
    c = from_spec(spec)
    assert c.fused
    flat = awkward(n)
    full = n // c.block
    whole = c._encode_whole(flat, full)
    loop = c._encode_chunks(flat, full, None)
    for a, b in zip(whole, loop, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("spec", ["int8", "int4", "fp4", "fp8"])
def test_the_fused_path_takes_half_precision_input_as_the_loop_does(spec: str) -> None:
    c = from_spec(spec)
    flat = awkward(8192, torch.bfloat16)
    for a, b in zip(c._encode_whole(flat, 8192 // c.block), c._encode_chunks(flat, 8192 // c.block, None),
                    strict=True):
        assert torch.equal(a, b)


def test_a_kernel_that_fails_to_compile_runs_eagerly_once_warned(monkeypatch, caplog) -> None:
    calls = []

    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.device.type)
        return x * 2

    def broken_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("no compiler here")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    fused = Fused(double)
    meta = torch.ones(3, device="meta")  # not the CPU: the compiled path is tried
    with caplog.at_level(logging.WARNING, logger="starling.compressors.fused"):
        out = fused(meta)
        fused(meta)
    assert out.shape == (3,) and fused.compiled_calls == 0
    assert fused.failure == "RuntimeError: no compiler here"
    assert sum("runs eagerly" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(fused(torch.ones(2)), torch.full((2,), 2.0))


def test_an_input_the_function_itself_refuses_still_raises_and_keeps_the_compiler(monkeypatch) -> None:
    def strict(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    fused = Fused(strict)
    with pytest.raises(ValueError, match="bad input"):
        fused(torch.ones(1, device="meta"))
    assert fused.failure is None


def test_the_environment_turns_compiling_off(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "0")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: pytest.fail("compiled with compiling off"))
    fused = Fused(lambda x: x + 1)
    assert fused(torch.ones(1, device="meta")).shape == (1,)
