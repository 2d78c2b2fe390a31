"""Smoke test of benchmarks/checkpoint.py: its quick run prints a row per repeat and a summary
with both ratios (not their values: those need the full run on a quiet box)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_zygote import cli_run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint.py"


@pytest.mark.slow
def test_quick_run_prints_rows_and_a_summary(tmp_path):
    out = cli_run([sys.executable, str(SCRIPT), "--quick", "--dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=240, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["bench"] for r in rows] == ["checkpoint", "checkpoint", "checkpoint_summary"]
    summary = rows[-1]
    assert summary["params"] > 4_000_000
    assert summary["pause_vs_clone"] > 0 and summary["write_vs_plain"] > 0
    assert isinstance(summary["pause_target_met"], bool) and isinstance(summary["write_target_met"], bool)
    assert list((tmp_path / "store").glob("*.json"))  # the checkpoint it wrote is there
