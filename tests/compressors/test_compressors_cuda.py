"""The same code on CUDA: identical random streams, packets that decode on either device.

Skipped where CUDA is absent.
"""
from __future__ import annotations

import pytest
import torch
from _compressors_support import ALL_SPECS, CUDA, over_the_wire, rel_err

from starling.compressors import CountSketch, GaussianSketch, from_spec, rng

pytestmark = CUDA


@pytest.mark.parametrize("offset", [0, 3, 1 << 33])
def test_rng_bit_identical_across_devices(offset: int) -> None:
    n = 100_003
    for draw in (
        lambda d: rng.bits64(9, n, d, offset=offset),
        lambda d: rng.uniform(9, n, d, offset=offset),
        lambda d: rng.uniform(9, n, d, torch.bfloat16, offset=offset),
        lambda d: rng.normal(9, n, d, offset=offset),
        lambda d: rng.normal(9, n, d, torch.float16, offset=offset),
        lambda d: rng.rademacher(9, n, d, offset=offset),
        lambda d: rng.randint(9, n, 12345, d, offset=offset),
        lambda d: rng.sample_indices(9, 1000, n, d),
    ):
        assert torch.equal(draw("cpu"), draw("cuda").cpu())


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_cuda_round_trip_and_cross_device_decode(spec: str) -> None:
    x = torch.randn(33, 40, generator=torch.Generator().manual_seed(0))
    c = from_spec(spec)
    packet = c.encode(x.cuda(), seed=5)
    assert all(b.is_cuda for b in packet.buffers)
    on_gpu = c.decode(packet)
    assert on_gpu.is_cuda and on_gpu.shape == x.shape
    on_cpu = from_spec(spec).decode(over_the_wire(packet))
    assert torch.allclose(on_cpu, on_gpu.cpu(), atol=1e-5, rtol=1e-4)
    to_gpu = c.decode(over_the_wire(c.encode(x, seed=5)), device="cuda")
    assert to_gpu.is_cuda


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "int4", "sign", "fp8", "randomk:0.1", "topk:0.1"])
def test_exact_codecs_match_cpu_bytes(spec: str) -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    c = from_spec(spec)
    cpu, gpu = c.encode(x, seed=3), c.encode(x.cuda(), seed=3)
    assert cpu.header == gpu.header
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu.buffers, gpu.buffers))


def test_sketches_agree_across_devices() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    for sk in (CountSketch((5, 64)), GaussianSketch(32), GaussianSketch(32, "srht")):
        assert torch.allclose(sk.sketch(x, 4), sk.sketch(x.cuda(), 4).cpu(), atol=1e-4)


def test_large_tensor_on_cuda() -> None:
    x = torch.randn(1 << 22, device="cuda")
    for spec, bound in (("int8", 0.01), ("int4", 0.15), ("fp4", 0.15)):
        c = from_spec(spec)
        assert rel_err(c.decode(c.encode(x)), x) < bound
    k = int(0.001 * x.numel()) + 1
    y = from_spec("topk:0.001").decode(from_spec("topk:0.001").encode(x))
    assert float(y.pow(2).sum() / torch.topk(x.abs(), k).values.pow(2).sum()) > 0.9


@pytest.mark.parametrize("spec", ["int8", "int4", "fp4", "fp4:e3m0", "fp8", "fp8:e5m2", "int8:stochastic=true",
                                  "int4:stochastic=true", "fp4:stochastic=true", "fp4:e3m0,stochastic=true"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_block_kernels_write_the_cpus_bytes(spec: str, dtype: torch.dtype) -> None:
    from starling.compressors.fused import Fused

    x = torch.randn(64 * 1000 + 37, generator=torch.Generator().manual_seed(4))  # a short last block too
    x[:256] = 0.0
    x[256:512] *= 1e-38
    x = x.to(dtype)
    c = from_spec(spec)
    cpu, eager = c.encode(x, seed=9), c.encode(x.cuda(), seed=9)  # eager while the kernel compiles
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu.buffers, eager.buffers, strict=True))
    Fused.settle(600)
    before = Fused.report()["compiled_calls"]
    gpu = c.encode(x.cuda(), seed=9)
    report = Fused.report()
    assert not report["failures"], report
    # stochastic rounding stays on the eager loop, where its codes are the CPU's
    assert (report["compiled_calls"] > before) == (not c.stochastic)
    assert cpu.header == gpu.header
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu.buffers, gpu.buffers, strict=True))
