"""benchmarks/socket_memory.py runs end to end: a row per transport, each measured in its own
process over connections that all carried a message (figures are not checked: the machine is
shared, and a small run's growth is mostly the allocator's rounding)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "socket_memory.py"


def test_a_small_run_prints_a_row_per_transport_against_inproc():
    done = subprocess.run([sys.executable, str(SCRIPT), "--connections", "40"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["transport"] for r in rows] == ["inproc", "ipc", "tcp"]
    assert all(r["connections"] == 40 and isinstance(r["kb_per_connection"], float) for r in rows)
    assert rows[0]["over_inproc"] in (1.0, None)


def test_bad_arguments_are_refused_with_a_clear_error():
    done = subprocess.run([sys.executable, str(SCRIPT), "--connections", "0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--connections must be at least 1" in done.stderr
