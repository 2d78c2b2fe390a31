"""benchmarks/heterogeneous.py: a run's row (utilization of the full-speed peers, the slow
peers' shares of tokens and weight), on a hand-made result (the runs need the benchmark)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import load_benchmark


def load_bench():
    return load_benchmark("heterogeneous")


def peer(rank, steps, compute_s, wall_s, info=None):
    records = [{"compute_s": compute_s, "step_wall_s": wall_s}] * steps
    return SimpleNamespace(rank=rank, records=records, protocol_info=info or {})


def test_a_row_reports_fast_utilization_and_the_slow_peers_shares():
    bench = load_bench()
    peers = [peer(0, 9, 0.09, 0.1, {"mean_share": 0.45}), peer(1, 9, 0.08, 0.1, {"mean_share": 0.45}),
             peer(2, 2, 0.1, 0.1, {"mean_share": 0.1, "missed_rounds": 1})]
    result = SimpleNamespace(peers=peers, config=SimpleNamespace(protocol="streaming-diloco", options={},
                                                                 duration_s=10.0),
                             summary={"eval_loss": 2.0, "bytes_sent_per_peer": 1.0, "wall_s": 10.0})
    row = bench.describe("async", result, (1.0, 1.0, 0.25))
    assert row["fast_utilization"] == pytest.approx(0.85)  # the slow peer's sleeps are not counted
    assert row["slow_token_share"] == pytest.approx(2 / 20)
    assert row["slow_weight_share"] == pytest.approx(0.1) and row["slow_missed_rounds"] == [1]
    # a protocol that reports no shares averages plainly: 1 / peers each
    row = bench.describe("allreduce", SimpleNamespace(**{**vars(result), "peers": [peer(r, 5, 1, 2) for r in range(3)]}),
                         (1.0, 1.0, 0.25))
    assert row["slow_weight_share"] == pytest.approx(1 / 3) and row["fast_utilization"] == pytest.approx(0.5)
