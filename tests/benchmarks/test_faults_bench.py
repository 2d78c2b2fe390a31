"""benchmarks/faults.py's quick case, which CI runs: four real `node start` processes train
allreduce, and the one that owns a shard is SIGKILLed once it holds every part of round 4,
before it answers any. Every survivor must hold the same parameters at every step from two
rounds after the kill on (the shard is skipped alike, not kept local by each)."""
from __future__ import annotations

import sys

import pytest
from cli_zygote import cli_popen
from conftest import load_benchmark


@pytest.fixture
def faults(monkeypatch):
    """benchmarks/faults.py, its nodes forked from the test zygote (tests/cli_zygote.py)."""
    module = load_benchmark("faults")
    monkeypatch.setattr(sys.modules["nodeprocs"], "popen", cli_popen)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_owner_killed_holding_every_part_leaves_the_survivors_with_one_model(tmp_path, faults):
    rows = faults.main(["--quick", "--log-dir", str(tmp_path)])
    (row,) = rows
    assert row["fired"], f"the victim never reached its fault point (logs in {tmp_path})"
    assert row["survivors_finished"]
    assert row["steps_compared"] >= 5
    assert row["steps_diverged"] == 0 and row["final_agree"] and row["one_outcome"], row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checked_owner_paused_holding_every_part_comes_back_and_bans_nobody(tmp_path, faults):
    """CenteredClip with one checked owner: the owner is stopped holding every part of round 4
    and resumed once the others went on. Its chunk went unaveraged, so each member's gradient
    there is the same in round 5 (quadratic's loss is deterministic): a repeat, not a replay.
    The survivors keep one model and nobody is banned."""
    row = faults.run_case(faults.Case.parse("allreduce-robust/reduce.owner.closing@4:pause/1"), 4, str(tmp_path))
    assert row["fired"], f"the victim never reached its fault point (logs in {tmp_path})"
    assert row["one_outcome"] and row["false_accusations"] == 0, row


def test_a_case_replays_from_the_line_a_row_prints():
    faults = load_benchmark("faults")
    cases = faults.schedule(7, 5, 4, list(faults.PROTOCOLS), list(faults.POINTS))
    assert cases == faults.schedule(7, 5, 4, list(faults.PROTOCOLS), list(faults.POINTS))  # seeded
    assert [faults.Case.parse(str(c)) for c in cases] == cases
