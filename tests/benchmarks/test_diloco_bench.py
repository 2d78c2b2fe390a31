"""benchmarks/diloco.py's lr schedule (no swarm: the training runs need the full benchmark)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "diloco.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("starling_bench_diloco", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lr_factor_constant_and_cosine():
    bench = load_bench()
    assert all(bench.lr_factor("constant", t, 100, 10, 0.1) == 1.0 for t in range(100))
    factors = [bench.lr_factor("cosine", t, 100, 10, 0.1) for t in range(100)]
    assert factors[:10] == pytest.approx([(t + 1) / 10 for t in range(10)])  # linear warmup to the peak
    assert factors[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))  # then it only decays
    assert bench.lr_factor("cosine", 100, 100, 10, 0.1) == pytest.approx(0.1)  # to the floor at the end
    assert bench.lr_factor("cosine", 55, 100, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))


def test_schedule_of_defaults_warmup_to_a_sixteenth_of_the_run():
    bench = load_bench()
    args = bench.argparse.Namespace(steps=512, warmup_steps=None, lr_schedule="cosine", min_lr_ratio=0.1)
    assert bench.schedule_of(args) == ("cosine", 32, 0.1)
    args.lr_schedule = "constant"
    assert bench.schedule_of(args)[:2] == ("constant", 0)
