"""What sketch-dp needs from the sketches: one map for many rows, a linear unbiased R^T for
count sketches, the cheap block-shift hash, and Gaussian R as a matrix."""
from __future__ import annotations

import pytest
import torch
from _compressors_support import over_the_wire, rel_err

from starling.compressors import CountSketch, GaussianSketch, decode, from_spec

SKETCHES = [CountSketch((3, 64)), CountSketch((3, 64), hash="shift"), CountSketch((1, 7), hash="shift"),
            GaussianSketch(32), GaussianSketch(32, "srht")]


@pytest.mark.parametrize("sketch", SKETCHES, ids=lambda s: s.spec)
def test_sketch_rows_sketches_every_row_with_the_same_map(sketch):
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    rows = sketch.sketch_rows(x, 5)
    for i in range(4):
        torch.testing.assert_close(rows[i], sketch.sketch(x[i], 5), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sketch.sketch(x[0] + x[1], 5), rows[0] + rows[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("hashing", ["mix", "shift"])
def test_count_sketch_transpose_is_unbiased(hashing):
    x = torch.randn(500, generator=torch.Generator().manual_seed(1))
    sketch = CountSketch((2, 50), hash=hashing)
    mean = sum(sketch.transpose(sketch.sketch(x, s), 500, s) for s in range(400)) / 400
    assert rel_err(mean, x) < 0.2  # one estimate is off by ~sqrt(500/50 / 2) ~ 2.2
    assert rel_err(sketch.transpose(sketch.sketch(x, 0), 500, 0), x) > 1.0


def test_shift_hash_is_exact_without_collisions_and_finds_heavy_hitters():
    x = torch.randn(500, generator=torch.Generator().manual_seed(2))
    one_block = CountSketch((1, 512), hash="shift")  # a single block: a signed cyclic shift, no collision
    assert torch.equal(one_block.unsketch(one_block.sketch(x, 3), 500, 3), x)
    y = torch.randn(20_000, generator=torch.Generator().manual_seed(3)) * 0.01
    heavy = torch.tensor([5, 4096, 12_345, 19_999])
    y[heavy] = torch.tensor([3.0, -4.0, 5.0, -6.0])
    sketch = CountSketch((5, 512), heavy=4, hash="shift")
    found = sketch.unsketch(sketch.sketch(y, 4), 20_000, 4, heavy=4)
    assert set(found.nonzero().view(-1).tolist()) == set(heavy.tolist())
    assert torch.allclose(found[heavy], y[heavy], atol=0.1)


def test_shift_hash_spec_and_header_round_trip():
    codec = from_spec("countsketch:1x100,hash=shift")
    assert codec.spec == "countsketch:1x100,hash=shift"
    assert from_spec("countsketch:1x100").spec == "countsketch:1x100"  # the default stays implicit
    x = torch.randn(300, generator=torch.Generator().manual_seed(5))
    packet = codec.encode(x, seed=6)
    assert packet.header["hash"] == "shift" and "hash" not in from_spec("countsketch:1x100").encode(x, seed=6).header
    expected = codec.unsketch(codec.sketch(x, 6), 300, 6)
    torch.testing.assert_close(decode(over_the_wire(packet)), expected)
    torch.testing.assert_close(from_spec("countsketch:1x100").decode(packet), expected)  # the header decides
    with pytest.raises(ValueError, match="hash"):
        from_spec("countsketch:1x100,hash=fast")


def test_gaussian_matrix_is_the_sketch_map():
    sketch = GaussianSketch(24)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(7))
    r = sketch.matrix(200, 8)
    assert r.shape == (24, 200)
    torch.testing.assert_close(x @ r.T, sketch.sketch_rows(x, 8), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.T @ x[0, :24], sketch.unsketch(x[0, :24], 200, 8), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gauss"):
        GaussianSketch(24, "srht").matrix(200, 8)
