"""benchmarks/replicas.py runs end to end (timings are not checked: the machine is shared)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_zygote import cli_run

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "replicas.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_inner_run_prints_the_step_and_broadcast_rows():
    done = cli_run([sys.executable, str(SCRIPT), "--only", "inner", "--steps", "2", "--warmup", "1"],
                          capture_output=True, text=True, timeout=250)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {r["row"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    inner, broadcast = rows["inner"], rows["state_broadcast"]
    assert inner["ranks"] == 2 and inner["ddp_step_ms"] > 0 and inner["starling_step_ms"] > 0
    assert inner["ratio"] == pytest.approx(inner["starling_step_ms"] / inner["ddp_step_ms"], rel=1e-2)
    # parameters, and the swarm's copy of them (charlm has no buffers), as float32
    assert broadcast["bytes"] == 2 * 4 * inner["parameters"]
