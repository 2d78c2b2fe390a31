"""Smoke test of benchmarks/restart.py: its quick run prints one row that compares the two runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cli_zygote import cli_run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "restart.py"


def test_quick_run_prints_a_row_comparing_the_runs():
    out = cli_run([sys.executable, str(SCRIPT), "--quick", "--stop-at", "13"], capture_output=True,
                         text=True, timeout=240, check=True).stdout
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["bench"] == "restart" and row["stopped_at"] == 13 and row["rounds_in_flight_at_stop"] == 1
    assert row["bit_for_bit"] is (row["eval_loss_restarted"] == row["eval_loss_uninterrupted"])
