"""sketch-dp through `starling simulate` and `starling node start`: sample-level DP gets the
peer's data set, --target-epsilon plans over --steps, and the privacy spent is reported in the
summary JSON and the final table."""
from __future__ import annotations

import json
import math
import sys

import pytest
from cli_zygote import cli_run
from conftest import opacus_accountants
from typer.testing import CliRunner

from starling.cli.main import app
from starling.runtime import SimConfig, with_run_length

runner = CliRunner()
SKETCH_DP = ["simulate", "--protocol", "sketch-dp", "--task", "teacher", "--peers", "2", "--baseline", "none",
             "--sketch", "gsketch:100", "--clip", "1.0", "--round-timeout-s", "10"]
SAMPLE = ["--dp-unit", "sample", "--sample-rate", "0.05", "--dataset-size", "640"]


def summary_of(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_run_length_fills_budget_steps_only_where_a_protocol_has_it_and_the_user_left_it():
    assert SimConfig(protocol="sketch-dp", steps=7).protocol_options()["budget_steps"] == 7
    assert SimConfig(protocol="sketch-dp", steps=7, options={"budget-steps": "3"}).protocol_options() == {
        "budget-steps": "3"}
    assert "budget_steps" not in SimConfig(protocol="allreduce", steps=7).protocol_options()
    assert with_run_length("sketch-dp", {"lr": 0.1}, None) == {"lr": 0.1}  # node start without --steps


def test_sample_unit_simulates_and_the_table_shows_the_privacy_spent(tmp_path):
    result = runner.invoke(app, [*SKETCH_DP, *SAMPLE, "--noise-multiplier", "1.0", "--steps", "3",
                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for heading in ("epsilon", "delta", "sigma", " C ", "unit", "sketch", "sample"):
        assert heading in result.stdout, heading
    info = json.loads((tmp_path / "summary.json").read_text())["protocol_info"]
    privacy = info["privacy"]
    reference = opacus_accountants().RDPAccountant()
    for _ in range(3):
        reference.step(noise_multiplier=1.0, sample_rate=0.05)
    assert privacy["dp_unit"] == "sample" and privacy["rounds"] == 3 and info["sketch_size"] == 100
    assert math.isfinite(privacy["epsilon"])
    assert privacy["epsilon"] == pytest.approx(reference.get_epsilon(delta=1e-5))
    peers = json.loads((tmp_path / "peers.json").read_text())
    assert all(p["protocol_info"]["privacy"]["rounds"] == 3 for p in peers)


def test_target_epsilon_is_spent_over_the_run_steps():
    summary = summary_of(runner.invoke(app, [*SKETCH_DP, *SAMPLE, "--target-epsilon", "2", "--steps", "4",
                                             "--json"]))
    info = summary["protocol_info"]
    assert info["config"]["budget_steps"] == 4 and info["privacy"]["rounds"] == 4
    assert 1.9 <= info["privacy"]["epsilon"] <= 2.0 + 1e-6


def test_local_steps_spend_one_release_per_round_of_the_run():
    summary = summary_of(runner.invoke(app, [*SKETCH_DP, "--target-epsilon", "3", "--local-steps", "2",
                                             "--lr", "0.05", "--steps", "4", "--json"]))
    info = summary["protocol_info"]
    assert info["update"] == "delta of 2 local steps" and info["config"]["budget_steps"] == 4
    assert info["privacy"]["rounds"] == 2 and 2.9 <= info["privacy"]["epsilon"] <= 3.0 + 1e-6


def test_protocols_without_privacy_print_no_privacy_table():
    result = runner.invoke(app, ["simulate", "--protocol", "allreduce", "--task", "quadratic", "--task-opt",
                                 "dim=16", "--peers", "2", "--steps", "2", "--baseline", "none"])
    assert result.exit_code == 0, result.output
    assert "privacy" not in result.stdout and "epsilon" not in result.stdout


@pytest.mark.parametrize("args, needle", [
    (["simulate", "--protocol", "sketch-dp", "--task", "quadratic", "--peers", "2", "--steps", "2",
      "--baseline", "none", "--dp-unit", "sample"], "dp_unit='sample' cannot use this task"),
    (["node", "start", "--plaintext", "--protocol", "sketch-dp", "--target-epsilon", "2"], "budget_steps"),
])
def test_sketch_dp_misuse_is_one_clear_line(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("starling: error:") and needle in lines[0], result.output


@pytest.mark.slow
@pytest.mark.timeout(600)  # a Python process that imports torch and Opacus, on a loaded box
def test_node_start_plans_the_budget_over_steps_and_reports_it():
    proc = cli_run(
        [sys.executable, "-m", "starling.cli.main", "node", "start", "--plaintext", "--protocol", "sketch-dp",
         "--task", "teacher", "--steps", "3", "--target-epsilon", "2", "--sketch", "gsketch:50", *SAMPLE,
         "--log-every", "0"], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stopped = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"event": "stopped"')]
    assert stopped and stopped[0]["step"] == 3
    privacy = stopped[0]["privacy"]
    assert privacy["dp_unit"] == "sample" and privacy["rounds"] == 3 and 1.9 <= privacy["epsilon"] <= 2.0 + 1e-6
