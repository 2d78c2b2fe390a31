"""Smoke test of benchmarks/flood.py: its quick run prints its two rows with every figure (timings
and RSS are not checked here: the machine is shared)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_zygote import cli_run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "flood.py"


@pytest.mark.slow
@pytest.mark.timeout(600)  # three processes that import torch, on a starved box
def test_quick_run_prints_its_rows_with_every_figure():
    out = cli_run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=500,
                         check=True).stdout
    growth, row = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert growth["bench"] == "status_growth" and growth["calls"] == 60 and growth["status_bytes_last"] > 0
    assert row["bench"] == "flood" and row["flood_sent"] > 0 and row["status_requests"] > 0
    for key in ("rss_growth_mb", "status_max_s", "status_p99_s", "step_ratio", "member_step_ratio", "met"):
        assert key in row
    assert row["rejected"].get("rate_limited", 0) > 0  # the flood was dropped unread, not served
