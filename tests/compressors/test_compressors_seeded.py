"""Seeded codecs (sketches, random-k), PowerSGD, and stochastic rounding's unbiasedness."""
from __future__ import annotations

import pytest
import torch
from _compressors_support import over_the_wire, rel_err

from starling.compressors import CountSketch, GaussianSketch, NonFiniteError, from_spec


@pytest.mark.parametrize("spec", ["randomk:0.1", "countsketch:3x64", "gsketch:32", "gsketch:32,kind=srht",
                                  "countsketch:3x64,heavy=5+int8", "int8:stochastic=true"])
def test_two_instances_agree(spec: str) -> None:
    x = torch.randn(500, generator=torch.Generator().manual_seed(0))
    a, b = from_spec(spec), from_spec(spec)
    pa, pb = a.encode(x, seed=11), b.encode(x, seed=11)
    assert pa.header == pb.header
    assert all(torch.equal(u, v) for u, v in zip(pa.buffers, pb.buffers))
    assert torch.equal(a.decode(pa), b.decode(over_the_wire(pa)))
    pc = a.encode(x, seed=12)
    assert not all(torch.equal(u, v) for u, v in zip(pa.buffers, pc.buffers))


def test_sketches_are_linear() -> None:
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    for sk in (CountSketch((5, 128)), GaussianSketch(32), GaussianSketch(64, "srht")):
        sx, sy, sxy = sk.sketch(x, 9), sk.sketch(y, 9), sk.sketch(x + y, 9)
        assert torch.allclose(sx + sy, sxy, atol=1e-4)


@pytest.mark.parametrize("kind", ["gauss", "srht"])
def test_gaussian_sketch_unbiased_and_exact_when_full(kind: str) -> None:
    x = torch.randn(24, generator=torch.Generator().manual_seed(2))
    sk = GaussianSketch(12, kind)
    mean = sum(sk.unsketch(sk.sketch(x, s), 24, s) for s in range(300)) / 300
    assert rel_err(mean, x) < 0.2  # single estimates are off by ~sqrt(24/12); the mean by ~0.08
    single = sk.unsketch(sk.sketch(x, 0), 24, 0)
    assert rel_err(single, x) > 0.5
    if kind == "srht":  # all rows of the transform: exact
        full = from_spec("gsketch:64,kind=srht")
        assert rel_err(full.decode(full.encode(x, seed=3)), x) < 1e-5


def test_count_sketch_recovers_heavy_hitters() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3)) * 0.01
    heavy = torch.tensor([17, 1000, 2345, 4999])
    x[heavy] = torch.tensor([5.0, -7.0, 3.0, -4.0])
    c = from_spec("countsketch:5x256,heavy=4")
    y = c.decode(c.encode(x, seed=4))
    assert set(y.nonzero().view(-1).tolist()) == set(heavy.tolist())
    assert torch.allclose(y[heavy], x[heavy], atol=0.1)
    median = from_spec("countsketch:5x256").decode(c.encode(x, seed=4))
    assert torch.allclose(median[heavy], x[heavy], atol=0.1)


def test_powersgd_low_rank_and_warm_start() -> None:
    gen = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    spectrum = 0.5 ** torch.arange(48.0)
    m = u[:, :48] @ torch.diag(spectrum) @ v.T
    best = float(spectrum[4:].norm() / spectrum.norm())  # Eckart-Young, rank 4
    c = from_spec("powersgd:4")
    cold = rel_err(c.decode(c.encode(m, name="w")), m)
    for _ in range(10):
        warm = rel_err(c.decode(c.encode(m, name="w")), m)
    assert warm < best * 1.01 and warm < cold
    packet = c.encode(m, name="w")
    assert packet.header["mode"] == "lowrank" and packet.nbytes < m.numel()
    state = c.state_dict()
    d = from_spec("powersgd:4")
    d.load_state_dict(state)
    assert torch.equal(d.encode(m, name="w").buffers[0], c.encode(m, name="w").buffers[0])
    c.reset()
    assert c.state_dict()["q"] == {}


def test_powersgd_falls_back_to_next_stage() -> None:
    v = torch.randn(100)
    assert torch.equal(from_spec("powersgd:4").decode(from_spec("powersgd:4").encode(v)), v)
    c = from_spec("powersgd:4+int8")
    packet = c.encode(v)
    assert packet.header["mode"] == "full" and packet.header["inner"]["codec"] == "int8"
    assert rel_err(c.decode(packet), v) < 0.01
    skinny = torch.randn(3, 4)  # (3 + 4) * 3 >= 12: not worth factoring
    assert from_spec("powersgd:4").encode(skinny).header["mode"] == "full"


def test_powersgd_nan_leaves_state() -> None:
    c = from_spec("powersgd:2")
    m = torch.randn(30, 30)
    c.encode(m, name="w")
    q = c.state_dict()["q"]["w"].clone()
    bad = m.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        c.encode(bad, name="w")
    assert torch.equal(c.state_dict()["q"]["w"], q)


@pytest.mark.parametrize("spec", ["int8:block=64,stochastic=true", "int4:block=64,stochastic=true",
                                  "fp4:block=64,stochastic=true", "fp4:e3m0,block=64,stochastic=true"])
def test_stochastic_rounding_is_unbiased(spec: str) -> None:
    trials, width = 400, 256
    base = torch.randn(width, generator=torch.Generator().manual_seed(6))
    base[::64] = 5.0  # fix each block's scale so every trial quantizes on the same grid
    x = base.repeat(trials)
    c = from_spec(spec)
    err = (c.decode(c.encode(x, seed=7)) - x).view(trials, width).double()
    mean, se = err.mean(0), err.std(0) / trials**0.5
    rounded = se > 0
    assert float((mean[rounded].abs() > 3 * se[rounded]).float().mean()) < 0.02
    assert abs(float(err.mean())) < 3 * float(err.std()) / err.numel() ** 0.5
    # deterministic rounding is biased on the same data: the check has teeth
    det = from_spec(spec.replace(",stochastic=true", ""))
    det_err = (det.decode(det.encode(x)) - x).view(trials, width)[0]
    assert float(det_err.abs().max()) > 0
