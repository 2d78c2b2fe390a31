"""`starling simulate --ray ADDRESS`: what it checks before any Ray cluster is needed (the run
itself is tests/runtime/test_sim_ray.py)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from starling.cli.main import app
from starling.cli.simulate import _sim_configs

runner = CliRunner()
TINY = ["simulate", "--protocol", "allreduce", "--task", "quadratic", "--peers", "2", "--steps", "2", "--baseline",
        "none", "--json"]


def configs(**given):
    args = dict(peers=4, protocol="allreduce", task="quadratic", steps=3, compressor=None, transport=None,
                processes=0, bandwidth=None, latency_ms=0.0, loss=0.0, churn=None, seed=0, opt=[], lr=None,
                task_opt=[], eval_every=0, baseline="gossip")
    return _sim_configs(**{**args, **given})


def test_ray_implies_tcp_and_the_baseline_runs_on_the_same_cluster():
    config, base = configs(ray="auto")
    assert (config.ray, config.transport, config.processes) == ("auto", "tcp", 0)  # 0: one worker per node
    assert (base.ray, base.transport) == ("auto", "tcp")
    assert config.describe()["ray"] == "auto"
    config, _ = configs(ray="10.0.0.5:6379", processes=3)
    assert (config.ray, config.processes) == ("10.0.0.5:6379", 3)
    assert "ray" not in configs()[0].describe()


@pytest.mark.parametrize("args, needle", [
    (["--ray", ""], "ray must be a Ray cluster's address, 'auto' or 'local', got ''"),
    (["--ray", "auto", "--transport", "ipc"], "transport 'ipc' stays on one machine (use tcp)"),
    (["--ray", "auto", "--transport", "inproc"], "transport 'inproc' stays on one machine (use tcp)"),
    (["--ray", "auto", "--processes", "3"], "processes must be a whole number from 0"),
    (["--ray", "auto", "--checkpoint-dir", "ck"], "drop --processes and --ray"),
    (["--ray", "auto", "--protocol", "diloco", "--nproc-per-replica", "2"], "drop ray"),
    (["--ray"], "--ray"),  # it takes an address
])
def test_bad_ray_input_is_one_clear_line(args, needle):
    result = runner.invoke(app, [*TINY, *args])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_an_address_where_no_cluster_answers_is_one_clear_line_at_once(ray_on_loopback):
    result = runner.invoke(app, [*TINY, "--ray", "127.0.0.1:1"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("starling: error: no Ray cluster answers at 127.0.0.1:1"), result.output
