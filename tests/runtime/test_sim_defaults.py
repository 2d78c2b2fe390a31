"""The simulator's defaults live in SimConfig: a run made in Python with no options is the run
`starling simulate` makes with none, and trains the same bits."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from starling.cli import simulate as simulate_cli
from starling.cli.main import app
from starling.runtime import SimConfig, SimError, Simulation
from starling.runtime.simconfig import (
    DEFAULT_SIM_OPTIONS,
    DEFAULT_SIM_PROTOCOL,
    DEFAULT_SIM_STEPS,
    DEFAULT_SIM_TASK,
    TUNED_ADAMW_LR,
    UNCAPPED_STEPS,
)

runner = CliRunner()
# charlm made small: the defaults under test (protocol, its sync period, the tuned lr, the
# transport) stay the simulator's own
TINY = {"n_layer": "1", "n_embd": "16", "n_head": "2", "seq_len": "16", "batch_size": "4", "corpus_chars": "20000",
        "eval_batches": "1"}
# what two runs that train the same bits report alike (not their wall times)
SAME = ("protocol", "task", "peers", "steps", "transport", "options", "task_options", "seed", "train_loss",
        "eval_loss", "bytes_sent_per_peer", "final_peers", "peer_status")


def test_the_command_with_no_options_builds_the_python_default_run_and_its_baseline(monkeypatch):
    made = []
    real = simulate_cli._sim_configs

    def recorded(**given):
        made.append(real(**given))
        return made[-1]

    monkeypatch.setattr(simulate_cli, "_sim_configs", recorded)

    def run_nothing(self):
        raise SimError("stopped before training: the test reads the configs")

    monkeypatch.setattr(Simulation, "run", run_nothing)
    result = runner.invoke(app, ["simulate", "--json"])
    assert "stopped before training" in result.output, result.output
    assert made == [(SimConfig(), SimConfig().baseline())]


def test_the_python_default_run_is_the_documented_one():
    config = SimConfig()
    assert (config.protocol, config.task, config.steps, config.transport) == (
        DEFAULT_SIM_PROTOCOL, DEFAULT_SIM_TASK, DEFAULT_SIM_STEPS, "inproc")
    # the sync period the simulator gives its default protocol, and AdamW's lr tuned for the task
    assert dict(config.options) == {**DEFAULT_SIM_OPTIONS, "lr": TUNED_ADAMW_LR[DEFAULT_SIM_TASK]}
    assert config.protocol_config().sync_every == DEFAULT_SIM_OPTIONS["sync_every"]
    # the baseline trains with the run's optimizer and lr
    assert dict(config.baseline().options) == {"optimizer": "adamw", "lr": TUNED_ADAMW_LR[DEFAULT_SIM_TASK]}
    # --help names them as they are
    help_text = runner.invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"}).output
    for default in (DEFAULT_SIM_PROTOCOL, DEFAULT_SIM_TASK, DEFAULT_SIM_STEPS):
        assert f"default {default}" in help_text, default


def test_what_a_run_names_wins_over_the_defaults():
    named = SimConfig(options={"sync-every": "8", "lr": "0.01"})
    assert dict(named.options) == {"sync-every": "8", "lr": "0.01"}
    assert named.protocol_config().sync_every == 8 and named.protocol_config().lr == 0.01
    # the sync period is the default protocol's; the tuned lr goes with AdamW on its task
    assert dict(SimConfig(protocol="diloco").options) == {"lr": TUNED_ADAMW_LR[DEFAULT_SIM_TASK]}
    assert dict(SimConfig(protocol="allreduce").options) == {}  # SGD
    assert dict(SimConfig(task="quadratic").options) == DEFAULT_SIM_OPTIONS


def test_the_steps_and_transport_follow_the_rest_of_the_run():
    assert SimConfig(duration_s=5.0).steps == UNCAPPED_STEPS  # peers train until the time is up
    assert SimConfig(duration_s=5.0, steps=30).steps == 30
    with pytest.raises(ValueError, match="needs --steps"):  # it plans its privacy over the run's length
        SimConfig(protocol="sketch-dp", duration_s=5.0)
    assert SimConfig(protocol="sketch-dp", duration_s=5.0, options={"budget_steps": 50}).steps == UNCAPPED_STEPS
    assert SimConfig(peers=2, processes=2).transport == "tcp"
    assert SimConfig(ray="auto").transport == "tcp"
    assert SimConfig(peers=2, processes=2, transport="ipc").transport == "ipc"
    with pytest.raises(ValueError, match="processes need the tcp or ipc transport"):
        SimConfig(peers=2, processes=2, transport="inproc")


def test_a_python_simulation_with_no_options_trains_as_the_command_with_none_does():
    """Streaming DiLoCo and its allreduce baseline repeat bit for bit, so the two must agree on
    every loss and byte: the same protocol, sync period, lr and transport."""
    steps = DEFAULT_SIM_OPTIONS["sync_every"]  # one outer round at the simulator's period
    args = ["simulate", "--peers", "2", "--steps", str(steps), "--json", "--no-plot"]
    result = runner.invoke(app, [*args, *(a for name, value in TINY.items() for a in ("--task-opt", f"{name}={value}"))])
    assert result.exit_code == 0, result.output
    command = json.loads(result.stdout)

    config = SimConfig(peers=2, steps=steps, task_options=TINY)
    run, base = Simulation(config).run().summary, Simulation(config.baseline()).run().summary

    assert run["protocol"] == DEFAULT_SIM_PROTOCOL and run["bytes_sent_per_peer"] > 0  # it synced
    for mine, theirs in ((run, command), (base, command["baseline"])):
        assert {k: mine[k] for k in SAME} == {k: theirs[k] for k in SAME}
        assert mine["protocol_info"]["config"] == theirs["protocol_info"]["config"]
