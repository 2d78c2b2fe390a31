"""benchmarks/allreduce.py runs end to end: rows for both backends, a correct Starling mean.

Timings are not checked (the machine is shared); the tiny run splits each shard into several
chunks, so the multi-chunk path of the sharded reducer is exercised across processes too.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "allreduce.py"


def load_script():
    return load_benchmark("allreduce")


@pytest.mark.slow
@pytest.mark.timeout(600)  # worker processes that import torch and gloo, on a starved box
def test_tiny_run_prints_a_correct_row_per_backend_and_a_summary():
    cmd = [sys.executable, str(SCRIPT), "--size-mb", "1", "--peers", "2", "--repeat", "1",
           "--chunk-mb", "0.125", "--timeout-s", "60"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    by_backend = {r["backend"]: r for r in rows if r["bench"] == "allreduce"}
    assert set(by_backend) == {"starling", "gloo"}
    for row in by_backend.values():
        assert row["peers"] == 2 and row["bytes"] == 2**20 and row["repeat"] == 1
        assert row["correct"] is True and row["max_abs_err"] < 1e-4
        assert row["median_s"] > 0 and row["algbw_GBps"] > 0
    assert by_backend["starling"]["chunk_mb"] == 0.125  # 4 chunks per shard
    summary = rows[-1]
    assert summary["bench"] == "summary" and summary["correct"] is True
    assert set(summary["ratio"]) == set(summary["met"]) == set(summary["ratio_best"]) == {"2"}
    assert summary["target_ratio"] == 1.5


@pytest.mark.parametrize("argv", [["--peers", "1"], ["--peers", "2,x"], ["--backends", "nccl"],
                                  ["--repeat", "0"], ["--size-mb", "0"], ["--chunk-mb", "-1"]])
def test_bad_arguments_are_refused_before_any_process_starts(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        load_script().parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
