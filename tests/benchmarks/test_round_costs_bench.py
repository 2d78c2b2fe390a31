"""benchmarks/round_costs.py runs end to end on a small swarm, and both ways of packing the
statement give the same bytes (timings are not checked: the machine is shared)."""
from __future__ import annotations

from conftest import benchmark_row


def test_a_small_run_prints_one_row_of_every_cost_both_ways():
    row = benchmark_row("round_costs", "--members", "64", "--repeat", "5")
    assert row["bench"] == "round_costs" and row["members"] == 64 and row["same_statement"] is True
    for key in ("owners", "contributors", "statement"):
        assert row[f"{key}_us"] > 0 and row[f"{key}_before_us"] > 0, key
    assert row["verify_us"] > 0 and row["verify_kept_us"] > 0
