"""Smoke test of benchmarks/cli_start.py: one `node status` as shipped and one with torch
loaded first, against a real node; the rows' fields, not the times."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_zygote import cli_run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cli_start.py"


@pytest.mark.slow
@pytest.mark.timeout(300)  # a node process and two CLI processes on a busy 2-core box
def test_quick_run_prints_both_rows_and_their_ratios():
    out = cli_run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=240,
                         check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    runs = {r["run"]: r for r in rows if r["bench"] == "node_status"}
    assert set(runs) == {"shipped", "torch_first"}
    assert all(r["repeats"] == 1 and r["wall_s"] > 0 and r["cpu_s"] > 0 for r in runs.values())
    (summary,) = [r for r in rows if r["bench"] == "summary"]
    assert summary["wall_ratio"] > 0 and summary["cpu_ratio"] > 0
