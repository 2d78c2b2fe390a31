"""benchmarks/membership_costs.py runs end to end: the fingers it times match the sorted ring's,
the node learns every record it is handed, and its table's pages hand each out once (timings
are not checked: the machine is shared)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import benchmark_row

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "membership_costs.py"


def test_a_small_run_prints_one_row_whose_fingers_match_the_sorted_ring():
    row = benchmark_row("membership_costs", "--members", "64", "--repeat", "5")
    assert row["same_fingers"] is True and row["learned"] == 64
    assert row["paged"] == 65  # a joiner's walk of the table hands out each live record once: 64 and the seed's
    assert row["fingers_ms"] > 0 and row["learn_news_us"] > 0 and row["page_walk_ms"] > 0
    assert row["same_probe_fingers"] is True and row["probe_target_ms"] > 0
    assert row["same_pull_page"] is True and row["pull_forming_us"] > 0  # both ways give one page


def test_bad_arguments_are_refused_with_a_clear_error():
    done = subprocess.run([sys.executable, str(SCRIPT), "--members", "1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--members must be >= 2" in done.stderr
