"""`starling simulate --peer-speed`: emulated slower peers, recorded in the JSON lines and the
summary, and one clear line for a bad value."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from starling.cli.main import app

runner = CliRunner()
TINY = ["--protocol", "diloco", "--task", "quadratic", "--task-opt", "dim=32", "--peers", "2", "--steps", "6",
        "--baseline", "none", "--opt", "sync_every=3"]


@pytest.mark.parametrize("value, needle", [
    ("1,1,1", "--peer-speed names 3 speeds for 2 peers"),
    ("1", "--peer-speed names 1 speeds for 2 peers"),
    ("1,0", "--peer-speed values must be finite numbers > 0, got 0"),
    ("1,-2", "--peer-speed values must be finite numbers > 0, got -2"),
    ("1,inf", "--peer-speed values must be finite numbers > 0, got inf"),
    ("1,fast", "--peer-speed takes numbers separated by commas"),
])
def test_a_bad_peer_speed_is_one_clear_line(value, needle):
    result = runner.invoke(app, ["simulate", *TINY, "--peer-speed", value])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:") and needle in lines[0], result.output


def test_a_negative_duration_is_one_clear_line():
    result = runner.invoke(app, ["simulate", *TINY, "--duration", "-1"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and "duration_s must be" in lines[0], result.output


def test_a_duration_stops_the_run_in_time():
    result = runner.invoke(app, ["simulate", "--protocol", "diloco", "--task", "quadratic", "--task-opt", "dim=32",
                                 "--peers", "2", "--steps", "1000000", "--baseline", "none", "--json",
                                 "--duration", "1"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["duration_s"] == 1.0 and summary["final_peers"] == 2 and summary["wall_s"] < 30


def test_peer_speed_slows_a_peer_and_is_recorded(tmp_path):
    result = runner.invoke(app, ["simulate", *TINY, "--peer-speed", "1,0.25", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["peer_speed"] == [1.0, 0.25]
    fast, slow = ([json.loads(line) for line in (tmp_path / f"peer-{r}.jsonl").read_text().splitlines()]
                  for r in (0, 1))
    assert {r["speed"] for r in fast} == {1.0} and {r["speed"] for r in slow} == {0.25}
    assert all(r["slowdown_s"] == 0 for r in fast)
    # the slow peer sleeps 3x each step's compute: (1 / 0.25 - 1)
    assert all(r["slowdown_s"] == pytest.approx(3 * r["compute_s"]) for r in slow)


def test_the_summary_says_how_busy_each_peer_was(tmp_path):
    result = runner.invoke(app, ["simulate", *TINY, "--peer-speed", "1,0.25", "--json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["busy_share"]) == {"0", "1"}
    result = runner.invoke(app, ["simulate", *TINY, "--peer-speed", "1,0.25", "--out", str(tmp_path), "--no-plot"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("busy "))
    assert "by peer: 0 " in line and "(speed 0.25)" in line
