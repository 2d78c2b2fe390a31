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


def fake_compile(calls: list[str]):
    """A stand-in for torch.compile that returns the function, counting its compiled calls."""

    def compile_(fn, **kwargs):
        assert kwargs["fullgraph"] and kwargs["backend"] == "inductor"
        assert kwargs["options"]  # division rounded as eager rounds it
        def compiled(*args):
            calls.append("compiled")
            return fn(*args)
        return compiled
    return compile_


def test_the_first_calls_run_eagerly_while_the_kernel_compiles_in_a_thread(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch, "compile", fake_compile(calls))
    fused = Fused(lambda x: x + 1)
    x = torch.ones(4, 3, device="meta")  # not the CPU: the compiled path is taken
    assert fused(x).shape == (4, 3) and fused.compiled_calls == 0
    Fused.settle(30)
    assert calls == ["compiled"]  # the compile ran on a two-row sample, in its thread
    assert fused(x).shape == (4, 3) and fused(torch.ones(9, 3, device="meta")).shape == (9, 3)
    assert fused.compiled_calls == 2 and calls == ["compiled"] * 3
    # another dtype or block width is another kernel: eager again until it is compiled
    fused(torch.ones(4, 5, device="meta"))
    assert fused.compiled_calls == 2
    Fused.settle(30)
    fused(torch.ones(4, 5, device="meta"))
    assert fused.compiled_calls == 3


def test_a_single_block_stays_eager_and_starts_no_compile(monkeypatch) -> None:
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: pytest.fail("compiled a single block"))
    fused = Fused(lambda x: x + 1)
    assert fused(torch.ones(1, 3, device="meta")).shape == (1, 3)
    assert not fused._threads


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
    meta = torch.ones(3, device="meta")
    with caplog.at_level(logging.WARNING, logger="starling.compressors.fused"):
        out = fused(meta)
        Fused.settle(30)
        fused(meta)
        fused(torch.ones(3, 2, device="meta"))  # another kind of input tries no compile of its own
    assert out.shape == (3,) and fused.compiled_calls == 0 and len(fused._threads) == 1
    assert fused.failure == "RuntimeError: no compiler here"
    assert sum("runs eagerly" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(fused(torch.ones(2)), torch.full((2,), 2.0))


def test_an_input_the_function_itself_refuses_still_raises_and_keeps_the_compiler(monkeypatch) -> None:
    def strict(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    fused = Fused(strict)
    with pytest.raises(ValueError, match="bad input"):
        fused(torch.ones(3, device="meta"))
    Fused.settle(30)
    assert fused.failure is None


def test_the_environment_turns_compiling_off(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "0")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: pytest.fail("compiled with compiling off"))
    fused = Fused(lambda x: x + 1)
    assert fused(torch.ones(3, device="meta")).shape == (3,)
    assert not fused._threads


@pytest.mark.slow
def test_a_real_compile_in_its_thread_takes_over_with_the_loops_bytes(monkeypatch) -> None:
    """torch.compile itself, with the CPU standing in for an accelerator: the kernel traces as one
    graph, encodes go on while it compiles in its thread, then use it, and a new count of blocks
    needs no new compile. The "eager" backend traces without generating code (Inductor would
    build C++ here for 20 s of CPU; the CUDA tests check the kernels it builds for a GPU)."""
    monkeypatch.setattr(Fused, "eager_devices", frozenset())
    monkeypatch.setattr(Fused, "backend", "eager")
    x = awkward(256 * 400 + 5)
    c = from_spec("int8")
    kernel = next(k for k in Fused.kernels if k.fn.__name__ == "_int8_codes")
    monkeypatch.setattr(kernel, "_compiled", None)
    monkeypatch.setattr(kernel, "_ready", {})
    before = kernel.compiled_calls
    packets = [c.encode(x, seed=1)]
    Fused.settle(300)
    assert kernel.failure is None
    packets += [c.encode(x, seed=1), c.encode(x[: 256 * 7], seed=1)]  # another count of blocks: no new compile
    assert kernel.compiled_calls == before + 2
    monkeypatch.setattr(Fused, "eager_devices", frozenset({"cpu"}))
    for packet, values in zip(packets, (x, x, x[: 256 * 7]), strict=True):
        want = c.encode(values, seed=1)
        assert all(torch.equal(a, b) for a, b in zip(want.buffers, packet.buffers, strict=True))
